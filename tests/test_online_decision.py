"""Online re-placement's pure parts: aligning a new map to the one in force (against a brute-force oracle),
the refined candidate's local moves, the decision's rules, and the window of recent passes.

Dimension letters: L MoE layers, E experts, P physical slots, R ranks, S steps.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.fit import fit, naive
from moeplace.algorithms.moves import align, align_layer, moved_slots, received_per_rank
from moeplace.algorithms.refine import refine
from moeplace.analysis.metrics import max_distinct_means, step_max_distinct
from moeplace.analysis.replace import MIN_STEPS, ReplaceConfig, choose, decide, standard_error
from moeplace.cost.model import CostModel
from moeplace.files.placement import Placement, check_placement
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.load import open_trace
from moeplace.trace.synthetic import synthetic_steps
from moeplace.trace.window import PassWindow, logical_ids
from test_algorithms import SAMPLE, assert_valid_placement, tiny_model

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def random_layer(rng: np.random.Generator, E: int, R: int, spares: int) -> np.ndarray:
    """A valid [P] map: every expert once, ``spares`` replicas more, no rank holding an expert twice."""
    P = E + spares
    while True:
        layer = rng.permutation(np.concatenate([np.arange(E), rng.choice(E, spares, replace=False)]))
        if all(np.unique(layer[r * (P // R):(r + 1) * (P // R)]).size == P // R for r in range(R)):
            return layer


def relabelled(layer: np.ndarray, R: int, rng: np.random.Generator, nodes: int = 1) -> np.ndarray:
    """``layer`` with its ranks renamed (within and across nodes as whole nodes) and each rank's slots shuffled:
    the same placement to every algorithm."""
    spr, per_node = layer.size // R, R // nodes
    node_order = rng.permutation(nodes)
    order = np.concatenate([n * per_node + rng.permutation(per_node) for n in node_order])
    return np.concatenate([rng.permutation(layer[r * spr:(r + 1) * spr]) for r in order])


def brute_force_moves(new: np.ndarray, old: np.ndarray, R: int) -> int:
    """The fewest slots to copy over every renaming of ``new``'s ranks (each rank keeping what it can in place)."""
    spr = new.size // R
    sets_new = [set(new[r * spr:(r + 1) * spr]) for r in range(R)]
    sets_old = [set(old[r * spr:(r + 1) * spr]) for r in range(R)]
    return min(sum(spr - len(sets_new[r] & sets_old[perm[r]]) for r in range(R))
               for perm in itertools.permutations(range(R)))


@PROPERTY
@given(seed=st.integers(0, 10_000), spares=st.sampled_from([0, 4, 8]), nodes=st.sampled_from([1, 2]))
def test_align_undoes_a_renaming_and_keeps_each_rank_s_experts(seed, spares, nodes):
    rng = np.random.default_rng(seed)
    E, R = 16, 4
    old = random_layer(rng, E, R, spares)
    new = relabelled(random_layer(rng, E, R, spares), R, rng)
    assert moved_slots(old[None], align_layer(relabelled(old, R, rng, nodes), old, R, nodes)[None])[0] == 0
    aligned = align_layer(new, old, R, nodes)
    spr = aligned.size // R
    ranks = lambda m: sorted(tuple(sorted(m[r * spr:(r + 1) * spr])) for r in range(R))   # noqa: E731
    assert ranks(aligned) == ranks(new)                     # the same placement, renamed
    if nodes == 1:
        assert moved_slots(old[None], aligned[None])[0] == brute_force_moves(new, old, R)


def test_align_over_nodes_keeps_ranks_within_their_node():
    rng = np.random.default_rng(3)
    E, R, nodes = 16, 4, 2
    old, new = random_layer(rng, E, R, 4), random_layer(rng, E, R, 4)
    aligned = align_layer(new, old, R, nodes)
    spr = aligned.size // R
    node_sets = lambda m: sorted(tuple(sorted(m[n * 2 * spr:(n + 1) * 2 * spr])) for n in range(nodes))  # noqa: E731
    assert node_sets(aligned) == node_sets(new)


def test_received_per_rank_counts_each_rank_s_changed_slots():
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = np.array([[0, 1, 2, 3, 5, 4, 7, 6]])
    assert received_per_rank(old, new, 4).tolist() == [[0, 0, 2, 2]]


@pytest.fixture(scope="module")
def skewed():
    model = tiny_model(32, 4, 3)
    _, steps = synthetic_steps(1200, 9, model, seed=5)
    return model, steps


@pytest.mark.parametrize("spares,dispatch", [(0, "dynamic"), (8, "balanced"), (8, "dynamic")])
def test_refine_moves_only_where_it_gains_on_its_steps(skewed, spares, dispatch):
    model, steps = skewed
    R = 8
    fitted_on, now = steps.slice(0, 400), steps.slice(400, 1200)
    current = solve("contiguous", PlacementProblem(model, fitted_on, R, redundant=spares))
    problem = PlacementProblem(model, now, R, redundant=spares, dispatch=dispatch, balance_floor=0.0)
    refined = refine(problem, current)
    assert_valid_placement(refined, problem)
    counts = lambda m: np.stack([np.sort(np.bincount(r, minlength=32)) for r in m])   # noqa: E731
    assert (counts(refined) == counts(current)).all()   # how many experts hold how many replicas: kept
    before, after = max_distinct_means(now, [Placement(model, R, m) for m in (current, refined)], [dispatch] * 2,
                                       [CostModel()] * 2)
    assert after < before
    assert refine(problem, current, min_step_gain=1e9).tolist() == current.tolist()   # no move pays: none made


def test_refine_moves_fewer_replicas_than_a_refit_for_most_of_its_gain(skewed):
    model, steps = skewed
    R = 8
    current = fit(PlacementProblem(model, steps.slice(0, 600), R)).phy2log
    later = steps.slice(600, 1200)
    problem = PlacementProblem(model, later, R)
    refined, refit = refine(problem, current), align(fit(problem).phy2log, current, R)
    assert moved_slots(current, refined).sum() < moved_slots(current, refit).sum()


def window_steps():
    """The shipped sample's verify steps (every 8th real GPT-OSS-20B sequence, about 34 steps each)."""
    return open_trace(SAMPLE).load("verify")


def test_decide_leaves_a_map_worse_than_the_naive_layout_even_when_moves_are_dear():
    steps = window_steps()
    model = steps.model
    window = steps.slice(0, 600)
    hottest_together = np.argsort(-window.expert_token_counts(), axis=1, kind="stable")   # rank 0 the 4 hottest, ...
    current = Placement(model, 8, hottest_together)
    dear = ReplaceConfig(replica_bytes=1e12, horizon=1)
    decision = decide(window, current, "dynamic", CostModel(), dear)
    assert decision.target is not None and decision.current > decision.naive
    check_placement(Placement(model, 8, decision.target))
    assert decision.chosen <= decision.naive + 1e-9
    assert decision.moved_replicas == int(moved_slots(current.phy2log, decision.target).sum())


def test_decide_keeps_the_map_a_fit_on_the_same_traffic_made():
    steps = window_steps()
    model = steps.model
    current = Placement(model, 8, fit(PlacementProblem(model, steps.slice(0, 1500), 8, balance_floor=0.9)).phy2log)
    decision = decide(steps.slice(1500, 2100), current, "dynamic", CostModel(), ReplaceConfig(replica_bytes=5e7))
    assert decision.target is None, decision.line


@pytest.mark.parametrize("spares,dispatch", [(0, "dynamic"), (8, "balanced")])
def test_decide_on_two_requests_does_not_lose_to_the_naive_layout_on_the_next(spares, dispatch):
    steps = window_steps()
    model = steps.model
    earlier, window, following = steps.slice(0, 300), steps.slice(300, 370), steps.slice(370, 1370)
    current = Placement(model, 8, naive(PlacementProblem(model, earlier, 8, redundant=spares)))
    decision = decide(window, current, dispatch, CostModel(), ReplaceConfig(replica_bytes=5e7))
    chosen = current if decision.target is None else Placement(model, 8, decision.target)
    fresh_naive = Placement(model, 8, naive(PlacementProblem(model, window, 8, redundant=spares)))
    ours, theirs = max_distinct_means(following, [chosen, fresh_naive], [dispatch] * 2, [CostModel()] * 2)
    assert ours <= theirs * 1.01, decision.line


def test_decide_refuses_a_window_too_short():
    steps = window_steps()
    current = Placement(steps.model, 8, solve("contiguous", PlacementProblem(steps.model, steps, 8)))
    decision = decide(steps.slice(0, MIN_STEPS - 1), current, "dynamic", CostModel())
    assert decision.target is None and "too few" in decision.reason


def scores_with(gain: float, noise: float, steps: int = 300, layers: int = 2, seed: int = 0) -> np.ndarray:
    """[4, L, S] out-of-fold maxima: the map in force at 3, every candidate ``gain`` lower, plus noise."""
    rng = np.random.default_rng(seed)
    now = 3 + noise * rng.standard_normal((layers, steps))
    candidates = np.stack([now - gain + noise * rng.standard_normal((layers, steps)) for _ in range(3)])
    candidates[2] += 0.5                                        # the naive layout is worse than the others
    return np.concatenate([now[None], candidates])


def test_choose_weighs_gain_against_moves_and_noise():
    current = np.tile(np.arange(8), (2, 1))
    moved = np.tile(np.array([1, 0, 3, 2, 5, 4, 7, 6]), (2, 1))
    finals = [moved, moved, current]
    cheap = ReplaceConfig(replica_bytes=1.0)
    assert choose(scores_with(0.3, 0.1), current, finals, 4, CostModel(), cheap).target is not None
    dear = ReplaceConfig(replica_bytes=1e12)
    assert choose(scores_with(0.3, 0.1), current, finals, 4, CostModel(), dear).target is None
    noisy = choose(scores_with(0.02, 3.0), current, finals, 4, CostModel(), cheap)
    assert noisy.target is None and "noise" in noisy.reason
    small = choose(scores_with(0.001, 0.0), current, finals, 4, CostModel(), cheap)
    assert small.target is None and "under" in small.reason


def test_standard_error_over_batches():
    assert standard_error(np.ones(100)) == 0.0
    assert standard_error(np.array([1.0])) == float("inf")
    values = np.repeat([0.0, 1.0], 50)
    assert standard_error(values) > standard_error(np.tile([0.0, 1.0], 50))   # runs of alike steps count less


def test_step_max_distinct_is_max_distinct_means_step_by_step(skewed):
    model, steps = skewed
    maps = [Placement(model, 8, solve(name, PlacementProblem(model, steps, 8, redundant=8)))
            for name in ("contiguous", "naive-spares")]
    rules, costs = ["balanced", "dynamic"], [CostModel()] * 2
    per_step = step_max_distinct(steps, maps, rules, costs)
    assert per_step.shape == (2, model.num_moe_layers, steps.num_steps)
    assert np.allclose(per_step.mean(axis=(1, 2)), max_distinct_means(steps, maps, rules, costs))


def test_window_keeps_the_last_passes_of_its_modes():
    model = ModelSpec.all_moe("m", 2, 8, 2)
    window = PassWindow(model, capacity=5)
    for start in range(0, 12, 3):   # passes start..start+2 of 1 row each; every third is a prefill
        ids = np.full((3, 2, 2), start, np.int16)
        ids[:, :, 1] = np.arange(start, start + 3)[:, None] % 8
        modes = np.array([M.TARGET_VERIFY, M.DECODE, M.EXTEND], np.uint8)
        window.add(ids % 8, np.ones(3, np.int64), modes, np.ones(3, np.int32))
    steps = window.steps()
    assert steps.num_steps == len(window) == 5 and window.seen == 8
    assert (steps.modes != M.EXTEND).all()
    assert steps.topk_ids[:, 0, 1].tolist() == [4, 6, 7, 9 % 8, 10 % 8]   # passes 4, 6, 7, 9, 10


def test_window_is_safe_to_read_while_filled():
    model = ModelSpec.all_moe("m", 1, 4, 1)
    window = PassWindow(model, capacity=50)
    errors = []

    def fill():
        for _ in range(300):
            window.add(np.zeros((2, 1, 1), np.int16), np.ones(2, np.int64), np.full(2, M.DECODE, np.uint8),
                       np.ones(2, np.int32))

    def read():
        try:
            for _ in range(300):
                assert window.steps().num_steps <= 50
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=fill), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(window) == 50


def test_logical_ids_through_each_layer_s_map():
    maps = np.array([[2, 0, 1], [1, 2, 0]])
    physical = np.array([[[0, 1], [2, -1]]], np.int16)       # [T=1, L=2, K=2]
    assert logical_ids(physical, maps).tolist() == [[[2, 0], [0, -1]]]


def test_the_decision_fits_with_its_pair_weight(monkeypatch):
    """The candidates' fits weigh the pairs as the config says (the default, 1/16, is not the tie-break's), and a
    negative weight is refused by name."""
    import moeplace.analysis.replace as replace_module
    from moeplace.algorithms.stepaware import TIE_BREAK
    from moeplace.errors import MoeplaceError

    seen = []
    original = replace_module.fit
    monkeypatch.setattr(replace_module, "fit", lambda problem: seen.append(problem.pair_weight) or original(problem))
    model = tiny_model(16)
    steps = synthetic_steps(200, model=model, seed=1)[1]
    current = Placement(model, 4, solve("deepseek", PlacementProblem(model, steps, 4)))
    decide(steps, current, "dynamic", CostModel(), ReplaceConfig(pair_weight=2**-3))
    assert seen and set(seen) == {2**-3}
    assert ReplaceConfig().pair_weight != TIE_BREAK
    with pytest.raises(MoeplaceError, match="pair_weight"):
        ReplaceConfig(pair_weight=-1.0).check()
