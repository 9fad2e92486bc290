"""The cost model's row-block term: SGLang's fused MoE runs an expert's pairs in blocks of BLOCK_SIZE_M rows,
and each block past an expert's first costs ``r``. Checked against naive per-rank loops for every place a
rank's cost is computed (advise's EP and TP-MoE layers, the dispatch rules' batches, report's totals)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.trace.resample import resample_batches

from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.advise import counts_work, ep_layer_cost, rank_work, slot_token_counts, tp_layer_cost, work_cost
from moeplace.analysis.metrics import LayerSums, accumulate, summarize
from moeplace.cost.model import CostModel, extra_row_blocks, load_cost_model
from moeplace.dispatch.balanced import step_expert_counts
from moeplace.dispatch.evaluation import RULES, Row, batch_costs, rule_extra_blocks, rule_loads, verify_batches
from moeplace.dispatch.loads import token_slots
from moeplace.errors import FormatError, MoeplaceError
from moeplace.files.placement import Placement
from test_cost_dispatch import kimi_shaped

MODEL = CostModel(20.0, 0.01, 60.0, r_us_per_block=12.0, block_m=4)   # small blocks: the test batches fill many


def naive_extra(counts, block_m: int) -> int:
    """Blocks past each expert's first: a loop over the counts."""
    total = 0
    for c in np.ravel(counts):
        blocks = 0
        while c > 0:
            blocks += 1
            c -= block_m
        total += max(blocks - 1, 0)
    return total


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_extra_row_blocks_against_a_loop(block_m):
    rng = np.random.default_rng(block_m)
    counts = rng.integers(0, 200, size=(5, 3, 7)) * (rng.random((5, 3, 7)) < 0.6)
    got = extra_row_blocks(counts, block_m)
    assert got.shape == (5, 3)
    for s in range(5):
        for r in range(3):
            assert got[s, r] == naive_extra(counts[s, r], block_m)


def test_a_model_without_the_term_adds_nothing():
    plain = CostModel(20.0, 0.01, 60.0)
    assert not plain.needs_blocks(10_000) and plain.extra_blocks(np.full((2, 3), 999)).tolist() == [0, 0]
    assert MODEL.needs_blocks(5) and not MODEL.needs_blocks(4)   # at most one pair per token: 4 tokens fit
    assert float(MODEL.cost(3, 40, 2)) == pytest.approx(20 * 3 + 12 * 2 + 0.01 * 40 + 60)


def test_file_round_trip_and_bad_terms(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(MODEL.to_json()))
    back = load_cost_model(path)
    assert back == MODEL
    for bad, fragment in [({"r_us_per_block": 3.0}, "no block_m"), ({"block_m": 16.5}, "whole number"),
                          ({"r_us_per_block": 3.0, "block_m": 24}, "not a power of two"),
                          ({"r_us_per_block": "x", "block_m": 16}, "r_us_per_block must be a number"),
                          ({"r_us_per_block": -1.0, "block_m": 16}, "r_us_per_block must be at least 0")]:
        path.write_text(json.dumps({"a_us_per_expert": 1, "b_us_per_token": 0, "c_us": 1, **bad}))
        with pytest.raises(FormatError, match=fragment):
            load_cost_model(path)


@pytest.fixture(scope="module")
def trace():
    return kimi_shaped(layers=1, steps=300)


@pytest.fixture(scope="module")
def spread(trace):
    return solve("deepseek", PlacementProblem(trace.model, trace, 8, redundant=96))


@pytest.mark.parametrize("rule", ["dynamic", "balanced", "cost"])
def test_ep_layer_cost_counts_the_blocks_of_each_rank(trace, spread, rule):
    steps = resample_batches(trace, 72, 8, seed=2)
    work = rank_work(slot_token_counts(steps, 0, spread[0], 8, rule, MODEL), 8)        # [S, R, slots]
    naive = np.array([[MODEL.a_us_per_expert * (w > 0).sum() + MODEL.r_us_per_block * naive_extra(w, 4)
                       + MODEL.b_us_per_token * w.sum() + MODEL.c_us for w in step] for step in work]).max(axis=1)
    np.testing.assert_allclose(ep_layer_cost(steps, 0, spread[0], 8, MODEL, rule), naive)
    assert (work > 4).any()            # the batches do hold experts of several blocks


@pytest.mark.parametrize("batch", [3, 9, 72])
def test_work_from_the_counts_costs_as_the_token_rows(trace, spread, batch):
    """advise costs every layout from each step's expert counts: the same µs as dispatching token rows, with
    one slot an expert (any rule) and under the cost rule with spare slots (which splits experts)."""
    steps = resample_batches(trace, batch, 8, seed=3)
    counts = step_expert_counts(steps, 0)
    one_each = solve("deepseek", PlacementProblem(trace.model, trace, 8))[0]
    for phy2log, rule in ((one_each, "dynamic"), (one_each, "static"), (spread[0], "cost")):
        for model in (MODEL, CostModel(20.0, 0.01, 60.0)):
            np.testing.assert_array_equal(work_cost(counts_work(counts, phy2log, 8, rule, model), model),
                                          ep_layer_cost(steps, 0, phy2log, 8, model, rule))
    with pytest.raises(MoeplaceError, match="needs the rows"):
        counts_work(counts, spread[0], 8, "dynamic")


def test_tp_layer_cost_counts_every_experts_blocks(trace):
    steps = resample_batches(trace, 144, 6, seed=4)
    counts = step_expert_counts(steps, 0)
    naive = [MODEL.a_us_per_expert * (c > 0).sum() + MODEL.r_us_per_block * naive_extra(c, 4)
             + MODEL.b_us_per_token * c.sum() + MODEL.c_us for c in counts]
    np.testing.assert_allclose(tp_layer_cost(steps, 0, MODEL), naive)


def test_steps_of_one_block_cost_as_before(trace, spread):
    """9-token steps never fill a 16-row block: the term is exactly 0 there, so nothing else moves."""
    steps = resample_batches(trace, 9, 8, seed=2)
    blocks16 = CostModel(20.0, 0.01, 60.0, r_us_per_block=12.0, block_m=16)
    plain = CostModel(20.0, 0.01, 60.0)
    for rule in ("dynamic", "balanced"):
        np.testing.assert_allclose(ep_layer_cost(steps, 0, spread[0], 8, blocks16, rule),
                                   ep_layer_cost(steps, 0, spread[0], 8, plain, rule))


@pytest.mark.parametrize("rule", RULES)
def test_rule_extra_blocks_are_the_rules_own_slots(trace, spread, rule):
    b = verify_batches(trace, 72, 5, seed=1)
    extra = rule_extra_blocks(b, 0, spread[0], 8, rule, MODEL)
    assert extra.shape == (5, 8) and np.all(extra >= 0)
    if rule in ("dynamic", "balanced", "cost"):
        step, slot = token_slots(b.steps, 0, spread[0], 8, rule, cost_model=MODEL)
        per_slot = np.bincount(step * spread.shape[1] + slot, minlength=5 * spread.shape[1]).reshape(5, 8, -1)
        np.testing.assert_array_equal(extra, [[naive_extra(w, 4) for w in s] for s in per_slot])
    distinct, pairs = rule_loads(b, 0, spread[0], 8, rule, MODEL)
    got = batch_costs(b, [Row("x", spread, rule, lambda t: MODEL)], 8, 72)["x"]
    np.testing.assert_allclose(got, MODEL.cost(distinct, pairs, extra).max(axis=1))


def test_report_totals_count_blocks_on_large_steps(trace, spread):
    steps = resample_batches(trace, 72, 10, seed=5)
    placement = Placement(steps.model, 8, spread)
    sums = LayerSums(1, 8)
    accumulate(sums, steps, placement, MODEL, "dynamic")
    step, slot = token_slots(steps, 0, spread[0], 8, "dynamic")
    per_slot = np.bincount(step * spread.shape[1] + slot, minlength=10 * spread.shape[1]).reshape(10, 8, -1)
    naive = [max(MODEL.a_us_per_expert * (w > 0).sum() + MODEL.r_us_per_block * naive_extra(w, 4)
                 + MODEL.b_us_per_token * w.sum() + MODEL.c_us for w in s) for s in per_slot]
    assert summarize(sums)["moe_us_per_step"] == pytest.approx(np.mean(naive))
