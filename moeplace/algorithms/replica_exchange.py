"""Exact local search on a balanced-dispatch replica layout: exchange the replica sets of two experts.

Dimension letters: S steps, E experts, R ranks, X rank sets (2^R), K distinct replica sets in the layout.

Replicas are added one at a time (``balanced_replicas.add_replicas``) on top of first copies placed
without them, so which expert ends up on which ranks is decided before the others are known. An exchange
of two experts' replica sets (masks) keeps every rank's slot count and the multiset of masks, and its
change of E[optimum] is exact and cheap:

* a step where both experts are active keeps the multiset of its active masks, so its f[X] (the active
  experts whose replicas all lie in X) and its optimum do not change;
* a step where one of them is active sees that expert's mask go from m to m'. With M the step's optimum
  (Hall: the largest ceil(f[X] / |X|)), the optimum rises by one exactly when a *full* set (f[X] = M|X|)
  gains the expert (m' in X, m not in X), and drops by one exactly when every *tight* set
  (f[X] > (M - 1)|X|) is one expert over and loses it (m in X, m' not in X) while no set at exactly
  (M - 1)|X| gains it.

"Some set of a family holds m' but not all of m" is "m is not inside the AND of the family's sets that
hold m'", so one superset-AND transform per family (full, at (M - 1)|X|, tight) and step answers it for
every pair of masks (``StepTables``). The search evaluates every exchange at once (a matrix product per
mask), then takes the improving ones in order, each re-checked against the state the earlier ones left,
and repeats until none improves or its work budget is spent.
"""

from __future__ import annotations

import numpy as np

from moeplace.dispatch.exact import subset_counts, subset_sizes

MIN_GAIN = 1e-6   # an exchange must lower the weighted sum of optima (weights of mean 1) by more than this


class StepTables:
    """Per step, what an active expert's change of mask does to the optimum (see the module docstring).

    ands: [3, X, S] int16, for the families full, level (exactly (M - 1)|X|) and tight, the AND of the
    family's sets that contain X (bit R set: none does); fragile: [S] every tight set is one expert
    over; inter: [S] the AND of the tight sets. Rank sets lead, so the transform runs on whole rows.
    """

    def __init__(self, f: np.ndarray, ranks: int) -> None:
        self.ranks = ranks
        self.none = np.int16(1 << ranks)
        self.sizes = subset_sizes(ranks)
        self.ands, self.fragile, self.inter = self._tables(f)

    def update(self, f: np.ndarray, steps: np.ndarray) -> None:
        """Recompute the tables of ``steps`` from their rows of f [S, X]."""
        self.ands[:, :, steps], self.fragile[steps], self.inter[steps] = self._tables(f[steps])

    def _tables(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ands [3, X, n], fragile [n], inter [n]) of the steps of f [n, X]."""
        size = self.sizes[:, None]
        g = np.ascontiguousarray(f.T)                            # [X, n]: the arithmetic below runs on whole rows
        # float32 division is exact here: a quotient of small integers is whole only if exact (3x the int16 one)
        opt = np.ceil(g[1:] / size[1:].astype(np.float32)).max(axis=0).astype(np.int16)
        over = g - (opt - 1) * size
        over[0] = -1                                             # the empty set is in no family
        ands = self._superset_and(np.stack([over == size, over == 0, over >= 1]))
        fragile = (over.max(axis=0) <= 1) & (opt > 0)
        return ands, fragile, ands[2, 0] & ~self.none            # every tight set contains the empty set

    def _superset_and(self, member: np.ndarray) -> np.ndarray:
        """[3, X, n]: the AND of the member sets that contain X (``none`` where no member does)."""
        R = self.ranks
        X = 1 << R
        everything = np.int16(X - 1) | self.none
        out = everything + member * (np.arange(X, dtype=np.int16)[:, None] - everything)   # np.where, 6x faster
        for r in range(R):
            view = out.reshape(3, X >> (r + 1), 2, -1)           # pairs of blocks 2^r rank sets apart
            view[:, :, 0] &= view[:, :, 1]
        return out

    def change(self, steps: np.ndarray | slice, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """[K, n, C] float32: the optimum change of ``steps`` (indices [n], or a slice: ``slice(None)`` for
        every step) when one of their active experts goes from each mask of ``old [C]`` to each mask of
        ``new [K]``; new masks lead, the layout ``_exchange_gains`` reads.

        A family's AND (any value, the ``none`` bit included) lets the expert in exactly when it is a set
        (no ``none`` bit) that holds ``new`` but not all of ``old``: one lookup a value (``enters``)."""
        old = np.asarray(old, np.int16)
        values = np.arange(2 * self.none, dtype=np.int16)[:, None]
        enters = ((values & self.none) == 0) & ((old[None, :] & ~values) != 0)   # [2^(R+1), C]
        full, level, tight = self.ands[:, new][:, :, steps]                      # [K, n] each
        up = enters[full]                                                        # a full set gains it
        level_gain = enters[level]
        inside = self.fragile[steps, None] & ((old[None, :] & ~self.inter[steps, None]) == 0)   # [n, C]
        loses_all = ((tight & self.none) != 0)[:, :, None] & inside[None]
        return up.astype(np.float32) - (loses_all & ~up & ~level_gain)


def exchange_masks(active: np.ndarray, weight: np.ndarray, masks: np.ndarray, ranks: int,
                   budget: float, min_gain: float = MIN_GAIN) -> np.ndarray:
    """Masks [E] after exchanges that lower sum_s weight[s] * optimum[s] on ``active [S, E]`` by more than
    ``min_gain`` each.

    budget: work allowed, in cells: a pass over all exchanges costs S * (K * (K + E) + E * E), an
    accepted exchange X * R for each step it touches. A pass takes exchanges in order of their gain,
    each checked exactly against the state the earlier ones left, until one no longer gains.
    """
    masks = masks.astype(np.int16).copy()
    weight = np.asarray(weight, np.float64)
    S, E = active.shape
    uniq = np.unique(masks)                                      # exchanges keep the multiset of masks
    pass_cost = S * (uniq.size * (uniq.size + E) + E * E)
    if pass_cost > budget:                                       # not even one pass: leave the layout
        return masks.astype(np.int64)
    f = subset_counts(active, masks, ranks)
    tables = StepTables(f, ranks)
    act = active.astype(np.float32)
    weighted = act * weight.astype(np.float32)[:, None]
    ids = np.arange(1 << ranks, dtype=np.int16)
    while pass_cost <= budget:
        budget -= pass_cost
        gain = _exchange_gains(tables, weighted, act, uniq, np.searchsorted(uniq, masks))
        changed = np.zeros(E, bool)
        accepted = 0
        for k in np.argsort(gain, axis=None, kind="stable")[:np.count_nonzero(gain < -min_gain)]:
            a, b = divmod(int(k), E)
            if a > b or changed[a] or changed[b]:
                continue
            only_a = np.flatnonzero(active[:, a] & ~active[:, b])
            only_b = np.flatnonzero(active[:, b] & ~active[:, a])
            # exact in float64 (the matrix is float32, and stale after the first exchange of the pass)
            delta = (weight[only_a] @ tables.change(only_a, masks[[a]], masks[[b]])[0, :, 0].astype(np.float64)
                     + weight[only_b] @ tables.change(only_b, masks[[b]], masks[[a]])[0, :, 0].astype(np.float64))
            if delta >= -min_gain:
                break                                            # evaluate every exchange again
            a_in = ((ids & masks[a]) == masks[a]).astype(np.int16)
            b_in = ((ids & masks[b]) == masks[b]).astype(np.int16)
            f[only_a] += b_in - a_in
            f[only_b] += a_in - b_in
            masks[a], masks[b] = masks[b], masks[a]
            touched = np.concatenate([only_a, only_b])
            tables.update(f, touched)
            budget -= touched.size * ids.size * ranks
            changed[[a, b]] = True
            accepted += 1
            if budget <= 0:
                break
        if not accepted:
            break
    return masks.astype(np.int64)


def _exchange_gains(tables: StepTables, weighted: np.ndarray, act: np.ndarray, uniq: np.ndarray,
                    cls: np.ndarray) -> np.ndarray:
    """[E, E] the exact change of the weighted E[optimum] if experts a and b exchange masks (+inf where
    their masks are equal). weighted: [S, E] weight of each step where the expert is active, else 0;
    uniq: [K] the masks in use; cls: [E] each expert's index into it."""
    E = cls.size
    change = tables.change(slice(None), uniq, uniq)                    # [K, S, C]: class c takes mask k
    one_way = np.empty((E, E), np.float32)
    for k in range(uniq.size):
        cols = np.flatnonzero(cls == k)
        moved = weighted * change[k][:, cls]                          # [S, E]: expert a active, takes uniq[k]
        one_way[:, cols] = moved.sum(axis=0)[:, None] - moved.T @ act[:, cols]   # minus the steps b is active
    gain = one_way + one_way.T
    gain[cls[:, None] == cls[None, :]] = np.inf
    return gain
