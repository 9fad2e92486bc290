"""Spare slots for balanced dispatch on many ranks (wide EP), in polynomial time.

Dimension letters: S steps, E logical experts, R ranks.

On one node the spare search (``balanced_replicas``) scores every (expert, rank) pair exactly through
Hall's rank sets, 2^R of them: out of reach beyond ``HALL_MAX_RANKS``. Here each step is solved
exactly by the uncapped rule (``moeplace.dispatch.flow``) and scored through its *closure*: the ranks
reachable from the busiest ones by moving an expert to another of its replicas. Every expert on those
ranks has all its replicas among them, which is what holds the busiest rank at its load. A replica of
such an expert on a rank outside the closure with load <= M - 2 opens a path that takes one expert off
a busiest rank: the step's maximum drops when that rank was the only one at M, and the gain is
counted as 1 / (ranks at M) otherwise (a share of the progress toward it). Per layer, in rounds:

1. dispatch the sampled steps exactly; find each step's closure and its light ranks;
2. gain of (e, r) = sum over the steps where e is active inside the closure and r is a light rank
   outside it (one matrix product, [E, S] x [S, R]);
3. add the best pairs of distinct experts, each rank at most its free slots, ties toward the busiest
   expert per replica, then the lower expert id and rank.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.balanced import Dispatch, mask_bits, pack_bits
from moeplace.dispatch.flow import closure, exact_dispatch
from moeplace.errors import MoeplaceError

ROUNDS = 6                # replicas go in about this many rounds (each re-solves the sampled steps)


def add_replicas(active: np.ndarray, masks: np.ndarray, ranks: int, room: int | np.ndarray,
                 expert_weight: np.ndarray) -> np.ndarray:
    """New replica sets after adding ``room`` replicas to every rank (one count, or [R] per rank), as ``masks``
    holds them (``ReplicaLayout.masks``: int64 bit sets [E], or [E, R] bool beyond 64 ranks).

    active: [S, E] bool, the steps to fit; masks: replica ranks before; expert_weight: [E] tokens, the
    tie-break toward the busiest expert per replica.
    """
    on = mask_bits(masks, ranks).copy()                                         # [E, R]
    room = np.broadcast_to(np.asarray(room, np.int64), (ranks,)).copy()
    batch = max(-(-int(room.sum()) // ROUNDS), 1)
    copies = on.sum(axis=1)
    tie_unit = 1e-6 / max(float(expert_weight.max(initial=0)), 1e-12)
    active_f = np.asarray(active, np.float32)
    dispatch = None
    while room.sum():
        allowed = ~on & (room > 0)[None, :]
        if not allowed.any():
            raise MoeplaceError("no expert can take another replica: spare slots exceed what ranks can hold")
        # each round's dispatch starts from the last one's: the replicas added since open a few paths
        dispatch = exact_dispatch(active_f, on, ranks, None if dispatch is None else dispatch.pick)
        gain = replica_gains(active_f, on, ranks, dispatch)
        total = np.where(allowed, gain + (tie_unit * expert_weight / copies)[:, None], -np.inf)
        for e, r in best_pairs(total, room, batch):
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


def replica_gains(active: np.ndarray, masks: np.ndarray, ranks: int, chosen: Dispatch | None = None) -> np.ndarray:
    """[E, R] the closure score of a replica of expert e on rank r over the steps ``active [S, E]`` (0/1
    float32) under the replica ranks ``masks`` (see the module docstring); chosen: their exact
    dispatch (``flow.exact_dispatch``), where the caller has it."""
    chosen = exact_dispatch(active, masks, ranks) if chosen is None else chosen
    d = chosen.distinct                                                         # [S, R]
    top = d.max(axis=1)
    inside = closure(chosen.pick, d, masks)                                     # [S, R]
    share = 1.0 / (d == top[:, None]).sum(axis=1)                               # [S]
    light = (~inside & (d <= top[:, None] - 2)).astype(np.float32)              # [S, R] where a replica helps
    pick = chosen.pick.astype(np.int64)
    in_closure = (pick >= 0) & np.take_along_axis(inside, np.maximum(pick, 0), axis=1)   # [S, E]
    weighted = (in_closure * share[:, None]).astype(np.float32)
    return weighted.T @ light                                                   # [E, R]
