"""The spread of co-active slots (moeplace.algorithms.coactive_spread) against naive references: the
co-activation counts against a loop over steps, the swap search's objective against a sum over every
rank's slot pairs, the layout it writes (same replicas per expert and slots per rank) at bit-set and
bool widths, spread_if_better's guard, and the activity it reads against the step counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import coactive_spread
from moeplace.algorithms.balanced_replicas import CHECK_STEPS, spread_if_better
from moeplace.algorithms.coactive_spread import coactivation, spread_slots, swap_slots
from moeplace.dispatch.balanced import mask_bits, pack_bits, step_expert_active, step_expert_counts
from moeplace.dispatch.flow import optimum
from moeplace.model.spec import ModelSpec
from test_metrics import random_steps


def random_layout(rng: np.random.Generator, experts: int, ranks: int, per_rank: int) -> np.ndarray:
    """[E, R] bool: every expert once, the other slots replicas of random experts, ``per_rank`` slots a rank,
    no expert twice on a rank."""
    while True:
        on = np.zeros((experts, ranks), bool)
        slots = np.repeat(np.arange(ranks), per_rank)
        rng.shuffle(slots)
        order = np.concatenate([rng.permutation(experts), rng.integers(experts, size=slots.size - experts)])
        for e, r in zip(order, slots):
            on[e, r] = True
        if (on.sum(axis=0) == per_rank).all() and (on.sum(axis=1) >= 1).all():
            return on


def objective(on: np.ndarray, pair_of_experts: np.ndarray, copies: np.ndarray) -> float:
    """The weighted co-activation of every two slots on a rank, summed by a loop over the ranks."""
    multi = copies > 1
    total = 0.0
    for r in range(on.shape[1]):
        here = np.flatnonzero(on[:, r])
        for a in range(here.size):
            for b in range(a + 1, here.size):
                e, f = here[a], here[b]
                weight = (coactive_spread.MULTI_MULTI if multi[e] and multi[f] else
                          coactive_spread.SINGLE_MULTI if multi[e] or multi[f] else 1.0)
                total += weight * pair_of_experts[e, f]
    return total


@settings(max_examples=30, deadline=None)
@given(steps=st.integers(0, 40), experts=st.integers(1, 30), seed=st.integers(0, 2**31 - 1))
def test_coactivation_counts_every_pair_of_each_step(steps, experts, seed):
    active = np.random.default_rng(seed).random((steps, experts)) < 0.3
    naive = np.zeros((experts, experts))
    for row in active:
        on = np.flatnonzero(row)
        naive[np.ix_(on, on)] += 1
    np.testing.assert_array_equal(coactivation(active), naive)


@pytest.mark.parametrize("seed", range(4))
def test_step_expert_active_is_where_the_counts_are_positive(seed):
    """Token-row steps (some ids -1) mixed with count steps, against step_expert_counts."""
    model = ModelSpec("toy", 3, (0, 1, 2), 12, 3)
    steps = random_steps(np.random.default_rng(seed), model, 40)
    for layer in range(3):
        np.testing.assert_array_equal(step_expert_active(steps, layer), step_expert_counts(steps, layer) > 0)


@pytest.mark.parametrize("ranks, experts, per_rank", [(4, 8, 3), (16, 40, 3), (64, 200, 4), (80, 150, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_spread_keeps_the_layout_and_lowers_the_pair_objective(ranks, experts, per_rank, seed):
    rng = np.random.default_rng(seed)
    on = random_layout(rng, experts, ranks, per_rank)
    active = rng.random((300, experts)) < rng.uniform(0.02, 0.3, experts)
    masks = pack_bits(on)
    out = spread_slots(active, masks, ranks)
    assert np.asarray(out).shape == np.asarray(masks).shape      # bit sets to 64 ranks, bools beyond
    after = mask_bits(out, ranks)
    np.testing.assert_array_equal(after.sum(axis=1), on.sum(axis=1))     # each expert's replicas
    np.testing.assert_array_equal(after.sum(axis=0), on.sum(axis=0))     # each rank's slots
    pairs, copies = coactivation(active), on.sum(axis=1)
    assert objective(after, pairs, copies) <= objective(on, pairs, copies) + 1e-6


def test_swap_slots_finds_the_one_swap_that_parts_two_coactive_experts():
    """Experts 0 and 1 always fire together and share rank 0; 2 and 3 never fire: one swap parts them."""
    on = np.zeros((4, 2), bool)
    on[[0, 1], 0] = True
    on[[2, 3], 1] = True
    active = np.zeros((10, 4), bool)
    active[:, :2] = True
    out = mask_bits(spread_slots(active, pack_bits(on), 2), 2)
    assert out[0].argmax() != out[1].argmax()


def test_swap_slots_stops_where_no_swap_gains():
    """Nothing is co-active: no slot moves."""
    rng = np.random.default_rng(5)
    on = random_layout(rng, 20, 5, 4)
    expert, home = np.nonzero(on)
    pair = np.zeros((expert.size, expert.size), np.float32)
    np.testing.assert_array_equal(swap_slots(pair, expert, home, on, 5, 1e-3), home)


@pytest.mark.parametrize("seed", range(3))
def test_spread_if_better_is_never_worse_on_its_check_steps(seed):
    rng = np.random.default_rng(seed)
    ranks, experts = 24, 60
    on = random_layout(rng, experts, ranks, 3)
    active = rng.random((CHECK_STEPS, experts)) < rng.uniform(0.01, 0.2, experts)
    masks = pack_bits(on)
    kept = spread_if_better(active, masks, ranks)
    assert optimum(active, kept, ranks).mean() <= optimum(active, masks, ranks).mean()
