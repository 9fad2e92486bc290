"""Split-KV MLA tree-verify attention (Triton), flash-decoding style.

Dimension letters:
    B   requests in the batch
    D   draft tokens of one request (the verify tree), D_max the largest
    T   all draft tokens of the batch, sum(D)
    H   query heads on this rank
    N   committed prefix tokens of one request (its KV length)
    S   KV splits of one request (programs that share its prefix)
    R   rows of one request's tile, D_max * H (row r = draft token r // H, head r % H)
    C   576 = 512 latent (also V) + 64 rope values per KV token

Two launches:
  1. ``_verify_split_kernel``, grid (tiles, S_max, B): each program takes one row tile of a
     request against one contiguous chunk of its prefix (so each KV tile goes through the
     tensor cores as an [M, C] x [C, BLOCK_N] product) and writes a normalised partial output
     plus its log2-sum-exp. Split 0 also attends to the draft tokens themselves under the
     tree mask. A row block is a 64-row main tile plus an optional small tail tile (72 rows =
     64 + 16); the tail runs as its own program next to the main one, which reads the same
     chunk, mostly from L2 (fusing it as a transposed tile spilled and was slower; launching it
     apart was slower still: docs/verify-kernel-log.md#triton-and-composed-trials).
  2. ``_verify_merge_kernel``, grid (B * D_max, H, 512 / BLOCK_DV): log-sum-exp merge of the
     partials into the output.

Nothing here reads a tensor on the host: the split count of each request is derived on the
device from ``kv_indptr``, so a CUDA graph captured once replays correctly for new lengths.
"""

import triton
import triton.language as tl

# Mask layouts (constexpr MASK_MODE).
MASK_CAUSAL = 0  # no mask tensor: draft token i sees draft tokens 0..i (a chain)
MASK_QLEN_ONLY = 1  # D x D per request, row-major, row stride D
MASK_FULL = 2  # SGLang FULL_MASK: D x (N + D) per request; prefix columns are ignored

LOG2E = 1.4426950408889634


@triton.jit
def _split_plan(kv_indptr, batch, B, MAX_SPLITS, TARGET_PROGRAMS, MIN_CHUNK: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """(kv_start, N, chunk, S) of one request; shared by both launches so they agree.

    The chunk is sized from the batch's total prefix so that the whole batch yields at most
    TARGET_PROGRAMS splits (long requests get more than short ones; each request rounds up by
    less than one chunk, hence the B held back), then capped by the grid's MAX_SPLITS: one
    wave of programs, never a nearly empty second one. Floor at MIN_CHUNK tokens: tiny splits
    cost more in partial writes than they save.
    """
    kv_start = tl.load(kv_indptr + batch)
    seq_len = tl.load(kv_indptr + batch + 1) - kv_start
    total = tl.load(kv_indptr + B) - tl.load(kv_indptr)
    chunk = tl.maximum(tl.cdiv(total, tl.maximum(TARGET_PROGRAMS - B, 1)), MIN_CHUNK)
    chunk = tl.maximum(chunk, tl.cdiv(seq_len, MAX_SPLITS))
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    n_splits = tl.maximum(tl.cdiv(seq_len, chunk), 1)
    return kv_start, seq_len, chunk, n_splits


@triton.jit
def _scores(qn, qp, kn, kp, UPCAST: tl.constexpr):
    """[M, N] QK scores of a row tile (qn [M, 512], qp [M, 64]) against a KV tile (kn [N, 512], kp [N, 64]).
    UPCAST runs the products in fp32: Triton's CPU interpreter multiplies bf16 wrongly."""
    if UPCAST:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
        kn = kn.to(tl.float32)
        kp = kp.to(tl.float32)
    s = tl.dot(qn, tl.trans(kn))
    return tl.dot(qp, tl.trans(kp), s)


@triton.jit
def _online_update(qn, qp, kn, kp, vn, keep, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """One online-softmax step of a row tile against a KV tile.

    qn [M, 512] qp [M, 64] kn [N, 512] kp [N, 64] vn [N, 512] keep [M, N] bool.
    Returns the updated (m_i [M], l_i [M], acc [M, 512]); scores are in the log2 domain.
    UPCAST: the products in fp32 (``_scores``).
    """
    s = _scores(qn, qp, kn, kp, UPCAST)
    if UPCAST:
        vn = vn.to(tl.float32)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vn.dtype), vn, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _kv_step(KV, slot, valid, stride_kvs, col0, qn, qp, m_i, l_i, acc, qk_scale,
             DN: tl.constexpr, DP: tl.constexpr, DVB: tl.constexpr, SEPARATE_V: tl.constexpr,
             UPCAST: tl.constexpr):
    """Gather the KV rows of ``slot`` [N] (``valid`` [N]) and fold them into the row tile."""
    row_ptr = KV + slot.to(tl.int64) * stride_kvs
    kn = tl.load(row_ptr[:, None] + tl.arange(0, DN)[None, :], mask=valid[:, None], other=0.0)
    kp = tl.load(row_ptr[:, None] + DN + tl.arange(0, DP)[None, :], mask=valid[:, None],
                 other=0.0)
    if SEPARATE_V:
        vn = tl.load(row_ptr[:, None] + col0 + tl.arange(0, DVB)[None, :], mask=valid[:, None],
                     other=0.0)
    else:
        vn = kn
    return _online_update(qn, qp, kn, kp, vn, valid[None, :], m_i, l_i, acc, qk_scale, UPCAST)


@triton.jit
def _load_rows(Q, q_row0, rows, H, n_rows, stride_qt, stride_qh, DN: tl.constexpr,
               DP: tl.constexpr):
    """Query tile of one request: rows [M] -> (q_nope [M, DN], q_rope [M, DP])."""
    tok = rows // H
    head = rows % H
    ok = rows < n_rows
    base = Q + (q_row0 + tok).to(tl.int64) * stride_qt + head * stride_qh
    qn = tl.load(base[:, None] + tl.arange(0, DN)[None, :], mask=ok[:, None], other=0.0)
    qp = tl.load(base[:, None] + DN + tl.arange(0, DP)[None, :], mask=ok[:, None], other=0.0)
    return qn, qp


@triton.jit
def _store_partial(O_part, L_part, part_row0, rows, m_i, l_i, acc, R_PAD, col0,
                   DN: tl.constexpr, DVB: tl.constexpr):
    """Write a normalised partial [M, DVB] (bf16, columns col0..) and its log2-sum-exp [M]."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(l_i > 0, m_i + tl.math.log2(safe_l), float("-inf"))
    ok = rows < R_PAD
    prow = part_row0 + rows.to(tl.int64)
    tl.store(O_part + prow[:, None] * DN + col0 + tl.arange(0, DVB)[None, :],
             out.to(O_part.dtype.element_ty), mask=ok[:, None])
    tl.store(L_part + prow, lse, mask=ok)


@triton.jit
def _tree_keep(Mask, mask_indptr, batch, rows, offs_j, H, D, seq_len, D_MAX: tl.constexpr,
               MASK_MODE: tl.constexpr, HAS_MASK_INDPTR: tl.constexpr):
    """[M, N] bool: may draft row (rows // H) see draft token offs_j?"""
    tok = rows // H
    inside = (tok[:, None] < D) & (offs_j[None, :] < D)
    if MASK_MODE == 0:
        keep = inside & (offs_j[None, :] <= tok[:, None])
    else:
        if MASK_MODE == 1:
            if HAS_MASK_INDPTR:
                base = tl.load(mask_indptr + batch).to(tl.int64)
            else:
                base = batch.to(tl.int64) * D_MAX * D_MAX
            idx = base + tok[:, None] * D + offs_j[None, :]
        else:
            base = tl.load(mask_indptr + batch).to(tl.int64)
            idx = base + tok[:, None].to(tl.int64) * (seq_len + D) + seq_len + offs_j[None, :]
        bits = tl.load(Mask + idx, mask=inside, other=0)
        keep = inside & (bits != 0)
    return keep


@triton.jit
def _attend(Q, K_ext, V_ext, KV, kv_indices, Mask, mask_indptr, O_part, L_part,
            batch, split, kv_start, seq_len, chunk, q_row0, D, H, rows, col0, part_row0, R_PAD,
            qk_scale, stride_qt, stride_qh, stride_kvs, stride_ket, stride_vet,
            M: tl.constexpr, D_MAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            MASK_MODE: tl.constexpr, HAS_MASK_INDPTR: tl.constexpr, DN: tl.constexpr,
            DP: tl.constexpr, DVB: tl.constexpr, SEPARATE_V: tl.constexpr,
            UPCAST: tl.constexpr, IDX_PREFETCH: tl.constexpr):
    """One row tile (M rows) against one split's chunk (+ the drafts in split 0); stores it."""
    n_rows = D * H
    qn, qp = _load_rows(Q, q_row0, rows, H, n_rows, stride_qt, stride_qh, DN, DP)
    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DVB], tl.float32)
    offs_dn = tl.arange(0, DN)
    offs_dp = tl.arange(0, DP)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    if IDX_PREFETCH:
        # The slot ids of step n + 1 are loaded during step n and carried in a loop variable,
        # so a KV gather's address never waits on a load of the same iteration (that wait is
        # the loop's main stall). The default wherever there is no tail tile: with one, the
        # tail's registers make it slower (docs/verify-kernel-log.md#triton-and-composed-trials).
        offs_b = tl.arange(0, BLOCK_N)
        slot = tl.load(kv_indices + kv_start + lo + offs_b, mask=lo + offs_b < hi, other=0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_b
            nxt = offs_n + BLOCK_N
            slot_next = tl.load(kv_indices + kv_start + nxt, mask=nxt < hi, other=0)
            m_i, l_i, acc = _kv_step(KV, slot, offs_n < hi, stride_kvs, col0, qn, qp, m_i, l_i,
                                     acc, qk_scale, DN, DP, DVB, SEPARATE_V, UPCAST)
            slot = slot_next
    else:
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            slot = tl.load(kv_indices + kv_start + offs_n, mask=valid, other=0)
            m_i, l_i, acc = _kv_step(KV, slot, valid, stride_kvs, col0, qn, qp, m_i, l_i, acc,
                                     qk_scale, DN, DP, DVB, SEPARATE_V, UPCAST)
    if split == 0:
        offs_j = tl.arange(0, BLOCK_D)
        ext = K_ext + (q_row0 + offs_j).to(tl.int64) * stride_ket
        jm = offs_j < D
        kn = tl.load(ext[:, None] + offs_dn[None, :], mask=jm[:, None], other=0.0)
        kp = tl.load(ext[:, None] + DN + offs_dp[None, :], mask=jm[:, None], other=0.0)
        vext = V_ext + (q_row0 + offs_j).to(tl.int64) * stride_vet
        vn = tl.load(vext[:, None] + col0 + tl.arange(0, DVB)[None, :], mask=jm[:, None],
                     other=0.0)
        keep = _tree_keep(Mask, mask_indptr, batch, rows, offs_j, H, D, seq_len, D_MAX,
                          MASK_MODE, HAS_MASK_INDPTR)
        m_i, l_i, acc = _online_update(qn, qp, kn, kp, vn, keep, m_i, l_i, acc, qk_scale, UPCAST)
    _store_partial(O_part, L_part, part_row0, rows, m_i, l_i, acc, R_PAD, col0, DN, DVB)


@triton.jit
def _verify_split_kernel(
    Q, K_ext, V_ext, KV, kv_indptr, kv_indices, qo_indptr, Mask, mask_indptr,
    O_part, L_part,
    B, H, MAX_SPLITS, TARGET_PROGRAMS, R_PAD, qk_scale,
    stride_qt, stride_qh, stride_kvs, stride_ket, stride_vet,
    D_MAX: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, MIN_CHUNK: tl.constexpr, MASK_MODE: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr, DN: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr,
    DV_SPLIT: tl.constexpr, TAIL_BLOCK_N: tl.constexpr,
    IDX_PREFETCH: tl.constexpr = False,
):
    """Partial attention of one (split, request, row block).

    Q [T, H, C]; K_ext [T, 1, C]; V_ext [T, 1, DN]; KV [slots, 1, C] (V = KV[..., :DN]);
    O_part [B * MAX_SPLITS, R_PAD, DN] bf16; L_part [B * MAX_SPLITS, R_PAD] fp32.
    A row block holds BLOCK_M + TAIL_M rows: the tail is a second, small tile (for example
    the 9th draft token's 8 heads), so 72 rows cost 80 rows of tensor-core work rather than
    128. It runs in its own program (grid axis 0 = row block x part x V slice), stepping
    TAIL_BLOCK_N KV tokens at a time. DV_SPLIT > 1 gives each program a slice of the 512
    output columns: fewer accumulator registers, the QK product repeated.
    """
    split = tl.program_id(1)
    batch = tl.program_id(2)
    DVB: tl.constexpr = DN // DV_SPLIT
    col0 = (tl.program_id(0) % DV_SPLIT) * DVB
    PARTS: tl.constexpr = 2 if TAIL_M > 0 else 1
    tile = tl.program_id(0) // DV_SPLIT
    rblock = tile // PARTS
    part = tile % PARTS
    kv_start, seq_len, chunk, n_splits = _split_plan(
        kv_indptr, batch, B, MAX_SPLITS, TARGET_PROGRAMS, MIN_CHUNK, BLOCK_N)
    if split >= n_splits:
        return
    q_row0 = tl.load(qo_indptr + batch)
    D = tl.load(qo_indptr + batch + 1) - q_row0
    n_rows = D * H
    row0 = rblock * (BLOCK_M + TAIL_M)
    if row0 >= n_rows:
        return
    part_row0 = (batch * MAX_SPLITS + split).to(tl.int64) * R_PAD
    if part == 0:
        _attend(Q, K_ext, V_ext, KV, kv_indices, Mask, mask_indptr, O_part, L_part,
                batch, split, kv_start, seq_len, chunk, q_row0, D, H,
                row0 + tl.arange(0, BLOCK_M), col0, part_row0, R_PAD, qk_scale,
                stride_qt, stride_qh, stride_kvs, stride_ket, stride_vet, BLOCK_M, D_MAX,
                BLOCK_N, BLOCK_D, MASK_MODE, HAS_MASK_INDPTR, DN, DP, DVB, DV_SPLIT > 1,
                UPCAST, IDX_PREFETCH)
    if TAIL_M > 0:
        if (part == 1) & (row0 + BLOCK_M < n_rows):
            _attend(Q, K_ext, V_ext, KV, kv_indices, Mask, mask_indptr, O_part, L_part,
                    batch, split, kv_start, seq_len, chunk, q_row0, D, H,
                    row0 + BLOCK_M + tl.arange(0, TAIL_M), col0, part_row0, R_PAD,
                    qk_scale, stride_qt, stride_qh, stride_kvs, stride_ket, stride_vet,
                    TAIL_M, D_MAX, TAIL_BLOCK_N, BLOCK_D, MASK_MODE, HAS_MASK_INDPTR, DN, DP,
                    DVB, DV_SPLIT > 1, UPCAST, IDX_PREFETCH)


@triton.jit
def _verify_merge_kernel(
    O_part, L_part, kv_indptr, qo_indptr, Out, Lse,
    B, H, MAX_SPLITS, TARGET_PROGRAMS, R_PAD, stride_ot, stride_oh, stride_lt,
    D_MAX: tl.constexpr, SPLITS_P2: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    HAS_LSE: tl.constexpr, DN: tl.constexpr,
):
    """Out[t, h, dv block] = sum_s w_s * O_part[s] with w_s = softmax_s(L_part[s]).

    Out [T, H, DN]; Lse [T, H] (natural log, as SGLang's ``lse_extend``).
    """
    pid_bt = tl.program_id(0)
    head = tl.program_id(1)
    dv0 = tl.program_id(2) * BLOCK_DV
    batch = pid_bt // D_MAX
    tok = pid_bt % D_MAX
    q_row0 = tl.load(qo_indptr + batch)
    D = tl.load(qo_indptr + batch + 1) - q_row0
    if tok >= D:
        return
    _, _, _, n_splits = _split_plan(kv_indptr, batch, B, MAX_SPLITS, TARGET_PROGRAMS,
                                    MIN_CHUNK, BLOCK_N)
    row = tok * H + head
    part0 = (batch * MAX_SPLITS).to(tl.int64) * R_PAD + row
    offs_s = tl.arange(0, SPLITS_P2)
    lse = tl.load(L_part + part0 + offs_s.to(tl.int64) * R_PAD, mask=offs_s < n_splits,
                  other=float("-inf"))
    lmax = tl.max(lse, 0)
    lmax = tl.where(lmax == float("-inf"), 0.0, lmax)
    denom = tl.sum(tl.math.exp2(lse - lmax), 0)

    offs_dv = dv0 + tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, n_splits, SPLIT_CHUNK):
        offs_c = s0 + tl.arange(0, SPLIT_CHUNK)
        cm = offs_c < n_splits
        prow = part0 + offs_c.to(tl.int64) * R_PAD
        w = tl.math.exp2(tl.load(L_part + prow, mask=cm, other=float("-inf")) - lmax)
        o = tl.load(O_part + prow[:, None] * DN + offs_dv[None, :], mask=cm[:, None], other=0.0)
        acc += tl.sum(o.to(tl.float32) * w[:, None], 0)
    safe = tl.where(denom > 0, denom, 1.0)
    t = (q_row0 + tok).to(tl.int64)
    tl.store(Out + t * stride_ot + head * stride_oh + offs_dv,
             (acc / safe).to(Out.dtype.element_ty))
    if HAS_LSE:
        if tl.program_id(2) == 0:
            nat = tl.where(denom > 0, (lmax + tl.math.log2(safe)) / 1.4426950408889634,
                           float("-inf"))
            tl.store(Lse + t * stride_lt + head, nat)
