"""Spread co-active experts over the ranks of a wide layout by swapping slots (balanced dispatch, many ranks).

Dimension letters: S steps, E logical experts, R ranks, N slots (items: one per replica).

On many ranks each rank holds a few experts and a step activates fewer experts than there are ranks, so
a step's busiest rank reads two experts mostly because two experts that fire together sit on one rank,
and three where a third joins them. Balanced dispatch moves an expert with a spare replica out of the way,
one with a single replica never. So the objective here is pairwise: the sum over ranks of the
co-activation of every two slots on the rank, ``C[e, f] = steps where e and f are both active``, weighted
by how much such a pair costs: 1 for two single-replica experts (they collide whenever both fire),
SINGLE_MULTI where one has spare replicas, MULTI_MULTI where both do. A pair count reads every fitted step
(one matrix product), where a per-step score reads a sample: on Kimi-K2-shaped routing at 64 ranks, swaps
of single-replica experts by the count of ranks with two or three of them active on 2,000 sampled steps
gained a quarter as much held out as by this pair count on all 14,000 (BENCHMARKS.md#wide-expert-parallelism).

Best-improvement swaps of two slots on different ranks, several on disjoint rank pairs a round, each
keeping every rank's slot count and no expert twice on a rank, until none lowers the objective by
MIN_GAIN of a step or MAX_ROUNDS end.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.balanced import mask_bits, pack_bits

SINGLE_MULTI = 0.2     # weight of a single-replica expert's co-activation with a replica of a multi-replica one
MULTI_MULTI = 0.1      # and of two replicas of multi-replica experts (BENCHMARKS.md#wide-expert-parallelism)
MIN_GAIN = 5e-5        # a swap must lower the objective by this share of the steps
MAX_ROUNDS = 12        # rounds of disjoint swaps at most (Kimi-K2-shaped at 64 ranks: as good held out as 200, which end at ~25)


def coactivation(active: np.ndarray) -> np.ndarray:
    """[E, E] float32: in how many of the steps ``active [S, E]`` (bool) each two experts are both active
    (the diagonal: each expert's own count). One dense float32 product: exact below 2^24 steps, and at
    Kimi K2's 14,000 x 384 a fifth of the time of a sparse one (18 against 88 ms on one core)."""
    x = np.asarray(active, np.float32)
    return x.T @ x


def spread_slots(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """New replica sets, as ``masks`` holds them (int64 bit sets [E], or [E, R] bool beyond 64 ranks), with
    the same replicas per expert and slots per rank, co-active experts spread apart over the steps
    ``active [S, E]`` (bool; see the module docstring)."""
    on = mask_bits(masks, ranks).copy()                                   # [E, R]
    expert, home = np.nonzero(on)                                         # [N] the slots
    multi = on.sum(axis=1)[expert] > 1
    weight = np.where(multi[:, None] & multi[None, :], MULTI_MULTI,
                      np.where(multi[:, None] | multi[None, :], SINGLE_MULTI, 1.0)).astype(np.float32)
    pair = coactivation(active)[expert][:, expert] * weight               # [N, N]
    pair[expert[:, None] == expert[None, :]] = 0
    home = swap_slots(pair, expert, home, on, ranks, MIN_GAIN * max(active.shape[0], 1))
    on[:] = False
    on[expert, home] = True
    return pack_bits(on) if np.asarray(masks).ndim == 1 else on


def swap_slots(pair: np.ndarray, expert: np.ndarray, home: np.ndarray, on: np.ndarray, ranks: int,
               min_gain: float) -> np.ndarray:
    """[N] each slot's rank after best-improvement swaps on ``sum over ranks of the pair [N, N] weights of
    its slots``, the slots holding ``expert [N]`` on ``home [N]`` (``on [E, R]``: which ranks hold each
    expert). Each round makes the best swaps on disjoint rank pairs among the 4R best."""
    home, on = home.copy(), on.copy()
    n = home.size
    rank_sum = pair @ np.eye(ranks, dtype=np.float32)[home]               # [N, R] i's weight with rank r's slots
    for _ in range(MAX_ROUNDS):
        here = rank_sum[np.arange(n), home]
        half = rank_sum[:, home] - here[:, None]                          # i onto j's rank, off its own
        delta = half + half.T - 2 * pair
        held = on[:, home][expert]                                        # i's expert already on j's rank
        held |= held.T                                                    # or j's on i's (or the same rank)
        delta[held] = np.inf
        flat = delta.ravel()
        k = min(4 * ranks, flat.size - 1)
        best = np.argpartition(flat, k)[:k]
        best = best[np.argsort(flat[best], kind="stable")]
        used, chosen = set(), []
        for t in best:
            if not flat[t] < -min_gain:
                break
            i, j = divmod(int(t), n)
            a, b = int(home[i]), int(home[j])
            if a not in used and b not in used:
                used.update((a, b))
                chosen.append((i, j))
        if not chosen:
            break
        for i, j in chosen:
            a, b = home[i], home[j]
            rank_sum[:, a] += pair[:, j] - pair[:, i]
            rank_sum[:, b] += pair[:, i] - pair[:, j]
            on[expert[i], a], on[expert[j], b] = False, False
            home[i], home[j] = b, a
            on[expert[i], b], on[expert[j], a] = True, True
    return home
