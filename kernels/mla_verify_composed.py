"""Composed MLA tree verify: the prefix on FlashMLA, the tree and the merge in one Triton kernel.

Letters as in ``mla_verify.py`` (B requests, D draft tokens of a request, D_max the largest, T =
sum(D), H heads, N prefix tokens of a request, DN = 512 latent values, DP = 64 rope values).

Every draft row of a request sees the whole committed prefix, so the prefix part is plain
non-causal decode attention over the request's KV: FlashMLA's SM90 dense decode
(``sgl_flash_mla``'s ``flash_mla_with_kvcache(..., causal=False, use_legacy=True)``) computes it
with its (out, lse) for D_max x H query rows per request. What FlashMLA cannot do is the tree:
the draft tokens attend to each other under a mask. ``_tree_merge_kernel`` does that part (at most
16 x 16 per request and head) and merges it with FlashMLA's result by log-sum-exp, in one launch:

    per row:  lse_p, o_p   from FlashMLA (natural log; o_p normalised)
              s_j = q . k_ext_j * scale (tree-visible j), m_t = max s_j, l_t = sum exp(s_j - m_t)
              out = (e^(lse_p - M) o_p + e^(m_t - M) sum_j e^(s_j - m_t) v_j) / (e^(lse_p - M) + e^(m_t - M) l_t)

Facts about FlashMLA 1.0.0 this relies on (read from the wheel's ``flash_mla_interface.py`` and
FlashMLA's ``csrc/api/dense_decode.h`` / ``csrc/smxx/decode/combine/combine.cu``):
  * q [B, s_q, H, 576] bf16; k_cache [pages, 64, 1, 576]; block_table [B, >= pages] int32;
    cache_seqlens [B] int32; the page size must be 64.
  * out [B, s_q, H, 512] bf16; lse [B, H, s_q] fp32 in the natural log, a strided view whose
    memory is laid out [B, s_q, H] (strides read at run time, never assumed).
  * A request with no prefix gets lse = +inf and out = 0 (the sum of weights is 0): the merge
    reads N from kv_indptr and ignores FlashMLA's row then. Out-of-range V of a partial last page
    is zero-filled by FlashMLA, so NaN in unused pool slots does not leak.
  * The tile-scheduler metadata depends on the batch's lengths; ``get_mla_decoding_metadata``
    builds it on the device (no host sync), once per batch in :meth:`ComposedVerify.plan`.

The pool must be laid out in 64-token pages (SGLang ``--page-size 64``, or any multiple of 64):
a request's token t then sits in slot page(t) * 64 + t % 64, so the block table is
``kv_indices[kv_indptr[b] + 64 p] // 64``, derived on the device by ``_block_table_kernel``.
Per batch: the block-table kernel and FlashMLA's metadata kernel. Per layer: FlashMLA's decode
(its split kernel and its combine kernel) and ``_tree_merge_kernel``; ragged draft counts add a
query gather (``_pad_queries_kernel``), since FlashMLA wants the same s_q for every request.

A batch of one request (and, with ``MergeConfig.batch_chunks``, of fewer requests than FlashMLA
has SM parts, C) instead gives FlashMLA its prefixes as at most C chunk requests
(``_chunk_plan_kernel`` per batch: S the fewest pages per chunk that fit the batch in C; each
request's runs of S pages first, the short tails last), so that FlashMLA's scheduler gives each
full chunk one SM part, splits few and its combine mostly returns at once; ``_tree_merge_kernel``
merges each request's chunks (out, lse) with the tree part, CB chunks per unrolled step (each step
still ends in a reduction over its chunks, so the steps' loads are not all in flight at once), where
FlashMLA's combine would walk a request's splits one dependent load after another (66 for one
request). The chunk requests' queries: one request's expanded with stride 0; a batch's gathered
per layer by ``_chunk_queries_kernel`` (FlashMLA reads q with one batch stride).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeplace_kernels.mla_verify import LOG2E, _scores, _tree_keep

log = logging.getLogger(__name__)

PAGE = 64  # FlashMLA's page size (fixed in its dense decode)
MAX_TREE = 16  # drafts per request the tree kernel's tile holds
KV_DIM, V_DIM = 576, 512


@triton.jit
def _block_table_kernel(kv_indptr, kv_indices, Table, Seqlens, stride_table,
                        PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, NPROG: tl.constexpr):
    """Table[b, p] = kv_indices[kv_indptr[b] + PAGE_SIZE p] // PAGE_SIZE; Seqlens[b] = N.

    Grid (B, NPROG); each program strides over the request's pages. A request with no prefix
    gets page 0 in its first entry: FlashMLA's scheduler gives every request at least one block.
    """
    b = tl.program_id(0)
    start = tl.load(kv_indptr + b)
    n = tl.load(kv_indptr + b + 1) - start
    if tl.program_id(1) == 0:
        tl.store(Seqlens + b, n.to(tl.int32))
    n_pages = tl.maximum(tl.cdiv(n, PAGE_SIZE), 1)
    for p0 in range(tl.program_id(1) * BLOCK, n_pages, NPROG * BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        inside = offs < n_pages
        tok = offs.to(tl.int64) * PAGE_SIZE
        slot = tl.load(kv_indices + start + tok, mask=inside & (tok < n), other=0)
        tl.store(Table + b * stride_table + offs, (slot // PAGE_SIZE).to(tl.int32), mask=inside)


@triton.jit
def _chunk_plan_kernel(kv_indptr, kv_indices, Table, Seqlens, ChunkStart, ChunkTail, Owner,
                       stride_table, B, CHUNKS: tl.constexpr, B_P2: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """The batch's prefixes as at most CHUNKS FlashMLA chunk requests of S pages (or fewer).

    Grid (CHUNKS,). S = the fewest pages such that sum_b cdiv(pages_b, S) <= CHUNKS (a binary
    search, repeated in every program: B is small). Request b's first pages_b // S runs of S
    pages are full chunks, ChunkStart[b] .. ChunkStart[b + 1], every request's in order; the
    rest of its pages (if any) is its tail chunk, ChunkTail[b] (-1: none), after all full ones.
    FlashMLA's scheduler then gives each full chunk one SM part (S + its per-request overhead
    fills a part's share), and only the short tails, at the end, share parts (a tail amid full
    chunks would leave room that a part fills with the start of the next chunk, splitting every
    chunk after it). Chunk c: Table[c] its page ids, Seqlens[c] its tokens, Owner[c] its
    request; past the batch's chunks Seqlens 0, Table[c, 0] page 0 (FlashMLA reads a first
    block of every request) and Owner the last request (its queries are gathered there too).
    """
    c = tl.program_id(0)
    offs_b = tl.arange(0, B_P2)
    inb = offs_b < B
    first_tok = tl.load(kv_indptr + offs_b, mask=inb, other=0)
    n_b = tl.load(kv_indptr + offs_b + 1, mask=inb, other=0) - first_tok
    pages = tl.where(inb, tl.cdiv(n_b, PAGE_SIZE), 0)
    lo = tl.maximum(tl.cdiv(tl.sum(pages, 0), CHUNKS), 1)
    hi = tl.maximum(tl.max(pages, 0), 1)
    for _ in range(32):  # the feasible S form a range above the answer: bisect it
        mid = (lo + hi) // 2
        fits = tl.sum(tl.cdiv(pages, mid), 0) <= CHUNKS
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    span = lo
    full = pages // span
    tail = tl.where(pages > full * span, 1, 0)
    full_end = tl.cumsum(full, 0)
    tail_end = tl.cumsum(tail, 0)
    n_full = tl.sum(full, 0)
    n_tail = tl.sum(tail, 0)
    if c == 0:
        tl.store(ChunkStart + offs_b, full_end - full, mask=inb)
        tl.store(ChunkStart + B, n_full)
        tl.store(ChunkTail + offs_b, tl.where(tail > 0, n_full + tail_end - tail, -1), mask=inb)
    is_full = c < n_full
    live = c < n_full + n_tail
    owner = tl.where(is_full, tl.sum(tl.where(inb & (full_end <= c), 1, 0), 0),
                     tl.sum(tl.where(inb & (tail_end <= c - n_full), 1, 0), 0))
    owner = tl.minimum(owner, B - 1)
    mine = offs_b == owner
    full_o = tl.sum(tl.where(mine, full, 0), 0)
    p_o = tl.sum(tl.where(mine, pages, 0), 0)
    n_o = tl.sum(tl.where(mine, n_b, 0), 0)
    i = c - tl.sum(tl.where(mine, full_end - full, 0), 0)
    first = tl.where(is_full, i * span, tl.where(live, full_o * span, 0))
    last = tl.where(is_full, first + span, tl.where(live, p_o, 1))
    tl.store(Owner + c, owner.to(tl.int32))
    tl.store(Seqlens + c, tl.where(live, tl.minimum(last * PAGE_SIZE, n_o) - first * PAGE_SIZE,
                                   0).to(tl.int32))
    base = tl.load(kv_indptr + owner).to(tl.int64)
    for p0 in range(0, last - first, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        inside = offs < last - first
        tok = (first + offs).to(tl.int64) * PAGE_SIZE
        slot = tl.load(kv_indices + base + tok, mask=inside & live, other=0)
        tl.store(Table + c * stride_table + offs, (slot // PAGE_SIZE).to(tl.int32), mask=inside)


@triton.jit
def _chunk_queries_kernel(Q, Q_chunks, Owner, qo_indptr, H, stride_qt, stride_qh,
                          D_MAX: tl.constexpr, UNIFORM: tl.constexpr, C: tl.constexpr,
                          BLOCK_C: tl.constexpr, HB: tl.constexpr):
    """Q_chunks[c, i] = draft i of chunk c's request (grid CHUNKS x D_max x cdiv(H, HB), HB
    heads per program in one tile: one load and one store, no dependent steps; rows past the
    request's drafts are left as they are: FlashMLA's rows there are never read)."""
    c = tl.program_id(0)
    i = tl.program_id(1)
    owner = tl.load(Owner + c)
    if UNIFORM:
        q0 = owner * D_MAX
    else:
        q0 = tl.load(qo_indptr + owner)
        if i >= tl.load(qo_indptr + owner + 1) - q0:
            return
    offs_h = tl.program_id(2) * HB + tl.arange(0, HB)
    offs = tl.arange(0, BLOCK_C)
    inside = (offs_h < H)[:, None] & (offs < C)[None, :]
    src = Q + (q0 + i).to(tl.int64) * stride_qt
    dst = Q_chunks + ((c * D_MAX + i) * H).to(tl.int64) * C
    rows = tl.load(src + offs_h[:, None] * stride_qh + offs[None, :], mask=inside)
    tl.store(dst + offs_h[:, None] * C + offs[None, :], rows, mask=inside)


@triton.jit
def _pad_queries_kernel(Q, Q_pad, qo_indptr, H, stride_qt, stride_qh,
                        D_MAX: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
                        HB: tl.constexpr):
    """Q_pad[b, i] = Q[qo_indptr[b] + i] for i < D_b (grid B x D_max x cdiv(H, HB), HB heads
    per program in one tile); Q_pad [B, D_max, H, C]."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    q0 = tl.load(qo_indptr + b)
    if i >= tl.load(qo_indptr + b + 1) - q0:
        return
    offs_h = tl.program_id(2) * HB + tl.arange(0, HB)
    offs = tl.arange(0, BLOCK_C)
    inside = (offs_h < H)[:, None] & (offs < C)[None, :]
    src = Q + (q0 + i).to(tl.int64) * stride_qt
    dst = Q_pad + ((b * D_MAX + i) * H).to(tl.int64) * C
    rows = tl.load(src + offs_h[:, None] * stride_qh + offs[None, :], mask=inside)
    tl.store(dst + offs_h[:, None] * C + offs[None, :], rows, mask=inside)


def query_heads_block(heads: int) -> int:
    """Heads per program of the query gathers: a [HB, 1024] bf16 tile, at most 8 rows."""
    return min(triton.next_power_of_2(heads), 8)


def gather_chunk_queries(q: torch.Tensor, q_chunks: torch.Tensor, owner: torch.Tensor,
                         qo_indptr: torch.Tensor, max_draft: int, uniform: bool) -> None:
    """q_chunks[c] = the queries of chunk c's request (q [T, H, 576]; q_chunks [C, D_max, H,
    576] contiguous; owner [C]); uniform: every request has max_draft drafts."""
    heads = q.shape[1]
    hb = query_heads_block(heads)
    _chunk_queries_kernel[(q_chunks.shape[0], max_draft, triton.cdiv(heads, hb))](
        q, q_chunks, owner, qo_indptr, heads, q.stride(0), q.stride(1), D_MAX=max_draft,
        UNIFORM=uniform, C=KV_DIM, BLOCK_C=1024, HB=hb, num_warps=4)


@triton.jit
def _load_prefix(O_pre, L_pre, b, h, offs_i, offs_v, has_p, stride_pb, stride_ps, stride_ph,
                 stride_lb, stride_lh, stride_ls):
    """FlashMLA's rows of (request b, head h): (lse [D] in log2 units, -inf where has_p is
    False, out [D, DVB] fp32, 0 there; FlashMLA's values in those rows are never read)."""
    lse_p = tl.load(L_pre + b * stride_lb + h * stride_lh + offs_i * stride_ls, mask=has_p,
                    other=float("-inf")) * 1.4426950408889634
    lse_p = tl.where(has_p, lse_p, float("-inf"))
    o_p = tl.load(O_pre + b * stride_pb + offs_i[:, None] * stride_ps + h * stride_ph
                  + offs_v[None, :], mask=has_p[:, None], other=0.0).to(tl.float32)
    return lse_p, o_p


@triton.jit
def _load_prefix_chunks(O_pre, L_pre, ChunkStart, ChunkTail, b, h, offs_i, offs_v, rows_ok,
                        stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                        CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, CB: tl.constexpr,
                        BATCH: tl.constexpr, UNROLL: tl.constexpr):
    """``_load_prefix`` where FlashMLA ran the prefixes as chunk requests: request b's full
    chunks (ChunkStart[b] .. ChunkStart[b + 1]) and tail (ChunkTail[b], -1: none;
    ``_chunk_plan_kernel``) merged by log-sum-exp. All lse first (the rows' maxima and sums),
    then the values CB chunks per step, with nothing to rescale; other requests' chunks and
    empty ones are never read. One request (BATCH False): the steps unrolled over all CHUNKS;
    a batch: the first UNROLL steps unrolled (masked past the request's chunks), then a loop over
    the request's chunks left, if any. Each step ends in a reduction over its CB chunks, a
    barrier: the steps run one after another (one sum reduced once at the end was measured
    slower at batch 1, docs/verify-kernel-log.md#triton-and-composed-trials)."""
    c0 = tl.load(ChunkStart + b)
    count = tl.load(ChunkStart + b + 1) - c0
    tail = tl.load(ChunkTail + b)
    tail_ok = rows_ok & (tail >= 0)
    tail = tl.maximum(tail, 0)
    lse_t = tl.load(L_pre + tail * stride_lb + h * stride_lh + offs_i * stride_ls, mask=tail_ok,
                    other=float("-inf"))
    lse_t = tl.where(tail_ok, lse_t * 1.4426950408889634, float("-inf"))
    offs_c = tl.arange(0, CHUNKS_P2)
    ok = (offs_c < count)[:, None] & rows_ok[None, :]
    lse_c = tl.load(L_pre + (c0 + offs_c)[:, None] * stride_lb + h * stride_lh
                    + offs_i[None, :] * stride_ls, mask=ok, other=float("-inf"))
    lse_c = tl.where(ok, lse_c * 1.4426950408889634, float("-inf"))
    m = tl.maximum(tl.max(lse_c, 0), lse_t)
    base = tl.where(m > float("-inf"), m, 0.0)
    w_t = tl.math.exp2(lse_t - base)
    l = tl.sum(tl.math.exp2(lse_c - base[None, :]), 0) + w_t
    o_t = tl.load(O_pre + tail * stride_pb + offs_i[:, None] * stride_ps + h * stride_ph
                  + offs_v[None, :], mask=tail_ok[:, None], other=0.0).to(tl.float32)
    acc = w_t[:, None] * o_t
    if BATCH:
        for step in tl.static_range(0, UNROLL * CB, CB):
            acc += _chunk_values(O_pre, L_pre, c0, step, count, h, offs_i, offs_v, rows_ok, base,
                                 stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                                 CB)
        for step in range(UNROLL * CB, count, CB):
            acc += _chunk_values(O_pre, L_pre, c0, step, count, h, offs_i, offs_v, rows_ok, base,
                                 stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                                 CB)
    else:
        for step in tl.static_range(0, CHUNKS, CB):  # unrolled
            acc += _chunk_values(O_pre, L_pre, c0, step, count, h, offs_i, offs_v, rows_ok, base,
                                 stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                                 CB)
    seen = l > 0
    lse_p = tl.where(seen, base + tl.math.log2(tl.where(seen, l, 1.0)), float("-inf"))
    return lse_p, acc / tl.where(seen, l, 1.0)[:, None]


@triton.jit
def _chunk_values(O_pre, L_pre, c0, step, count, h, offs_i, offs_v, rows_ok, base, stride_pb,
                  stride_ps, stride_ph, stride_lb, stride_lh, stride_ls, CB: tl.constexpr):
    """sum over the request's chunks step .. step + CB of exp2(lse_c - base) out_c:
    [BLOCK_D, DVB] fp32."""
    offs_c = step + tl.arange(0, CB)
    ok = (offs_c < count)[:, None] & rows_ok[None, :]
    chunk = c0 + offs_c
    lse_c = tl.load(L_pre + chunk[:, None] * stride_lb + h * stride_lh
                    + offs_i[None, :] * stride_ls, mask=ok, other=float("-inf"))
    w = tl.math.exp2(tl.where(ok, lse_c * 1.4426950408889634, float("-inf")) - base[None, :])
    o_c = tl.load(O_pre + chunk[:, None, None] * stride_pb + offs_i[None, :, None] * stride_ps
                  + h * stride_ph + offs_v[None, None, :], mask=ok[:, :, None],
                  other=0.0).to(tl.float32)
    return tl.sum(w[:, :, None] * o_c, 0)


@triton.jit
def _prefix(O_pre, L_pre, ChunkStart, ChunkTail, b, h, offs_i, offs_v, rows_ok, n, stride_pb,
            stride_ps, stride_ph, stride_lb, stride_lh, stride_ls, CHUNKS: tl.constexpr,
            CHUNKS_P2: tl.constexpr, CB: tl.constexpr, BATCH: tl.constexpr,
            UNROLL: tl.constexpr):
    """The prefix part's (lse in log2 units, out) of the rows: FlashMLA's row, or the merge of
    the request's chunks; -inf and 0 where the request has no prefix (FlashMLA: lse +inf, out 0
    there)."""
    if CHUNKS > 0:
        lse_p, o_p = _load_prefix_chunks(O_pre, L_pre, ChunkStart, ChunkTail, b, h, offs_i,
                                         offs_v, rows_ok,
                                         stride_pb, stride_ps, stride_ph, stride_lb, stride_lh,
                                         stride_ls, CHUNKS, CHUNKS_P2, CB, BATCH, UNROLL)
    else:
        lse_p, o_p = _load_prefix(O_pre, L_pre, b, h, offs_i, offs_v, rows_ok & (n > 0),
                                  stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls)
    return lse_p, o_p


@triton.jit
def _tree_part(Q, K_ext, V_ext, Mask, mask_indptr, b, h, tok, rows_ok, D, n, offs_v, qk_scale,
               stride_qt, stride_qh, stride_ket, stride_vet, BLOCK_D: tl.constexpr,
               D_MAX: tl.constexpr,
               MASK_MODE: tl.constexpr, HAS_MASK_INDPTR: tl.constexpr, DN: tl.constexpr,
               DP: tl.constexpr, UPCAST: tl.constexpr):
    """(m_t, l_t, acc) of the rows' scores against the request's draft keys under the tree
    mask: row max and sum of exp2 (log2 units), and the unnormalised sum over the value slice."""
    offs_i = tl.arange(0, BLOCK_D)
    offs_dn = tl.arange(0, DN)
    offs_dp = tl.arange(0, DP)
    q_row = Q + tok * stride_qt + h * stride_qh
    qn = tl.load(q_row[:, None] + offs_dn[None, :], mask=rows_ok[:, None], other=0.0)
    qp = tl.load(q_row[:, None] + DN + offs_dp[None, :], mask=rows_ok[:, None], other=0.0)
    k_row = K_ext + tok * stride_ket
    kn = tl.load(k_row[:, None] + offs_dn[None, :], mask=rows_ok[:, None], other=0.0)
    kp = tl.load(k_row[:, None] + DN + offs_dp[None, :], mask=rows_ok[:, None], other=0.0)
    vn = tl.load(V_ext + tok[:, None] * stride_vet + offs_v[None, :], mask=rows_ok[:, None],
                 other=0.0)
    s = _scores(qn, qp, kn, kp, UPCAST)
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly
        vn = vn.to(tl.float32)
    # rows = draft index (H = 1 in _tree_keep's row numbering)
    keep = _tree_keep(Mask, mask_indptr, b, offs_i, offs_i, 1, D, n, D_MAX, MASK_MODE,
                      HAS_MASK_INDPTR)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_t = tl.max(s, 1)
    m_t = tl.where(m_t > float("-inf"), m_t, 0.0)  # rows past D see nothing
    p = tl.math.exp2(s - m_t[:, None])
    l_t = tl.sum(p, 1)
    acc = tl.dot(p.to(vn.dtype), vn)  # [BLOCK_D, DVB]
    return m_t, l_t, acc


@triton.jit
def _tree_merge_kernel(
    Q, K_ext, V_ext, Mask, mask_indptr, qo_indptr, kv_indptr, O_pre, L_pre, Out, Lse,
    O_tree, L_tree, ChunkStart, ChunkTail, qk_scale,
    stride_qt, stride_qh, stride_ket, stride_vet,
    stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
    stride_ot, stride_oh, stride_lt, H,
    D_MAX: tl.constexpr, BLOCK_D: tl.constexpr, DVB: tl.constexpr, MASK_MODE: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr, HAS_LSE: tl.constexpr, DN: tl.constexpr, DP: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, UNIFORM: tl.constexpr, PHASE: tl.constexpr,
    CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, CB: tl.constexpr, BATCH: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Tree part of (request b, head h, value slice) merged with the prefix part.

    Grid (B, H, DN / DVB). Q [T, H, 576]; K_ext [T, ., 576]; V_ext [T, ., >= DN];
    O_pre [B, D_max, H, DN] bf16 (FlashMLA's out, strides given); L_pre [B, H, D_max] fp32
    natural log; Out [T, H, DN]; Lse [T, H] natural log. qk_scale is sm_scale * log2(e).
    The QK product is repeated per value slice (it is 16 x 16 x 576): more programs in flight.
    PDL: launched as a programmatic dependent of FlashMLA's last kernel; the tree part (which
    reads only inputs written before FlashMLA ran) overlaps its tail, and ``gdc_wait`` comes
    before FlashMLA's outputs are read. Without PDL every load is issued up front.
    UNIFORM: every request has D_MAX drafts, so request b's rows start at b * D_MAX: no load
    of qo_indptr before the others (one dependent global load fewer in the kernel's latency).
    PHASE 0: tree part and merge. PHASE 1: the tree part alone, normalised, into O_tree
    [T, H, DN] fp32 and L_tree [T, H] (log2 units, -inf for a row that sees no draft), while
    FlashMLA runs on another stream; PHASE 2: only the merge, reading those instead.
    CHUNKS > 0: O_pre / L_pre hold FlashMLA's (at most) CHUNKS chunk requests of the batch's
    prefixes (``_chunk_plan_kernel``), request b's at ChunkStart[b] .. ChunkStart[b + 1], merged
    here CB at a time, in place of FlashMLA's own combine.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    col0 = tl.program_id(2) * DVB
    if UNIFORM:
        q0 = b * D_MAX
        D = D_MAX
    else:
        q0 = tl.load(qo_indptr + b)
        D = tl.load(qo_indptr + b + 1) - q0
    n = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    offs_i = tl.arange(0, BLOCK_D)
    rows_ok = offs_i < D
    tok = (q0 + offs_i).to(tl.int64)
    offs_v = col0 + tl.arange(0, DVB)
    tree_row = tok * H + h
    if PHASE != 1 and not PDL:
        lse_p, o_p = _prefix(O_pre, L_pre, ChunkStart, ChunkTail, b, h, offs_i, offs_v,
                             rows_ok, n, stride_pb, stride_ps, stride_ph, stride_lb,
                             stride_lh, stride_ls, CHUNKS, CHUNKS_P2, CB, BATCH, UNROLL)
    if PHASE == 2:
        lse_t = tl.load(L_tree + tree_row, mask=rows_ok, other=float("-inf"))
        acc = tl.load(O_tree + tree_row[:, None] * DN + offs_v[None, :], mask=rows_ok[:, None],
                      other=0.0)
        sees = lse_t > float("-inf")
        m_t = tl.where(sees, lse_t, 0.0)
        l_t = tl.where(sees, 1.0, 0.0)
    else:
        m_t, l_t, acc = _tree_part(Q, K_ext, V_ext, Mask, mask_indptr, b, h, tok, rows_ok, D, n,
                                   offs_v, qk_scale, stride_qt, stride_qh, stride_ket,
                                   stride_vet, BLOCK_D, D_MAX, MASK_MODE, HAS_MASK_INDPTR, DN, DP,
                                   UPCAST)
    if PHASE == 1:
        safe_l = tl.where(l_t > 0, l_t, 1.0)
        tl.store(O_tree + tree_row[:, None] * DN + offs_v[None, :], acc / safe_l[:, None],
                 mask=rows_ok[:, None])
        if tl.program_id(2) == 0:
            tl.store(L_tree + tree_row,
                     tl.where(l_t > 0, m_t + tl.math.log2(safe_l), float("-inf")), mask=rows_ok)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
            lse_p, o_p = _prefix(O_pre, L_pre, ChunkStart, ChunkTail, b, h, offs_i, offs_v,
                                 rows_ok, n, stride_pb, stride_ps, stride_ph, stride_lb,
                                 stride_lh, stride_ls, CHUNKS, CHUNKS_P2, CB, BATCH, UNROLL)
        big = tl.maximum(lse_p, m_t)
        w_p = tl.math.exp2(lse_p - big)
        w_t = tl.math.exp2(m_t - big)
        total = w_p + w_t * l_t
        safe = tl.where(total > 0, total, 1.0)
        out = (w_p[:, None] * o_p + w_t[:, None] * acc) / safe[:, None]
        tl.store(Out + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                 out.to(Out.dtype.element_ty), mask=rows_ok[:, None])
        if HAS_LSE:
            if tl.program_id(2) == 0:
                nat = tl.where(total > 0, (big + tl.math.log2(safe)) / 1.4426950408889634,
                               float("-inf"))
                tl.store(Lse + tok * stride_lt + h, nat, mask=rows_ok)


def tree_merge(q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor, mask, mask_mode: int,
               mask_indptr, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
               o_pre: Optional[torch.Tensor], lse_pre: Optional[torch.Tensor],
               out: Optional[torch.Tensor], lse: Optional[torch.Tensor], sm_scale: float,
               max_draft: int, config: Optional["MergeConfig"] = None, upcast: bool = False,
               uniform: bool = False, phase: int = 0, o_tree: Optional[torch.Tensor] = None,
               l_tree: Optional[torch.Tensor] = None, chunks: int = 0,
               chunk_start: Optional[torch.Tensor] = None,
               chunk_tail: Optional[torch.Tensor] = None) -> None:
    """Launch ``_tree_merge_kernel``: out (and lse) from FlashMLA's prefix (o_pre, lse_pre).

    o_pre [B, >= D_max, H, 512], lse_pre [B, H, >= D_max] natural log (any strides, last dim of
    o_pre contiguous); the other arguments as ``MlaVerify.forward`` takes them. uniform: the
    caller knows every request has max_draft drafts (q has B x max_draft rows), so the kernel
    need not read qo_indptr; taken only where ``config.uniform`` allows it. phase 1: only the
    tree part, into o_tree [>= T, H, 512] fp32 and l_tree [>= T, H] fp32 (contiguous; o_pre,
    lse_pre, out, lse unused); phase 2: only the merge of those with FlashMLA's result.
    chunks > 0: FlashMLA ran the prefixes as (at most) that many chunk requests (o_pre
    [chunks, ...]), request b's full ones at chunk_start[b] .. chunk_start[b + 1] and its tail
    at chunk_tail[b] (-1: none; ``ComposedPlan``).
    """
    if chunks and (chunk_start is None or chunk_tail is None):
        raise ValueError("tree_merge: chunks > 0 needs chunk_start and chunk_tail")
    cfg = config or MergeConfig()
    bs = qo_indptr.shape[0] - 1
    heads = q.shape[1]
    batch = bool(chunks) and bs > 1
    dv_split = (cfg.batch_chunk_dv_split if batch else cfg.chunk_dv_split) if chunks \
        else cfg.dv_split
    warps = (cfg.batch_chunk_num_warps if batch else cfg.chunk_num_warps) if chunks \
        else cfg.num_warps
    dvb = V_DIM // dv_split
    pdl = cfg.pdl and phase != 1
    launch = dict(launch_pdl=True) if pdl else {}
    mask_arg = mask.view(torch.uint8) if mask is not None else kv_indptr
    mip_arg = mask_indptr if mask_indptr is not None else kv_indptr
    if phase == 0:
        o_tree = l_tree = kv_indptr  # never read
    pre_strides = (o_pre.stride()[:3] + lse_pre.stride()) if phase != 1 else (0,) * 6
    if phase == 1:
        o_pre, lse_pre, out = o_tree, l_tree, o_tree  # never read or written
    lse_arg = lse if lse is not None else lse_pre
    _tree_merge_kernel[(bs, heads, dv_split)](
        q, k_ext, v_ext, mask_arg, mip_arg, qo_indptr, kv_indptr, o_pre, lse_pre, out, lse_arg,
        o_tree, l_tree, chunk_start if chunks else kv_indptr,
        chunk_tail if chunks else kv_indptr, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_ext.stride(0), v_ext.stride(0), *pre_strides,
        out.stride(0) if phase != 1 else 0, out.stride(1) if phase != 1 else 0,
        lse.stride(0) if lse is not None else 0, heads,
        D_MAX=max_draft, BLOCK_D=max(16, triton.next_power_of_2(max_draft)), DVB=dvb,
        MASK_MODE=mask_mode, HAS_MASK_INDPTR=mask_indptr is not None,
        HAS_LSE=lse is not None and phase != 1, DN=V_DIM, DP=KV_DIM - V_DIM, UPCAST=upcast,
        PDL=pdl, UNIFORM=uniform and cfg.uniform, PHASE=phase, CHUNKS=chunks,
        CHUNKS_P2=triton.next_power_of_2(max(chunks, 1)),
        CB=cfg.batch_chunk_block if batch else cfg.chunk_block, BATCH=batch,
        UNROLL=cfg.batch_chunk_unroll if batch else 0, num_warps=warps,
        **launch)


@dataclass(frozen=True)
class MergeConfig:
    """Launch settings of ``_tree_merge_kernel``.

    dv_split: programs per (request, head), each a 512 / dv_split slice of the values (the
    16 x 16 QK product is repeated in each). pdl: programmatic dependent launch after FlashMLA
    (Triton's ``launch_pdl``; never in the interpreter). uniform: where every request has
    max_draft drafts (SGLang's verify batches), compute row offsets instead of loading them.
    side_stream: the tree part on a second stream, forked before FlashMLA and joined after it
    (a fork and join in a CUDA graph), so that only the merge runs after FlashMLA.
    chunks: FlashMLA runs the batch's prefixes as this many chunk requests of balanced length
    (None: as many as FlashMLA has SM parts, so that it splits few; 0: each request as one),
    merged by our kernel with chunk_dv_split programs per head of chunk_num_warps warps,
    chunk_block chunks per step: FlashMLA's own combine walks a request's splits one dependent
    load at a time (66 for one request). batch_chunks: batches of more than one request take
    the chunked layout too (their queries gathered per chunk request, one launch per layer;
    merged with batch_chunk_dv_split programs per request and head of batch_chunk_num_warps
    warps, batch_chunk_block chunks per step, the first batch_chunk_unroll steps unrolled, then a
    loop over the request's chunks left); off by
    default: FlashMLA's own split and combine serve batches, 1.01-1.12x FlashMLA's time where
    the chunked layout took 1.07-1.20x (H200, docs/verify-kernel-log.md#batches).
    """

    dv_split: int = 4
    num_warps: int = 4
    pdl: bool = False
    uniform: bool = True
    side_stream: bool = False
    chunks: Optional[int] = None
    chunk_dv_split: int = 16
    chunk_block: int = 8
    chunk_num_warps: int = 8
    batch_chunks: bool = False
    batch_chunk_dv_split: int = 8
    batch_chunk_block: int = 2
    batch_chunk_num_warps: int = 2
    batch_chunk_unroll: int = 4

    def __post_init__(self) -> None:
        if self.pdl and self.side_stream:
            raise ValueError("MergeConfig: pdl and side_stream do not go together (the merge "
                             "after a join has two prerequisites)")
        if self.batch_chunk_unroll < 0:
            raise ValueError("MergeConfig: batch_chunk_unroll must be >= 0, got "
                             f"{self.batch_chunk_unroll}")
        if self.chunks is not None and self.chunks < 0:
            raise ValueError(f"MergeConfig: chunks must be >= 0 or None, got {self.chunks}")


_flash: dict[str, Any] = {}


def flash_sm_parts(device: torch.device, rows: int) -> int:
    """FlashMLA's SM parts for ``rows`` query rows per request (its dense decode's rule: SMs
    over 64-row blocks); 0 off CUDA, where the chunked layout is not used."""
    if device.type != "cuda":
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(sms // triton.cdiv(rows, 64), 1)


def load_flash_mla() -> Optional[Any]:
    """The ``flash_mla`` module of sgl-flash-mla with its SM90 kernels, or None after one warning."""
    if "mod" not in _flash:
        try:
            import flash_mla

            if not flash_mla.has_legacy():
                raise ImportError("this flash_mla build has no SM90 (legacy) kernels")
            _flash["mod"] = flash_mla
        except Exception as exc:  # ImportError, or a broken CUDA extension (OSError)
            log.warning("moeplace: FlashMLA (sgl_flash_mla) unavailable (%s); the MLA verify "
                        "kernel runs its own path", str(exc).splitlines()[0][:200])
            _flash["mod"] = None
    return _flash["mod"]


@dataclass
class ComposedPlan:
    """Per-batch state of the composed path (made by :meth:`ComposedVerify.plan`).

    kv_indptr / kv_indices: the tensors it was made from (by identity: a forward over other
    tensors plans anew). block_table [B, P] and seqlens [B] are views of the op's buffers
    ([chunks, W] and [chunks] where chunks > 0, with chunk_start [B + 1], chunk_tail [B] and
    owner [chunks]);
    meta is FlashMLA's scheduler metadata for this batch.
    """

    bs: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    meta: Any
    chunks: int = 0  # > 0: the prefixes as (at most) this many FlashMLA chunk requests
    chunk_start: Optional[torch.Tensor] = None
    chunk_tail: Optional[torch.Tensor] = None
    owner: Optional[torch.Tensor] = None


def chunk_width(kv_tokens: int, bs: int, chunks: int) -> int:
    """Pages a chunk request can hold for ``bs`` requests over ``kv_tokens`` slot ids: the
    plan's S is at most cdiv(P, chunks - bs) (that many pages per chunk fit every request in
    ``chunks``), P <= cdiv(kv_tokens, 64) + bs pages in all."""
    pages = triton.cdiv(kv_tokens, PAGE) + bs
    return max(1, triton.cdiv(pages, chunks - bs) if chunks > bs else pages)


class ComposedVerify:
    """Buffers and launches of the composed path for one MlaVerify (one head count).

    Buffers: block table [max_bs, P] int32 (P = kv_indices' length / 64: ``reserve`` sizes it
    for the longest kv_indices buffer before any graph capture, ``plan`` grows it otherwise),
    seqlens [max_bs] int32, and for ragged draft counts a padded query buffer
    [max_bs, D_max, H, 576] bf16, made on first need (SGLang's verify batches are never ragged).
    Batches of fewer requests than ``self.chunks`` take the chunked layout: a chunk table
    [chunks, W], lengths and owners [chunks], chunk starts [max_bs + 1] and tails [max_bs], and
    for more than one
    request the gathered queries [chunks, D_max, H, 576] bf16. Grown with ``torch.empty``:
    every entry FlashMLA reads is written by each plan (the gathered queries by each forward).
    """

    def __init__(self, flash: Any, num_heads: int, max_draft: int, max_bs: int,
                 device: torch.device, config: Optional[MergeConfig] = None) -> None:
        self.flash = flash
        self.config = config or MergeConfig()
        self.num_heads, self.max_draft, self.max_bs = num_heads, max_draft, max_bs
        self.device = device
        self.seqlens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_bs, 1, dtype=torch.int32, device=device)
        self.chunks = self.config.chunks
        if self.chunks is None:
            self.chunks = flash_sm_parts(device, num_heads * max_draft)
        n = max(self.chunks, 1)
        self.chunk_seqlens = torch.zeros(n, dtype=torch.int32, device=device)
        self.chunk_owner = torch.zeros(n, dtype=torch.int32, device=device)
        self.chunk_start = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.chunk_tail = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.chunk_table = torch.zeros(n, 1, dtype=torch.int32, device=device)
        self.q_chunks: Optional[torch.Tensor] = None
        self.q_pad: Optional[torch.Tensor] = None
        self.hoisted_meta = True  # False once get_mla_decoding_metadata failed: lazy fill
        self.side: Optional[torch.cuda.Stream] = None
        if self.config.side_stream:  # the tree part's results, [max_bs x D_max, H, 512] fp32
            self.side = torch.cuda.Stream(device)
            self.o_tree = torch.empty(max_bs * max_draft, num_heads, V_DIM, device=device)
            self.l_tree = torch.empty(max_bs * max_draft, num_heads, device=device)

    def chunks_for(self, bs: int) -> int:
        """Chunk requests for a batch of ``bs`` (0: FlashMLA's own split and combine)."""
        if bs == 1 or (self.config.batch_chunks and bs < self.chunks):
            return self.chunks
        return 0

    def reserve(self, bs: int, kv_tokens: int) -> None:
        """Size the block table and lengths for ``bs`` requests over ``kv_tokens`` slot ids."""
        pages = max(1, triton.cdiv(kv_tokens, PAGE))
        if pages > self.block_table.shape[1] or bs > self.block_table.shape[0]:
            self.block_table = torch.empty(max(bs, self.block_table.shape[0]),
                                           max(pages, 2 * self.block_table.shape[1]),
                                           dtype=torch.int32, device=self.device)
        if bs > self.seqlens.shape[0]:
            self.seqlens = torch.empty(bs, dtype=torch.int32, device=self.device)
        if bs + 1 > self.chunk_start.shape[0]:
            self.chunk_start = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
            self.chunk_tail = torch.empty(bs, dtype=torch.int32, device=self.device)
        chunked_bs = max((b for b in range(1, bs + 1) if self.chunks_for(b)), default=0)
        width = chunk_width(kv_tokens, chunked_bs, self.chunks) if chunked_bs else 0
        if width > self.chunk_table.shape[1]:
            self.chunk_table = torch.empty(self.chunk_table.shape[0],
                                           max(width, 2 * self.chunk_table.shape[1]),
                                           dtype=torch.int32, device=self.device)
        if chunked_bs > 1 and self.q_chunks is None:
            self.q_chunks = torch.zeros(self.chunks, self.max_draft, self.num_heads, KV_DIM,
                                        dtype=torch.bfloat16, device=self.device)

    def write_table(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, bs: int,
                    chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the batch's block table and lengths as FlashMLA reads them (the chunk requests'
        where ``chunks`` > 0, with their starts and owners) and return them; ``reserve`` must
        have sized the buffers."""
        if chunks:
            table, seqlens = self.chunk_table, self.chunk_seqlens
            _chunk_plan_kernel[(chunks,)](kv_indptr, kv_indices, table, seqlens,
                                          self.chunk_start, self.chunk_tail, self.chunk_owner,
                                          table.stride(0), bs,
                                          CHUNKS=chunks, B_P2=triton.next_power_of_2(bs),
                                          PAGE_SIZE=PAGE, BLOCK=64, num_warps=1)
        else:
            table, seqlens = self.block_table[:bs], self.seqlens[:bs]
            _block_table_kernel[(bs, 4)](kv_indptr, kv_indices, table, seqlens, table.stride(0),
                                         PAGE_SIZE=PAGE, BLOCK=256, NPROG=4, num_warps=1)
        return table, seqlens

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
             kv_indices: torch.Tensor) -> ComposedPlan:
        """Block table, lengths and FlashMLA's scheduler metadata for this batch (no host sync)."""
        bs = qo_indptr.shape[0] - 1
        self.reserve(bs, kv_indices.numel())
        chunks = self.chunks_for(bs)
        table, seqlens = self.write_table(kv_indptr, kv_indices, bs, chunks)
        meta, _ = self.flash.get_mla_metadata()
        if self.hoisted_meta:
            try:
                meta.tile_scheduler_metadata, meta.num_splits = \
                    self.flash.get_mla_decoding_metadata(
                        seqlens, self.max_draft * self.num_heads, 1, self.num_heads, False, None,
                        use_legacy=True)
            except Exception as exc:  # FlashMLA then fills it on the first layer's call
                self.hoisted_meta = False
                meta, _ = self.flash.get_mla_metadata()
                log.warning("moeplace: FlashMLA metadata not hoisted (%s); its first call per "
                            "batch builds it", str(exc).splitlines()[0][:200])
        return ComposedPlan(bs, kv_indptr, kv_indices, table, seqlens, meta, chunks,
                            self.chunk_start[:bs + 1] if chunks else None,
                            self.chunk_tail[:bs] if chunks else None,
                            self.chunk_owner if chunks else None)

    def forward(self, plan: ComposedPlan, q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr,
                mask, mask_mode, mask_indptr, out, lse, sm_scale) -> None:
        bs = plan.bs
        T, H = q.shape[0], q.shape[1]
        uniform = T == bs * self.max_draft
        if plan.chunks and bs > 1:  # each chunk request gets its own request's queries
            q4 = self.q_chunks[:plan.chunks]
            gather_chunk_queries(q, q4, plan.owner, qo_indptr, self.max_draft,
                                 uniform and self.config.uniform)
        elif uniform:
            # Every request has max_draft drafts (none has more): FlashMLA reads q in place.
            q4 = q.view(bs, self.max_draft, H, KV_DIM)
        else:
            if self.q_pad is None or self.q_pad.shape[0] < bs:
                self.q_pad = torch.zeros(self.max_bs, self.max_draft, H, KV_DIM,
                                         dtype=q.dtype, device=q.device)
            q4 = self.q_pad[:bs]
            hb = query_heads_block(H)
            _pad_queries_kernel[(bs, self.max_draft, triton.cdiv(H, hb))](
                q, q4, qo_indptr, H, q.stride(0), q.stride(1), D_MAX=self.max_draft, C=KV_DIM,
                BLOCK_C=1024, HB=hb, num_warps=4)
        if plan.chunks and bs == 1:  # every chunk request reads the one request's queries
            q4 = q4.expand(plan.chunks, *q4.shape[1:])
        pages = kv_pool.shape[0] // PAGE
        k_cache = kv_pool[:pages * PAGE].unflatten(0, (pages, PAGE))  # [pages, 64, 1, 576]
        tree_args = (q, k_ext, v_ext, mask, mask_mode, mask_indptr, qo_indptr, kv_indptr)
        merge = dict(uniform=uniform, chunks=plan.chunks, chunk_start=plan.chunk_start,
                     chunk_tail=plan.chunk_tail)
        if self.side is not None:
            main = torch.cuda.current_stream(q.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                tree_merge(*tree_args, None, None, None, None, sm_scale, self.max_draft,
                           self.config, uniform=uniform, phase=1, o_tree=self.o_tree,
                           l_tree=self.l_tree)
        o_pre, lse_pre = self.flash.flash_mla_with_kvcache(
            q4, k_cache, plan.block_table, plan.seqlens, V_DIM, plan.meta,
            softmax_scale=sm_scale, causal=False, use_legacy=True)
        if self.side is not None:
            main.wait_stream(self.side)
            tree_merge(*tree_args, o_pre, lse_pre, out, lse, sm_scale, self.max_draft,
                       self.config, phase=2, o_tree=self.o_tree, l_tree=self.l_tree, **merge)
            return
        tree_merge(*tree_args, o_pre, lse_pre, out, lse, sm_scale, self.max_draft, self.config,
                   **merge)
