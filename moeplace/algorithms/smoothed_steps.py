"""Smoothed steps: a step model without co-activation, to shrink a short capture's statistics toward.

Dimension letters: S steps, E experts.

A spare-slot search fitted on few steps places its last replicas on gains that do not recur (a step's
exact co-activation is seen once). Mixing in steps drawn from a smoothed model of the same layer keeps
every replica's gain tied to what recurs: how often each expert is active and how many experts a step
activates. ``independent_steps`` draws them: a step's size from the fitted steps' sizes, its experts
without replacement in proportion to their smoothed activation counts (a Gumbel top-k draw).
"""

from __future__ import annotations

import numpy as np

PRIOR_COUNT = 0.5   # Jeffreys' pseudo-count per expert: an expert never seen active keeps a small chance


def independent_steps(active: np.ndarray, num_steps: int, rng: np.random.Generator) -> np.ndarray:
    """[num_steps, E] bool steps drawn from ``active [S, E]``'s activation counts and step sizes, each
    expert independent of the others (no co-activation)."""
    S, E = active.shape
    counts = active.sum(axis=0) + PRIOR_COUNT
    log_p = np.log(counts / counts.sum())
    sizes = active.sum(axis=1)[rng.integers(S, size=num_steps)]
    keys = log_p[None, :] - np.log(-np.log(rng.random((num_steps, E))))    # Gumbel: top-n keys = a draw of n
    # a step's experts: its n largest keys, those at or above its n-th largest (continuous keys: no ties)
    nth = np.sort(keys, axis=1)[np.arange(num_steps), np.minimum(E - sizes, E - 1)]
    return (keys >= nth[:, None]) & (sizes[:, None] > 0)


def with_smoothed_steps(active: np.ndarray, share: float, num_smoothed: int,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S + n, E], weight [S + n]): ``active [S, E]`` and n = ``num_smoothed`` independent steps
    drawn from it, weighted so that the smoothed ones make up ``share`` of the total (mean weight 1).
    share 0: the steps alone, each weight 1."""
    if share <= 0 or active.shape[0] == 0:
        return active, np.ones(active.shape[0])
    return weighted_union(active, independent_steps(active, max(num_smoothed, 1), rng), share)


def weighted_union(active: np.ndarray, extra: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S + n, E], weight [S + n]): ``active [S, E]`` then ``extra [n, E]``, weighted so that the extra
    steps make up ``share`` of the total (mean weight 1)."""
    S, n = active.shape[0], extra.shape[0]
    total = S + n
    weight = np.concatenate([np.full(S, (1 - share) * total / S), np.full(n, share * total / n)])
    return np.concatenate([active, extra]), weight
