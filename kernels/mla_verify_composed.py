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

A batch of one request instead gives FlashMLA its prefix as C chunk requests (C = FlashMLA's SM
parts; ``_chunk_table_kernel`` per batch, the queries expanded over them with stride 0): FlashMLA
then splits none and its combine returns at once, and ``_tree_merge_kernel`` merges the chunks'
(out, lse) with the tree part, every chunk's loads in flight, where FlashMLA's combine would walk
its 66 splits of one request one dependent load after another.
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
def _chunk_span(n, CHUNKS: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Tokens per chunk of an n-token prefix: cdiv(cdiv(n, PAGE_SIZE), CHUNKS) whole pages, >= 1."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, PAGE_SIZE), CHUNKS), 1) * PAGE_SIZE


@triton.jit
def _chunk_table_kernel(kv_indptr, kv_indices, Table, Seqlens, stride_table,
                        CHUNKS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One request's prefix as CHUNKS consecutive runs of whole pages, one FlashMLA request each.

    Grid (CHUNKS,). Chunk c holds pages [c pc, (c + 1) pc) of the request, pc = cdiv(pages,
    CHUNKS) (``_chunk_span``): Table[c, p] is that page's id, Seqlens[c] its token count (0 past
    the prefix, where Table[c, 0] = page 0, since FlashMLA gives every request a block).
    """
    c = tl.program_id(0)
    start = tl.load(kv_indptr)
    n = tl.load(kv_indptr + 1) - start
    span = _chunk_span(n, CHUNKS, PAGE_SIZE)
    first = c * span
    tl.store(Seqlens + c, tl.minimum(tl.maximum(n - first, 0), span).to(tl.int32))
    for p0 in range(0, span // PAGE_SIZE, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tok = first + offs.to(tl.int64) * PAGE_SIZE
        slot = tl.load(kv_indices + start + tok, mask=tok < n, other=0)
        tl.store(Table + c * stride_table + offs, (slot // PAGE_SIZE).to(tl.int32),
                 mask=offs < span // PAGE_SIZE)


@triton.jit
def _pad_queries_kernel(Q, Q_pad, qo_indptr, H, stride_qt, stride_qh,
                        D_MAX: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """Q_pad[b, i] = Q[qo_indptr[b] + i] for i < D_b (grid B x D_max); Q_pad [B, D_max, H, C]."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    q0 = tl.load(qo_indptr + b)
    if i >= tl.load(qo_indptr + b + 1) - q0:
        return
    offs = tl.arange(0, BLOCK_C)
    src = Q + (q0 + i).to(tl.int64) * stride_qt
    dst = Q_pad + ((b * D_MAX + i) * H).to(tl.int64) * C
    for h in range(H):
        row = tl.load(src + h * stride_qh + offs, mask=offs < C)
        tl.store(dst + h * C + offs, row, mask=offs < C)


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
def _load_prefix_chunks(O_pre, L_pre, h, offs_i, offs_v, rows_ok, n, stride_pb, stride_ps,
                        stride_ph, stride_lb, stride_lh, stride_ls, CHUNKS: tl.constexpr,
                        CHUNKS_P2: tl.constexpr, CB: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``_load_prefix`` where FlashMLA ran one request's prefix as CHUNKS requests: their
    (lse, out) merged by log-sum-exp. All lse first (the rows' maxima and sums), then the values
    CB chunks per step, with nothing to rescale; chunks past the prefix are never read."""
    span = _chunk_span(n, CHUNKS, PAGE_SIZE)
    offs_c = tl.arange(0, CHUNKS_P2)
    ok = ((offs_c < CHUNKS) & (offs_c * span < n))[:, None] & rows_ok[None, :]
    lse_c = tl.load(L_pre + offs_c[:, None] * stride_lb + h * stride_lh
                    + offs_i[None, :] * stride_ls, mask=ok, other=float("-inf"))
    lse_c = tl.where(ok, lse_c * 1.4426950408889634, float("-inf"))
    m = tl.max(lse_c, 0)
    base = tl.where(m > float("-inf"), m, 0.0)
    l = tl.sum(tl.math.exp2(lse_c - base[None, :]), 0)
    acc = tl.zeros((offs_i.shape[0], offs_v.shape[0]), tl.float32)
    for c0 in tl.static_range(0, CHUNKS, CB):  # unrolled: every step's loads issued at once
        acc += _chunk_values(O_pre, L_pre, c0, h, offs_i, offs_v, rows_ok, n, span, base,
                             stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                             CHUNKS, CB)
    seen = l > 0
    lse_p = tl.where(seen, base + tl.math.log2(tl.where(seen, l, 1.0)), float("-inf"))
    return lse_p, acc / tl.where(seen, l, 1.0)[:, None]


@triton.jit
def _chunk_values(O_pre, L_pre, c0, h, offs_i, offs_v, rows_ok, n, span, base, stride_pb,
                  stride_ps, stride_ph, stride_lb, stride_lh, stride_ls, CHUNKS: tl.constexpr,
                  CB: tl.constexpr):
    """sum over chunks c0 .. c0 + CB of exp2(lse_c - base) out_c: [BLOCK_D, DVB] fp32."""
    offs_c = c0 + tl.arange(0, CB)
    ok = ((offs_c < CHUNKS) & (offs_c * span < n))[:, None] & rows_ok[None, :]
    lse_c = tl.load(L_pre + offs_c[:, None] * stride_lb + h * stride_lh
                    + offs_i[None, :] * stride_ls, mask=ok, other=float("-inf"))
    w = tl.math.exp2(tl.where(ok, lse_c * 1.4426950408889634, float("-inf")) - base[None, :])
    o_c = tl.load(O_pre + offs_c[:, None, None] * stride_pb + offs_i[None, :, None] * stride_ps
                  + h * stride_ph + offs_v[None, None, :], mask=ok[:, :, None],
                  other=0.0).to(tl.float32)
    return tl.sum(w[:, :, None] * o_c, 0)


@triton.jit
def _prefix(O_pre, L_pre, b, h, offs_i, offs_v, rows_ok, n, stride_pb, stride_ps, stride_ph,
            stride_lb, stride_lh, stride_ls, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
            CB: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The prefix part's (lse in log2 units, out) of the rows: FlashMLA's row, or its chunks'
    merge; -inf and 0 where the request has no prefix (FlashMLA: lse +inf, out 0 there)."""
    if CHUNKS > 0:
        lse_p, o_p = _load_prefix_chunks(O_pre, L_pre, h, offs_i, offs_v, rows_ok, n, stride_pb,
                                         stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
                                         CHUNKS, CHUNKS_P2, CB, PAGE_SIZE)
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
    O_tree, L_tree, qk_scale,
    stride_qt, stride_qh, stride_ket, stride_vet,
    stride_pb, stride_ps, stride_ph, stride_lb, stride_lh, stride_ls,
    stride_ot, stride_oh, stride_lt, H,
    D_MAX: tl.constexpr, BLOCK_D: tl.constexpr, DVB: tl.constexpr, MASK_MODE: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr, HAS_LSE: tl.constexpr, DN: tl.constexpr, DP: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, UNIFORM: tl.constexpr, PHASE: tl.constexpr,
    CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, CB: tl.constexpr, PAGE_SIZE: tl.constexpr,
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
    CHUNKS > 0 (one request): O_pre / L_pre hold FlashMLA's CHUNKS chunk requests of its prefix
    (``_chunk_table_kernel``), merged here CB at a time, in place of FlashMLA's own combine.
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
        lse_p, o_p = _prefix(O_pre, L_pre, b, h, offs_i, offs_v, rows_ok, n, stride_pb,
                             stride_ps, stride_ph, stride_lb, stride_lh, stride_ls, CHUNKS,
                             CHUNKS_P2, CB, PAGE_SIZE)
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
            lse_p, o_p = _prefix(O_pre, L_pre, b, h, offs_i, offs_v, rows_ok, n, stride_pb,
                                 stride_ps, stride_ph, stride_lb, stride_lh, stride_ls, CHUNKS,
                                 CHUNKS_P2, CB, PAGE_SIZE)
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
               l_tree: Optional[torch.Tensor] = None, chunks: int = 0) -> None:
    """Launch ``_tree_merge_kernel``: out (and lse) from FlashMLA's prefix (o_pre, lse_pre).

    o_pre [B, >= D_max, H, 512], lse_pre [B, H, >= D_max] natural log (any strides, last dim of
    o_pre contiguous); the other arguments as ``MlaVerify.forward`` takes them. uniform: the
    caller knows every request has max_draft drafts (q has B x max_draft rows), so the kernel
    need not read qo_indptr; taken only where ``config.uniform`` allows it. phase 1: only the
    tree part, into o_tree [>= T, H, 512] fp32 and l_tree [>= T, H] fp32 (contiguous; o_pre,
    lse_pre, out, lse unused); phase 2: only the merge of those with FlashMLA's result.
    chunks > 0: one request, whose prefix FlashMLA ran as that many chunk requests (o_pre
    [chunks, ...]).
    """
    cfg = config or MergeConfig()
    bs = qo_indptr.shape[0] - 1
    heads = q.shape[1]
    dv_split = cfg.chunk_dv_split if chunks else cfg.dv_split
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
        o_tree, l_tree, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_ext.stride(0), v_ext.stride(0), *pre_strides,
        out.stride(0) if phase != 1 else 0, out.stride(1) if phase != 1 else 0,
        lse.stride(0) if lse is not None else 0, heads,
        D_MAX=max_draft, BLOCK_D=max(16, triton.next_power_of_2(max_draft)), DVB=dvb,
        MASK_MODE=mask_mode, HAS_MASK_INDPTR=mask_indptr is not None,
        HAS_LSE=lse is not None and phase != 1, DN=V_DIM, DP=KV_DIM - V_DIM, UPCAST=upcast,
        PDL=pdl, UNIFORM=uniform and cfg.uniform, PHASE=phase, CHUNKS=chunks,
        CHUNKS_P2=triton.next_power_of_2(max(chunks, 1)), CB=cfg.chunk_block, PAGE_SIZE=PAGE,
        num_warps=cfg.chunk_num_warps if chunks else cfg.num_warps, **launch)


@dataclass(frozen=True)
class MergeConfig:
    """Launch settings of ``_tree_merge_kernel``.

    dv_split: programs per (request, head), each a 512 / dv_split slice of the values (the
    16 x 16 QK product is repeated in each). pdl: programmatic dependent launch after FlashMLA
    (Triton's ``launch_pdl``; never in the interpreter). uniform: where every request has
    max_draft drafts (SGLang's verify batches), compute row offsets instead of loading them.
    side_stream: the tree part on a second stream, forked before FlashMLA and joined after it
    (a fork and join in a CUDA graph), so that only the merge runs after FlashMLA.
    chunks: for a batch of one request, FlashMLA runs its prefix as this many chunk requests
    (None: as many as FlashMLA has SM parts, so that it splits none; 0: as one request), merged
    by our kernel with chunk_dv_split programs per head of chunk_num_warps warps, chunk_block
    chunks per step: FlashMLA's own combine of one request's 66 splits walks them one dependent
    load at a time.
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

    def __post_init__(self) -> None:
        if self.pdl and self.side_stream:
            raise ValueError("MergeConfig: pdl and side_stream do not go together (the merge "
                             "after a join has two prerequisites)")
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
    ([chunks, P / chunks] and [chunks] where chunks > 0); meta is FlashMLA's scheduler metadata
    for this batch.
    """

    bs: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    meta: Any
    chunks: int = 0  # > 0: one request, FlashMLA's prefix as this many chunk requests


class ComposedVerify:
    """Buffers and launches of the composed path for one MlaVerify (one head count).

    Buffers: block table [max_bs, P] int32 (P = kv_indices' length / 64: ``reserve`` sizes it
    for the longest kv_indices buffer before any graph capture, ``plan`` grows it otherwise),
    seqlens [max_bs] int32, and for ragged draft counts a padded query buffer
    [max_bs, D_max, H, 576] bf16, made on first need (SGLang's verify batches are never ragged).
    A batch of one request takes the chunked layout where ``self.chunks`` > 0: its own table
    [chunks, P / chunks] and lengths [chunks]. Grown with ``torch.empty``: every entry FlashMLA
    reads is written by each plan.
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
        self.chunk_seqlens = torch.zeros(max(self.chunks, 1), dtype=torch.int32, device=device)
        self.chunk_table = torch.zeros(max(self.chunks, 1), 1, dtype=torch.int32, device=device)
        self.q_pad: Optional[torch.Tensor] = None
        self.hoisted_meta = True  # False once get_mla_decoding_metadata failed: lazy fill
        self.side: Optional[torch.cuda.Stream] = None
        if self.config.side_stream:  # the tree part's results, [max_bs x D_max, H, 512] fp32
            self.side = torch.cuda.Stream(device)
            self.o_tree = torch.empty(max_bs * max_draft, num_heads, V_DIM, device=device)
            self.l_tree = torch.empty(max_bs * max_draft, num_heads, device=device)

    def reserve(self, bs: int, kv_tokens: int) -> None:
        """Size the block table and lengths for ``bs`` requests over ``kv_tokens`` slot ids."""
        pages = max(1, triton.cdiv(kv_tokens, PAGE))
        if pages > self.block_table.shape[1] or bs > self.block_table.shape[0]:
            self.block_table = torch.empty(max(bs, self.block_table.shape[0]),
                                           max(pages, 2 * self.block_table.shape[1]),
                                           dtype=torch.int32, device=self.device)
        if bs > self.seqlens.shape[0]:
            self.seqlens = torch.empty(bs, dtype=torch.int32, device=self.device)
        width = triton.cdiv(pages, self.chunks) if self.chunks else 0
        if width > self.chunk_table.shape[1]:
            self.chunk_table = torch.empty(self.chunk_table.shape[0],
                                           max(width, 2 * self.chunk_table.shape[1]),
                                           dtype=torch.int32, device=self.device)

    def write_table(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, bs: int,
                    chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the batch's block table and lengths as FlashMLA reads them (the chunk requests'
        where ``chunks`` > 0) and return them; ``reserve`` must have sized the buffers."""
        if chunks:
            table, seqlens = self.chunk_table, self.chunk_seqlens
            _chunk_table_kernel[(chunks,)](kv_indptr, kv_indices, table, seqlens,
                                           table.stride(0), CHUNKS=chunks, PAGE_SIZE=PAGE,
                                           BLOCK=64, num_warps=1)
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
        chunks = self.chunks if bs == 1 else 0
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
        return ComposedPlan(bs, kv_indptr, kv_indices, table, seqlens, meta, chunks)

    def forward(self, plan: ComposedPlan, q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr,
                mask, mask_mode, mask_indptr, out, lse, sm_scale) -> None:
        bs = plan.bs
        T, H = q.shape[0], q.shape[1]
        if T == bs * self.max_draft:
            # Every request has max_draft drafts (none has more): FlashMLA reads q in place.
            q4 = q.view(bs, self.max_draft, H, KV_DIM)
        else:
            if self.q_pad is None or self.q_pad.shape[0] < bs:
                self.q_pad = torch.zeros(self.max_bs, self.max_draft, H, KV_DIM,
                                         dtype=q.dtype, device=q.device)
            q4 = self.q_pad[:bs]
            _pad_queries_kernel[(bs, self.max_draft)](
                q, q4, qo_indptr, H, q.stride(0), q.stride(1), D_MAX=self.max_draft, C=KV_DIM,
                BLOCK_C=1024, num_warps=4)
        if plan.chunks:  # every chunk request reads the one request's queries (stride 0)
            q4 = q4.expand(plan.chunks, *q4.shape[1:])
        pages = kv_pool.shape[0] // PAGE
        k_cache = kv_pool[:pages * PAGE].unflatten(0, (pages, PAGE))  # [pages, 64, 1, 576]
        tree_args = (q, k_ext, v_ext, mask, mask_mode, mask_indptr, qo_indptr, kv_indptr)
        uniform = T == bs * self.max_draft
        merge = dict(uniform=uniform, chunks=plan.chunks)
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
