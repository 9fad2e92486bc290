"""The spare-slot search for balanced dispatch: the exchange search's exact gains against brute
force, the smoothed steps, the cross-validated smoothing, and placements that hold on steps the fit did not
see, against the naive layout built here.

Dimension letters: S steps, E experts, R ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms import wide_spares
from moeplace.algorithms.balanced_replicas import SMOOTHING_SHARES, choose_smoothing, first_copies_and_room
from moeplace.algorithms.replica_exchange import StepTables, _exchange_gains, exchange_masks
from moeplace.algorithms.smoothed_steps import independent_steps, with_smoothed_steps
from moeplace.dispatch.balanced import mask_bits, pack_bits, replica_layout, step_expert_counts
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
from moeplace.dispatch.flow import optimum
from moeplace.model.spec import ModelSpec
from moeplace.trace.synthetic import synthetic_steps

PROPERTY = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def random_layout(rng: np.random.Generator, ranks: int, experts: int, extra: int) -> np.ndarray:
    """Masks [E]: one copy of each expert round-robin, then ``extra`` replicas on random other ranks."""
    masks = (np.int64(1) << (np.arange(experts) % ranks)).astype(np.int64)
    for e in rng.choice(experts, extra, replace=True):
        masks[e] |= np.int64(1) << rng.integers(ranks)
    return masks


def weighted_optimum(active: np.ndarray, weight: np.ndarray, masks: np.ndarray, ranks: int) -> float:
    return float(weight @ step_optimum(subset_counts(active, masks, ranks), subset_sizes(ranks)))


@pytest.mark.parametrize("ranks,experts", [(2, 6), (4, 12), (8, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_mask_change_is_exact(ranks, experts, seed):
    """StepTables.change against recomputing the optimum, for every expert and every other mask."""
    rng = np.random.default_rng(seed)
    masks = random_layout(rng, ranks, experts, experts // 2)
    active = rng.random((25, experts)) < 0.5
    f = subset_counts(active, masks, ranks)
    tables = StepTables(f, ranks)
    before = step_optimum(f, subset_sizes(ranks))
    targets = rng.choice(np.arange(1, 1 << ranks), min(12, (1 << ranks) - 1), replace=False)
    for e in range(experts):
        steps = np.flatnonzero(active[:, e])
        got = tables.change(steps, masks[[e]], targets)[:, :, 0].T
        for k, m in enumerate(targets):
            changed = masks.copy()
            changed[e] = m
            after = step_optimum(subset_counts(active, changed, ranks), subset_sizes(ranks))
            np.testing.assert_array_equal(got[:, k], (after - before)[steps])


@pytest.mark.parametrize("ranks,experts", [(4, 12), (8, 24)])
@pytest.mark.parametrize("seed", range(3))
def test_exchange_gains_are_exact(ranks, experts, seed):
    rng = np.random.default_rng(seed)
    masks = random_layout(rng, ranks, experts, experts // 2)
    active = rng.random((30, experts)) < 0.4
    weight = rng.random(30) + 0.5
    base = weighted_optimum(active, weight, masks, ranks)
    uniq, cls = np.unique(masks.astype(np.int16), return_inverse=True)
    tables = StepTables(subset_counts(active, masks, ranks), ranks)
    gain = _exchange_gains(tables, (active * weight[:, None]).astype(np.float32), active.astype(np.float32), uniq, cls)
    for a in range(experts):
        for b in range(experts):
            if masks[a] == masks[b]:
                assert gain[a, b] == np.inf
                continue
            swapped = masks.copy()
            swapped[a], swapped[b] = masks[b], masks[a]
            assert gain[a, b] == pytest.approx(weighted_optimum(active, weight, swapped, ranks) - base, abs=1e-4)


@PROPERTY
@given(st.sampled_from([2, 4, 8]), st.integers(1, 4), st.integers(0, 12), st.integers(0, 10_000))
def test_property_exchanges_keep_the_slots_and_never_hurt(ranks, per_rank, extra, seed):
    rng = np.random.default_rng(seed)
    experts = ranks * per_rank
    masks = random_layout(rng, ranks, experts, extra)
    active = rng.random((40, experts)) < rng.uniform(0.1, 0.9)
    weight = rng.random(40) + 0.1
    out = exchange_masks(active, weight, masks, ranks, budget=1e12)
    assert sorted(out.tolist()) == sorted(masks.tolist())          # the same replica sets, so the same slots
    assert weighted_optimum(active, weight, out, ranks) <= weighted_optimum(active, weight, masks, ranks) + 1e-9
    np.testing.assert_array_equal(exchange_masks(active, weight, masks, ranks, budget=1e12), out)


def test_exchange_search_stops_at_its_budget():
    rng = np.random.default_rng(0)
    masks = random_layout(rng, 4, 16, 8)
    active = rng.random((50, 16)) < 0.5
    np.testing.assert_array_equal(exchange_masks(active, np.ones(50), masks, 4, budget=0), masks)


def test_exchange_separates_co_active_experts():
    """Experts 0 and 1 always fire together, 2 and 3 never with them: one exchange puts each pair apart."""
    masks = np.array([1, 1, 2, 2], np.int64)              # 0, 1 on rank 0; 2, 3 on rank 1
    active = np.array([[1, 1, 0, 0], [0, 0, 1, 1]] * 10, bool)
    out = exchange_masks(active, np.ones(20), masks, 2, budget=1e9)
    assert out[0] != out[1] and out[2] != out[3]
    assert weighted_optimum(active, np.ones(20), out, 2) == 20     # one expert a rank in every step


def test_independent_steps_keep_sizes_and_marginals():
    rng = np.random.default_rng(1)
    active = np.zeros((400, 10), bool)
    active[:200, :3] = True                               # half the steps: experts 0-2 together
    active[200:, 5:8] = True                              # the rest: 5-7 together
    drawn = independent_steps(active, 4000, np.random.default_rng(2))
    assert drawn.shape == (4000, 10) and np.all(drawn.sum(axis=1) == 3)
    share = drawn.mean(axis=0)
    assert np.all(np.abs(share[[0, 1, 2, 5, 6, 7]] - 0.5) < 0.05) and np.all(share[[3, 4, 8, 9]] < 0.02)
    together = (drawn[:, 0] & drawn[:, 1]).mean()         # 0.5 in the real steps; near 0.5 * 0.5 when independent
    assert together < 0.35
    np.testing.assert_array_equal(independent_steps(active, 50, np.random.default_rng(3)),
                                  independent_steps(active, 50, np.random.default_rng(3)))


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5])
def test_smoothed_steps_take_their_share_of_the_weight(share):
    active = np.random.default_rng(0).random((30, 8)) < 0.5
    steps, weight = with_smoothed_steps(active, share, 70, np.random.default_rng(1))
    real = weight[:30].sum() / weight.sum()
    assert real == pytest.approx(1 - share) and weight.mean() == pytest.approx(1.0)
    np.testing.assert_array_equal(steps[:30], active)
    assert steps.shape[0] == (30 if share == 0 else 100)


def shape(experts: int, top_k: int, layers: int) -> ModelSpec:
    return ModelSpec(f"SYNTHETIC {experts}x top-{top_k}", layers, tuple(range(layers)), experts, top_k)


def held_out_optimum(phy2log: np.ndarray, held, ranks: int) -> float:
    E = held.model.num_experts
    return float(np.mean([step_optimum(subset_counts(step_expert_counts(held, layer) > 0,
                                                     replica_layout(phy2log[layer], E, ranks).masks, ranks),
                                       subset_sizes(ranks)).mean() for layer in range(held.model.num_moe_layers)]))


def test_smoothing_is_chosen_by_cross_validation_and_is_repeatable():
    model = shape(64, 6, 2)
    _, steps = synthetic_steps(300, 9, model, seed=4)
    problem = PlacementProblem(model, steps, 8, redundant=16, dispatch="balanced")
    share = choose_smoothing(problem, seed=5)
    assert share in SMOOTHING_SHARES and choose_smoothing(problem, seed=5) == share


@pytest.mark.parametrize("fit_steps", [60, 600])
@pytest.mark.parametrize("spare", [8, 32, 64])
def test_never_worse_than_the_naive_layout_on_held_out_steps(fit_steps, spare):
    """64 experts, top-6, 8 ranks: fitted on a short capture or a longer one, scored on 1,500 later steps."""
    model = shape(64, 6, 3)
    _, steps = synthetic_steps(fit_steps + 1500, 9, model, seed=fit_steps + spare)
    fit, held = steps.take(np.arange(fit_steps)), steps.take(np.arange(fit_steps, fit_steps + 1500))
    ours = solve("stepaware", PlacementProblem(model, fit, 8, redundant=spare, dispatch="balanced"))
    naive = solve("naive-spares", PlacementProblem(model, fit, 8, redundant=spare))
    assert held_out_optimum(ours, held, 8) <= held_out_optimum(naive, held, 8)


@PROPERTY
@given(st.integers(2, 24), st.integers(1, 40), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_property_first_copies_and_room_against_a_loop(ranks, experts, per_rank, seed):
    """One copy of each expert where its first slot is, and each rank's free slots, against a plain loop over a
    layout whose ranks hold some experts twice over (the replicas that even out E % R, and spare ones)."""
    rng = np.random.default_rng(seed)
    spr = -(-experts // ranks) + per_rank
    if spr > experts:
        return
    # every expert once, then replicas, no rank holding an expert twice
    rank_experts = [[] for _ in range(ranks)]
    for e in range(experts):
        rank_experts[e % ranks].append(e)
    for r in range(ranks):
        others = [e for e in rng.permutation(experts) if e not in rank_experts[r]]
        rank_experts[r] += others[:spr - len(rank_experts[r])]
    base = np.concatenate([rng.permutation(x) for x in rank_experts])
    masks, room = first_copies_and_room(base, experts, ranks, spr + 1)
    on = mask_bits(masks, ranks)
    for e in range(experts):
        first_slot = int(np.flatnonzero(base == e)[0])
        assert np.flatnonzero(on[e]).tolist() == [first_slot // spr]
    assert room.tolist() == [spr + 1 - int(on[:, r].sum()) for r in range(ranks)]


@pytest.mark.parametrize("ranks, experts, per_rank", [(16, 40, 1), (24, 40, 2), (70, 100, 1)])
def test_wide_spares_fill_uneven_room_exactly(ranks, experts, per_rank):
    """Where the experts do not split over the ranks, ranks start with unequal room; the wide search fills
    each exactly, never puts an expert twice on a rank, and lowers the optimum on the fitted steps."""
    rng = np.random.default_rng(ranks)
    spr = -(-experts // ranks) + per_rank
    on = np.zeros((experts, ranks), bool)
    on[np.arange(experts), np.arange(experts) % ranks] = True
    room = spr - on.sum(axis=0)
    active = rng.random((200, experts)) < 12 / experts
    masks = pack_bits(on)
    more = mask_bits(wide_spares.add_replicas(active, masks, ranks, room, active.sum(axis=0)), ranks)
    assert (more.sum(axis=0) == spr).all() and (more >= on).all()
    assert optimum(active, pack_bits(more), ranks).mean() < optimum(active, masks, ranks).mean()


@PROPERTY
@given(st.integers(1, 12), st.integers(1, 9), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_property_best_pairs_is_the_sorted_scan(experts, ranks, batch, seed):
    """A round's pairs (both spare searches) against a scan of every pair in sorted order, ties included."""
    rng = np.random.default_rng(seed)
    total = rng.integers(0, 4, (experts, ranks)).astype(float)
    total[rng.random((experts, ranks)) < 0.3] = -np.inf
    room = rng.integers(0, 3, ranks)
    total[:, room == 0] = -np.inf
    kept, taken = [], np.zeros(ranks, int)
    for k in np.argsort(-total, axis=None, kind="stable"):
        e, r = divmod(int(k), ranks)
        if not np.isfinite(total[e, r]) or len(kept) >= batch:
            break
        if taken[r] < room[r] and all(e != c for c, _ in kept):
            kept.append((e, r))
            taken[r] += 1
    assert wide_spares.best_pairs(total, room, batch) == kept
