"""Spare slots for balanced dispatch on many ranks (wide EP), in polynomial time.

Dimension letters: S steps, E logical experts, R ranks.

On one node the spare search (``balanced_replicas``) scores every (expert, rank) pair exactly through
Hall's rank sets, 2^R of them: out of reach beyond ``HALL_MAX_RANKS``. Here each step is solved
exactly by the uncapped rule (``moeplace.dispatch.flow``) and scored through its *closure*: the ranks
reachable from the busiest ones by moving an expert to another of its replicas. Every expert on those
ranks has all its replicas among them, which is what holds the busiest rank at its load. A replica of
such an expert on a rank outside the closure opens a path that takes one expert off a busiest rank
when that rank *drains*: it is at load <= M - 2, or one of its experts can move on to a rank that
drains. The step's maximum drops when the path starts at the only rank at M, and the gain is counted
as 1 / (ranks at M) otherwise (a share of the progress toward it).

A few hundred sampled steps pin each pair's gain down loosely: the best of 10^4 pairs by that count
is partly luck, and the spares it picks fix the sampled steps better than the next ones (fitted E[max]
~0.15 below held-out on Kimi-K2-shaped routing at 64 ranks). Two terms that read steady statistics
instead pull toward spares that help on unseen steps:

- each pair's gain is shrunk (SHRINK) toward its expert's total times the rank's share of light steps;
- a *collision* term per expert: an expert with a single replica collides on its rank with the rank's
  other single-replica experts; with activations independent at their sampled rates, a second replica
  lowers P(k or more such experts active on the rank) by p_e * P(k - 1 of the others active). Summed
  over k = 2 (a step off max 1) and k = 3 (a step up to max 3) with COLLISION_WEIGHTS, in steps.

Per layer, in rounds:

1. dispatch the sampled steps exactly; find each step's closure and the ranks that drain;
2. gain of (e, r) = sum over the steps where e is active inside the closure and r drains outside it
   (one matrix product, [E, S] x [S, R]), shrunk, plus e's collision term;
3. add the best pairs of distinct experts, each rank at most its free slots, ties toward the busiest
   expert per replica, then the lower expert id and rank.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.balanced import Dispatch, mask_bits, pack_bits
from moeplace.dispatch.flow import closure, exact_dispatch
from moeplace.errors import MoeplaceError

ROUNDS = 6                # replicas go in about this many rounds (each re-solves the sampled steps)
SHRINK = 0.3              # share of a pair's gain taken from its expert's total x the rank's light share
COLLISION_WEIGHTS = {2: 1.0, 3: 2.0}   # k: weight of P(k single-replica experts active on one rank)


def add_replicas(active: np.ndarray, masks: np.ndarray, ranks: int, spare_per_rank: int | np.ndarray,
                 expert_weight: np.ndarray) -> np.ndarray:
    """New replica sets after filling every rank's free slots, as ``masks`` holds them
    (``ReplicaLayout.masks``: int64 bit sets [E], or [E, R] bool beyond 64 ranks).

    active: [S, E] bool, the steps to fit; masks: replica ranks before; spare_per_rank: free slots of
    every rank, one count or [R] counts (ranks may hold unequal numbers of first copies);
    expert_weight: [E] tokens, the tie-break toward the busiest expert per replica.
    """
    on = mask_bits(masks, ranks).copy()                                         # [E, R]
    room = np.broadcast_to(np.asarray(spare_per_rank, np.int64), (ranks,)).copy()
    if np.any(room < 0):
        raise MoeplaceError("free slots per rank must be >= 0")
    batch = max(-(-int(room.sum()) // ROUNDS), 1)
    copies = on.sum(axis=1)
    tie_unit = 1e-6 / max(float(expert_weight.max(initial=0)), 1e-12)
    active_f = np.asarray(active, np.float32)
    rate = active_f.mean(axis=0) if active_f.shape[0] else np.zeros(on.shape[0], np.float32)   # [E]
    dispatch = None
    while room.sum():
        allowed = ~on & (room > 0)[None, :]
        if not allowed.any():
            raise MoeplaceError("no expert can take another replica: spare slots exceed what ranks can hold")
        # each round's dispatch starts from the last one's: the replicas added since open a few paths
        dispatch = exact_dispatch(active_f, on, ranks, None if dispatch is None else dispatch.pick)
        gain = replica_gains(active_f, on, ranks, dispatch)
        gain += (active_f.shape[0] * collision_gains(rate, on) + tie_unit * expert_weight / copies)[:, None]
        total = np.where(allowed, gain, -np.inf)
        chosen, taken = set(), np.zeros(ranks, np.int64)
        for k in np.argsort(-total, axis=None, kind="stable"):
            e, r = divmod(int(k), ranks)
            if not np.isfinite(total[e, r]) or len(chosen) >= batch:
                break
            if taken[r] < room[r] and e not in chosen:
                chosen.add(e)
                taken[r] += 1
                on[e, r] = True
                copies[e] += 1
        room -= taken
    return pack_bits(on) if np.asarray(masks).ndim == 1 else on


def replica_gains(active: np.ndarray, masks: np.ndarray, ranks: int, chosen: Dispatch | None = None,
                  shrink: float = SHRINK) -> np.ndarray:
    """[E, R] the closure score of a replica of expert e on rank r over the steps ``active [S, E]`` (0/1
    float32) under the replica ranks ``masks`` (see the module docstring), a share ``shrink`` of it
    taken from e's total times r's share of steps where it drains; chosen: their exact dispatch
    (``flow.exact_dispatch``), where the caller has it."""
    chosen = exact_dispatch(active, masks, ranks) if chosen is None else chosen
    d = chosen.distinct                                                         # [S, R]
    top = d.max(axis=1)
    inside = closure(chosen.pick, d, masks)                                     # [S, R]
    share = 1.0 / (d == top[:, None]).sum(axis=1)                               # [S]
    light = (~inside & drains(chosen.pick, d, masks)).astype(np.float32)        # [S, R] where a replica helps
    pick = chosen.pick.astype(np.int64)
    in_closure = (pick >= 0) & np.take_along_axis(inside, np.maximum(pick, 0), axis=1)   # [S, E]
    weighted = (in_closure * share[:, None]).astype(np.float32)
    exact = weighted.T @ light                                                  # [E, R]
    if not shrink or not d.shape[0]:
        return exact
    return (1 - shrink) * exact + shrink * np.outer(weighted.sum(axis=0), light.mean(axis=0))


def drains(pick: np.ndarray, distinct: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """[S, R] bool: the ranks from which moves "an expert on rank a to its replica on rank b" reach a rank
    at load <= M - 2 (M: the step's maximum), given an exact dispatch (pick [S, E], distinct [S, R]):
    a rank that takes one more expert and passes the one it holds on along such moves."""
    S, R = distinct.shape
    bits = mask_bits(masks, R)
    step, expert = np.nonzero((pick >= 0) & (bits.sum(axis=1) > 1))     # the experts that can move
    rep_expert, rep_rank = np.nonzero(bits[expert])                       # each active expert's replica ranks
    s = step[rep_expert]
    source = s * R + pick[s, expert[rep_expert]].astype(np.int64)        # the moves, as flat (step, rank)
    dest = s * R + rep_rank
    reached = (distinct <= distinct.max(axis=1, keepdims=True) - 2).ravel()
    while True:
        grow = reached[dest] & ~reached[source]
        if not grow.any():
            return reached.reshape(S, R)
        reached[source[grow]] = True


def collision_gains(rate: np.ndarray, on: np.ndarray, weights: dict[int, float] = COLLISION_WEIGHTS) -> np.ndarray:
    """[E] sum over k of weights[k] * rate[e] * P(exactly k - 1 other single-replica experts of e's rank
    active), for each expert with a single replica (0 for the others): how much a second replica of e
    lowers P(k or more single-replica experts active on its rank), activations independent at ``rate [E]``
    (the fraction of steps each expert is active in). on: [E, R] bool replica ranks."""
    E, R = on.shape
    single = np.flatnonzero(on.sum(axis=1) == 1)
    home = on[single].argmax(axis=1)
    order = np.argsort(home, kind="stable")
    expert, rank = single[order], home[order]                             # by rank
    slot = np.arange(rank.size) - np.searchsorted(rank, rank)             # place among its rank's experts
    width = int(slot.max(initial=-1)) + 1
    p = np.zeros((R, width))
    p[rank, slot] = rate[expert]
    top = max(weights)
    out = np.zeros(E)
    for j in range(width):                                                # leave slot j out, on every rank
        others = np.zeros((R, top))                                       # P(k others active), k < top
        others[:, 0] = 1.0
        for i in range(width):
            if i != j:
                q = p[:, i:i + 1]
                others[:, 1:] = others[:, 1:] * (1 - q) + others[:, :-1] * q
                others[:, 0] *= 1 - q[:, 0]
        here = slot == j
        e, r = expert[here], rank[here]
        out[e] = rate[e] * sum(w * others[r, k - 1] for k, w in weights.items())
    return out
