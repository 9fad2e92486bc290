"""Placement algorithms: every registered algorithm's answer is a valid placement; the swap search's
delta matrix is the exact objective change; stepaware reaches known optima; invariants by hypothesis.

Dimension letters: L MoE layers, E experts, P physical slots, R ranks, S steps.
The DeepSeek EPLB port itself is checked against SGLang in ``test_deepseek_eplb.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.algorithms import ALGORITHMS, PlacementProblem, get_algorithm, solve
from moeplace.algorithms.balanced_replicas import first_copies_and_room
from moeplace.algorithms.baselines import separate_replicas
from moeplace.algorithms.robust import robust_spares
from moeplace.algorithms.stepaware import (TIE_BREAK, _loads, _objective, greedy_place, item_activity,
                                           order_replicas, rank_deltas, replica_counts, swap_deltas)
from moeplace.analysis.optimize import split_steps
from moeplace.dispatch.balanced import replica_layout, step_expert_counts
from moeplace.dispatch.flow import optimum
from moeplace.dispatch.loads import balancedness, layer_rank_loads
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement, check_placement
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.synthetic import synthetic_steps

# Keep the property tests fast and reproducible on a 2-core CI box.
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def tiny_model(num_experts: int, top_k: int = 4, num_moe_layers: int = 2) -> ModelSpec:
    """A model whose first layer is dense, so MoE layer indices differ from hidden-layer indices."""
    return ModelSpec(f"test-{num_experts}e", num_moe_layers + 1, tuple(range(1, num_moe_layers + 1)),
                     num_experts, min(top_k, num_experts))


def tiny_steps(model: ModelSpec, num_steps: int, ranks: int, seed: int) -> RoutingSteps:
    """Synthetic steps of 9 tokens; each step recorded on a different source rank (static dispatch reads it)."""
    _, steps = synthetic_steps(num_steps, 9, model, seed=seed)
    steps.ranks = (np.arange(steps.num_steps) % ranks).astype(np.int16)
    return steps


def assert_valid_placement(phy2log: np.ndarray, problem: PlacementProblem) -> None:
    """The answer check every algorithm must pass: shape [L, E+R] of integer expert ids, every expert
    placed in every layer, equal slots per rank, no rank holding two replicas of one expert,
    and no expert with more replicas than ranks."""
    m, R = problem.model, problem.ranks
    phy2log = np.asarray(phy2log)
    assert phy2log.shape == (m.num_moe_layers, m.num_experts + problem.redundant)
    assert np.issubdtype(phy2log.dtype, np.integer)
    check_placement(Placement(m, R, phy2log, nodes=problem.nodes))   # raises PlacementError listing problems
    P = phy2log.shape[1]
    assert P % R == 0
    for layer in range(m.num_moe_layers):
        copies = np.bincount(phy2log[layer], minlength=m.num_experts)
        assert copies.min() >= 1 and copies.sum() == P and copies.max() <= R
        per_rank = phy2log[layer].reshape(R, P // R)
        for r in range(R):
            assert np.unique(per_rank[r]).size == P // R, f"layer {layer} rank {r}: {per_rank[r]}"


def make_problem(E: int, R: int, redundant: int, nodes: int, dispatch: str, seed: int = 0,
                 num_steps: int = 30, effort: float | None = None) -> PlacementProblem:
    model = tiny_model(E, top_k=2 if E <= 8 else 4)
    p = PlacementProblem(model, tiny_steps(model, num_steps, R, seed), R, nodes=nodes, redundant=redundant,
                         dispatch=dispatch, seed=seed)
    if effort is not None:
        p.effort = effort
    return p


def fitting_redundant(E: int, R: int) -> int:
    """A redundant-slot count that splits evenly and makes some expert take several replicas."""
    return 3 * R if (E + 3 * R) // R <= E else R


# ----------------------------------------------------------------------------- every algorithm, every shape

SHAPES = [(E, R) for E in (8, 16, 32, 64) for R in (2, 4, 8)]


@pytest.mark.parametrize("dispatch", ["dynamic", "static"])
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("with_redundant", [False, True], ids=["r0", "rplus"])
@pytest.mark.parametrize("E,R", SHAPES, ids=[f"E{E}-R{R}" for E, R in SHAPES])
def test_every_algorithm_gives_a_valid_placement(E, R, with_redundant, nodes, dispatch):
    redundant = fitting_redundant(E, R) if with_redundant else 0
    for name in ALGORITHMS:
        problem = make_problem(E, R, redundant, nodes, dispatch, seed=E + R, effort=2e6)
        phy2log = solve(name, problem)
        assert_valid_placement(phy2log, problem)


def test_registry_names_resolve_and_unknown_name_is_a_user_error():
    for name in ALGORITHMS:
        assert callable(get_algorithm(name))
    with pytest.raises(MoeplaceError, match="unknown algorithm 'nope'"):
        get_algorithm("nope")


def test_progress_reports_every_layer():
    for name in ALGORITHMS:
        seen = []
        problem = make_problem(16, 4, 4, 1, "dynamic")
        problem.progress = seen.append
        solve(name, problem)
        if name != "contiguous":   # the trivial layout does no per-layer work
            assert sum(seen) == problem.model.num_moe_layers, name


# ----------------------------------------------------------------------------- PlacementProblem.check

@pytest.mark.parametrize("E,R,redundant,nodes,message", [
    (32, 7, 0, 1, r"32 slots do not split evenly over 7 ranks"),
    (32, 8, 3, 1, r"35 slots do not split evenly over 8 ranks"),
    (8, 2, 10, 1, r"9 slots per rank exceed the 8 experts"),
    (16, 6, 0, 4, r"--ranks \(6\) must be a positive multiple of --nodes \(4\)"),
    (16, 4, -4, 1, r"--redundant must be >= 0"),
    (16, 0, 0, 1, r"--ranks \(0\)"),
])
def test_problem_check_rejects_impossible_problems(E, R, redundant, nodes, message):
    model = tiny_model(E)
    problem = PlacementProblem(model, tiny_steps(model, 3, 1, 0), R, nodes=nodes, redundant=redundant)
    with pytest.raises(MoeplaceError, match=message):
        problem.check()
    with pytest.raises(MoeplaceError, match=message):   # solve checks before any algorithm runs
        solve("stepaware", problem)


SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "gptoss20b-sample.mptrace"


def test_balance_floor_is_kept_and_trades_against_distinct_experts():
    """On the shipped real sample (fitted steps): every layer's token balancedness is at least
    balance_floor x DeepSeek EPLB's, and a looser floor never gives a worse E[max distinct]."""
    from moeplace.trace.load import open_trace

    trace = open_trace(SAMPLE)
    steps = trace.load("verify").take(np.arange(1500))
    reference = solve("deepseek", PlacementProblem(trace.model, steps, 8))

    def measured(phy2log):
        per_layer = [layer_rank_loads(steps, layer, phy2log[layer], 8, "dynamic")
                     for layer in range(trace.model.num_moe_layers)]
        return (np.mean([d.max(axis=1).mean() for d, _ in per_layer]),
                np.array([balancedness(t.sum(axis=0)[None])[0] for _, t in per_layer]))

    _, ref_balance = measured(reference)
    e_max = {}
    for floor in (0.0, 0.9, 0.98):
        e_max[floor], balance = measured(solve("stepaware", PlacementProblem(trace.model, steps, 8,
                                                                             balance_floor=floor)))
        assert (balance >= floor * ref_balance - 1e-9).all(), floor
    assert e_max[0.0] <= e_max[0.9] <= e_max[0.98]
    with pytest.raises(MoeplaceError, match="balance-floor"):
        PlacementProblem(trace.model, steps, 8, balance_floor=1.5).check()


def test_problem_check_accepts_edge_cases():
    model = tiny_model(8)
    steps = tiny_steps(model, 3, 1, 0)
    PlacementProblem(model, steps, 8, nodes=8).check()                # one slot per rank
    PlacementProblem(model, steps, 2, redundant=8).check()            # slots per rank == E
    PlacementProblem(model, steps, 1).check()


# ----------------------------------------------------------------------------- swap_deltas vs brute force

def random_swap_instance(rng: np.random.Generator, S: int, R: int, spr: int, E: int):
    """Random activity X [S, P], a balanced rank per item, and item experts with no rank holding two."""
    P = R * spr
    X = (rng.random((S, P)) < rng.uniform(0.2, 0.7)).astype(np.float32)
    while True:
        extra = np.sort(rng.choice(E, P - E, replace=True)) if P > E else np.zeros(0, np.int64)
        item_expert = np.sort(np.concatenate([np.arange(E), extra]))
        if np.bincount(item_expert).max() <= R:
            break
    for _ in range(200):
        rank = order_replicas(rng.permutation(np.repeat(np.arange(R), spr)), item_expert)
        if all(np.unique(item_expert[rank == r]).size == spr for r in range(R)):
            return X, rank, item_expert
    pytest.skip("no separating assignment drawn")


def brute_force_deltas(X, rank, item_expert, R, pairs=TIE_BREAK):
    """[P, P] objective change per swap from scratch, inf where the swap is not allowed."""
    P = X.shape[1]
    before = _objective(_loads(X, rank, R), pairs)
    out = np.full((P, P), np.inf)
    for i, j in itertools.product(range(P), repeat=2):
        if rank[i] == rank[j] or item_expert[i] == item_expert[j]:
            # same rank: nothing moves; same expert: only relabels two replicas (phy2log unchanged)
            continue
        swapped = rank.copy()
        swapped[i], swapped[j] = rank[j], rank[i]
        if any(np.unique(item_expert[swapped == r]).size < np.count_nonzero(swapped == r) for r in range(R)):
            continue   # a rank would hold two replicas of one expert
        if not np.array_equal(swapped, order_replicas(swapped, item_expert)):
            continue   # an expert's replica items would stop having increasing ranks
        out[i, j] = _objective(_loads(X, swapped, R), pairs) - before
    return out


@pytest.mark.parametrize("pairs", [TIE_BREAK, 2**-4])
@pytest.mark.parametrize("seed", range(12))
def test_swap_deltas_match_brute_force(seed, pairs):
    rng = np.random.default_rng(seed)
    R = int(rng.choice([2, 3, 4]))
    spr = int(rng.integers(1, 4))
    E = int(rng.integers(max(1, spr), R * spr + 1))    # some experts replicated when E < R * spr
    X, rank, item_expert = random_swap_instance(rng, int(rng.integers(1, 9)), R, spr, E)
    D = _loads(X, rank, R)
    delta = swap_deltas(X, D, rank, item_expert, R, pairs)
    expect = brute_force_deltas(X, rank, item_expert, R, pairs)
    assert np.array_equal(np.isinf(delta), np.isinf(expect)), (delta, expect)
    finite = np.isfinite(expect)
    np.testing.assert_allclose(delta[finite], expect[finite], rtol=1e-5, atol=1e-4)
    assert np.array_equal(delta, delta.T)


@pytest.mark.parametrize("seed", range(12))
def test_rank_deltas_are_that_ranks_rows_of_the_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    R = int(rng.choice([2, 3, 4, 5]))
    spr = int(rng.integers(1, 4))
    E = int(rng.integers(max(1, spr), R * spr + 1))
    X, rank, item_expert = random_swap_instance(rng, int(rng.integers(1, 9)), R, spr, E)
    D = _loads(X, rank, R)
    heavy = int(seed % R)
    items, delta = rank_deltas(X, D, rank, item_expert, R, heavy)
    assert np.array_equal(items, np.flatnonzero(rank == heavy))
    expect = brute_force_deltas(X, rank, item_expert, R)[items]
    assert np.array_equal(np.isinf(delta), np.isinf(expect)), (delta, expect)
    finite = np.isfinite(expect)
    np.testing.assert_allclose(delta[finite], expect[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pairs", [TIE_BREAK, 2**-4])
@pytest.mark.parametrize("seed", range(4))
def test_rank_deltas_equal_swap_deltas_bit_for_bit(seed, pairs):
    """A repair step reads rank_deltas where a swap round reads swap_deltas: the two sum the same float32 terms
    in different orders, so they pick the same swaps only if every term is exact (the weight of the pairs a power
    of two: the tie-break, and the online decision's)."""
    rng = np.random.default_rng(200 + seed)
    X, rank, item_expert = random_swap_instance(rng, 400, 8, 6, 40)
    D = _loads(X, rank, 8)
    heavy = int(np.argmax(D.sum(axis=0)))
    items, delta = rank_deltas(X, D, rank, item_expert, 8, heavy, pairs)
    assert np.array_equal(delta, swap_deltas(X, D, rank, item_expert, 8, pairs)[items])


def test_objective_definition():
    D = np.array([[1, 3], [2, 2]], np.float32)
    assert _objective(D) == pytest.approx(3 + 2 + TIE_BREAK * (1 + 9 + 4 + 4))


# ----------------------------------------------------------------------------- known optima

def steps_of(model: ModelSpec, step_ids: list[list[list[int]]]) -> RoutingSteps:
    """Steps from explicit token rows: step_ids[s][t] = the top-k experts of token t of step s (one layer)."""
    rows = [row for step in step_ids for row in step]
    ids = np.array(rows, np.int16)[:, None, :]
    return RoutingSteps.from_topk(model, ids, [len(s) for s in step_ids], M.TARGET_VERIFY)


def e_max_distinct(steps: RoutingSteps, phy2log: np.ndarray, R: int, dispatch: str = "dynamic") -> float:
    """Mean over layers and steps of the per-step maximum of distinct experts over ranks (the metric)."""
    return float(np.mean([layer_rank_loads(steps, layer, phy2log[layer], R, dispatch)[0].max(axis=1).mean()
                          for layer in range(phy2log.shape[0])]))


def brute_force_optimum(steps: RoutingSteps, E: int, R: int) -> float:
    """Best E[max distinct] over every balanced partition of E experts (one slot each) onto R ranks."""
    spr = E // R
    best = np.inf

    def groups(rest: tuple[int, ...]):
        if not rest:
            yield []
            return
        first = rest[0]
        for mates in itertools.combinations(rest[1:], spr - 1):
            group = (first, *mates)
            left = tuple(e for e in rest if e not in group)
            for tail in groups(left):
                yield [group, *tail]

    for partition in groups(tuple(range(E))):
        phy2log = np.array([e for g in partition for e in g])[None]
        best = min(best, e_max_distinct(steps, phy2log, R))
    return best


PAIRS = [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]                      # one token per step, top-2
QUADS = [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[0, 4, 1, 5]], [[2, 6, 3, 7]]]   # top-4
# Two tokens per step: the step reads the union of both tokens' experts.
TWO_TOKEN = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [4, 6]], [[1, 3], [5, 7]], [[0, 7], [3, 4]],
             [[1, 6], [2, 5]]]


@pytest.mark.parametrize("case,R,top_k", [
    ("pairs", 2, 2), ("pairs", 4, 2), ("quads", 2, 4), ("quads", 4, 4), ("two_token", 2, 2),
    ("two_token", 4, 2),
])
def test_stepaware_reaches_brute_force_optimum(case, R, top_k):
    """Every expert appears equally often, so every partition is token-balanced and the balance floor
    does not bind: the optimum over balanced partitions is the one to reach."""
    base = {"pairs": PAIRS, "quads": QUADS, "two_token": TWO_TOKEN}[case]
    model = ModelSpec.all_moe(case, 1, 8, top_k)
    steps = steps_of(model, base * 3)
    counts = steps.expert_token_counts()[0]
    assert np.all(counts == counts[0])
    optimum = brute_force_optimum(steps, 8, R)
    problem = PlacementProblem(model, steps, R)
    phy2log = solve("stepaware", problem)
    assert_valid_placement(phy2log, problem)
    assert e_max_distinct(steps, phy2log, R) == pytest.approx(optimum)
    # and the instance is one where placement matters: the trivial layout is worse
    assert e_max_distinct(steps, solve("contiguous", problem), R) > optimum


@pytest.mark.parametrize("seed", range(6))
def test_stepaware_on_random_small_instances_reaches_optimum(seed):
    """Random 8-expert steps with each expert used equally often (a Latin arrangement)."""
    rng = np.random.default_rng(seed)
    R = 2 if seed % 2 else 4
    model = ModelSpec.all_moe("random", 1, 8, 2)
    step_ids = []
    for _ in range(3):
        perm = rng.permutation(8)
        step_ids += [[[int(perm[2 * t]), int(perm[2 * t + 1])]] for t in range(4)]
    steps = steps_of(model, step_ids)
    optimum = brute_force_optimum(steps, 8, R)
    problem = PlacementProblem(model, steps, R)
    assert e_max_distinct(steps, solve("stepaware", problem), R) == pytest.approx(optimum)


# ----------------------------------------------------------------------------- separate_replicas

@pytest.mark.parametrize("seed", range(10))
def test_separate_replicas_removes_duplicates_and_keeps_multiset(seed):
    rng = np.random.default_rng(seed)
    R, spr = 4, 4
    E = int(rng.integers(8, 13))
    P = R * spr
    while True:
        copies = np.ones(E, np.int64) + np.bincount(rng.integers(0, E, P - E), minlength=E)
        if copies.max() <= R:
            break
    phy2log = rng.permutation(np.repeat(np.arange(E), copies))
    weight = rng.random(E) * 100
    out = separate_replicas(phy2log, R, weight)
    assert np.array_equal(np.sort(out), np.sort(phy2log))
    for r in range(R):
        assert np.unique(out[r * spr:(r + 1) * spr]).size == spr, out
    assert separate_replicas(phy2log.copy(), R, weight).tolist() == out.tolist()   # deterministic


def test_separate_replicas_caps_replicas_at_the_rank_count():
    """EPLB gives a hot expert as many replicas as it likes; more than ``ranks`` cannot be separated,
    so the extras go to other experts (regression: this raised ValueError from ``min([])``)."""
    phy2log = np.array([6, 7, 7, 0, 0, 2, 5, 1, 1, 7, 3, 0, 2, 4])   # DeepSeek EPLB's row, 2 ranks
    weight = np.array([110., 87., 68., 40., 31., 22., 54., 128.])
    out = separate_replicas(phy2log, 2, weight)
    copies = np.bincount(out, minlength=8)
    assert out.shape == phy2log.shape and copies.min() >= 1 and copies.max() <= 2
    assert np.unique(out[:7]).size == 7 and np.unique(out[7:]).size == 7


def test_separate_replicas_when_swaps_corner_themselves():
    """Regression: every expert within the cap, yet the one-swap repair found no partner (ValueError)."""
    phy2log = np.array([0, 3, 5, 4, 0, 1, 5, 4, 0, 1, 5, 2, 0, 3, 5, 2, 3, 3, 1, 5, 1, 1, 3, 5, 3, 3, 3, 4,
                        1, 1, 1, 4])                                   # DeepSeek EPLB's row, 8 ranks
    assert np.bincount(phy2log).max() <= 8
    out = separate_replicas(phy2log, 8, np.array([1000., 1800., 300., 1800., 800., 1300.]))
    assert sorted(out.tolist()) == sorted(phy2log.tolist())
    assert all(np.unique(out[r * 4:(r + 1) * 4]).size == 4 for r in range(8))


def test_deepseek_with_more_spare_slots_than_ranks_can_separate():
    problem = make_problem(8, 2, 6, 1, "dynamic")
    for name in ("deepseek", "deepseek-hierarchical"):
        assert_valid_placement(solve(name, problem), problem)


def test_hierarchical_stepaware_with_many_replicas_per_expert():
    """Regression: with nodes=2 and 4 ranks per node, an expert with 4 replicas had all of them keyed
    to different nodes (only 2 exist) and greedy packing raised AssertionError."""
    problem = make_problem(8, 8, 24, 2, "dynamic")
    assert replica_counts(problem.steps, 0, 8, 24, 8).max() >= 3
    assert_valid_placement(solve("stepaware", problem), problem)


def test_stepaware_fitted_objective_is_the_measured_one_with_replicas(monkeypatch):
    """The search's objective with replicas is what SGLang's dynamic rule gives the written map:
    item k of an expert (rows r % n == k) sits on the k-th replica by physical id (order_replicas)."""
    import moeplace.algorithms.stepaware as stepaware_module

    seen = []
    original = stepaware_module.partition

    def spy(active, search, item_tokens, item_expert, R, floor, rounds, wide=None, pairs=TIE_BREAK):
        rank = original(active, search, item_tokens, item_expert, R, floor, rounds, wide, pairs)
        seen.append(float(_loads(active, rank, R).max(axis=1).mean()))
        return rank

    monkeypatch.setattr(stepaware_module, "partition", spy)
    model = ModelSpec.all_moe("replicas", 1, 16, 4)
    steps = tiny_steps(model, 200, 1, 0)
    phy2log = stepaware_module.stepaware(PlacementProblem(model, steps, 4, redundant=8))
    assert e_max_distinct(steps, phy2log, 4) == pytest.approx(seen[0])


def test_separate_replicas_leaves_a_valid_row_alone():
    phy2log = np.array([0, 1, 2, 3, 0, 4, 5, 6])
    assert separate_replicas(phy2log, 2, np.ones(7)).tolist() == phy2log.tolist()


def test_separate_replicas_does_not_modify_its_input():
    phy2log = np.array([0, 0, 1, 2, 3, 4, 5, 6])
    before = phy2log.copy()
    out = separate_replicas(phy2log, 2, np.arange(1.0, 8.0))
    assert phy2log.tolist() == before.tolist()
    assert np.unique(out[:4]).size == 4 and np.unique(out[4:]).size == 4


# ----------------------------------------------------------------------------- properties (hypothesis)

@st.composite
def problems(draw):
    E = draw(st.sampled_from([4, 6, 8, 12, 16]))
    R = draw(st.sampled_from([r for r in (1, 2, 3, 4, 6, 8) if r <= 2 * E]))
    nodes = draw(st.sampled_from([n for n in (1, 2, 3) if R % n == 0]))
    # redundant slots that split evenly and leave at most E slots per rank
    options = [x for x in range(0, 3 * R + 1) if (E + x) % R == 0 and (E + x) // R <= E]
    redundant = draw(st.sampled_from(options)) if options else None
    if redundant is None:
        E = R * max(1, E // R)
        redundant = 0
    model = tiny_model(E, top_k=draw(st.integers(1, min(4, E))), num_moe_layers=draw(st.integers(1, 2)))
    steps = tiny_steps(model, draw(st.integers(2, 20)), R, draw(st.integers(0, 10_000)))
    return PlacementProblem(model, steps, R, nodes=nodes, redundant=redundant,
                            dispatch=draw(st.sampled_from(["dynamic", "static"])),
                            seed=draw(st.integers(0, 3)), effort=1e6)


@PROPERTY
@given(problems(), st.sampled_from(sorted(ALGORITHMS)))
def test_property_every_algorithm_valid(problem, name):
    if name == "deepseek-hierarchical" and problem.model.num_experts % problem.nodes:
        # one expert group per node: the experts must split evenly over the nodes (a clear user error)
        with pytest.raises(MoeplaceError, match="not divisible"):
            solve(name, problem)
        return
    assert_valid_placement(solve(name, problem), problem)


@PROPERTY
@given(problems())
def test_property_balanced_spares_valid_whether_or_not_experts_split(problem):
    # under balanced dispatch the first copies fill ceil(E / R) slots a rank (replicas where E % R), the rest
    # are spare slots the search places; the out-of-fold choice picks among layouts placed the same way
    problem = replace(problem, dispatch="balanced")
    assert problem.spares_left == problem.num_physical - problem.ranks * -(-problem.model.num_experts // problem.ranks)
    assert_valid_placement(solve("stepaware", problem), problem)
    if problem.spares_left:
        assert_valid_placement(robust_spares(problem)[0], problem)


@PROPERTY
@given(problems(), st.sampled_from(sorted(ALGORITHMS)))
def test_property_same_seed_same_placement(problem, name):
    if name == "deepseek-hierarchical" and problem.model.num_experts % problem.nodes:
        return
    first = solve(name, problem)
    again = PlacementProblem(problem.model, problem.steps, problem.ranks, nodes=problem.nodes,
                             redundant=problem.redundant, dispatch=problem.dispatch, seed=problem.seed,
                             effort=problem.effort)
    assert np.array_equal(first, solve(name, again))


@PROPERTY
@given(problems())
def test_property_replica_counts(problem):
    E, R = problem.model.num_experts, problem.ranks
    for layer in range(problem.model.num_moe_layers):
        counts = replica_counts(problem.steps, layer, E, problem.redundant, R, problem.dispatch)
        assert counts.shape == (E,)
        assert counts.sum() == E + problem.redundant
        assert counts.min() >= 1 and counts.max() <= R


@PROPERTY
@given(problems(), st.floats(0.0, 0.99, allow_subnormal=False))
def test_property_greedy_place_fills_every_rank_exactly(problem, floor):
    E, R, P = problem.model.num_experts, problem.ranks, problem.num_physical
    replicas = replica_counts(problem.steps, 0, E, problem.redundant, R, problem.dispatch)
    active, item_tokens = item_activity(problem.steps, 0, replicas, problem.dispatch)
    assert active.shape == (problem.steps.num_steps, P) and item_tokens.shape == (P,)
    item_expert = np.repeat(np.arange(E), replicas)
    rank = greedy_place(active, item_tokens, item_expert, R, P // R, floor)
    assert np.bincount(rank, minlength=R).tolist() == [P // R] * R
    for r in range(R):
        assert np.unique(item_expert[rank == r]).size == P // R


@PROPERTY
@given(problems(), st.sampled_from([0.0, 0.3, 0.5]))
def test_property_stepaware_not_worse_than_contiguous_on_fitted_steps(problem, holdout):
    """On the steps it was fitted to, stepaware is never worse than SGLang's trivial layout, layer by
    layer, wherever the trivial layout is an answer stepaware may give: its token balancedness is at
    least balance_floor times DeepSeek EPLB's (below that stepaware trades distinct experts for token
    balance by design).

    Without spare slots the search's objective is exactly the measured one under either dispatch rule;
    with replicas it is a model of the rule (see the xfail cases below), so redundant 0 here.
    """
    if problem.steps.num_steps < 4:
        holdout = 0.0
    fit, _ = split_steps(problem.steps, holdout)
    E = problem.model.num_experts
    R = next(r for r in range(problem.ranks, 0, -1) if E % r == 0)
    nodes = problem.nodes if R % problem.nodes == 0 else 1
    problem = PlacementProblem(problem.model, fit, R, nodes=nodes, dispatch=problem.dispatch, seed=problem.seed)
    stepaware = solve("stepaware", problem)
    contiguous = solve("contiguous", problem)
    reference = solve("deepseek", problem)
    for layer in range(problem.model.num_moe_layers):
        def measured(phy2log):
            distinct, tokens = layer_rank_loads(fit, layer, phy2log[layer], R, problem.dispatch)
            return distinct.max(axis=1).mean(), balancedness(tokens.sum(axis=0)[None])[0]

        trivial, trivial_balance = measured(contiguous)
        if trivial_balance >= problem.balance_floor * measured(reference)[1]:
            assert measured(stepaware)[0] <= trivial + 1e-9, layer


def test_stepaware_static_with_replicas_not_worse_than_contiguous_on_fitted_steps():
    """Regression: under the static rule replicas of hot experts pulled each step's load onto its
    source rank (this case ended worse than contiguous); spare slots now go to the coldest experts
    and the search re-derives each slot's steps from SGLang's static table."""
    model = tiny_model(6, top_k=1, num_moe_layers=1)
    steps = tiny_steps(model, 4, 3, 250)
    problem = PlacementProblem(model, steps, 3, redundant=6, dispatch="static", seed=250)
    assert e_max_distinct(steps, solve("stepaware", problem), 3, "static") \
        <= e_max_distinct(steps, solve("contiguous", problem), 3, "static")


@pytest.mark.xfail(strict=True, reason="known, not fixed: the greedy start and swap search are heuristics "
                   "under a token-balance floor; on this tiny case with replicas they end worse than "
                   "contiguous on the fitted steps")
def test_stepaware_dynamic_with_replicas_not_worse_than_contiguous_on_fitted_steps():
    model = tiny_model(16, top_k=1, num_moe_layers=1)
    steps = tiny_steps(model, 8, 3, 8)
    problem = PlacementProblem(model, steps, 3, redundant=5, dispatch="dynamic", seed=8)
    assert e_max_distinct(steps, solve("stepaware", problem), 3) \
        <= e_max_distinct(steps, solve("contiguous", problem), 3)


@pytest.mark.parametrize("experts, ranks, redundant", [
    (40, 24, 8),      # the spare slots only even out the first copies
    (40, 24, 32),     # and one more a rank for the search
    (256, 144, 32),   # DeepSeek-V3 on 144 GPUs, 256 routed experts and 32 redundant
])
def test_balanced_spares_on_many_ranks_where_experts_do_not_split(experts, ranks, redundant):
    model = tiny_model(experts, top_k=8)
    problem = PlacementProblem(model, tiny_steps(model, 120, ranks, seed=2), ranks, redundant=redundant,
                               dispatch="balanced")
    placed = solve("stepaware", problem)
    assert_valid_placement(placed, problem)
    assert_valid_placement(solve("naive-spares", problem), problem)
    if problem.spares_left:
        assert_valid_placement(robust_spares(problem)[0], problem)
    # the search's replicas lower the optimum on the steps it fitted, against one copy of each expert alone
    active = step_expert_counts(problem.steps, 0) > 0
    layout = replica_layout(placed[0], experts, ranks)
    one_each = first_copies_and_room(placed[0], experts, ranks, problem.num_physical // ranks)[0]
    assert optimum(active, layout.masks, ranks).mean() < optimum(active, one_each, ranks).mean()

