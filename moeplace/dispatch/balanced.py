"""Balanced dispatch: per step, send each active expert's tokens to one of its replicas, chosen so that
the busiest rank reads as few distinct experts as possible.

Dimension letters: S steps, E logical experts, R ranks.

**The per-step problem.** A step activates the experts with ``counts[e] > 0`` tokens; expert e has a
replica on each rank of ``masks[e]`` (bit r set: a replica on rank r). All of the step's tokens for e go
to one of those ranks. Minimise the largest number of distinct experts on a rank, then, as a tie-break
(not exactly), the tokens of the busiest rank. At verify batch a rank's MoE time follows the number of
experts whose weights it reads, and the step waits for its slowest rank. SGLang's own rules choose by
token row (``dynamic``: one expert's tokens split over ranks that each read it) or by source rank
(``static``: at batch 1 a replica is never used); neither counts distinct experts.

It is restricted assignment of unit jobs (a semi-matching). Two solvers:

* ``exact_assign``: bisection on the maximum M with a max-flow (source -> expert, capacity 1;
  expert -> its replica ranks, 1; rank -> sink, M). An independent oracle for the tests.
* the **fast rule** (``fast_rule_step`` states it for one step; ``fast_rule`` computes the same for
  many steps at once; ``moeplace_kernels.balanced_dispatch`` runs it on the GPU inside SGLang):

  1. an expert with one replica goes to its rank;
  2. the others, in increasing expert id, each to the replica rank with the fewest distinct experts
     so far (then the fewest tokens, then the lowest rank);
  3. augmenting paths: while a rank of the maximum load M reaches a rank of load <= M - 2 by moves
     "an expert on rank a to its replica on rank b", breadth first, move one expert along each edge of
     a shortest such path (ties: the lowest parent rank, the least-loaded then lowest target rank, the
     lowest expert id). The path's first rank loses an expert and its last gains one.

  When step 3 stops by itself the maximum is optimal: the ranks reachable from the maximal ones all
  have load >= M - 1, and their experts have no replica elsewhere, so in any assignment these |X|
  ranks hold at least (M - 1)|X| + 1 experts. The GPU caps step 3 at ``MAX_AUGMENT`` paths per step for
  a fixed worst-case time; ``max_augment=None`` runs it to the end: the exact optimum.

Every choice is a fixed function of the step's expert ids and the placement (ties fall by id and
rank), so every rank that sees the same top-k ids picks the same replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.errors import MoeplaceError
from moeplace.trace.steps import _ranges

MAX_AUGMENT = 16   # augmenting paths per step on the GPU (BENCHMARKS.md#rules-compared: how often the cap is reached)
MASK_RANKS = 64    # up to here a layout's replica sets are int64 bit sets (what the GPU kernels read), beyond [E, R] bool


@dataclass(frozen=True)
class ReplicaLayout:
    """Where one layer's replicas are, as the dispatch needs it.

    masks: [E] int64, bit r set when expert e has a replica on rank r (up to MASK_RANKS ranks; beyond,
        [E, R] bool); every function here takes either, reading it through ``mask_bits``
    slots: [E, R] int64 physical slot of e's replica on rank r (the lowest one), -1 where none
    """

    masks: np.ndarray
    slots: np.ndarray

    @property
    def ranks(self) -> int:
        return int(self.slots.shape[1])


def replica_layout(phy2log: np.ndarray, num_experts: int, ranks: int) -> ReplicaLayout:
    """The layout of one layer's map ``phy2log [P]`` (rank r owns slots [r*P/R, (r+1)*P/R))."""
    if ranks < 1:
        raise MoeplaceError(f"balanced dispatch needs at least one rank, got {ranks}")
    P = phy2log.shape[0]
    rank_of = np.arange(P) // (P // ranks)
    slots = np.full((num_experts, ranks), -1, np.int64)
    for p in range(P - 1, -1, -1):   # descending, so the lowest slot of a rank wins
        slots[phy2log[p], rank_of[p]] = p
    if np.any((slots < 0).all(axis=1)):
        missing = int(np.flatnonzero((slots < 0).all(axis=1))[0])
        raise MoeplaceError(f"expert {missing} has no replica in the placement")
    return ReplicaLayout(pack_bits(slots >= 0), slots)


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """Replica sets ``bits [E, R]`` (bool) as ``ReplicaLayout.masks`` holds them: int64 bit sets up to
    MASK_RANKS ranks, else the bools themselves."""
    R = bits.shape[1]
    if R > MASK_RANKS:
        return np.asarray(bits, bool)
    return (np.asarray(bits).astype(np.int64) << np.arange(R, dtype=np.int64)).sum(axis=1)


def mask_bits(masks: np.ndarray, ranks: int) -> np.ndarray:
    """[N, R] bool: the replica sets ``masks`` (int64 bit sets [N], or [N, R] bool) as bools."""
    masks = np.asarray(masks)
    if masks.ndim == 2:
        return masks.astype(bool, copy=False)
    return ((masks.astype(np.int64)[:, None] >> np.arange(ranks)) & 1).astype(bool)


# ----------------------------------------------------------------------------- one step (the rule)

def fast_rule_step(counts: np.ndarray, masks: np.ndarray, ranks: int,
                   max_augment: int | None = MAX_AUGMENT) -> np.ndarray:
    """pick [E]: the rank each active expert's tokens go to (-1 where inactive), by the fast rule.

    counts: [E] tokens per expert in this step; masks: [E] replica ranks (``ReplicaLayout.masks``).
    Written for clarity: this is the statement the vectorised and GPU versions must match exactly.
    """
    E = counts.shape[0]
    bits = mask_bits(masks, ranks)
    load, tok = [0] * ranks, [0] * ranks
    pick = [-1] * E
    multi = []
    for e in range(E):
        if counts[e] <= 0:
            continue
        cand = list(np.flatnonzero(bits[e]))
        if len(cand) == 1:
            pick[e] = cand[0]
            load[cand[0]] += 1
            tok[cand[0]] += counts[e]
        else:
            multi.append(e)
    for e in multi:
        r = min(np.flatnonzero(bits[e]), key=lambda r: (load[r], tok[r], r))
        pick[e] = r
        load[r] += 1
        tok[r] += counts[e]
    done = 0
    while max_augment is None or done < max_augment:
        top = max(load)
        if min(load) > top - 2:
            break
        roots = {r for r in range(ranks) if load[r] == top}
        level, seen, parent, target = sorted(roots), set(roots), {}, None
        while level and target is None:
            nxt = []
            for b in range(ranks):
                if b in seen:
                    continue
                a = next((a for a in level if any(pick[e] == a and bits[e, b] for e in multi)), None)
                if a is not None:
                    parent[b] = a
                    nxt.append(b)
            seen.update(nxt)
            hits = [b for b in nxt if load[b] <= top - 2]
            if hits:
                target = min(hits, key=lambda b: (load[b], b))
            level = nxt
        if target is None:
            break
        b = target
        while b not in roots:
            a = parent[b]
            e = next(e for e in multi if pick[e] == a and bits[e, b])
            pick[e] = b
            tok[a] -= counts[e]
            tok[b] += counts[e]
            b = a
        load[b] -= 1
        load[target] += 1
        done += 1
    return np.array(pick, np.int64)


# ----------------------------------------------------------------------------- many steps at once

@dataclass
class Dispatch:
    """The fast rule's choice for S steps of one layer.

    pick: [S, E] int8 rank each active expert goes to, -1 where inactive
    distinct: [S, R] distinct experts per rank; tokens: [S, R] tokens per rank
    augments: [S] augmenting paths used
    """

    pick: np.ndarray
    distinct: np.ndarray
    tokens: np.ndarray
    augments: np.ndarray


@dataclass(frozen=True)
class ActivePairs:
    """The active (step, expert) pairs of ``counts [S, E]``, by step then expert id: what the fast rule
    reads of the counts whatever the placement, so several placements on the same steps share it."""

    flat: np.ndarray     # [N] step * E + expert
    step: np.ndarray     # [N]
    expert: np.ndarray   # [N]
    tokens: np.ndarray   # [N]
    by_expert: np.ndarray      # [N] the pairs by expert, then step
    expert_start: np.ndarray   # [E + 1] where each expert's pairs start in by_expert


def active_pairs(counts: np.ndarray) -> ActivePairs:
    """``ActivePairs`` of ``counts [S, E]``."""
    E = counts.shape[1]
    flat = np.flatnonzero(counts > 0)
    step, expert = np.divmod(flat, E)
    by_expert = np.argsort(expert.astype(np.int16 if E < 2**15 else np.int64), kind="stable")
    start = np.concatenate([[0], np.cumsum(np.bincount(expert, minlength=E))])
    return ActivePairs(flat, step, expert, np.asarray(counts).ravel()[flat].astype(np.int64, copy=False),
                       by_expert, start)


def fast_rule(counts: np.ndarray, masks: np.ndarray, ranks: int,
              max_augment: int | None = MAX_AUGMENT, pairs: ActivePairs | None = None,
              floor: np.ndarray | None = None, start: np.ndarray | None = None) -> Dispatch:
    """``fast_rule_step`` for every row of ``counts [S, E]`` (whole tokens) at once: the same picks,
    vectorised over steps. pairs: ``active_pairs(counts)``, where the caller has it already.
    floor: [S] a lower bound on each step's optimum; a step whose maximum reaches it takes no more paths
    (its maximum is then optimal, its picks no longer the rule's: for callers that need the optimum only).
    start: [S, E] picks to take step 3 from instead of steps 1-2 (each active expert on one of its replicas:
    an earlier answer for fewer replicas), for callers that need an exact dispatch, not the rule's."""
    S, E = counts.shape
    R = ranks
    counts = np.asarray(counts, np.int64)
    bits = mask_bits(masks, R)                                            # [E, R]
    nrep = bits.sum(axis=1)
    if start is not None:
        pick = np.array(start, copy=True)
        s, e = np.nonzero(pick >= 0)
        cell = s * R + pick[s, e]
        distinct = np.bincount(cell, minlength=S * R).reshape(S, R)
        tokens = np.bincount(cell, weights=counts[s, e], minlength=S * R).astype(np.int64).reshape(S, R)
        augments = np.zeros(S, np.int64)
        _augment(counts, bits, np.flatnonzero(nrep > 1), pick, distinct, tokens, augments, max_augment, floor)
        return Dispatch(pick, distinct, tokens, augments)
    pairs = active_pairs(counts) if pairs is None else pairs
    flat, step_of, expert_of, tok = pairs.flat, pairs.step, pairs.expert, pairs.tokens
    single = nrep[expert_of] == 1
    pick = np.full(S * E, -1, np.int8 if R <= 127 else np.int16)
    home = bits.argmax(axis=1)
    r1 = home[expert_of[single]]
    pick[flat[single]] = r1
    # A rank's load as one integer, distinct * span + tokens (tokens < span), so that the order of step
    # 2 (fewest distinct, then fewest tokens, then lowest rank) is that of load * R + rank.
    span = int(np.bincount(step_of, weights=tok, minlength=1).max()) + 1
    # key[s, r] = load * R + r
    key = np.arange(R) + R * np.bincount(step_of[single] * R + r1, weights=span + tok[single],
                                         minlength=S * R).astype(np.int64).reshape(S, R)
    # Step 2, one multi-replica expert at a time in increasing id, in every step that activates it
    # (within a step that is the rule's order; different steps never interact).
    multi = np.flatnonzero(nrep > 1)
    lengths = pairs.expert_start[multi + 1] - pairs.expert_start[multi]
    by_expert = pairs.by_expert[_ranges(pairs.expert_start[multi], lengths)]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    row_cell, add = step_of[by_expert] * R, (span + tok[by_expert]) * R   # flat key index of (step, rank 0)
    cell = np.empty(by_expert.size, np.int64)                              # the chosen (step, rank) of each pair
    flat_key = key.reshape(-1)                                             # a view: updates reach key
    rep_expert, rep_rank = np.nonzero(bits[multi])
    rank_lists = np.split(rep_rank, np.searchsorted(rep_expert, np.arange(1, multi.size)))
    for ranks_e, lo, hi in zip(rank_lists, bounds[:-1].tolist(), bounds[1:].tolist()):
        if lo == hi:
            continue
        base = row_cell[lo:hi]
        if ranks_e.size == 2:   # the usual case, without a [rows, replicas] gather
            at0, at1 = base + ranks_e[0], base + ranks_e[1]
            at = np.where(flat_key[at1] < flat_key[at0], at1, at0)   # keys differ by rank: no ties
        else:
            at = base + ranks_e[flat_key[base[:, None] + ranks_e].argmin(axis=1)]
        cell[lo:hi] = at
        flat_key[at] += add[lo:hi]   # one pair per step of this expert: the cells are distinct
    pick[flat[by_expert]] = cell - row_cell
    load = key // R
    distinct, tokens = load // span, load % span
    pick = pick.reshape(S, E)
    augments = np.zeros(S, np.int64)
    if multi.size:
        _augment(counts, bits, multi, pick, distinct, tokens, augments, max_augment, floor)
    return Dispatch(pick, distinct, tokens, augments)


def _augment(counts: np.ndarray, bits: np.ndarray, multi: np.ndarray, pick: np.ndarray, distinct: np.ndarray,
             tokens: np.ndarray, augments: np.ndarray, max_augment: int | None,
             floor: np.ndarray | None = None) -> None:
    """Step 3 of the fast rule for all steps, in place (see ``fast_rule_step``). bits: [E, R] replica
    ranks; multi: the experts with several, ascending.

    Each round searches every live step at once over its moves as a list of edges (step, a, b, expert:
    an active expert on rank a with a replica on rank b), rebuilt from the picks each round: a step has
    a few dozen such edges however many ranks there are, so a round costs the edges, not steps x R x R."""
    R = distinct.shape[1]

    def needs_path(d: np.ndarray, steps: np.ndarray) -> np.ndarray:
        top = d.max(axis=1)
        keep = d.min(axis=1) <= top - 2
        return keep & (top > floor[steps]) if floor is not None else keep

    live = np.flatnonzero(needs_path(distinct, np.arange(distinct.shape[0])))   # the steps a path may help
    if not live.size or max_augment == 0:
        return
    M = multi.size
    pick_m = pick[live[:, None], multi].astype(np.int64)                  # [n, M] kept in step with pick
    rows = np.arange(live.size)                                           # live[i]'s row of pick_m
    # the candidate moves, one per (row, active multi-replica expert, replica rank): the expert on its
    # picked rank a could go to rank b; kept for the rows still live, a move only while a != b.
    # replicas [M, Q]: each expert's replica ranks, ascending, padded with -1
    rep_expert, rep_rank = np.nonzero(bits[multi])
    per_expert = np.bincount(rep_expert, minlength=M)
    first = np.searchsorted(rep_expert, np.arange(M))
    replicas = np.full((M, int(per_expert.max())), -1, np.int64)
    replicas[rep_expert, np.arange(rep_expert.size) - first[rep_expert]] = rep_rank
    k, j = np.nonzero(pick_m >= 0)
    per = per_expert[j]
    all_k, all_kj = np.repeat(k, per), np.repeat(k * M + j, per)          # all_kj: the flat index into pick_m
    all_b = replicas[j].ravel()
    if per_expert.min() < replicas.shape[1]:
        all_b = all_b[all_b >= 0]
    position = np.full(live.size, -1)                                     # a pick_m row's place in live
    rounds = 0
    while live.size and (max_augment is None or rounds < max_augment):
        rounds += 1
        keep = needs_path(distinct[live], live)
        live, rows = live[keep], rows[keep]
        if not live.size:
            return
        n = live.size
        d = distinct[live]
        top = d.max(axis=1)
        position[:] = -1
        position[rows] = np.arange(n)
        if not keep.all():                                                # the rows that left stay gone
            on = np.flatnonzero(position[all_k] >= 0)
            all_k, all_kj, all_b = all_k.take(on), all_kj.take(on), all_b.take(on)
        all_a = pick_m.reshape(-1).take(all_kj)
        move = np.flatnonzero(all_a != all_b)
        mk = all_k.take(move)
        ek, ej, ea, eb = position.take(mk), all_kj.take(move) - mk * M, all_a.take(move), all_b.take(move)
        # [5, edges]: row, expert, source rank, and the flat (row, rank) of each end; one take filters them
        edges = np.stack([ek, ej, ea, ek * R + ea, ek * R + eb])
        # breadth first from the ranks at the maximum; level[i * R + r]: moves from them to reach rank r
        # (-1: not reached); the first level with a rank two experts lighter holds the target (least
        # loaded, lowest). A rank's parent: the lowest rank of the level before with an edge to it; its
        # expert: the lowest-id expert of that edge.
        level = np.where(d == top[:, None], 0, -1).ravel()
        low = (d <= top[:, None] - 2).ravel()
        parent = np.full(n * R, R)
        expert = np.full(n * R, multi.size)
        target = np.full(n, -1, np.int64)
        depth = np.zeros(n, np.int64)
        t = 0
        while edges.shape[1]:
            # from the level-t ranks; after the first level every edge left leads to a rank not reached yet
            at_t = level[edges[3]] == t
            new = np.flatnonzero(at_t & (level[edges[4]] < 0) if t == 0 else at_t)
            nk, nj, na, _, nb = edges.take(new, axis=1)
            level[nb] = t + 1
            np.minimum.at(parent, nb, na)
            first_edge = na == parent[nb]
            np.minimum.at(expert, nb[first_edge], nj[first_edge])
            t += 1
            hit = low[nb]
            searching = np.zeros(n, bool)
            searching[nk] = True                                          # rows that reached a new rank
            if hit.any():
                key = np.full(n, np.iinfo(np.int64).max)
                np.minimum.at(key, nk[hit], d.ravel()[nb[hit]] * R + nb[hit] % R)
                found = np.flatnonzero(key < np.iinfo(np.int64).max)
                target[found] = key[found] % R
                depth[found] = t
                searching[found] = False
            # the rows still searching, and of their edges those to ranks not reached yet (no other can be new)
            edges = edges.take(np.flatnonzero(searching[edges[0]] & (level[edges[4]] < 0)), axis=1)
        ok = target >= 0
        if not ok.any():
            return
        # the paths back from their targets along the parents
        b, walking = np.where(ok, target, -1), ok.copy()
        moves = []
        while walking.any():
            w = np.flatnonzero(walking)
            at = w * R + b[w]
            moves.append((w, parent[at], b[w], expert[at]))
            b[w] = parent[at]
            depth[w] -= 1
            walking &= depth > 0
        # every move of a path at once: the moves of a path take experts off distinct ranks (a path visits a
        # rank once), so none changes another's choice, and each update touches a (step, rank) once
        w, a, bb, jj = (np.concatenate(x) for x in zip(*moves))
        s, e = live[w], multi[jj]
        pick[s, e] = bb
        pick_m[rows[w], jj] = bb
        c = counts[s, e]
        tokens[s, a] -= c
        tokens[s, bb] += c
        done = np.flatnonzero(ok)
        distinct[live[done], b[done]] -= 1
        distinct[live[done], target[done]] += 1
        augments[live[done]] += 1


# ----------------------------------------------------------------------------- exact solver (oracle)

def exact_assign(counts: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """pick [E] minimising the largest number of distinct experts on a rank (max-flow, exact).

    Bisection on the maximum M: M is feasible when a flow source -> expert (1) -> replica rank (1)
    -> sink (M) saturates every active expert. Tokens are not considered.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    active = np.flatnonzero(np.asarray(counts) > 0)
    bits = mask_bits(masks, ranks)
    A = active.size
    pick = np.full(counts.shape[0], -1, np.int64)
    if A == 0:
        return pick
    src, sink = 0, A + ranks + 1
    rows, cols = [], []
    for i, e in enumerate(active):
        rows.append(src)
        cols.append(1 + i)
        for r in np.flatnonzero(bits[e]):
            rows.append(1 + i)
            cols.append(1 + A + r)
    rows += [1 + A + r for r in range(ranks)]
    cols += [sink] * ranks
    unit = len(rows) - ranks

    def flow_at(limit: int):
        caps = np.array([1] * unit + [limit] * ranks, np.int32)
        graph = csr_matrix((caps, (rows, cols)), shape=(sink + 1, sink + 1))
        return maximum_flow(graph, src, sink)

    lo, hi = -(-A // ranks), A
    while lo < hi:
        mid = (lo + hi) // 2
        if flow_at(mid).flow_value == A:
            hi = mid
        else:
            lo = mid + 1
    flow = flow_at(lo).flow.tocoo()
    for u, v, f in zip(flow.row, flow.col, flow.data):
        if f > 0 and 1 <= u <= A and 1 + A <= v < 1 + A + ranks:
            pick[active[u - 1]] = v - 1 - A
    return pick


def rank_loads(pick: np.ndarray, counts: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct [R], tokens [R]) of one step's ``pick [E]``."""
    on = pick >= 0
    return (np.bincount(pick[on], minlength=ranks),
            np.bincount(pick[on], weights=counts[on], minlength=ranks))


def _token_cells(steps, layer: int) -> np.ndarray:
    """[N] flat step * E + expert of every routed (token row, top-k) pair of one layer (ids of -1 left out)."""
    step_of_row, _, ids = steps.layer(layer)
    valid = ids >= 0
    return np.broadcast_to(step_of_row[:, None], ids.shape)[valid] * steps.model.num_experts + ids[valid]


def step_expert_active(steps, layer: int) -> np.ndarray:
    """[S, E] bool: ``step_expert_counts(steps, layer) > 0`` without the counts (half the time at Kimi K2's
    14,000 x 384: one store a token row's expert instead of a bincount and a compare)."""
    S, E = steps.num_steps, steps.model.num_experts
    out = np.zeros(S * E, bool)
    out[_token_cells(steps, layer)] = True
    out = out.reshape(S, E)
    if steps.count_steps.size:
        out[steps.count_steps] |= steps.counts[:, layer, :] > 0
    return out


def step_expert_counts(steps, layer: int) -> np.ndarray:
    """[S, E] tokens each logical expert gets in each step at one layer (token rows and count steps)."""
    S, E = steps.num_steps, steps.model.num_experts
    out = np.bincount(_token_cells(steps, layer), minlength=S * E).reshape(S, E).astype(np.int64, copy=False)
    if steps.count_steps.size:
        out[steps.count_steps] += np.rint(steps.counts[:, layer, :]).astype(np.int64)
    return out
