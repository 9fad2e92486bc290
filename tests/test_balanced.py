"""Balanced dispatch: the per-step rule against brute force and max-flow, its vectorised twin, and the
replica placement built for it (exact gains, Hall's bound)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.balanced_replicas import add_replicas, masks_to_phy2log, replica_gains
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
from moeplace.dispatch.balanced import (MAX_AUGMENT, mask_bits, exact_assign, fast_rule, fast_rule_step, rank_loads,
                               replica_layout, step_expert_counts)
from moeplace.dispatch.flow import optimum
from moeplace.dispatch.loads import balanced_loads, layer_rank_loads, token_slots
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement, check_placement
from moeplace.trace.steps import RoutingSteps
from test_algorithms import tiny_model, tiny_steps


def random_case(rng: np.random.Generator, ranks: int, experts: int, steps: int = 1,
                density: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(counts [S, E], masks [E]): each expert on 1..R random ranks, random active sets and token counts."""
    masks = np.zeros(experts, np.int64)
    for e in range(experts):
        k = int(rng.integers(1, ranks + 1)) if rng.random() < 0.6 else 1
        for r in rng.choice(ranks, k, replace=False):
            masks[e] |= 1 << int(r)
    p = rng.random() if density is None else density
    counts = (rng.random((steps, experts)) < p) * rng.integers(1, 6, (steps, experts))
    return counts, masks


def brute_force_max(counts: np.ndarray, masks: np.ndarray, ranks: int) -> int:
    """The smallest possible max distinct experts on a rank, by trying every assignment."""
    active = np.flatnonzero(counts > 0)
    choices = [[r for r in range(ranks) if (masks[e] >> r) & 1] for e in active]
    best = len(active)
    for pick in itertools.product(*choices):
        best = min(best, int(np.bincount(pick, minlength=ranks).max(initial=0)) if pick else 0)
    return best


def max_distinct(pick: np.ndarray, counts: np.ndarray, ranks: int) -> int:
    return int(rank_loads(pick, counts, ranks)[0].max(initial=0))


def check_served(pick: np.ndarray, counts: np.ndarray, masks: np.ndarray) -> None:
    """Every active expert goes to one of its own replicas; inactive experts go nowhere."""
    active = counts > 0
    assert np.all(pick[~active] == -1)
    assert np.all(pick[active] >= 0)
    assert np.all((masks[active] >> pick[active]) & 1)


@pytest.mark.parametrize("seed", range(40))
def test_exact_and_fast_rule_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    ranks, experts = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    counts, masks = random_case(rng, ranks, experts)
    counts = counts[0]
    best = brute_force_max(counts, masks, ranks)
    exact = exact_assign(counts, masks, ranks)
    fast = fast_rule_step(counts, masks, ranks, max_augment=None)
    for pick in (exact, fast):
        check_served(pick, counts, masks)
        assert max_distinct(pick, counts, ranks) == best


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 12), experts=st.integers(1, 40))
def test_uncapped_fast_rule_is_exact(seed, ranks, experts):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts)
    counts = counts[0]
    fast = fast_rule_step(counts, masks, ranks, max_augment=None)
    check_served(fast, counts, masks)
    assert max_distinct(fast, counts, ranks) == max_distinct(exact_assign(counts, masks, ranks), counts, ranks)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 10), experts=st.integers(1, 30),
       cap=st.sampled_from([0, 1, 2, MAX_AUGMENT, None]))
def test_vectorised_rule_equals_the_statement(seed, ranks, experts, cap):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=6)
    chosen = fast_rule(counts, masks, ranks, max_augment=cap)
    for s in range(counts.shape[0]):
        pick = fast_rule_step(counts[s], masks, ranks, max_augment=cap)
        np.testing.assert_array_equal(chosen.pick[s], pick)
        distinct, tokens = rank_loads(pick, counts[s], ranks)
        np.testing.assert_array_equal(chosen.distinct[s], distinct)
        np.testing.assert_array_equal(chosen.tokens[s], tokens)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 8), experts=st.integers(2, 30))
def test_capped_rule_is_never_below_the_optimum_and_exact_below_its_cap(seed, ranks, experts):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=8)
    full = fast_rule(counts, masks, ranks, max_augment=None)
    for cap in (0, 1, 2):
        capped = fast_rule(counts, masks, ranks, max_augment=cap)
        assert np.all(capped.distinct.max(axis=1) >= full.distinct.max(axis=1))
        below = full.augments < cap
        np.testing.assert_array_equal(capped.pick[below], full.pick[below])


def test_rule_depends_only_on_the_step_and_is_deterministic():
    """Ranks must agree: the same counts and layout give the same picks, whatever else is around."""
    rng = np.random.default_rng(3)
    counts, masks = random_case(rng, 8, 64, steps=20, density=0.2)
    a = fast_rule(counts, masks, 8)
    b = fast_rule(counts[::-1].copy(), masks, 8)
    np.testing.assert_array_equal(a.pick, b.pick[::-1])
    np.testing.assert_array_equal(a.pick, fast_rule(counts, masks, 8).pick)


def test_one_replica_each_is_the_static_placement():
    counts = np.array([[3, 1, 0, 2]])
    masks = np.array([1, 2, 2, 1])
    chosen = fast_rule(counts, masks, 2)
    np.testing.assert_array_equal(chosen.pick, [[0, 1, -1, 0]])
    np.testing.assert_array_equal(chosen.distinct, [[2, 1]])
    np.testing.assert_array_equal(chosen.tokens, [[5, 1]])


def test_augmenting_path_through_a_middle_rank():
    """Greedy fills rank 0 with three experts; the only way down is 0 -> 1 -> 2 (two moves)."""
    masks = np.array([0b001, 0b001, 0b011, 0b110, 0b010])   # e2 on {0, 1}, e3 on {1, 2}
    counts = np.array([1, 1, 9, 9, 1])                         # e2 goes to 0 on tokens, e3 to 1
    pick = fast_rule_step(counts, masks, 3, max_augment=None)
    assert max_distinct(pick, counts, 3) == 2 == brute_force_max(counts, masks, 3)


def test_replica_layout_and_its_errors():
    phy2log = np.array([0, 1, 2, 0, 3, 1])      # ranks of 2 slots: {0,1}, {2,0}, {3,1}
    layout = replica_layout(phy2log, 4, 3)
    np.testing.assert_array_equal(layout.masks, [0b011, 0b101, 0b010, 0b100])
    np.testing.assert_array_equal(layout.slots, [[0, 3, -1], [1, -1, 5], [-1, 2, -1], [-1, -1, 4]])
    with pytest.raises(MoeplaceError, match="expert 4 has no replica"):
        replica_layout(phy2log, 5, 3)
    wide = replica_layout(np.arange(65), 65, 65)   # beyond 64 ranks: the replica sets as bools
    np.testing.assert_array_equal(wide.masks, np.eye(65, dtype=bool))
    np.testing.assert_array_equal(mask_bits(replica_layout(np.arange(64), 64, 64).masks, 64), np.eye(64, dtype=bool))


# ----------------------------------------------------------------------------- the placement for it

@pytest.mark.parametrize("seed", range(6))
def test_hall_bound_is_the_optimum(seed):
    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(1, 7))
    counts, masks = random_case(rng, ranks, 20, steps=10)
    optimum = step_optimum(subset_counts(counts > 0, masks, ranks), subset_sizes(ranks))
    exact = [max_distinct(exact_assign(c, masks, ranks), c, ranks) for c in counts]
    np.testing.assert_array_equal(optimum, exact)


def test_subset_counts_against_a_naive_count():
    rng = np.random.default_rng(1)
    counts, masks = random_case(rng, 4, 12, steps=5)
    f = subset_counts(counts > 0, masks, 4)
    for s in range(5):
        for x in range(16):
            assert f[s, x] == sum(1 for e in range(12) if counts[s, e] and masks[e] & ~x == 0)


@pytest.mark.parametrize("seed", range(5))
def test_replica_gains_are_exact(seed):
    rng = np.random.default_rng(seed)
    ranks, experts = 4, 10
    counts, masks = random_case(rng, ranks, experts, steps=30, density=0.5)
    active = counts > 0
    sizes = subset_sizes(ranks)
    before = step_optimum(subset_counts(active, masks, ranks), sizes)
    gains = replica_gains(active, masks, ranks)
    for e in range(experts):
        for r in range(ranks):
            if (masks[e] >> r) & 1:
                assert gains[e, r] == 0
                continue
            more = masks.copy()
            more[e] |= 1 << r
            after = step_optimum(subset_counts(active, more, ranks), sizes)
            assert gains[e, r] == (before - after).sum()


def test_add_replicas_fills_every_rank_and_never_hurts():
    rng = np.random.default_rng(7)
    ranks, experts = 4, 16
    masks = np.int64(1) << (np.arange(experts) % ranks)
    active = rng.random((200, experts)) < 0.3
    new = add_replicas(active, masks, ranks, 2, active.sum(axis=0).astype(float))
    assert np.all(new & masks == masks)
    bits = (new[:, None] >> np.arange(ranks)) & 1
    np.testing.assert_array_equal(bits.sum(axis=0) - ((masks[:, None] >> np.arange(ranks)) & 1).sum(axis=0), 2)
    sizes = subset_sizes(ranks)
    assert step_optimum(subset_counts(active, new, ranks), sizes).sum() \
        <= step_optimum(subset_counts(active, masks, ranks), sizes).sum()
    phy2log = masks_to_phy2log(new, ranks, experts // ranks + 2)
    np.testing.assert_array_equal(replica_layout(phy2log, experts, ranks).masks, new)
    np.testing.assert_array_equal(add_replicas(active, masks, ranks, 2, active.sum(axis=0).astype(float)), new)


def test_add_replicas_refuses_too_many_ranks():
    with pytest.raises(MoeplaceError, match="at most"):
        add_replicas(np.ones((2, 16), bool), np.int64(1) << np.arange(16), 16, 1, np.ones(16))


@pytest.mark.parametrize("redundant", [4, 8, 16])
def test_stepaware_for_balanced_dispatch(redundant):
    model = tiny_model(16, top_k=2, num_moe_layers=2)
    steps = tiny_steps(model, 300, 3, seed=redundant)
    problem = PlacementProblem(model, steps, 4, redundant=redundant, dispatch="balanced")
    phy2log = solve("stepaware", problem)
    check_placement(Placement(model, 4, phy2log))
    np.testing.assert_array_equal(phy2log, solve("stepaware", PlacementProblem(model, steps, 4, redundant=redundant,
                                                                                 dispatch="balanced")))
    plain = solve("stepaware", PlacementProblem(model, steps, 4))
    for layer in range(2):
        with_spares = layer_rank_loads(steps, layer, phy2log[layer], 4, "balanced")[0].max(axis=1).mean()
        without = layer_rank_loads(steps, layer, plain[layer], 4, "dynamic")[0].max(axis=1).mean()
        assert with_spares < without


@pytest.mark.parametrize("redundant", [2, 6])
def test_balanced_placement_where_experts_do_not_split_over_ranks(redundant):
    # 10 experts on 4 ranks: 2 replicas even out the first copies, the rest are spare slots; the search places
    # both, and on the steps it fitted does at least as well as the naive layout (DeepSeek EPLB, hot replicas)
    model = tiny_model(10, top_k=2, num_moe_layers=1)
    steps = tiny_steps(model, 200, 3, 0)
    problem = PlacementProblem(model, steps, 4, redundant=redundant, dispatch="balanced")
    phy2log = solve("stepaware", problem)
    check_placement(Placement(model, 4, phy2log))
    naive = solve("naive-spares", problem)
    active = step_expert_counts(steps, 0) > 0
    placed, base = (optimum(active, replica_layout(p[0], 10, 4).masks, 4).mean() for p in (phy2log, naive))
    assert placed <= base


def test_metrics_under_balanced_dispatch_follow_the_rule():
    model = tiny_model(16, top_k=2, num_moe_layers=1)
    steps = tiny_steps(model, 50, 4, seed=5)
    phy2log = np.concatenate([np.arange(16), [0, 1, 2, 3]])            # 5 slots a rank, 4 ranks
    distinct, tokens = layer_rank_loads(steps, 0, phy2log, 4, "balanced")
    layout = replica_layout(phy2log, 16, 4)
    counts = step_expert_counts(steps, 0)
    for s in range(steps.num_steps):
        d, t = rank_loads(fast_rule_step(counts[s], layout.masks, 4), counts[s], 4)
        np.testing.assert_array_equal(distinct[s], d)
        np.testing.assert_array_equal(tokens[s], t)
    step_k, slot = token_slots(steps, 0, phy2log, 4, "balanced")
    np.testing.assert_array_equal(np.bincount(step_k * 4 + slot // 5, minlength=200).reshape(50, 4), tokens)
    chosen, optimum = balanced_loads(steps, 0, phy2log, 4)
    assert np.all(optimum <= distinct.max(axis=1))


def test_step_counts_include_count_only_steps():
    model = tiny_model(4, top_k=1, num_moe_layers=1)
    steps = RoutingSteps.from_counts(model, np.array([[[0, 2, 0, 1]]], float), modes=1)
    np.testing.assert_array_equal(step_expert_counts(steps, 0), [[0, 2, 0, 1]])


@pytest.mark.parametrize("seed", range(4))
def test_replica_optimum_is_the_uncapped_rules_and_the_fitted_column_uses_it(seed):
    """Hall's formula and the uncapped rule agree step by step; ``max_distinct_means`` (optimize's fitted
    column) gives balanced rows that optimum and every other row what ``evaluate`` measures."""
    from moeplace.cost.model import CostModel
    from moeplace.dispatch.loads import replica_optimum
    from moeplace.analysis.metrics import max_distinct_means
    from moeplace.analysis.report import evaluate

    rng = np.random.default_rng(seed)
    model = tiny_model(16, top_k=4, num_moe_layers=2)
    steps = tiny_steps(model, 60, 4, seed=seed)
    spares = np.stack([np.concatenate([rng.permutation(16), rng.choice(16, 4, replace=False)]) for _ in range(2)])
    single = np.stack([rng.permutation(16) for _ in range(2)])
    placements = {"spares": Placement(model, 4, spares), "single": Placement(model, 4, single)}
    for layer in range(2):
        counts = step_expert_counts(steps, layer)
        _, optimum = balanced_loads(steps, layer, spares[layer], 4)
        np.testing.assert_array_equal(replica_optimum(counts > 0, spares[layer], 4), optimum)
    cost = CostModel()
    for dispatch in ("balanced", "dynamic", "static"):
        got = max_distinct_means(steps, list(placements.values()), [dispatch] * 2, [cost] * 2)
        measured = {e.name: e.summary for e in evaluate(placements, [steps], cost, dispatch)}
        want = [measured["spares"]["optimum" if dispatch == "balanced" else "e_max_distinct"],
                measured["single"]["e_max_distinct"]]
        np.testing.assert_allclose(got, want, rtol=1e-12)
