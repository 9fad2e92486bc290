"""Hall's formula for balanced dispatch: a step's optimum from the rank sets its active experts fit in.

Dimension letters: S steps, E logical experts, R ranks, X subsets of ranks (2^R; bit r of the index: rank r).

Under balanced dispatch (``moeplace.dispatch.balanced``) the best a step can do has a closed form (Hall's theorem
for this flow): with ``f[X]`` the number of the step's active experts whose replicas all lie in the rank
set X, the optimum is the largest ``ceil(f[X] / |X|)`` over non-empty X.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def subset_sizes(ranks: int) -> np.ndarray:
    """[X] number of ranks in each rank set (bit r of the index: rank r)."""
    x = np.arange(1 << ranks)
    return np.array([bin(v).count("1") for v in x], np.int16)


def subset_counts(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """f [S, X] int16: active experts whose replica ranks all lie in each rank set. active: [S, E] bool
    (or already 0/1 float32, when several placements are measured on the same steps).

    Two small matrix products: active experts per distinct mask [S, K], times whether each mask lies
    in each rank set [K, X] (float32 is exact: counts stay far below 2^24).
    """
    X = 1 << ranks
    uniq, cls = np.unique(masks, return_inverse=True)
    per_mask = np.zeros((masks.shape[0], uniq.size), np.float32)
    per_mask[np.arange(masks.shape[0]), cls] = 1.0
    inside = ((np.arange(X)[None, :] & uniq[:, None]) == uniq[:, None]).astype(np.float32)   # [K, X]
    return ((np.asarray(active, np.float32) @ per_mask) @ inside).astype(np.int16)


def step_optimum(f: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[S] the optimal max distinct experts per rank of each step, from ``subset_counts`` (sizes:
    ``subset_sizes``): the largest f of each set size k, then the largest ceil(that / k)."""
    ranks = int(sizes[-1])
    order, starts = by_size(ranks)
    top = np.maximum.reduceat(f.take(order + 1, axis=1), starts, axis=1)        # [S, R]; take: C order
    k = np.arange(1, ranks + 1)
    return ((top + k - 1) // k).max(axis=1)


@lru_cache(maxsize=None)
def by_size(ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty rank sets grouped by size (as indices into the sets after the empty one), and where
    each size starts: (order [X-1], starts [R])."""
    sizes = subset_sizes(ranks)[1:]
    return np.argsort(sizes, kind="stable"), np.searchsorted(np.sort(sizes), np.arange(1, ranks + 1))
