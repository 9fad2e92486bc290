"""Balanced dispatch's per-step optimum at any width, in polynomial time.

Dimension letters: S steps, E logical experts, R ranks.

Hall's formula (``moeplace.dispatch.exact``) enumerates the 2^R rank sets: exact and fast on one node
of up to HALL_MAX_RANKS ranks, impossible beyond. The per-step problem is a bipartite assignment
(active experts to their replica ranks, the busiest rank's load minimised), and the fast rule without
its cap on augmenting paths (``moeplace.dispatch.balanced.fast_rule``, ``max_augment=None``) solves it
exactly: it stops only when no path leads from a busiest rank to a rank two experts lighter, and then
the ranks such paths reach prove the maximum optimal (Hall's bound for that set). ``closure`` returns
that set, which the spare-slot search of wide layouts (``moeplace.algorithms.wide_spares``) reads.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.balanced import Dispatch, fast_rule, mask_bits
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes

HALL_MAX_RANKS = 12   # up to here the rank-set enumeration (4,096 sets) is exact and the faster one


def exact_dispatch(active: np.ndarray, masks: np.ndarray, ranks: int, start: np.ndarray | None = None) -> Dispatch:
    """The uncapped fast rule on the steps ``active [S, E]`` (bool or 0/1; tokens do not matter here):
    its ``distinct.max(axis=1)`` is each step's optimum, and no path is left from a busiest rank to a rank
    two experts lighter. masks: replica ranks (``ReplicaLayout.masks``). start: [S, E] an earlier exact dispatch of
    these steps under fewer replicas, to take the paths from (the new replicas open only a few)."""
    return fast_rule(np.asarray(active > 0, np.int64), masks, ranks, max_augment=None, start=start)


def optimum(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """[S] the best max distinct experts per rank of each step of ``active [S, E]`` given the replica
    ranks ``masks [E]``: Hall's formula up to HALL_MAX_RANKS ranks, the uncapped rule above (same values;
    tests/test_wide_ep.py checks them against each other)."""
    if ranks <= HALL_MAX_RANKS:
        return step_optimum(subset_counts(active, masks, ranks), subset_sizes(ranks))
    counts = np.asarray(active > 0, np.int64)
    floor = lower_bound(counts > 0, masks, ranks)   # a step at its bound takes no more paths
    return fast_rule(counts, masks, ranks, max_augment=None, floor=floor).distinct.max(axis=1)


def lower_bound(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """[S] a lower bound on each step's optimum: the active experts spread evenly over the ranks, and the
    most active experts with a single replica on one rank."""
    bits = mask_bits(masks, ranks)
    single = np.flatnonzero(bits.sum(axis=1) == 1)                       # one replica
    home = bits[single].argmax(axis=1)
    step, which = np.nonzero(active[:, single])
    forced = np.bincount(step * ranks + home[which], minlength=active.shape[0] * ranks)
    spread = -(-active.sum(axis=1) // ranks)
    return np.maximum(forced.reshape(-1, ranks).max(axis=1), spread)


def closure(pick: np.ndarray, distinct: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """[S, R] bool: the ranks reachable from each step's busiest ranks by moves "an expert on rank a to its
    replica on rank b", given an exact dispatch (``exact_dispatch``: pick [S, E], distinct [S, R]). Every
    expert on those ranks has all its replicas among them."""
    S, R = distinct.shape
    bits = mask_bits(masks, R)
    step, expert = np.nonzero((pick >= 0) & (bits.sum(axis=1) > 1))     # the experts that can move
    rep_expert, rep_rank = np.nonzero(bits[expert])                       # each active expert's replica ranks
    s, b = step[rep_expert], rep_rank
    a = pick[s, expert[rep_expert]].astype(np.int64)
    source, dest = s * R + a, s * R + b                                   # the moves, as flat (step, rank)
    reached = (distinct == distinct.max(axis=1, keepdims=True)).ravel()
    while True:
        grow = reached[source] & ~reached[dest]
        if not grow.any():
            return reached.reshape(S, R)
        reached[dest[grow]] = True
