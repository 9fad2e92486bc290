"""Wide expert parallelism: the polynomial per-step optimum against Hall's formula, the closure the
wide spare search reads, placements at 16 to 512 ranks through the CLI (no traceback; one line where
a width cannot be placed). SGLang's start-up reading 64- and 128-rank files: tests/test_sglang_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.wide_spares import add_replicas
from moeplace.cli import cli, main
from moeplace.dispatch.balanced import MAX_AUGMENT, fast_rule, fast_rule_step, mask_bits, pack_bits
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
from moeplace.dispatch.flow import closure, exact_dispatch, lower_bound, optimum
from test_algorithms import assert_valid_placement, tiny_model, tiny_steps
from test_balanced import random_case


def hall(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    return step_optimum(subset_counts(active, masks, ranks), subset_sizes(ranks))


@pytest.mark.parametrize("ranks, experts", [(2, 3), (4, 8), (6, 12), (8, 16), (10, 30), (12, 24)])
@pytest.mark.parametrize("seed", range(6))
def test_rule_optimum_equals_halls_formula(ranks, experts, seed):
    """The uncapped rule (used above HALL_MAX_RANKS), with and without its early stop at a lower
    bound, gives Hall's optimum on every step."""
    rng = np.random.default_rng(seed)
    counts, masks = random_case(rng, ranks, experts, steps=60)
    want = hall(counts > 0, masks, ranks)
    np.testing.assert_array_equal(exact_dispatch(counts > 0, masks, ranks).distinct.max(axis=1), want)
    bound = lower_bound(counts > 0, masks, ranks)
    assert np.all(bound <= want)
    got = fast_rule(counts, masks, ranks, max_augment=None, floor=bound).distinct.max(axis=1)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 9), experts=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_property_closure_is_halls_tight_set(ranks, experts, seed):
    """The closure holds every replica of the experts dispatched into it, and its Hall ratio is the
    step's optimum: the certificate that no dispatch does better."""
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=20)
    chosen = exact_dispatch(counts > 0, masks, ranks)
    reach = closure(chosen.pick, chosen.distinct, masks)                  # [S, R] bool
    bits = mask_bits(masks, ranks)
    best = hall(counts > 0, masks, ranks)
    for s in range(counts.shape[0]):
        if best[s] == 0:
            continue
        inside = [e for e in np.flatnonzero(counts[s] > 0) if reach[s, chosen.pick[s, e]]]
        assert all(not (bits[e] & ~reach[s]).any() for e in inside)
        assert -(-len(inside) // int(reach[s].sum())) == best[s]


def wide_case(rng: np.random.Generator, ranks: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts [S, 3R], masks [3R]) as wide EP looks: three experts a rank, a third of them with a second
    replica, a few per rank active in a step (so the greedy pass leaves paths to find)."""
    E = 3 * ranks
    home = rng.permutation(np.arange(E) % ranks)
    second = np.where(rng.random(E) < 1 / 3, rng.integers(0, ranks, E), home)
    bits = np.zeros((E, ranks), bool)
    bits[np.arange(E), home] = bits[np.arange(E), second] = True
    masks = pack_bits(bits)                           # int64 bit sets up to 64 ranks, bools beyond
    counts = (rng.random((steps, E)) < 0.5) * rng.integers(1, 6, (steps, E))
    return counts, masks


@settings(max_examples=25, deadline=None)
@given(ranks=st.sampled_from([13, 40, 63, 64, 65, 128, 200]), seed=st.integers(0, 2**31 - 1),
       cap=st.sampled_from([MAX_AUGMENT, None]))
def test_rule_on_many_ranks_equals_its_statement(ranks, seed, cap):
    """The vectorised rule's augmenting paths on wide layouts, pick for pick against ``fast_rule_step``
    (replica sets as int64 bit sets up to 64 ranks, as bools beyond)."""
    counts, masks = wide_case(np.random.default_rng(seed), ranks, steps=32)
    chosen = fast_rule(counts, masks, ranks, max_augment=cap)
    assume(chosen.augments.any())          # a case the greedy pass leaves nothing to do tests nothing here
    for s in range(counts.shape[0]):
        np.testing.assert_array_equal(chosen.pick[s], fast_rule_step(counts[s], masks, ranks, max_augment=cap))


@pytest.mark.parametrize("ranks, per_rank", [(16, 1), (24, 2), (64, 1), (128, 1), (320, 1)])
def test_wide_spares_fill_every_rank_and_never_hurt(ranks, per_rank):
    rng = np.random.default_rng(ranks)
    E = 2 * ranks
    masks = pack_bits(np.arange(E)[:, None] % ranks == np.arange(ranks))   # two experts a rank
    active = rng.random((300, E)) < 0.08
    more = add_replicas(active, masks, ranks, per_rank, active.sum(axis=0).astype(float))
    assert more.shape == masks.shape and more.dtype == masks.dtype     # as the layout holds them
    bits = mask_bits(more, ranks)
    assert np.all(bits.sum(axis=0) == 2 + per_rank)                   # every rank: its copies and its spares
    assert np.all(bits >= mask_bits(masks, ranks))                     # first copies kept
    assert optimum(active, more, ranks).mean() <= optimum(active, masks, ranks).mean()
    # the spares went somewhere useful: the optimum dropped on the fitted steps
    assert optimum(active, more, ranks).mean() < optimum(active, masks, ranks).mean()


@pytest.mark.parametrize("ranks, nodes, redundant, dispatch", [
    (16, 1, 16, "balanced"), (32, 4, 32, "balanced"), (64, 1, 64, "dynamic"), (128, 16, 0, "dynamic"),
    (96, 1, 96, "static"), (256, 1, 0, "dynamic")])
def test_stepaware_places_wide_layouts(ranks, nodes, redundant, dispatch):
    model = tiny_model(2 * ranks if ranks != 256 else 256, top_k=8)
    problem = PlacementProblem(model, tiny_steps(model, 120, ranks, seed=1), ranks, nodes=nodes,
                               redundant=redundant, dispatch=dispatch)
    assert_valid_placement(solve("stepaware", problem), problem)


def synth_trace(directory: Path, shape: str, steps: int) -> Path:
    """A SYNTHETIC trace of ``shape`` made by ``moeplace trace synth`` in ``directory``."""
    path = directory / "t.mptrace"
    result = CliRunner().invoke(cli, ["trace", "synth", "--shape", shape, "--steps", str(steps), "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def wide_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_trace(tmp_path_factory.mktemp("wide"), "deepseek-v3", 120)


@pytest.mark.parametrize("args", [
    ["--ranks", "64", "--redundant", "64", "--dispatch", "balanced"],
    ["--ranks", "32", "--nodes", "4", "--redundant", "32", "--dispatch", "balanced"],
    ["--ranks", "128", "--redundant", "128"],
    ["--ranks", "144", "--redundant", "32", "--nodes", "18"],
    ["--ranks", "256", "--nodes", "32"],
    ["--ranks", "512", "--redundant", "256"],
    ["--ranks", "128", "--redundant", "128", "--dispatch", "balanced"],
    ["--ranks", "256", "--redundant", "256", "--nodes", "32", "--dispatch", "balanced"],
])
def test_optimize_at_wide_widths(wide_trace, tmp_path, args):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["optimize", str(wide_trace), *args, "--holdout", "0.5", "-o", str(out),
                                       "--sglang-out", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["ranks"] == int(args[1])


@pytest.mark.parametrize("args, says", [
    (["--ranks", "512"], "do not split evenly over 512 ranks; --redundant 256 would"),
    (["--ranks", "100", "--redundant", "10"], "do not split evenly over 100 ranks; --redundant 44 would"),
    (["--ranks", "64", "--redundant", "64", "--nodes", "3"], "--nodes"),
])
def test_widths_that_cannot_be_placed_say_so_in_one_line(wide_trace, tmp_path, args, says):
    runner = CliRunner()
    with runner.isolation() as (stdout, stderr, *_):
        with pytest.raises(SystemExit) as exit_info:
            main(["optimize", str(wide_trace), *args, "-o", str(tmp_path / "p.json")])
    lines = stderr.getvalue().decode().strip().splitlines()
    assert exit_info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert not (tmp_path / "p.json").exists()



def test_advise_costs_a_sample_of_layers_of_a_deep_wide_model():
    from moeplace.analysis.layouts import layer_sample

    small = tiny_model(16, top_k=4, num_moe_layers=6)
    steps = tiny_steps(small, 30, 8, seed=0)
    assert layer_sample(steps) == (steps, 1.0)                      # few layers x experts: all of them
    wide = tiny_model(1024, top_k=8, num_moe_layers=12)
    steps = tiny_steps(wide, 30, 8, seed=0)
    sub, factor = layer_sample(steps)
    kept = [wide.moe_layers.index(h) for h in sub.model.moe_layers]
    assert len(kept) == 4 and factor == 12 / 4 and kept[0] == 0 and kept[-1] == 11
    np.testing.assert_array_equal(sub.topk_ids, steps.topk_ids[:, kept])
    assert sub.model.num_experts == wide.num_experts and sub.num_steps == steps.num_steps


@pytest.mark.parametrize("E, top_k, steps, seed", [(16, 4, 40, 0), (64, 8, 200, 1), (256, 8, 120, 2)])
def test_dynamic_reads_match_the_slot_activity(E, top_k, steps, seed):
    """The replica-count inputs read off the token pairs equal those of item_activity with 1 and 2 replicas."""
    from moeplace.algorithms.stepaware import dynamic_reads, item_activity

    model = tiny_model(E, top_k=top_k)
    trace = tiny_steps(model, steps, 8, seed=seed)
    for layer in range(model.num_moe_layers):
        single = item_activity(trace, layer, np.ones(E, np.int64), "dynamic")[0].sum(axis=0)
        paired = item_activity(trace, layer, np.full(E, 2), "dynamic")[0]
        extra = paired.reshape(steps, E, 2).sum(axis=(0, 2)) - single
        got_single, got_extra = dynamic_reads(trace, layer, E)
        np.testing.assert_array_equal(got_single, single)
        np.testing.assert_array_equal(got_extra, extra)


@pytest.mark.parametrize("dispatch", ["dynamic", "static"])
def test_slot_activity_on_sampled_rows_is_those_rows(dispatch):
    from moeplace.algorithms.stepaware import item_activity, replica_counts

    model = tiny_model(64, top_k=8)
    trace = tiny_steps(model, 150, 16, seed=4)
    rows = np.sort(np.random.default_rng(0).choice(150, 40, replace=False))
    for layer in range(model.num_moe_layers):
        replicas = replica_counts(trace, layer, 64, 32, 16, dispatch)
        full, tokens = item_activity(trace, layer, replicas, dispatch)
        part, part_tokens = item_activity(trace, layer, replicas, dispatch, rows=rows)
        np.testing.assert_array_equal(part, full[rows])
        np.testing.assert_array_equal(part_tokens, tokens)   # tokens still over every step


@pytest.mark.parametrize("ranks, nodes", [(16, 1), (32, 4)])
def test_robust_spares_on_many_ranks_choose_between_the_wide_search_and_naive(ranks, nodes):
    from moeplace.algorithms.robust import WIDE_CANDIDATES, choose, robust_spares

    model = tiny_model(2 * ranks, top_k=8, num_moe_layers=2)
    problem = PlacementProblem(model, tiny_steps(model, 240, ranks, seed=5), ranks, nodes=nodes,
                               redundant=ranks, dispatch="balanced")
    choice = choose(problem, seed=1)
    assert set(choice.losses) == set(WIDE_CANDIDATES)
    assert choice.losses[choice.name] == min(choice.losses.values())
    phy2log, _ = robust_spares(problem)
    assert_valid_placement(phy2log, problem)


def test_wide_table_is_on_a_sample_of_held_out_steps_and_says_so(wide_trace, tmp_path, monkeypatch):
    from moeplace.analysis import optimize as optimize_module

    monkeypatch.setattr(optimize_module, "WIDE_EVAL_CELLS", 128 * 20)
    monkeypatch.setattr(optimize_module, "WIDE_EVAL_STEPS", 20)
    out = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["optimize", str(wide_trace), "--ranks", "128", "--redundant", "128",
                                       "--holdout", "0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "128 ranks: the table is on 20 of the 60 held-out steps" in result.output
    assert json.loads(out.read_text())["metrics"]["eval_steps"] == 20
