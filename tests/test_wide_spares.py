"""The wide spare search (moeplace.algorithms.wide_spares) against naive references: its reach sets
against a per-step search and against Hall's optimum with the replica added, its collision term
against enumeration of the active sets, and add_replicas' layout properties with equal and unequal
free slots."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms.wide_spares import add_replicas, collision_gains, moves, reach, replica_gains
from moeplace.dispatch.balanced import mask_bits, pack_bits
from moeplace.dispatch.flow import closure, exact_dispatch, optimum
from test_balanced import random_case


def naive_reach(start: np.ndarray, pick: np.ndarray, bits: np.ndarray, backward: bool) -> np.ndarray:
    """[R] one step's cells reached from ``start [R]`` by moves "an expert on rank a to its replica on b"
    (backward: from b to a), by a plain graph search."""
    R = start.size
    edges = [(int(pick[e]), int(b)) for e in np.flatnonzero(pick >= 0) for b in np.flatnonzero(bits[e])
             if b != pick[e]]
    if backward:
        edges = [(b, a) for a, b in edges]
    seen, todo = set(np.flatnonzero(start).tolist()), list(np.flatnonzero(start))
    while todo:
        a = todo.pop()
        for x, y in edges:
            if x == a and y not in seen:
                seen.add(y)
                todo.append(y)
    return np.isin(np.arange(R), list(seen))


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(2, 9), experts=st.integers(1, 24), seed=st.integers(0, 2**31 - 1))
def test_reach_matches_a_graph_search_and_the_closure(ranks, experts, seed):
    counts, masks = random_case(np.random.default_rng(seed), ranks, experts, steps=15)
    chosen = exact_dispatch(counts > 0, masks, ranks)
    d, bits = chosen.distinct, mask_bits(masks, ranks)
    top = d.max(axis=1, keepdims=True)
    step, expert = np.nonzero(chosen.pick >= 0)
    source, dest = moves(step, expert, chosen.pick[step, expert].astype(np.int64), bits)
    inside = reach(d == top, source, dest)
    drain = reach(d <= top - 2, dest, source)
    np.testing.assert_array_equal(inside, closure(chosen.pick, d, masks))
    for s in range(d.shape[0]):
        np.testing.assert_array_equal(inside[s], naive_reach(d[s] == top[s], chosen.pick[s], bits, False))
        np.testing.assert_array_equal(drain[s], naive_reach(d[s] <= top[s] - 2, chosen.pick[s], bits, True))
        assert not (inside[s] & drain[s]).any()   # an exact dispatch leaves no path from the busiest ranks


@pytest.mark.parametrize("ranks, experts", [(3, 6), (4, 10), (6, 14), (8, 20)])
@pytest.mark.parametrize("seed", range(4))
def test_gain_is_exactly_where_a_replica_lowers_the_optimum(ranks, experts, seed):
    """On a step with one busiest rank, (e, r) scores 1 exactly where a replica of e on r lowers the
    step's optimum (Hall's formula with the replica added), else 0: the score has no false positives
    and misses nothing."""
    rng = np.random.default_rng(seed)
    counts, masks = random_case(rng, ranks, experts, steps=25, density=0.5)
    active = (counts > 0).astype(np.float32)
    bits = mask_bits(masks, ranks)
    best = optimum(active, masks, ranks)
    checked = 0
    for s in range(active.shape[0]):
        chosen = exact_dispatch(active[s:s + 1], masks, ranks)
        if best[s] == 0 or (chosen.distinct[0] == best[s]).sum() != 1:
            continue
        gain = replica_gains(active[s:s + 1], masks, ranks, chosen, shrink=0.0)
        for e, r in itertools.product(range(experts), range(ranks)):
            if bits[e, r]:
                continue
            more = bits.copy()
            more[e, r] = True
            lowered = optimum(active[s:s + 1], pack_bits(more), ranks)[0] < best[s]
            assert gain[e, r] == (1.0 if lowered else 0.0), (s, e, r)
            checked += 1
    assert checked


@pytest.mark.parametrize("seed", range(5))
def test_collision_term_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    E, R = 14, 4
    on = np.zeros((E, R), bool)
    on[np.arange(E), rng.integers(0, R, E)] = True
    on[rng.choice(E, 3, replace=False), rng.integers(0, R, 3)] = True   # a few experts with two replicas
    rate = rng.random(E) * 0.6
    weights = {2: 1.0, 3: 2.0}
    got = collision_gains(rate, on, weights)
    single = on.sum(axis=1) == 1
    for e in range(E):
        if not single[e]:
            assert got[e] == 0
            continue
        others = [f for f in np.flatnonzero(single & on[:, on[e].argmax()]) if f != e]
        exactly = np.zeros(len(others) + 1)
        for pattern in itertools.product([0, 1], repeat=len(others)):
            exactly[sum(pattern)] += np.prod([rate[f] if a else 1 - rate[f] for f, a in zip(others, pattern)])
        want = rate[e] * sum(w * (exactly[k - 1] if k - 1 < exactly.size else 0.0) for k, w in weights.items())
        assert got[e] == pytest.approx(want, abs=1e-12)


def check_layout(active: np.ndarray, masks: np.ndarray, more: np.ndarray, ranks: int, room: np.ndarray) -> None:
    before, after = mask_bits(masks, ranks), mask_bits(more, ranks)
    assert more.shape == masks.shape and more.dtype == masks.dtype
    np.testing.assert_array_equal(after.sum(axis=0), before.sum(axis=0) + room)   # every rank exactly full
    assert np.all(after >= before)                                                  # first copies kept
    assert optimum(active, more, ranks).mean() <= optimum(active, masks, ranks).mean()


@pytest.mark.parametrize("ranks", [16, 40, 80])
def test_unequal_free_slots_fill_every_rank_exactly(ranks):
    rng = np.random.default_rng(ranks)
    E = 3 * ranks
    home = rng.permutation(np.arange(E) % ranks)                        # three first copies a rank
    on = home[:, None] == np.arange(ranks)
    room = rng.integers(0, 4, ranks)
    masks = pack_bits(on)
    active = rng.random((200, E)) < 0.1
    more = add_replicas(active, masks, ranks, room, active.sum(axis=0).astype(float))
    check_layout(active, masks, more, ranks, room)
    assert optimum(active, more, ranks).mean() < optimum(active, masks, ranks).mean()


@settings(max_examples=25, deadline=None)
@given(ranks=st.integers(13, 24), per_rank=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       unequal=st.booleans())
def test_property_add_replicas_layouts(ranks, per_rank, seed, unequal):
    rng = np.random.default_rng(seed)
    E = 2 * ranks
    masks = pack_bits(np.arange(E)[:, None] % ranks == np.arange(ranks))
    room = rng.integers(0, per_rank + 1, ranks) if unequal else np.full(ranks, per_rank)
    active = rng.random((60, E)) < rng.uniform(0.02, 0.3)
    more = add_replicas(active, masks, ranks, room if unequal else per_rank, rng.random(E))
    check_layout(active, masks, more, ranks, room)


def test_no_room_left_for_a_replica_says_so():
    from moeplace.errors import MoeplaceError
    masks = pack_bits(np.ones((2, 16), bool))                           # every expert on every rank
    with pytest.raises(MoeplaceError, match="no expert can take another replica"):
        add_replicas(np.ones((5, 2), bool), masks, 16, 1, np.ones(2))
