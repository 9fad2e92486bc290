"""Spare slots chosen out of fold (``algorithms.robust``) and the stale-placement check (``analysis.staleness``).

The choice is checked against a plain re-scoring of its candidates on the held-out blocks, the even
candidate's replica counts against the naive layout's, and the check's verdict on traffic whose hot
experts moved against traffic that did not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.balanced_replicas import add_replicas, lift_to_floor, sample_size, spare_floor
from moeplace.algorithms.baselines import hot_expert_spares
from moeplace.algorithms.deepseek import rebalance_experts
from moeplace.algorithms.robust import (CANDIDATES, CV_CELLS, CV_LAYERS, DESCRIPTION, choose, cv_layers, even_copies,
                                        fold_blocks, layer_masks, robust_spares, uniform_steps)
from moeplace.analysis.staleness import staleness
from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import mask_bits, replica_layout, step_expert_counts
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
from moeplace.dispatch.flow import optimum
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps
from test_algorithms import assert_valid_placement, tiny_model, tiny_steps
from test_cli_optimize import run_main, topk_npz


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from([8, 16, 32, 64]), st.integers(0, 130), st.integers(0, 2**16))
def test_even_copies_spread_replicas_hottest_first(E, redundant, seed):
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 20, E).astype(float)            # ties: the lower id counts as hotter
    want = [1] * E
    for i in range(redundant):                               # one more each, hottest first, round after round
        want[sorted(range(E), key=lambda e: (-weight[e], e))[i % E]] += 1
    assert even_copies(weight, redundant).tolist() == want


@pytest.mark.parametrize("E,R,redundant", [(16, 4, 8), (32, 8, 32), (64, 8, 16)])
def test_even_copies_match_the_naive_layout_where_it_fills_in_order(E, R, redundant):
    weight = np.arange(E, 0, -1).astype(float)               # expert 0 hottest
    naive = hot_expert_spares(np.arange(E), weight, R, redundant)
    assert np.array_equal(even_copies(weight, redundant), np.bincount(naive, minlength=E))


def test_uniform_steps_keep_sizes_and_spread_evenly():
    rng = np.random.default_rng(0)
    active = np.zeros((50, 16), bool)
    active[:, :5] = True                                     # every fitted step: experts 0-4
    steps = uniform_steps(active, 4000, rng)
    assert np.all(steps.sum(axis=1) == 5)
    share = steps.mean(axis=0)
    assert np.allclose(share, 5 / 16, atol=0.03)             # uniform over experts, whatever was fitted


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from([(8, 4), (16, 4), (16, 8), (32, 8)]), st.integers(1, 2), st.integers(0, 2**16))
def test_spare_replicas_keep_every_expert_at_the_floor(shape, per_expert, seed):
    """With R >= E spare slots every expert holds 1 + R // E replicas at least, as in the naive layout,
    whatever the fitted steps say; each rank gets exactly its share of the spare slots."""
    E, ranks = shape
    redundant = per_expert * E
    rng = np.random.default_rng(seed)
    masks = np.int64(1) << (rng.permutation(E) % ranks)
    hot = rng.random(E) ** 4                                  # a few hot experts take most of the steps
    active = rng.random((60, E)) < hot
    floor = spare_floor(E, redundant)
    new = add_replicas(active, masks, ranks, redundant // ranks, active.sum(axis=0).astype(float), min_copies=floor)
    bits = mask_bits(new, ranks)
    assert np.all(bits.sum(axis=1) >= floor)
    np.testing.assert_array_equal(bits.sum(axis=0), E // ranks + redundant // ranks)


def test_lift_to_floor_moves_a_replica_from_an_expert_above_it():
    """Expert 3 holds one replica and expert 1 three: expert 1's replica on the lowest rank 3 lacks moves."""
    masks = np.array([0b0011, 0b0111, 0b1100, 0b1000])
    lifted = lift_to_floor(masks, 4, np.full(4, 2))
    assert lifted.tolist() == [0b0011, 0b0110, 0b1100, 0b1001]
    assert lift_to_floor(lifted, 4, np.full(4, 2)).tolist() == lifted.tolist()     # at the floor: unchanged


@pytest.mark.parametrize("S,folds", [(1, 1), (5, 3), (100, 3)])
def test_fold_blocks_are_contiguous_and_cover(S, folds):
    blocks = fold_blocks(S, folds)
    assert np.array_equal(np.concatenate(blocks), np.arange(S))
    assert all(np.all(np.diff(b) == 1) for b in blocks)


def layers_by_budget(problem: PlacementProblem, num_steps: int) -> int:
    """``cv_layers`` written out for a trace of ``num_steps``: add a layer while every fold's fit of every
    candidate on it stays within CV_CELLS (a fold fits each candidate but naive on up to half the search's
    sample of its steps, a blend on a quarter of the sample in uniform steps more; a step costs its rank sets
    and experts)."""
    L = problem.model.num_moe_layers
    half = sample_size(problem) // 2
    cells = 2 ** problem.ranks + problem.model.num_experts
    per_layer = 0
    for block in fold_blocks(num_steps, 3):
        for candidate in CANDIDATES:
            if candidate.name != "naive":
                fitted = min(num_steps - block.size, half)
                per_layer += cells * (fitted + (half // 2 if candidate.prior else 0))
    layers = 0
    while layers < L and (layers + 1) * per_layer <= CV_CELLS:
        layers += 1
    return min(L, max(layers, CV_LAYERS))


def budget_layers(problem: PlacementProblem, num_steps: int) -> int:
    return cv_layers(problem, fold_blocks(num_steps, 3), CANDIDATES, sample_size(problem) // 2)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from([(32, 8, 24), (64, 8, 12), (16, 4, 60), (384, 8, 60)]), st.integers(6, 30_000))
def test_cv_layers_spend_the_budget_on_short_traces(shape, num_steps):
    """As many layers as CV_CELLS of fitting allows, CV_LAYERS at least, every layer at most; never more
    for a longer trace."""
    E, ranks, L = shape
    model = tiny_model(E, top_k=4, num_moe_layers=L)
    problem = PlacementProblem(model, RoutingSteps.empty(model), ranks, redundant=ranks)
    got = [budget_layers(problem, n) for n in (num_steps, 2 * num_steps)]
    assert got == [layers_by_budget(problem, n) for n in (num_steps, 2 * num_steps)]
    assert min(CV_LAYERS, L) <= got[1] <= got[0] <= L


def test_choice_scores_more_layers_on_a_short_trace():
    """A short capture of a deep model is scored on more layers than CV_LAYERS; Kimi K2's shape on CV_LAYERS."""
    model = tiny_model(32, top_k=4, num_moe_layers=24)
    short = PlacementProblem(model, tiny_steps(model, 60, 8, 1), 8, redundant=8, dispatch="balanced")
    assert choose(short, seed=0).layers == budget_layers(short, 60) > CV_LAYERS
    kimi = tiny_model(384, top_k=8, num_moe_layers=60)
    assert budget_layers(PlacementProblem(kimi, RoutingSteps.empty(kimi), 8, redundant=96), 14_000) == CV_LAYERS


@pytest.mark.parametrize("E,ranks,redundant,layers", [(16, 4, 4, 2), (32, 8, 8, 5), (32, 8, 32, 3)])
def test_choice_losses_match_a_plain_rescoring(E, ranks, redundant, layers):
    """The choice's out-of-fold figures of the candidates that draw nothing at random (naive, even,
    replicas: every fitted step is in the search's sample here) against a plain re-scoring: each fold's
    steps copied out, each candidate fitted on them and scored on the held-out block, averaged over the
    folds and the layers the choice scored."""
    model = tiny_model(E, top_k=4, num_moe_layers=layers)
    steps = drifting_steps(model, 150, E, True)
    problem = PlacementProblem(model, steps, ranks, redundant=redundant, dispatch="balanced")
    choice = choose(problem, seed=1)
    scored = np.unique(np.linspace(0, layers - 1, choice.layers).round().astype(int))
    blocks = fold_blocks(steps.num_steps, 3)
    for candidate in (c for c in CANDIDATES if c.name in ("naive", "even", "replicas")):
        total = []
        for layer in scored:
            for k, block in enumerate(blocks):
                fit = steps.take(np.concatenate([b for i, b in enumerate(blocks) if i != k]))
                counts = step_expert_counts(fit, int(layer))
                weight = counts.sum(axis=0)
                base = rebalance_experts(weight[None].astype(np.float64), E, 1, 1, ranks, False)[0][0]
                masks = layer_masks(candidate, counts > 0, weight, base, ranks, redundant, 0,
                                    np.random.default_rng(0))[0]
                total.append(optimum(step_expert_counts(steps.take(block), int(layer)) > 0, masks, ranks).mean())
        assert choice.losses[candidate.name] == pytest.approx(np.mean(total), abs=1e-12), candidate.name


def drifting_steps(model, num_steps: int, seed: int, moved: bool) -> RoutingSteps:
    """Synthetic steps; ``moved``: their second half has each layer's expert ids reversed (hot turn cold)."""
    steps = tiny_steps(model, num_steps, 4, seed)
    if not moved:
        return steps
    ids = steps.topk_ids.copy()
    half = steps.token_offsets[num_steps // 2]
    E = model.num_experts
    ids[half:] = np.where(ids[half:] >= 0, E - 1 - ids[half:], -1)
    return RoutingSteps.from_topk(model, ids, np.diff(steps.token_offsets), steps.modes)


@pytest.mark.parametrize("E,ranks,redundant,moved", [(16, 4, 4, False), (16, 4, 16, True), (32, 8, 8, True),
                                                     (32, 8, 32, False)])
def test_choice_is_the_best_candidate_out_of_fold(E, ranks, redundant, moved):
    model = tiny_model(E, top_k=4, num_moe_layers=2)
    problem = PlacementProblem(model, drifting_steps(model, 300, E + redundant, moved), ranks,
                               redundant=redundant, dispatch="balanced")
    choice = choose(problem, seed=3)
    assert set(choice.losses) == {c.name for c in CANDIDATES}
    assert choice.losses[choice.name] == min(choice.losses.values())
    assert choice.losses[choice.name] <= choice.losses["naive"]      # never below the naive layout out of fold
    assert DESCRIPTION[choice.name] in choice.line and "naive layout" in choice.line
    phy2log, again = robust_spares(problem)
    assert_valid_placement(phy2log, problem)


def e_opt(steps: RoutingSteps, phy2log: np.ndarray, ranks: int) -> float:
    from moeplace.dispatch.balanced import step_expert_counts
    E = steps.model.num_experts
    return float(np.mean([step_optimum(subset_counts(step_expert_counts(steps, layer) > 0,
                                                     replica_layout(row, E, ranks).masks, ranks),
                                       subset_sizes(ranks)).mean() for layer, row in enumerate(phy2log)]))


def hot_cold_swapped(steps: RoutingSteps, by: RoutingSteps, share: int) -> RoutingSteps:
    """``steps`` with each layer's E / share hottest experts of ``by`` and its E / share coldest trading ids."""
    weight = by.expert_token_counts()
    L, E = weight.shape
    perms = np.tile(np.arange(E), (L, 1))
    for layer in range(L):
        order = np.lexsort((np.arange(E), -weight[layer]))
        hot, cold = order[:E // share], order[::-1][:E // share]
        perms[layer, hot], perms[layer, cold] = cold, hot
    ids = steps.topk_ids.astype(np.int64)
    ids = np.where(ids >= 0, perms[np.arange(L)[None, :, None], np.maximum(ids, 0)], -1)
    return RoutingSteps.from_topk(steps.model, ids, np.diff(steps.token_offsets), steps.modes)


@pytest.mark.parametrize("E,ranks,top_k,seed", [(32, 8, 4, 1), (64, 8, 6, 2), (16, 4, 2, 3)])
def test_spares_at_r_equal_e_stay_below_naive_when_hot_experts_swap(E, ranks, top_k, seed):
    """Fitted on steps where a few experts are hot, scored on later steps where the coldest took their place:
    with R = E the written layout is at or below the naive one (every expert two replicas) there."""
    model = tiny_model(E, top_k=top_k, num_moe_layers=2)
    steps = tiny_steps(model, 1200, ranks, seed)
    fit = steps.slice(0, 400)
    later = hot_cold_swapped(steps.slice(400, 1200), fit, 8)
    problem = PlacementProblem(model, fit, ranks, redundant=E, dispatch="balanced")
    ours, choice = robust_spares(problem)
    naive = solve("naive-spares", problem)
    if choice.name != "naive":                               # (whose greedy fill may leave one expert out)
        assert all(np.all(np.bincount(row, minlength=E) >= 2) for row in ours), choice.name
    assert e_opt(later, ours, ranks) <= e_opt(later, naive, ranks), choice.name


def test_staleness_sees_moved_traffic():
    """A placement fitted before the hot experts moved has more to gain from re-placing than one fitted after."""
    E, ranks, redundant = 32, 8, 8
    model = tiny_model(E, top_k=4, num_moe_layers=2)
    old = tiny_steps(model, 400, ranks, 1)
    new = drifting_steps(model, 800, 1, True).slice(400, 800)          # the same routing, hot experts reversed
    fit = lambda steps: robust_spares(PlacementProblem(model, steps, ranks, redundant=redundant,
                                                       dispatch="balanced"))[0]
    before, after = (Placement(model, ranks, fit(s), algorithm="stepaware") for s in (old, new.slice(0, 280)))
    stale = staleness(new, before, "balanced", CostModel())
    fresh = staleness(new, after, "balanced", CostModel())
    assert stale.to_gain > fresh.to_gain
    assert stale.to_gain > 0.01 and "re-place" in stale.line
    assert stale.current == pytest.approx(e_opt(new.slice(280, 400), before.phy2log, ranks))


def test_report_says_whether_to_replace(tmp_path, capsys):
    trace = topk_npz(tmp_path / "t.npz", 16, 120, layers=2)
    code, _, err = run_main(capsys, "optimize", trace, "--ranks", "4", "--redundant", "4", "--dispatch", "balanced",
                            "--max-steps", "600", "--effort", "2e7", "-o", tmp_path / "p.json")
    assert code == 0, err
    code, out, _ = run_main(capsys, "report", trace, "--ranks", "4", "--dispatch", "balanced",
                            "--placement", tmp_path / "p.json", "--json")
    assert code == 0
    stale = json.loads(out)["staleness"]
    assert stale["fit_steps"] + stale["scored_steps"] == 120 and ("re-place" in stale["line"] or "keep" in stale["line"])
    code, out, _ = run_main(capsys, "report", trace, "--ranks", "4", "--dispatch", "balanced",
                            "--placement", tmp_path / "p.json")
    assert code == 0 and stale["line"] in out


@pytest.mark.parametrize("active, warning", [
    (8, "50% of the experts (8.0 of 16 a layer, on average) are never active"),   # half the spare slots rest on nothing
    (15, None),   # 1 of 16 never active: under NARROW_SHARE, a rare expert, no warning
])
def test_optimize_warns_on_a_narrow_trace_only(tmp_path, capsys, active, warning):
    """A trace where only ``active`` of 16 experts are ever routed to."""
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(active, 2, replace=False) for _ in range(2)]) for _ in range(60 * 9)])
    np.savez(tmp_path / "n.npz", topk_ids=ids.astype(np.int16), num_experts=np.int64(16), model_name=np.str_("tiny"))
    code, _, err = run_main(capsys, "optimize", tmp_path / "n.npz", "--ranks", "4", "--redundant", "4",
                            "--dispatch", "balanced", "--effort", "2e7", "-o", tmp_path / "p.json")
    assert code == 0
    if warning:
        assert warning in err and "rests on nothing seen" in err and "capture more" in err
    else:
        assert "never active" not in err
