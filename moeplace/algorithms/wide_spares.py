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

- each pair's gain is shrunk (SHRINK) toward its expert's total times the rank's share of steps where
  it drains;
- a *collision* term per expert: an expert with a single replica collides on its rank with the rank's
  other single-replica experts; with activations independent at their sampled rates, a second replica
  lowers P(k or more such experts active on the rank) by p_e * P(k - 1 of the others active). Summed
  over k = 2 (a step off max 1) and k = 3 (a step up to max 3) with COLLISION_WEIGHTS, in steps.

Per layer, in rounds:

1. dispatch the sampled steps exactly; find each step's closure and the ranks that drain;
2. gain of (e, r) = sum over the steps where e is active inside the closure and r drains outside it
   (one count over the active experts in closures and the ranks that drain), shrunk, plus e's
   collision term;
3. add the best pairs of distinct experts, each rank at most its free slots, ties toward the busiest
   expert per replica, then the lower expert id and rank.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.balanced import Dispatch, mask_bits, pack_bits
from moeplace.dispatch.flow import exact_dispatch
from moeplace.errors import MoeplaceError

ROUNDS = 6                # replicas go in about this many rounds (each re-solves the sampled steps)
SHRINK = 0.3              # share of a pair's gain taken from its expert's total x the rank's light share
COLLISION_WEIGHTS = {2: 1.0, 3: 2.0}   # k: weight of P(k single-replica experts active on one rank)


def add_replicas(active: np.ndarray, masks: np.ndarray, ranks: int, room: int | np.ndarray,
                 expert_weight: np.ndarray) -> np.ndarray:
    """New replica sets after filling every rank's free slots, as ``masks`` holds them
    (``ReplicaLayout.masks``: int64 bit sets [E], or [E, R] bool beyond 64 ranks).

    active: [S, E] bool, the steps to fit; masks: replica ranks before; room: free slots of every rank,
    one count or [R] counts (ranks may hold unequal numbers of first copies);
    expert_weight: [E] tokens, the tie-break toward the busiest expert per replica.
    """
    on = mask_bits(masks, ranks).copy()                                         # [E, R]
    room = np.broadcast_to(np.asarray(room, np.int64), (ranks,)).copy()
    if np.any(room < 0):
        raise MoeplaceError("free slots per rank must be >= 0")
    batch = max(-(-int(room.sum()) // ROUNDS), 1)
    copies = on.sum(axis=1)
    tie_unit = 1e-6 / max(float(expert_weight.max(initial=0)), 1e-12)
    active_f = np.asarray(active, np.float32)
    rate = active_f.mean(axis=0) if active_f.shape[0] else np.zeros(on.shape[0], np.float32)   # [E]
    num_steps = active_f.shape[0]
    dispatch = None
    while room.sum():
        allowed = ~on & (room > 0)[None, :]
        if not allowed.any():
            raise MoeplaceError("no expert can take another replica: spare slots exceed what ranks can hold")
        # each round's dispatch starts from the last one's: the replicas added since open a few paths
        dispatch = exact_dispatch(active_f, on, ranks, None if dispatch is None else dispatch.pick)
        open_steps = dispatch.distinct.max(axis=1) > 1      # a step at max 1 stays there: no gain to read
        if not open_steps.all():
            active_f = active_f[open_steps]
            dispatch = Dispatch(*(x[open_steps] for x in (dispatch.pick, dispatch.distinct, dispatch.tokens,
                                                           dispatch.augments)))
        step, expert = np.nonzero(active_f)                                     # [N] the active pairs
        gain = pair_gains(step, expert, dispatch, on, SHRINK, num_steps)
        gain += (num_steps * collision_gains(rate, on) + tie_unit * expert_weight / copies)[:, None]
        for e, r in best_pairs(np.where(allowed, gain, -np.inf), room, batch):
            on[e, r] = True
            copies[e] += 1
            room[r] -= 1
    return pack_bits(on) if np.asarray(masks).ndim == 1 else on


def best_pairs(total: np.ndarray, room: np.ndarray, batch: int) -> list[tuple[int, int]]:
    """Up to ``batch`` (expert, rank) pairs by ``total [E, R]``, best first: each expert once, each rank at most
    ``room [R]`` times, none at -inf; the first of equals (lower expert, then rank). What a scan of all pairs in
    sorted order keeps, one argmax a pair (a hot expert's R pairs are not walked one by one)."""
    total, left, pairs = total.copy(), room.copy(), []
    for _ in range(batch):
        e, r = divmod(int(np.argmax(total)), total.shape[1])
        if not np.isfinite(total[e, r]):
            break
        pairs.append((e, r))
        left[r] -= 1
        total[e] = -np.inf
        if left[r] <= 0:
            total[:, r] = -np.inf
    return pairs


def replica_gains(active: np.ndarray, masks: np.ndarray, ranks: int, chosen: Dispatch | None = None,
                  shrink: float = SHRINK) -> np.ndarray:
    """[E, R] the closure score of a replica of expert e on rank r over the steps ``active [S, E]`` (0/1
    float32) under the replica ranks ``masks`` (see the module docstring), a share ``shrink`` of it
    taken from e's total times r's share of steps where it drains; chosen: their exact dispatch
    (``flow.exact_dispatch``), where the caller has it."""
    chosen = exact_dispatch(active, masks, ranks) if chosen is None else chosen
    step, expert = np.nonzero(chosen.pick >= 0)
    return pair_gains(step, expert, chosen, mask_bits(masks, ranks), shrink)


def pair_gains(step: np.ndarray, expert: np.ndarray, chosen: Dispatch, on: np.ndarray, shrink: float,
               num_steps: int | None = None) -> np.ndarray:
    """``replica_gains`` from the active (step, expert) pairs [N] of the dispatched steps and the replica
    ranks ``on [E, R]`` (bool); num_steps: the steps the rank's share of draining steps is over (more than
    those dispatched where the others, at max 1, have none)."""
    d = chosen.distinct                                                         # [S, R]
    E, R = on.shape
    if not d.shape[0]:
        return np.zeros((E, R))
    num_steps = d.shape[0] if num_steps is None else num_steps
    top = d.max(axis=1, keepdims=True)
    rank = chosen.pick[step, expert].astype(np.int64)                           # [N] where each pair went
    source, dest = moves(step, expert, rank, on)
    inside = reach(d == top, source, dest)                                      # [S, R] the closure
    light = ~inside & reach(d <= top - 2, dest, source)                         # [S, R] where a replica helps
    share = 1.0 / (d == top).sum(axis=1)                                        # [S]
    keep = inside[step, rank]                                                   # active experts in the closure
    step, expert = step[keep], expert[keep]
    row, col = np.nonzero(light[step])
    exact = np.bincount(expert[row] * R + col, weights=share[step[row]], minlength=E * R).reshape(E, R)
    if not shrink:
        return exact
    per_expert = np.bincount(expert, weights=share[step], minlength=E)
    return (1 - shrink) * exact + shrink * np.outer(per_expert, light.sum(axis=0) / num_steps)


def moves(step: np.ndarray, expert: np.ndarray, rank: np.ndarray, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, dest) [M] flat step * R + rank: every move "an active expert on rank a to another of its
    replicas, on rank b" of an exact dispatch that sent the active pairs (step, expert) [N] to ``rank``
    [N], under the replica ranks ``on [E, R]`` (bool)."""
    R = on.shape[1]
    copies = on.sum(axis=1)
    held_by, held_on = np.nonzero(on)                                     # replicas, by expert
    first = np.searchsorted(held_by, np.arange(on.shape[0]))             # [E] each expert's first replica
    multi = copies[expert] > 1                                            # the pairs that can move
    step, expert, rank = step[multi], expert[multi], rank[multi]
    n = copies[expert]
    pair = np.repeat(np.arange(expert.size), n)                           # one row per (pair, replica)
    replica = first[expert][pair] + np.arange(pair.size) - np.repeat(np.cumsum(n) - n, n)
    b = held_on[replica]
    a = rank[pair]
    move = a != b
    s = step[pair][move] * R
    return s + a[move], s + b[move]


def reach(start: np.ndarray, frm: np.ndarray, to: np.ndarray) -> np.ndarray:
    """[S, R] bool: the cells reached from ``start [S, R]`` along the flat edges frm -> to, and ``start``.
    Forward along the moves (frm = source) it is ``flow.closure`` from the busiest ranks; backward
    (frm = dest) from the ranks at load <= M - 2 it gives the ranks that *drain* (module docstring)."""
    reached = start.ravel().copy()
    while True:
        grow = reached[frm] & ~reached[to]
        if not grow.any():
            return reached.reshape(start.shape)
        reached[to[grow]] = True


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
