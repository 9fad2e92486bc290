"""Balanced dispatch in Triton: the same fast rule as ``balanced_dispatch.cu``, for GPUs where the CUDA
kernel cannot be built, and for Triton's CPU interpreter (``TRITON_INTERPRET=1``: the CI checks the rule
there). Every pick follows ``moeplace.dispatch.balanced.fast_rule_step`` exactly, ties included.

Dimension letters: N token rows, K top-k, E logical experts, R ranks (<= 32).

One program holds the whole step in registers: per expert [E_PAD] (tokens, replica mask, chosen rank),
per rank [RANKS_PAD] (a packed key ``load << 20 | tok << 6 | rank`` whose order is the rule's tie
order), per entry [ENTRIES] (id and chosen rank). Triton has no warp ballots and no per-lane loops, so
where the CUDA kernel walks a list, this one takes a reduction per step: the next multi-replica expert
is the minimum of ``id * 2048 + tokens`` over the experts after the last one, and a BFS level ORs the
masks of each level rank's experts. That is several reductions per expert, which is why the CUDA
kernel is the default (BENCHMARKS.md#balanced-dispatch-kernel).

With ``COST`` the kernel runs the rule by cost (``moeplace.dispatch.by_cost.cost_rule_step``) after the balanced
rule: each round's candidate moves are one key per (expert, target) [E_PAD, RANKS_PAD] for the experts not
yet moved (their tokens are all on their pick), and per (row, target) [SPLIT, RANKS_PAD] for each source rank
for the moved ones, whose tokens per rank are rows of a [SPLIT, RANKS_PAD] table. A moved expert's valid
entries then take its ranks in increasing rank order, in entry order (a cumulative sum over the entries).
That program runs 16 warps (``COST_WARPS``), so each thread's share of those tensors stays small enough to
compile in seconds, and takes at most 1,023 experts (``balanced_dispatch.TRITON_COST_EXPERTS``).
"""

from __future__ import annotations

import triton
import triton.language as tl

RANKS_PAD = tl.constexpr(64)   # rank vectors; bin 63 (>= 32 ranks) collects what a histogram must ignore
BIG = tl.constexpr(1 << 62)
SPLIT = tl.constexpr(32)       # rule by cost: rows of the table of moved experts (moves per step at most)


@triton.jit
def _popcount(x):
    """Set bits of each value of ``x`` (int64, < 2^32)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def _lowest_bit(x):
    """Index of the lowest set bit of each value of ``x`` (int64, non-zero, < 2^32)."""
    return _popcount((x & -x) - 1)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def balanced_dispatch_kernel(ids_ptr, masks_ptr, slots_ptr, num_rows_ptr, out_ptr,
                             rows, k, experts, ranks, max_augment, read, pair, block, block_shift,
                             max_rounds, ENTRIES: tl.constexpr, E_PAD: tl.constexpr, HAS_NUM_ROWS: tl.constexpr,
                             COST: tl.constexpr, BLOCKS: tl.constexpr):
    RP: tl.constexpr = RANKS_PAD
    i = tl.arange(0, ENTRIES)
    e = tl.arange(0, E_PAD).to(tl.int64)
    r = tl.arange(0, RP).to(tl.int64)
    entries = rows * k
    valid_rows = rows
    if HAS_NUM_ROWS:
        valid_rows = tl.minimum(tl.maximum(tl.load(num_rows_ptr).to(tl.int32), 0), rows)
    rank_bits = (tl.full((), 1, tl.int64) << ranks) - 1
    in_rank = r < ranks
    bit = tl.full([RP], 1, tl.int64) << r

    ids = tl.load(ids_ptr + i, mask=i < entries, other=-1).to(tl.int64)
    known = (ids >= 0) & (ids < experts)
    m_entry = tl.load(masks_ptr + ids, mask=known, other=0).to(tl.int64) & rank_bits
    known = known & (m_entry != 0)
    valid = known & (i < valid_rows * k)
    multi_entry = (m_entry & (m_entry - 1)) != 0
    rank_entry = _lowest_bit(m_entry)   # replaced by the rule's pick for valid multi entries

    # 1. tokens per expert; one-replica experts go to their rank
    cnt = tl.histogram(tl.where(valid, ids, E_PAD - 1).to(tl.int32), E_PAD).to(tl.int64)  # E_PAD > E
    m = tl.load(masks_ptr + e, mask=e < experts, other=0).to(tl.int64) & rank_bits
    active = (cnt > 0) & (e < experts) & (m != 0)
    multi = active & ((m & (m - 1)) != 0)
    single = active & ((m & (m - 1)) == 0)
    load = tl.histogram(tl.where(single, _lowest_bit(m), RP - 1).to(tl.int32), RP).to(tl.int64)
    tok = tl.histogram(tl.where(valid & ~multi_entry, rank_entry, RP - 1).to(tl.int32), RP).to(tl.int64)
    state = tl.where(in_rank, (load << 20) + (tok << 6), 0) + r

    # 2. greedy over the active multi-replica experts in id order
    pick = tl.where(single, _lowest_bit(m), -1)
    order = tl.where(multi, e * 16384 + cnt, BIG)   # id, then its tokens (<= 8192)
    prev = tl.full((), -1, tl.int64)
    for _ in range(tl.sum(multi.to(tl.int32))):
        head = tl.min(tl.where(e > prev, order, BIG))
        ex = head // 16384
        c = head % 16384
        mx = tl.load(masks_ptr + ex).to(tl.int64) & rank_bits
        best = tl.min(tl.where(((mx >> r) & 1) != 0, state, BIG))
        chosen = best % RP
        state = tl.where(state == best, state + (1 << 20) + (c << 6), state)
        pick = tl.where(e == ex, chosen, pick)
        rank_entry = tl.where(valid & (ids == ex), chosen, rank_entry)
        prev = ex
    load = tl.where(in_rank, state >> 20, 0)
    tok = (state >> 6) & 16383

    # 3. augmenting paths (breadth first from the ranks of maximum load; see moeplace.dispatch.balanced)
    done = tl.full((), 0, tl.int32)
    searching = done < max_augment
    while searching:
        top = tl.max(tl.where(in_rank, load, -1))
        searching = tl.min(tl.where(in_rank, load, BIG)) <= top - 2
        if searching:
            roots = tl.sum(tl.where(in_rank & (load == top), bit, 0))
            low = tl.sum(tl.where(in_rank & (load <= top - 2), bit, 0))
            seen = roots
            level = roots
            parent = tl.full([RP], -1, tl.int64)
            target = tl.full((), -1, tl.int64)
            while (level != 0) & (target < 0):
                reached = tl.full((), 0, tl.int64)
                rest = level
                while rest != 0:   # level ranks in increasing order: the lowest parent wins
                    a = _lowest_bit(rest)
                    rest = rest & (rest - 1)
                    edges = tl.reduce(tl.where(multi & (pick == a), m, 0), 0, _or) & ~seen & ~reached
                    parent = tl.where(((edges >> r) & 1) != 0, a, parent)
                    reached = reached | edges
                seen = seen | reached
                hits = reached & low
                if hits != 0:
                    target = tl.min(tl.where(((hits >> r) & 1) != 0, (load << 6) + r, BIG)) % RP
                level = reached
            searching = target >= 0
            if searching:
                b = target
                while ((roots >> b) & 1) == 0:   # one expert along each edge, target back to a root
                    a = tl.sum(tl.where(r == b, parent, 0))
                    ex = tl.min(tl.where(multi & (pick == a) & (((m >> b) & 1) != 0), e, BIG))
                    c = tl.sum(tl.where(e == ex, cnt, 0))
                    pick = tl.where(e == ex, b, pick)
                    rank_entry = tl.where(valid & (ids == ex), b, rank_entry)
                    tok = tok - tl.where(r == a, c, 0) + tl.where(r == b, c, 0)
                    b = a
                load = load - tl.where(r == b, 1, 0) + tl.where(r == target, 1, 0)
                done += 1
                searching = done < max_augment

    if COST:   # 3b. the rule by cost's moves, then the entries of the moved experts
        rank_entry = _cost_moves(ids, valid, rank_entry, e, r, m, cnt, multi, pick, load, tok, in_rank, ranks,
                                 read, pair, block, block_shift, max_rounds, E_PAD, RP, BLOCKS)

    # 4. slots: valid rows by the rule, padding rows the lowest replica rank, unknown ids -1
    slot = tl.load(slots_ptr + ids * ranks + rank_entry, mask=known, other=-1)
    tl.store(out_ptr + i, slot.to(out_ptr.dtype.element_ty), mask=i < entries)


@triton.jit
def _key(value, kind, expert, src, target):
    """One candidate move as an int64 whose order is the rule's: value, kind (whole, levelling share, the tokens
    past the last full row block), expert, source, target."""
    return (value << 24) | (kind << 22) | (expert << 10) | (src << 5) | target


@triton.jit
def _extra_blocks(tokens, block_shift):
    """Row blocks beyond the first of an expert with ``tokens`` on one rank (blocks of 2**block_shift rows)."""
    return tl.where(tokens > 0, (tokens - 1) >> block_shift, 0)


@triton.jit
def _after(moved, top, here, there, dest, read, pair, block, block_shift, BLOCKS: tl.constexpr):
    """The higher cost of the two ranks after moving ``moved`` of ``here`` tokens onto ``there``; dest: the
    target's cost with the read it gains where it had none."""
    left = top - tl.where(moved == here, read, 0) - pair * moved
    arrived = dest + pair * moved
    if BLOCKS:
        left -= block * (_extra_blocks(here, block_shift) - _extra_blocks(here - moved, block_shift))
        arrived += block * (_extra_blocks(there + moved, block_shift) - _extra_blocks(there, block_shift))
    return tl.maximum(left, arrived)


@triton.jit
def _best_move(top, here, there, dest, read, pair, block, block_shift, BLOCKS: tl.constexpr):
    """(value, kind) of the best move of ``here`` tokens onto a rank with ``there``: whole, the levelling share
    (where pairs cost), or the tokens past the last full row block (with BLOCKS); ties to the lower kind."""
    value = _after(here, top, here, there, dest, read, pair, block, block_shift, BLOCKS)
    kind = tl.zeros_like(value)
    share = tl.minimum(tl.maximum((top - dest) // 2, 1), here - 1)
    level = tl.where((pair > 0) & (here >= 2),
                     _after(share, top, here, there, dest, read, pair, block, block_shift, BLOCKS), BIG)
    kind = tl.where(level < value, 1, kind)
    value = tl.minimum(level, value)
    if BLOCKS:
        past = here - (((here - 1) >> block_shift) << block_shift)
        shed = tl.where(here > (1 << block_shift),
                        _after(past, top, here, there, dest, read, pair, block, block_shift, BLOCKS), BIG)
        kind = tl.where(shed < value, 2, kind)
        value = tl.minimum(shed, value)
    return value, kind


@triton.jit
def _cost_moves(ids, valid, rank_entry, e, r, m, cnt, multi, pick, load, tok, in_rank, ranks, read, pair, block,
                block_shift, max_rounds, E_PAD: tl.constexpr, RP: tl.constexpr, BLOCKS: tl.constexpr):
    """Step 3 of ``cost_rule_step`` after the balanced rule; returns each entry's rank (see the module docstring).
    A rank costs read * load + pair * tok + block * blocks (row blocks of 2**block_shift rows beyond each expert's
    first; BLOCKS: block > 0, a compile-time choice, so the rule without the term compiles as small as before)."""
    jj = tl.arange(0, SPLIT).to(tl.int64)
    split_alloc = tl.zeros([SPLIT, RP], tl.int64)   # tokens of moved expert j on rank r
    split_e = tl.full([SPLIT], -1, tl.int64)
    split_m = tl.zeros([SPLIT], tl.int64)
    row_of = tl.full([E_PAD], -1, tl.int64)           # the table row of a moved expert
    used = tl.full((), 0, tl.int64)
    pairs = tl.sum(tl.where(in_rank, tok, 0))
    # an unmoved expert keeps its count: its row blocks, and its tokens past the last full block
    here_blk = _extra_blocks(cnt, block_shift)
    past = cnt - (((cnt - 1) >> block_shift) << block_shift)
    can_shed = (cnt > (1 << block_shift))[:, None]
    blocks = tl.zeros_like(tok)                                                          # [RP]
    if BLOCKS:
        blocks = tl.sum(tl.where(pick[:, None] == r[None, :], here_blk[:, None], 0), axis=0)
    rounds = tl.full((), 0, tl.int32)
    going = ((pair * pairs >= read) | (tl.sum(blocks) > 0)) & (rounds < max_rounds)
    target_bit = ((m[:, None] >> r[None, :]) & 1) != 0          # [E_PAD, RP]
    while going:
        cost = tl.where(in_rank, read * load + pair * tok + block * blocks, -1)
        top = tl.max(cost)
        # experts not moved yet: all of their tokens on their pick
        at_pick = r[None, :] == pick[:, None]
        cost_src = tl.sum(tl.where(at_pick, cost[None, :], 0), axis=1)
        # (_best_move with none of the expert's tokens on the target, the 1-D terms computed once)
        dest = cost[None, :] + read                                                    # [1, RP]
        whole_cost = pair * cnt                                                        # [E_PAD]: what moves with it
        if BLOCKS:
            whole_cost += block * here_blk
        value = tl.maximum((top - read - whole_cost)[:, None], dest + whole_cost[:, None])
        kind = tl.zeros_like(value)
        share = tl.minimum(tl.maximum((top - dest) // 2, 1), cnt[:, None] - 1)             # [E_PAD, RP]
        left = top - pair * share
        arrived = dest + pair * share
        if BLOCKS:
            left -= block * (here_blk[:, None] - _extra_blocks(cnt[:, None] - share, block_shift))
            arrived += block * _extra_blocks(share, block_shift)
        level = tl.where((pair > 0) & (cnt >= 2)[:, None], tl.maximum(left, arrived), BIG)
        kind = tl.where(level < value, 1, kind)
        value = tl.minimum(level, value)
        if BLOCKS:   # the source sheds one block, the target gains none (past <= a block's rows)
            shed = tl.where(can_shed, tl.maximum((top - pair * past)[:, None] - block, dest + (pair * past)[:, None]),
                            BIG)
            kind = tl.where(shed < value, 2, kind)
            value = tl.minimum(shed, value)
        key = _key(value, kind, e[:, None], pick[:, None], r[None, :])
        allowed = (multi & (row_of < 0) & (cost_src == top))[:, None] & target_bit & ~at_pick
        best = tl.min(tl.min(tl.where(allowed, key, BIG), axis=1))
        # experts moved before: their tokens per rank in the table, every source rank at the maximum
        row_bit = ((split_m[:, None] >> r[None, :]) & 1) != 0      # [SPLIT, RP]
        for src in range(0, ranks):
            a_src = tl.sum(tl.where(r[None, :] == src, split_alloc, 0), axis=1)[:, None]   # [SPLIT, 1]
            cost_s = tl.sum(tl.where(r == src, cost, 0))
            dest_s = cost[None, :] + tl.where(split_alloc == 0, read, 0)
            value_s, kind_s = _best_move(top, a_src, split_alloc, dest_s, read, pair, block, block_shift, BLOCKS)
            key_s = _key(value_s, kind_s, split_e[:, None], src, r[None, :])
            allowed_s = (jj < used)[:, None] & (a_src > 0) & (cost_s == top) & row_bit & (r[None, :] != src)
            best = tl.minimum(best, tl.min(tl.min(tl.where(allowed_s, key_s, BIG), axis=1)))
        going = (best < BIG) & ((best >> 24) < top)
        if going:
            chosen_kind = (best >> 22) & 3
            ex = (best >> 10) & 4095
            source = (best >> 5) & 31
            tgt = best & 31
            row = tl.sum(tl.where(e == ex, row_of, 0))
            new = row < 0
            row = tl.where(new, used, row)
            home = tl.sum(tl.where(e == ex, pick, 0))
            c = tl.sum(tl.where(e == ex, cnt, 0))
            mx = tl.sum(tl.where(e == ex, m, 0))
            in_row = (jj == row)[:, None]
            split_alloc = tl.where(new & in_row & (r[None, :] == home), c, split_alloc)
            split_e = tl.where(new & (jj == row), ex, split_e)
            split_m = tl.where(new & (jj == row), mx, split_m)
            row_of = tl.where(new & (e == ex), row, row_of)
            used += new.to(tl.int64)
            alloc = tl.sum(tl.where(in_row, split_alloc, 0), axis=0)   # [RP]
            had_src = tl.sum(tl.where(r == source, alloc, 0))
            had_tgt = tl.sum(tl.where(r == tgt, alloc, 0))
            dest_t = tl.sum(tl.where(r == tgt, cost, 0)) + tl.where(had_tgt == 0, read, 0)
            share_t = tl.minimum(tl.maximum((top - dest_t) // 2, 1), had_src - 1)
            past_t = had_src - (((had_src - 1) >> block_shift) << block_shift)
            moved = tl.where(chosen_kind == 1, share_t, tl.where(chosen_kind == 2, past_t, had_src))
            split_alloc = (split_alloc - tl.where(in_row & (r[None, :] == source), moved, 0)
                           + tl.where(in_row & (r[None, :] == tgt), moved, 0))
            tok = tok - tl.where(r == source, moved, 0) + tl.where(r == tgt, moved, 0)
            load = (load - tl.where((r == source) & (had_src == moved), 1, 0)
                    + tl.where((r == tgt) & (had_tgt == 0), 1, 0))
            if BLOCKS:
                blocks = (blocks
                          + tl.where(r == source, _extra_blocks(had_src - moved, block_shift)
                                     - _extra_blocks(had_src, block_shift), 0)
                          + tl.where(r == tgt, _extra_blocks(had_tgt + moved, block_shift)
                                     - _extra_blocks(had_tgt, block_shift), 0))
            rounds += 1
            going = rounds < max_rounds
    for j in range(0, used):   # a moved expert's valid entries: its ranks in increasing order, entry order
        ex = tl.sum(tl.where(jj == j, split_e, 0))
        match = valid & (ids == ex)
        position = tl.cumsum(match.to(tl.int32), 0) - 1
        ends = tl.cumsum(tl.sum(tl.where((jj == j)[:, None], split_alloc, 0), axis=0), 0)   # [RP]
        rank = tl.zeros_like(rank_entry)
        for rr in range(0, ranks - 1):
            rank += (position >= tl.sum(tl.where(r == rr, ends, 0))).to(rank.dtype)
        rank_entry = tl.where(match, rank, rank_entry)
    return rank_entry


MIN_ENTRIES = 32   # entries are padded to a power of two >= this: few compiled variants
# The rule by cost's [E_PAD, RANKS_PAD] tensors over 16 warps: 64 values a thread at 512 experts. In one warp
# they were 1,024, which ptxas took over 8 minutes (and 10 GB) to allocate registers for; 16 warps: 12 s.
COST_WARPS = 16


def launch(topk_ids, masks, slots, num_rows, out, max_augment: int, weights=None, max_rounds: int = 0) -> None:
    """Run the kernel on checked inputs (see ``balanced_dispatch.balanced_dispatch``); with ``weights``
    (``moeplace.dispatch.by_cost.RuleWeights``), the rule by cost (``balanced_dispatch.cost_dispatch``)."""
    rows, k = topk_ids.shape
    experts, ranks = slots.shape
    e_pad = triton.next_power_of_2(experts + 1)   # one bin past the experts for ignored entries
    w = ((weights.read, weights.pair, weights.block, max(weights.block_m, 1).bit_length() - 1) if weights is not None
         else (1, 0, 0, 0))   # block_m: a power of two (balanced_dispatch.check_weights), passed as its shift
    balanced_dispatch_kernel[(1,)](
        topk_ids, masks, slots, num_rows if num_rows is not None else masks, out,
        rows, k, experts, ranks, max_augment, *w, max_rounds,
        ENTRIES=max(MIN_ENTRIES, triton.next_power_of_2(rows * k)), E_PAD=e_pad,
        HAS_NUM_ROWS=num_rows is not None, COST=weights is not None, BLOCKS=weights is not None and weights.block > 0,
        num_warps=COST_WARPS if weights is not None else 1 if e_pad <= 1024 else 4)
