"""Dispatch by cost: the MILP against brute force, the fast rule against the MILP and against balanced
dispatch (equal at verify batch), its vectorised twin against its statement, and its invariants."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.commands.costing import Costing
from moeplace.cost.derive import derive_cost_model
from moeplace.dispatch.balanced import fast_rule, replica_layout, step_expert_counts
from moeplace.dispatch.by_cost import (READ_UNIT, RuleWeights, allocation_cost, cost_rule, cost_rule_step,
                                    exact_split, pair_slots, rule_weights)
from moeplace.analysis.optimize import split_steps
from moeplace.cost.model import CostModel
from moeplace.dispatch.evaluation import verify_batches
from moeplace.model.expert_shape import ExpertShape
from moeplace.model.spec import ModelSpec
from moeplace.trace.load import open_trace
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.synthetic import synthetic_steps
from test_algorithms import SAMPLE
from test_balanced import random_case

KIMI_EXPERT = ExpertShape(7168, 2048, "bf16", "Kimi-K2-shaped")
GPTOSS_EXPERT = ExpertShape(2880, 2880, "bf16", "GPT-OSS-shaped")


def check_alloc(alloc: np.ndarray, counts: np.ndarray, masks: np.ndarray) -> None:
    """Every expert's tokens all served, each on one of its own replicas, none negative."""
    R = alloc.shape[1]
    bits = ((masks[:, None] >> np.arange(R)) & 1).astype(bool)
    assert np.all(alloc >= 0)
    np.testing.assert_array_equal(alloc.sum(axis=1), counts)
    assert not np.any(alloc[~bits])


def balanced_alloc(counts: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """[S, E, R] the balanced rule's allocation (all of an expert's tokens on its picked rank)."""
    pick = fast_rule(counts, masks, ranks).pick
    out = np.zeros((*counts.shape, ranks), np.int64)
    s, e = np.nonzero(pick >= 0)
    out[s, e, pick[s, e]] = counts[s, e]
    return out


def brute_force(counts: np.ndarray, masks: np.ndarray, ranks: int, a: float, b: float, rb: float = 0.0,
                block_m: int = 0) -> float:
    """The lowest busiest-rank ``a * distinct + rb * extra row blocks + b * tokens`` over every integer
    allocation."""
    E = counts.shape[0]
    per_expert = []
    for e in range(E):
        reps = [r for r in range(ranks) if (masks[e] >> r) & 1]
        splits = [c for c in itertools.product(range(counts[e] + 1), repeat=len(reps)) if sum(c) == counts[e]]
        per_expert.append([(reps, c) for c in splits])
    best = np.inf
    for choice in itertools.product(*per_expert):
        alloc = np.zeros((E, ranks), np.int64)
        for e, (reps, c) in enumerate(choice):
            alloc[e, reps] = c
        ranks_cost = a * (alloc > 0).sum(axis=0) + b * alloc.sum(axis=0)
        if rb:      # written out, not through allocation_cost: ceil(x / block_m) - 1 blocks past the first
            ranks_cost = ranks_cost + rb * np.array([sum(max(-(-int(x) // block_m) - 1, 0) for x in alloc[:, q])
                                                     for q in range(ranks)])
        best = min(best, float(ranks_cost.max()))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_exact_split_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    ranks, experts = int(rng.integers(2, 4)), int(rng.integers(1, 5))
    counts, masks = random_case(rng, ranks, experts)
    counts = counts[0] * 2
    a, b = float(rng.uniform(0.5, 6)), float(rng.uniform(0.1, 1))
    exact = exact_split(counts, masks, ranks, a, b)
    check_alloc(exact.alloc, counts, masks)
    best = brute_force(counts, masks, ranks, a, b)
    assert exact.optimal
    assert exact.value == pytest.approx(best, rel=1e-6)
    assert exact.bound <= exact.value + 1e-9 and exact.bound >= best * (1 - 1e-3)


@pytest.mark.parametrize("seed", range(20))
def test_exact_split_with_row_blocks_matches_brute_force(seed):
    """The MILP with the cost model's row-block term (a block of 2-4 rows, r below a) against every allocation."""
    rng = np.random.default_rng(100 + seed)
    ranks, experts = int(rng.integers(2, 4)), int(rng.integers(1, 4))
    counts, masks = random_case(rng, ranks, experts)
    counts = counts[0] * 3
    a, b = float(rng.uniform(1, 6)), float(rng.uniform(0, 0.5))
    rb, block_m = float(rng.uniform(0.2, 1.0)) * a, int(rng.integers(2, 5))
    exact = exact_split(counts, masks, ranks, a, b, row_block_us=rb, block_m=block_m)
    check_alloc(exact.alloc, counts, masks)
    best = brute_force(counts, masks, ranks, a, b, rb, block_m)
    assert exact.optimal and exact.value == pytest.approx(best, rel=1e-6)
    assert float(allocation_cost(exact.alloc, a, b, rb, block_m).max()) == pytest.approx(best, rel=1e-6)
    assert exact.bound <= exact.value + 1e-9


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 6), experts=st.integers(1, 14),
       q=st.integers(1, 40))
def test_fast_rule_between_the_optimum_and_balanced_dispatch(seed, ranks, experts, q):
    """Never below the MILP's proven bound; never above where it started (the balanced rule)."""
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=3)
    counts = counts * 7
    chosen = cost_rule(counts, masks, ranks, q)
    alloc, start = chosen.full_alloc(counts), balanced_alloc(counts, masks, ranks)
    for s in range(counts.shape[0]):
        check_alloc(alloc[s], counts[s], masks)
        mine = allocation_cost(alloc[s], q, 1).max()
        assert mine <= allocation_cost(start[s], q, 1).max()
        assert mine >= exact_split(counts[s], masks, ranks, float(q), 1.0).bound - 1e-6
        np.testing.assert_array_equal(chosen.distinct[s], (alloc[s] > 0).sum(axis=0))
        np.testing.assert_array_equal(chosen.tokens[s], alloc[s].sum(axis=0))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 8), experts=st.integers(1, 30),
       q=st.one_of(st.none(), st.integers(1, 60)), rounds=st.sampled_from([0, 1, 3, 16]))
def test_vectorised_rule_equals_the_statement(seed, ranks, experts, q, rounds):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=6)
    counts = counts * 5
    chosen = cost_rule(counts, masks, ranks, q, max_rounds=rounds).full_alloc(counts)
    for s in range(counts.shape[0]):
        np.testing.assert_array_equal(chosen[s], cost_rule_step(counts[s], masks, ranks, q, max_rounds=rounds))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 8), experts=st.integers(1, 30))
def test_steps_with_fewer_pairs_than_one_read_keep_the_balanced_choice(seed, ranks, experts):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=6)
    q = int(counts.sum(axis=1).max()) + 1
    np.testing.assert_array_equal(cost_rule(counts, masks, ranks, q).full_alloc(counts),
                                  balanced_alloc(counts, masks, ranks))


def test_rule_depends_only_on_the_step_and_is_deterministic():
    counts, masks = random_case(np.random.default_rng(5), 8, 64, steps=30, density=0.6)
    counts = counts * 40
    a = cost_rule(counts, masks, 8, 50).full_alloc(counts)
    b = cost_rule(counts[::-1].copy(), masks, 8, 50).full_alloc(counts[::-1].copy())
    np.testing.assert_array_equal(a, b[::-1])


def test_below_one_read_of_pairs_the_rule_keeps_balanced_and_loses_less_than_the_pairs():
    """Two ranks, expert 0 on both, the others pinned. With fewer pairs than q the rule keeps the balanced
    choice (no split), within b * pairs of the optimum; with a hot expert it splits, onto the optimum."""
    masks = np.array([0b11, 0b01, 0b10])
    for hot in (30, 400):
        counts = np.array([hot, 5, 5])
        alloc = cost_rule_step(counts, masks, 2, 100)
        exact = exact_split(counts, masks, 2, 100.0, 1.0)
        mine = allocation_cost(alloc, 100, 1).max()
        if counts.sum() < 100:
            assert (alloc[0] > 0).sum() == 1
            assert exact.value <= mine < exact.value + counts.sum()
        else:
            assert (alloc[0] > 0).sum() == 2
            assert mine == pytest.approx(exact.value)


weights_with_blocks = st.builds(RuleWeights, read=st.integers(1, 60), pair=st.integers(0, 1),
                                block=st.integers(1, 60), block_m=st.sampled_from([1, 2, 3, 4, 8]))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 8), experts=st.integers(1, 30),
       weights=weights_with_blocks, rounds=st.sampled_from([0, 1, 3, 16]))
def test_vectorised_rule_with_row_blocks_equals_the_statement(seed, ranks, experts, weights, rounds):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=6)
    counts = counts * 3
    chosen = cost_rule(counts, masks, ranks, weights, max_rounds=rounds)
    alloc = chosen.full_alloc(counts)
    for s in range(counts.shape[0]):
        np.testing.assert_array_equal(alloc[s], cost_rule_step(counts[s], masks, ranks, weights, max_rounds=rounds))
        np.testing.assert_array_equal(chosen.distinct[s], (alloc[s] > 0).sum(axis=0))
        np.testing.assert_array_equal(chosen.tokens[s], alloc[s].sum(axis=0))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 5), experts=st.integers(1, 10),
       weights=weights_with_blocks)
def test_rule_with_row_blocks_between_the_optimum_and_balanced_dispatch(seed, ranks, experts, weights):
    """Under the weighted cost with row blocks: never below the MILP's bound, never above the balanced start."""
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=2)
    counts = counts * 4
    w = weights
    alloc, start = cost_rule(counts, masks, ranks, w).full_alloc(counts), balanced_alloc(counts, masks, ranks)
    for s in range(counts.shape[0]):
        check_alloc(alloc[s], counts[s], masks)
        mine = allocation_cost(alloc[s], w.read, w.pair, w.block, w.block_m).max()
        assert mine <= allocation_cost(start[s], w.read, w.pair, w.block, w.block_m).max()
        exact = exact_split(counts[s], masks, ranks, float(w.read), float(w.pair), row_block_us=float(w.block),
                            block_m=w.block_m)
        assert mine >= exact.bound - 1e-6


@pytest.mark.parametrize("weights", [RuleWeights(20), RuleWeights(3), RuleWeights(30, 0, 25, 2),
                                     RuleWeights(20, 1, 12, 4), RuleWeights(9, 1, 5, 1)])
def test_no_move_wins_once_the_cheapest_rank_plus_a_pair_and_a_read_reaches_the_maximum(weights):
    """The GPU kernel's early end of the moves: where the cheapest rank plus one pair (and one read, unless an
    expert's tokens are on two ranks) reaches the busiest rank's cost, the rule's next round moves nothing."""
    w, ended, searched = weights, 0, 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        ranks = int(rng.integers(2, 9))
        counts, masks = random_case(rng, ranks, int(rng.integers(4, 40)), steps=1, density=0.7)
        counts = counts[0] * int(rng.integers(1, 12))
        for rounds in range(4):
            alloc = cost_rule_step(counts, masks, ranks, w, max_rounds=rounds)
            cost = allocation_cost(alloc, w.read, w.pair, w.block, w.block_m)
            split = ((alloc > 0).sum(axis=1) > 1).any()
            after = cost_rule_step(counts, masks, ranks, w, max_rounds=rounds + 1)
            if cost.min() + w.pair + (0 if split else w.read) >= cost.max():
                np.testing.assert_array_equal(after, alloc, err_msg=f"seed {seed}, round {rounds}")
                ended += 1
            else:
                searched += 1
    assert ended >= 10 and searched >= 100   # both sides of the test are exercised


def test_a_hot_expert_past_its_block_is_split_at_the_block_boundary():
    """Two ranks, expert 0 (21 tokens, blocks of 16) on both, one pinned expert each: the balanced rule puts
    expert 0 on rank 0, which then runs a second block; the rule moves the 5 tokens past the block to rank 1."""
    masks = np.array([0b11, 0b01, 0b10])
    counts = np.array([21, 5, 5])
    w = RuleWeights(read=4096, pair=0, block=2500, block_m=16)
    np.testing.assert_array_equal(balanced_alloc(counts[None], masks, 2)[0, 0], [21, 0])
    alloc = cost_rule_step(counts, masks, 2, w)
    np.testing.assert_array_equal(alloc[0], [16, 5])
    exact = exact_split(counts, masks, 2, 4096.0, 0.0, row_block_us=2500.0, block_m=16)
    assert allocation_cost(alloc, 4096, 0, 2500, 16).max() == pytest.approx(exact.value) == 2 * 4096


def test_rule_weights_from_cost_models():
    assert rule_weights(CostModel(19.0, 0.0415, 50.0)) == RuleWeights(458, 1, 0, 0)
    assert rule_weights(CostModel(19.0, 0.0415, 50.0, r_us_per_block=10.0, block_m=16)) == RuleWeights(458, 1, 241, 16)
    assert rule_weights(CostModel(19.0, 0.0, 50.0, r_us_per_block=10.0, block_m=16)) == RuleWeights(
        READ_UNIT, 0, round(READ_UNIT * 10 / 19), 16)
    assert rule_weights(CostModel(19.0, 0.0, 50.0)) is None
    assert rule_weights(CostModel(0.0, 1.0, 0.0)) == RuleWeights(1, 1, 0, 0)
    assert rule_weights(CostModel(1.0, 1e-9, 0.0)).read == 1 << 16       # capped: the kernels' 32-bit costs


def test_pair_slots_follow_the_allocation_in_row_order():
    """A hot expert 0 with replicas on ranks 0 and 1 (slots 0 and 2) is split; its first pairs go to rank 0."""
    model = ModelSpec("two ranks", 1, (0,), 3, 1)
    ids = np.array([0] * 40 + [1] * 2 + [2] * 2)[:, None, None]
    steps = RoutingSteps.from_topk(model, ids, [44], 5)
    phy2log = np.array([[0, 1, 0, 2]])                          # rank 0: slots 0, 1; rank 1: slots 2, 3
    cost = CostModel(10.0, 1.0, 0.0)
    step, slot = pair_slots(steps, 0, phy2log[0], 2, cost)
    alloc = cost_rule(step_expert_counts(steps, 0), replica_layout(phy2log[0], 3, 2).masks, 2, 10).full_alloc(
        step_expert_counts(steps, 0))[0]
    assert (alloc[0] > 0).all()
    np.testing.assert_array_equal(slot[:40], [0] * alloc[0, 0] + [2] * alloc[0, 1])
    np.testing.assert_array_equal(slot[40:], [1, 1, 3, 3])
    np.testing.assert_array_equal(step, 0)


@pytest.mark.parametrize("ranks, redundant, tokens", [(4, 4, 64), (8, 8, 256), (16, 16, 128)])
def test_pair_slots_equal_a_per_pair_walk_of_the_allocation(ranks, redundant, tokens):
    """Every pair's slot against a naive walk: each (step, expert)'s pairs in row order fill its ranks in
    increasing rank order, ``alloc`` tokens each (batches large enough that experts split)."""
    model = ModelSpec("SYNTHETIC", 2, (1,), 32, 4)
    steps = verify_batches(synthetic_steps(400, tokens_per_step=9, model=model)[1], tokens, 6, seed=2).steps
    phy2log = solve("stepaware", PlacementProblem(model, steps, ranks, redundant=redundant, dispatch="balanced",
                                                  effort=2e6))[0]
    cost = CostModel(10.0, 1.0, 0.0)
    step, slot = pair_slots(steps, 0, phy2log, ranks, cost)
    layout = replica_layout(phy2log, 32, ranks)
    counts = step_expert_counts(steps, 0)
    alloc = cost_rule(counts, layout.masks, ranks, rule_weights(cost)).full_alloc(counts)
    assert (np.count_nonzero(alloc, axis=2) > 1).any()                 # some expert is split
    step_of_row, _, ids = steps.layer(0)
    expect, used = [], {}
    for row in range(ids.shape[0]):
        for e in ids[row]:
            if e < 0:
                continue
            s = int(step_of_row[row])
            k = used.get((s, e), 0)
            used[(s, e)] = k + 1
            rank = int(np.searchsorted(np.cumsum(alloc[s, e]), k, side="right"))
            expect.append(layout.slots[e, rank])
    np.testing.assert_array_equal(slot, expect)


def kimi_shaped(layers: int = 2, steps: int = 800):
    model = ModelSpec("SYNTHETIC kimi-k2-shaped", layers + 1, tuple(range(1, layers + 1)), 384, 8)
    return synthetic_steps(steps, tokens_per_step=9, model=model)[1]


@pytest.fixture(scope="module")
def kimi():
    """Kimi-K2-shaped steps (2 layers) and balanced dispatch's placement with E/4 spare slots."""
    steps = kimi_shaped()
    fit, held = split_steps(steps, 0.3)
    phy2log = solve("stepaware", PlacementProblem(steps.model, fit, 8, redundant=96, dispatch="balanced",
                                                  effort=2e7))
    return held, phy2log, KIMI_EXPERT


@pytest.fixture(scope="module")
def gptoss():
    steps = open_trace(SAMPLE, window=9).load("verify")
    fit, held = split_steps(steps, 0.3)
    phy2log = solve("stepaware", PlacementProblem(steps.model, fit, 8, redundant=8, dispatch="balanced",
                                                  effort=2e7))
    return held, phy2log, GPTOSS_EXPERT


@pytest.mark.parametrize("trace", ["kimi", "gptoss"])
def test_equals_balanced_dispatch_at_verify_batch(trace, request):
    """At 9 tokens per step the rule is today's balanced rule, pick for pick, under the derived cost model."""
    held, phy2log, shape = request.getfixturevalue(trace)
    model = held.model
    slots = phy2log.shape[1] // 8
    w = rule_weights(derive_cost_model(shape, slots, model.top_k, step_tokens=9))
    for layer in range(model.num_moe_layers):
        masks = replica_layout(phy2log[layer], model.num_experts, 8).masks
        counts = step_expert_counts(held, layer)
        # no move can be searched: fewer pairs than a read costs, no expert past a row block (None: only reads cost)
        assert w is None or (w.pair * counts.sum(axis=1).max() < w.read and counts.max() <= w.block_m)
        chosen = cost_rule(counts, masks, 8, w)
        np.testing.assert_array_equal(chosen.full_alloc(counts), balanced_alloc(counts, masks, 8))
        assert not chosen.rounds.any()


@pytest.mark.parametrize("tokens", [144, 576])
def test_within_two_percent_of_the_optimum_on_kimi_shaped_batches(kimi, tokens):
    """Larger batches: the rule's predicted layer time (c and row blocks included) within 2% of the MILP's
    proven bound."""
    held, phy2log, shape = kimi
    cost = Costing(shape, 8).ep(phy2log.shape[1] // 8, tokens)
    masks = replica_layout(phy2log[0], 384, 8).masks
    counts = step_expert_counts(verify_batches(held, tokens, 3, seed=1).steps, 0)
    alloc = cost_rule(counts, masks, 8, rule_weights(cost)).full_alloc(counts)
    a, b, c = cost.a_us_per_expert, cost.b_us_per_token, cost.c_us
    blocks = (cost.r_us_per_block, cost.block_m)
    assert cost.needs_blocks(tokens)
    for s in range(counts.shape[0]):
        exact = exact_split(counts[s], masks, 8, a, b, 8, *blocks)
        assert allocation_cost(alloc[s], a, b, *blocks).max() + c <= 1.02 * (exact.bound + c)


def test_no_torch_or_sglang():
    code = ("import sys, moeplace.dispatch.by_cost, moeplace.dispatch.lplb, moeplace.dispatch.evaluation\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_the_rule_by_cost_is_balanced_where_acts_as_balanced_says(tokens):
    """Steps of ``tokens`` tokens of top-4: weights whose read outweighs every pair of a step, and whose row blocks
    hold a step's tokens, leave every balanced choice as it is (no move); a read under the step's pairs does not
    say so (advise prints --dispatch balanced for the first, cost for the second)."""
    from moeplace.dispatch.by_cost import acts_as_balanced

    rng = np.random.default_rng(tokens)
    ranks, experts, top_k = 8, 32, 4
    counts = np.zeros((300, experts), np.int64)
    for s in range(300):
        for _ in range(tokens):
            counts[s, rng.choice(experts, top_k, replace=False)] += 1
    masks = random_case(rng, ranks, experts)[1]
    quiet = RuleWeights(tokens * top_k + 1, 1, 5, 16)
    assert acts_as_balanced(quiet, tokens, top_k) and acts_as_balanced(None, tokens, top_k)
    chosen = cost_rule(counts, masks, ranks, quiet)
    assert not chosen.rounds.any()
    np.testing.assert_array_equal(chosen.pick, fast_rule(counts, masks, ranks).pick)
    assert not acts_as_balanced(RuleWeights(tokens * top_k, 1), tokens, top_k)
    assert not acts_as_balanced(RuleWeights(10_000, 1, 5, 4), 8, top_k)   # 8 tokens: an expert may fill 2 blocks
