"""Dispatch by cost: per step, choose each active expert's replica, and split its tokens over its replicas
where the token term pays, so that the busiest rank's predicted MoE time is as low as possible.

Dimension letters: S steps, E logical experts, M experts with more than one replica, R ranks.

**The per-step problem.** Expert e has ``counts[e]`` tokens this step and a replica on each rank of
``masks[e]``. Choose ``alloc[e, r] >= 0`` tokens of e on each replica rank r, summing to ``counts[e]``.
Rank r then costs ``a * distinct_r + b * tokens_r + c`` (``moeplace.cost.model``: distinct_r the experts
with ``alloc[e, r] > 0``, tokens_r their (token, expert) pairs; c, SGLang's launch grid, is the same on
every rank of a step, ``moeplace.cost.derive``). Minimise the largest. At verify batch ``a`` dominates
and the answer is balanced dispatch's (``moeplace.dispatch.balanced``: one replica per expert, fewest distinct
experts on the busiest rank); at large batch every replica is read anyway and the token term decides,
as SGLang's LPLB assumes.

The rule works in integers (``RuleWeights``, from the cost model by ``rule_weights``): a rank costs
``read * distinct + pair * tokens + block * extra_blocks``. Where tokens cost anything, the unit is one
(token, expert) pair (``pair = 1``, ``read = q = round(a / b)``, ``block = round(r / b)``); where only reads and
row blocks do, ``pair = 0`` and ``read = READ_UNIT``. Every rank computes the same choice from the same ids,
with no floating-point ties.

* ``exact_split``: the problem as a MILP (``scipy.optimize.milp``), the oracle for the tests and the
  evaluation; it returns HiGHS's proven lower bound beside the best allocation found.
* the **fast rule** (``cost_rule_step`` states it for one step; ``cost_rule`` computes the same for many
  steps at once):

  1. the balanced rule (``dispatch.balanced.fast_rule``, with its GPU cap on augmenting paths);
  2. a step with fewer pairs than one read costs (``pair * pairs < read``) where no expert runs past its
     first row block keeps it: one more read on the busiest rank then costs more than all of the step's
     tokens, so the model's optimum also has the fewest distinct experts there, and what moving tokens
     could still gain is under ``b * pairs`` (at a 9-token Kimi-shaped step under 3 µs of a ~170 µs layer).
     This makes the rule balanced dispatch, pick for pick, at verify batch;
  3. otherwise, up to ``MAX_ROUNDS`` times: on every rank r at the maximum cost, for every expert with
     tokens there and a replica on another rank r', the best of moving all of its tokens to r' (r sheds a
     read), moving the share that levels the two ranks (where tokens cost: r' may gain a read) and moving
     what it runs past its last full row block (where blocks cost: r sheds a block); take the move whose two
     ranks end highest the lowest (ties: a whole move, then a levelling share, then the lowest expert id,
     source rank, target rank), if both end below the maximum; else stop. Each move lowers the maximum or
     the number of ranks at it, so the rule never ends above balanced dispatch's cost.

A split expert's tokens go to its ranks in increasing rank order, in token-row order
(``pair_slots``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.cost.model import CostModel, blocks_past_first, extra_row_blocks
from moeplace.dispatch.balanced import MAX_AUGMENT, fast_rule, mask_bits, replica_layout, step_expert_counts
from moeplace.errors import MoeplaceError
from moeplace.trace.steps import RoutingSteps

MAX_ROUNDS = 16   # moves per step after the balanced rule (BENCHMARKS.md#rules-compared: how many the evaluated steps used)
READ_UNIT = 4096  # an expert read where tokens are free (pair = 0): fine enough for the ratio of r to a
MAX_WEIGHT = 1 << 16   # read and block at most: a rank's cost stays far inside 32 bits (distinct <= 4096)
WHOLE, LEVEL, BLOCK = 0, 1, 2    # the kinds of move, in their tie order


@dataclass(frozen=True)
class RuleWeights:
    """A rank's integer cost under the rule: ``read * distinct + pair * tokens + block * extra_blocks``, the
    extra row blocks counted in blocks of ``block_m`` rows (``moeplace.cost.model``; block 0: not counted)."""

    read: int
    pair: int = 1
    block: int = 0
    block_m: int = 0

    def extra_blocks(self, tokens: np.ndarray) -> np.ndarray:
        """Row blocks beyond the first of an expert with ``tokens`` on one rank (0 where block is 0)."""
        if not self.block:
            return np.zeros(np.shape(tokens), np.int64)
        return blocks_past_first(tokens, self.block_m).astype(np.int64)

    def problem(self, max_block_m: int) -> str | None:
        """Why the kernels cannot take these weights (one line), or None: read 1 to MAX_WEIGHT, pair and block 0
        to MAX_WEIGHT, block_m a power of two up to ``max_block_m`` where block > 0 (SGLang's row blocks are)."""
        for name, low in (("read", 1), ("pair", 0), ("block", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_WEIGHT:
                return f"{'q' if name == 'read' else name} must be an int from {low} to {MAX_WEIGHT}, got {value!r}"
        m = self.block_m
        whole_rows = isinstance(m, int) and not isinstance(m, bool)
        if self.block and not (whole_rows and 1 <= m <= max_block_m and m & (m - 1) == 0):
            return f"block_m must be a power of two from 1 to {max_block_m} where block > 0, got {m!r}"
        return None


def rule_weights(cost: CostModel) -> RuleWeights | None:
    """The rule's integer weights for ``cost`` (None when only expert reads cost: the balanced rule)."""
    a, b, r = cost.a_us_per_expert, cost.b_us_per_token, cost.r_us_per_block
    blocks = r > 0 and cost.block_m > 0
    if b > 0:
        return RuleWeights(min(MAX_WEIGHT, max(1, round(a / b))), 1,
                           min(MAX_WEIGHT, round(r / b)) if blocks else 0, cost.block_m if blocks else 0)
    if blocks and a > 0:
        return RuleWeights(READ_UNIT, 0, min(MAX_WEIGHT, max(1, round(READ_UNIT * r / a))), cost.block_m)
    return None


def acts_as_balanced(weights: RuleWeights | None, step_tokens: int, top_k: int) -> bool:
    """Whether the fast rule keeps the balanced rule's choice on every step of at most ``step_tokens`` tokens of
    ``top_k`` experts each (its step 2): fewer pairs than one read costs, and no expert past its first row block."""
    return weights is None or (weights.pair * step_tokens * top_k < weights.read
                               and (not weights.block or step_tokens <= weights.block_m))


def as_weights(weights: RuleWeights | int | None) -> RuleWeights | None:
    """A plain q is ``RuleWeights(q)``: reads and pairs only."""
    return RuleWeights(weights) if isinstance(weights, (int, np.integer)) else weights


def moves_possible(weights: RuleWeights | None, pairs: int, extra_blocks: int) -> bool:
    """Step 2: whether a step of ``pairs`` with ``extra_blocks`` under the balanced rule searches moves."""
    if weights is None:
        return False
    return weights.pair * pairs >= weights.read or (weights.block > 0 and extra_blocks > 0)


# ----------------------------------------------------------------------------- one step (the rule)

def cost_rule_step(counts: np.ndarray, masks: np.ndarray, ranks: int, weights: RuleWeights | int | None,
                   max_rounds: int = MAX_ROUNDS, max_augment: int | None = MAX_AUGMENT) -> np.ndarray:
    """alloc [E, R]: tokens of each expert on each rank, by the fast rule (see the module docstring).

    counts: [E] tokens per expert in this step; masks: [E] replica ranks (``ReplicaLayout.masks``);
    weights: ``rule_weights`` (an int q: reads and pairs only; None: the balanced rule).
    Written for clarity: this is the statement the vectorised version (and a GPU one) must match.
    """
    w = as_weights(weights)
    counts = np.asarray(counts, np.int64)
    E = counts.shape[0]
    pick = fast_rule(counts[None, :], masks, ranks, max_augment).pick[0]
    alloc = np.zeros((E, ranks), np.int64)
    on = pick >= 0
    alloc[np.flatnonzero(on), pick[on]] = counts[on]
    if not moves_possible(w, int(counts.sum()), int(w.extra_blocks(counts).sum()) if w else 0):
        return alloc
    bits = mask_bits(masks, ranks)
    multi = np.flatnonzero(bits.sum(axis=1) > 1)
    for _ in range(max_rounds):
        cost = (w.read * (alloc > 0).sum(axis=0) + w.pair * alloc.sum(axis=0)
                + w.block * w.extra_blocks(alloc).sum(axis=0))
        top = int(cost.max())
        best = None          # (pair max, kind, expert, source, target, tokens moved)
        for e in multi:
            for src in np.flatnonzero((cost == top) & (alloc[e] > 0)):
                here = int(alloc[e, src])
                for r in np.flatnonzero(bits[e]):
                    if r == src:
                        continue
                    there = int(alloc[e, r])
                    dest = int(cost[r]) + (w.read if there == 0 else 0)
                    moves = [(WHOLE, here)]
                    if w.pair and here >= 2:
                        moves.append((LEVEL, min(max((top - dest) // 2, 1), here - 1)))
                    if w.block and here > w.block_m:
                        moves.append((BLOCK, here - w.block_m * ((here - 1) // w.block_m)))
                    for kind, m in moves:
                        shed = w.extra_blocks(here) - w.extra_blocks(here - m)
                        gained = w.extra_blocks(there + m) - w.extra_blocks(there)
                        left = top - (w.read if m == here else 0) - w.pair * m - w.block * int(shed)
                        arrived = dest + w.pair * m + w.block * int(gained)
                        key = (max(left, arrived), kind, int(e), int(src), int(r), m)
                        if best is None or key < best:
                            best = key
        if best is None or best[0] >= top:
            break
        _, _, e, src, r, m = best
        alloc[e, src] -= m
        alloc[e, r] += m
    return alloc


# ----------------------------------------------------------------------------- many steps at once

@dataclass
class CostDispatch:
    """The fast rule's choice for S steps of one layer.

    multi: [M] the experts with more than one replica (ascending); alloc: [S, M, R] their tokens on
    each rank (every other active expert runs on its one rank); distinct, tokens: [S, R] per rank;
    pick: [S, E] the balanced rule's rank for each active expert (-1 inactive), where the rule started;
    rounds: [S] moves made after it.
    """

    multi: np.ndarray
    alloc: np.ndarray
    distinct: np.ndarray
    tokens: np.ndarray
    pick: np.ndarray
    rounds: np.ndarray

    def full_alloc(self, counts: np.ndarray) -> np.ndarray:
        """[S, E, R] tokens of every expert on every rank (``counts``: the [S, E] the rule ran on)."""
        S, E = counts.shape
        R = self.distinct.shape[1]
        out = np.zeros((S, E, R), np.int64)
        s, e = np.nonzero(self.pick >= 0)
        out[s, e, self.pick[s, e]] = counts[s, e]
        out[:, self.multi, :] = self.alloc
        return out


def cost_rule(counts: np.ndarray, masks: np.ndarray, ranks: int, weights: RuleWeights | int | None,
              max_rounds: int = MAX_ROUNDS, max_augment: int | None = MAX_AUGMENT) -> CostDispatch:
    """``cost_rule_step`` for every row of ``counts [S, E]`` at once (the same allocations, vectorised)."""
    w = as_weights(weights)
    counts = np.asarray(counts, np.int64)
    S, E = counts.shape
    R = ranks
    base = fast_rule(counts, masks, R, max_augment)
    bits = mask_bits(masks, R)
    multi = np.flatnonzero(bits.sum(axis=1) > 1)
    M = multi.size
    alloc = np.zeros((S, M, R), np.int64)
    s, i = np.nonzero(base.pick[:, multi] >= 0)
    alloc[s, i, base.pick[s, multi[i]]] = counts[s, multi[i]]
    distinct, tokens = base.distinct.copy(), base.tokens.astype(np.int64)
    rounds = np.zeros(S, np.int64)
    if w is None or not M:
        return CostDispatch(multi, alloc, distinct, tokens, base.pick, rounds)
    blk = w.extra_blocks
    s, e = np.nonzero(base.pick >= 0)
    blocks = np.bincount(s * R + base.pick[s, e], blk(counts[s, e]), S * R).astype(np.int64).reshape(S, R)
    live = np.flatnonzero((w.pair * counts.sum(axis=1) >= w.read) | ((w.block > 0) & (blocks.sum(axis=1) > 0)))
    replica = bits[multi]                                                 # [M, R]
    big = np.iinfo(np.int64).max // 8
    for _ in range(max_rounds):
        if not live.size:
            break
        cost = w.read * distinct[live] + w.pair * tokens[live] + w.block * blocks[live]   # [n, R]
        top = cost.max(axis=1)
        # The candidate moves: (row, expert i, source rank at the maximum) with tokens there, in (row, i,
        # source) order, each against every target rank [c, R]; only the busiest ranks' experts are
        # gathered, so a round costs the candidates times R, not steps x M x R x R.
        at_top, src = np.nonzero(cost == top[:, None])
        held = alloc[live[at_top], :, src] > 0                            # [t, M]
        t, i = np.nonzero(held)
        row, src = at_top[t], src[t]
        order = np.lexsort((src, i, row))
        row, i, src = row[order], i[order], src[order]
        c = row.size
        here = alloc[live[row], i, src][:, None]                          # [c, 1]
        there = alloc[live[row], i, :]                                    # [c, R]
        top_c = top[row][:, None]
        dest = cost[row] + w.read * (there == 0)
        allowed = replica[i] & (np.arange(R)[None, :] != src[:, None])

        def value(m):
            left = top_c - w.read * (m == here) - w.pair * m - w.block * (blk(here) - blk(here - m))
            return np.maximum(left, dest + w.pair * m + w.block * (blk(there + m) - blk(there)))

        shares = [np.broadcast_to(here, (c, R))]                          # WHOLE, LEVEL, BLOCK
        values = [np.where(allowed, value(here), big)]
        if w.pair:
            level = np.clip((top_c - dest) // 2, 1, np.maximum(here - 1, 1))
            shares.append(level)
            values.append(np.where(allowed & (here >= 2), value(level), big))
        if w.block:
            past = here - w.block_m * ((here - 1) // w.block_m)
            shares.append(np.broadcast_to(past, (c, R)))
            values.append(np.where(allowed & (here > w.block_m), value(past), big))
        kinds = [WHOLE] + ([LEVEL] if w.pair else []) + ([BLOCK] if w.block else [])
        key = np.min([v * 4 + k for v, k in zip(values, kinds)], axis=0).ravel()   # ties: the kind order, then
        # the first (expert, source, target) of the row: a stable sort by row, then key, puts each row's
        # choice first (as np.argmin over its flattened block)
        row_of = np.repeat(row, R)
        by_key = np.lexsort((key, row_of))
        flat = by_key[np.flatnonzero(np.diff(row_of[by_key], prepend=-1))]   # [rows with a candidate]
        ok = key[flat] // 4 < top[row_of[flat]]
        flat = flat[ok]
        live = live[row_of[flat]]
        kind = key[flat] % 4
        cand, r = flat // R, flat % R
        i, src = i[cand], src[cand]
        m = np.zeros(live.size, np.int64)
        for k, share in zip(kinds, shares):
            m = np.where(kind == k, share[cand, r], m)
        had, got = alloc[live, i, src], alloc[live, i, r]
        alloc[live, i, src] -= m
        alloc[live, i, r] += m
        tokens[live, src] -= m
        tokens[live, r] += m
        distinct[live, src] -= m == had
        distinct[live, r] += got == 0
        blocks[live, src] += blk(had - m) - blk(had)
        blocks[live, r] += blk(got + m) - blk(got)
        rounds[live] += 1
    return CostDispatch(multi, alloc, distinct, tokens, base.pick, rounds)


# ----------------------------------------------------------------------------- exact solver (oracle)

@dataclass(frozen=True)
class ExactSplit:
    """The MILP's answer for one step: alloc [E, R]; value, the busiest rank's ``a*d + b*t`` (no c);
    bound, HiGHS's proven lower bound on it; optimal, whether the two met within the MILP's gap."""

    alloc: np.ndarray
    value: float
    bound: float
    optimal: bool


def exact_split(counts: np.ndarray, masks: np.ndarray, ranks: int, a: float, b: float,
                time_limit: float = 20.0, row_block_us: float = 0.0, block_m: int = 0) -> ExactSplit:
    """Minimise ``max_r a * distinct_r + row_block_us * extra_row_blocks_r + b * tokens_r`` over integer
    allocations (one step; ``row_block_us``, ``block_m``: the cost model's row-block term, off at 0).

    Variables, for each active expert e with several replicas and each of its ranks r: x[e, r] tokens
    (integer, 0..counts[e]) and y[e, r] (binary, x <= counts[e] * y), with the row-block term k[e, r] blocks
    (integer, k >= y, block_m * k >= x); and T, the maximum. Experts with one replica are fixed. Minimise T
    subject to sum_r x[e, r] = counts[e] and, on every rank, a * (fixed reads + sum_e y) + row_block_us * (fixed extra
    blocks + sum_e (k - y)) + b * (fixed tokens + sum_e x) <= T; and sum_r y[e, r] >= 1 (implied, but it makes
    the LP relaxation count one read per expert, which is most of the cost at low batch). T starts from two
    proven floors (below), which the relaxation alone would not find.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    counts = np.asarray(counts, np.int64)
    E, R = counts.shape[0], ranks
    bits = mask_bits(masks, R)
    if np.any((counts > 0) & ~bits.any(axis=1)):
        raise MoeplaceError("an active expert has no replica")
    alloc = np.zeros((E, R), np.int64)
    single = (counts > 0) & (bits.sum(axis=1) == 1)
    alloc[np.flatnonzero(single), bits[single].argmax(axis=1)] = counts[single]
    blocks = row_block_us > 0 and block_m > 0
    fixed = allocation_cost(alloc, a, b, row_block_us, block_m)                       # [R]
    pairs = [(e, q) for e in np.flatnonzero((counts > 0) & ~single) for q in np.flatnonzero(bits[e])]
    if not pairs:
        value = float(fixed.max(initial=0.0))
        return ExactSplit(alloc, value, value, True)
    V = len(pairs)                       # x: 0..V-1, y: V..2V-1, T: 2V, k (row blocks): 2V+1..3V
    nvar = 3 * V + 1 if blocks else 2 * V + 1
    rows, cols, vals, lo, hi = [], [], [], [], []
    experts = sorted({e for e, _ in pairs})
    for row, e in enumerate(experts):                     # sum_r x[e, r] = counts[e]
        for j, (ej, _) in enumerate(pairs):
            if ej == e:
                rows.append(row), cols.append(j), vals.append(1.0)
        lo.append(counts[e]), hi.append(counts[e])
    base = len(experts)
    for j, (e, _) in enumerate(pairs):                    # x - counts[e] * y <= 0
        rows += [base + j, base + j]
        cols += [j, V + j]
        vals += [1.0, -float(counts[e])]
        lo.append(-np.inf), hi.append(0.0)
    base += V
    for row, e in enumerate(experts):                     # sum_r y[e, r] >= 1: tightens the relaxation
        for j, (ej, _) in enumerate(pairs):
            if ej == e:
                rows.append(base + row), cols.append(V + j), vals.append(1.0)
        lo.append(1.0), hi.append(np.inf)
    base += len(experts)
    if blocks:
        for j in range(V):                                # x - block_m * k <= 0 and y - k <= 0
            k = 2 * V + 1 + j
            rows += [base, base, base + 1, base + 1]
            cols += [j, k, V + j, k]
            vals += [1.0, -float(block_m), 1.0, -1.0]
            lo += [-np.inf, -np.inf]
            hi += [0.0, 0.0]
            base += 2
    for q in range(R):                                    # (a - rb) * y + rb * k + b * x - T <= -fixed[q]
        for j, (_, qj) in enumerate(pairs):
            if qj == q:
                rows += [base + q, base + q]
                cols += [V + j, j]
                vals += [a - row_block_us if blocks else a, b]
                if blocks:
                    rows.append(base + q), cols.append(2 * V + 1 + j), vals.append(row_block_us)
        rows.append(base + q), cols.append(2 * V), vals.append(-1.0)
        lo.append(-np.inf), hi.append(-fixed[q])
    A = coo_matrix((vals, (rows, cols)), shape=(base + R, nvar)).tocsr()
    # Two valid floors on T: the busiest rank holds at least the optimum of the distinct experts alone
    # (balanced dispatch's exact rule), each with a token; and the ranks share all reads and pairs.
    fewest = int(fast_rule(counts[None, :], masks, R, max_augment=None).distinct.max())
    floor = max((a + b) * fewest, (a * int((counts > 0).sum()) + b * int(counts.sum())) / R)
    lower = np.concatenate([np.zeros(2 * V), [floor], np.zeros(nvar - 2 * V - 1)])
    upper = np.concatenate([[counts[e] for e, _ in pairs], np.ones(V), [np.inf],
                            [-(-counts[e] // block_m) for e, _ in pairs] if blocks else []])
    integrality = np.concatenate([np.ones(2 * V), [0], np.ones(nvar - 2 * V - 1)])
    objective = np.zeros(nvar)
    objective[2 * V] = 1.0
    res = milp(objective, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(lower, upper), options={"time_limit": time_limit})
    if res.x is None:
        raise MoeplaceError(f"the MILP found no allocation within {time_limit:g} s ({res.message})")
    x = np.rint(res.x[:V]).astype(np.int64)
    for (e, r), v in zip(pairs, x):
        alloc[e, r] = v
    value = float(allocation_cost(alloc, a, b, row_block_us, block_m).max())
    bound = getattr(res, "mip_dual_bound", None)
    bound = value if bound is None or not np.isfinite(bound) else float(bound)
    return ExactSplit(alloc, value, min(bound, value), res.status == 0)


def allocation_cost(alloc: np.ndarray, a: float, b: float, row_block_us: float = 0.0,
                    block_m: int = 0) -> np.ndarray:
    """[..., R] ``a * distinct + row_block_us * extra_row_blocks + b * tokens`` per rank of ``alloc [..., E, R]``
    (no c)."""
    cost = a * (alloc > 0).sum(axis=-2) + b * alloc.sum(axis=-2)
    if row_block_us > 0 and block_m > 0:
        cost = cost + row_block_us * extra_row_blocks(np.swapaxes(alloc, -1, -2), block_m)
    return cost


# ----------------------------------------------------------------------------- a layer of a trace

PLACED_AS = {"cost": "balanced"}    # the cost rule's spare slots are placed as balanced dispatch's


def layer_dispatch(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, cost: CostModel) -> CostDispatch:
    """The fast rule on every step of ``steps`` at one layer (``phy2log [P]`` its map)."""
    return counts_dispatch(step_expert_counts(steps, layer), phy2log, ranks, cost)


def counts_dispatch(counts: np.ndarray, phy2log: np.ndarray, ranks: int, cost: CostModel) -> CostDispatch:
    """The fast rule on every step of one layer's ``counts [S, E]`` (``step_expert_counts``), ``phy2log [P]`` its map."""
    masks = replica_layout(phy2log, counts.shape[1], ranks).masks
    return cost_rule(counts, masks, ranks, rule_weights(cost))


def pair_slots(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(step [N], slot [N]) of every valid (token row, top-k) pair of the token-row steps under the rule:
    a split expert's pairs go to its ranks in increasing rank order, in token-row order."""
    layout = replica_layout(phy2log, steps.model.num_experts, ranks)
    chosen = layer_dispatch(steps, layer, phy2log, ranks, cost)
    step_of_row, _, ids = steps.layer(layer)
    valid = ids >= 0
    step = np.broadcast_to(step_of_row[:, None], ids.shape)[valid]
    expert = ids[valid].astype(np.int64)
    slot = layout.slots[expert, np.maximum(chosen.pick[step, expert], 0)]
    where = np.full(steps.model.num_experts, -1, np.int64)
    where[chosen.multi] = np.arange(chosen.multi.size)
    split = np.flatnonzero(where[expert] >= 0)
    if split.size:
        # the split pairs by (step, expert), row order kept; each group's ranks in increasing order, alloc
        # tokens each, are then the ranks of its pairs in that order (a group's alloc sums to its pairs)
        E = steps.model.num_experts
        key = step[split] * E + expert[split]
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        group = sorted_key[np.concatenate([[True], sorted_key[1:] != sorted_key[:-1]])]
        alloc = chosen.alloc[group // E, where[group % E]]                # [groups, R]
        rank = np.empty(split.size, np.int64)
        rank[order] = np.repeat(np.tile(np.arange(ranks), group.size), alloc.ravel())
        slot[split] = layout.slots[expert[split], rank]
    return step, slot
