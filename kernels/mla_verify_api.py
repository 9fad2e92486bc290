"""Typed entry point for the MLA tree-verify kernels: backend choice, input checks, workspace.

Dimension letters as in ``mla_verify.py`` (B requests, D draft tokens, T = sum(D), H heads,
C = 576 KV values per token, DN = 512 of them also V).

Three backends behind one interface:
  * ``composed``: FlashMLA's SM90 decode for the prefix plus one Triton kernel for the tree and
    the merge (``mla_verify_composed.py``); on compute capability 9.0 where ``sgl_flash_mla``
    imports and the pool is laid out in 64-token pages (``page_size`` a multiple of 64). Under
    "auto" it serves the shapes ``prefer_composed`` names, the own kernel the rest;
  * ``sm90``: the Hopper CUDA kernel (``csrc/mla_verify_sm90.cu``, loaded by
    ``mla_verify_sm90.py``), chosen automatically on compute capability 9.0 when nvcc can build it;
  * ``triton``: the Triton kernel (``mla_verify.py``), everywhere else (sm_120 keeps its own tile
    preset) and in Triton's CPU interpreter.
``MOEPLACE_VERIFY_BACKEND=composed`` (or ``sm90``, ``triton``) overrides the automatic choice.

Usage (CUDA-graph safe: allocate once, then call ``forward`` inside capture and replay)::

    op = MlaVerify(num_heads=8, max_draft=9, max_bs=32, device="cuda", page_size=64)
    plan = op.plan(qo_indptr, kv_indptr, kv_indices)       # once per batch
    out = op.forward(q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, kv_indices,
                     mask=qlen_only_mask, mask_layout="qlen_only", plan=plan)  # per layer
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Literal, Optional

import torch
import triton

from moeplace_kernels import mla_verify_composed, mla_verify_sm90
from moeplace_kernels.mla_verify import (
    LOG2E,
    MASK_CAUSAL,
    MASK_FULL,
    MASK_QLEN_ONLY,
    _verify_merge_kernel,
    _verify_split_kernel,
)

MaskLayout = Literal["causal", "qlen_only", "full"]
_MASK_MODES = {"causal": MASK_CAUSAL, "qlen_only": MASK_QLEN_ONLY, "full": MASK_FULL}
Backend = Literal["auto", "composed", "sm90", "triton"]
BACKEND_ENV = "MOEPLACE_VERIFY_BACKEND"
log = logging.getLogger(__name__)

# Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies bf16 tiles wrongly: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

KV_DIM = 576
V_DIM = 512
ROPE_DIM = KV_DIM - V_DIM


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the split kernel.

    block_m + tail_m rows per row block (tail_m = 0 for none); row_blocks blocks cover one
    request's R = D_max * H rows. Shared memory ~ block_m * 576 * 2 (queries) + buffers *
    block_n * 576 * 2 (KV tiles): Triton 3.6 gives the gathered KV loads 2 buffers up to
    num_stages 4 with block_n 32 (no overlap: slot ids are a plain load), and from num_stages
    5 pipelines the slot-id loads too (3 buffers at 5-6, 4 at 7); block_n 64 with 2 stages
    (the Hopper default) takes 216 KB: one program per SM. The sm_120 preset stays under its
    ~99 KB.
    """

    block_m: int
    tail_m: int
    row_blocks: int
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    min_chunk: int = 256
    dv_split: int = 1
    programs_per_sm: float = 2  # the batch's splits <= programs_per_sm * SMs / row_blocks
    tail_block_n: int = 0  # KV tokens per step of a tail program; 0: block_n
    idx_prefetch: bool = False  # carry step n+1's slot ids in a loop variable (_attend)

    def tag(self) -> str:
        """Short label used by the benchmark sweep."""
        return (f"m{self.block_m}+{self.tail_m}x{self.row_blocks} n{self.block_n} "
                f"w{self.num_warps} s{self.num_stages} mc{self.min_chunk} "
                f"pps{self.programs_per_sm:g} tn{self.tail_block_n} pf{int(self.idx_prefetch)}")


def choose_rows(rows: int, max_m: int = 64) -> tuple[int, int, int]:
    """(block_m, tail_m, row_blocks) that cover ``rows`` with the fewest padded rows.

    Tensor-core tiles want power-of-two rows; a 64-row tile plus a 16/32-row tail covers
    72 rows (9 drafts x 8 heads) as 80 instead of 128.
    """
    if rows <= max_m:
        return max(16, triton.next_power_of_2(rows)), 0, 1
    best = None
    for tail in (0, 16, 32):
        if tail >= max_m:
            continue
        blocks = triton.cdiv(rows, max_m + tail)
        cost = blocks * (max_m + tail)
        if best is None or cost < best[0]:
            best = (cost, tail, blocks)
    return max_m, best[1], best[2]


def default_config(num_heads: int, max_draft: int, arch_major: int = 9) -> TileConfig:
    """Tile config for this head count and draft width; ``arch_major`` 12 keeps sm_120's budget."""
    if arch_major >= 12:
        # ~99 KB of shared memory per block: queries (<= 48 rows) plus two 16-token KV tiles.
        block_m, tail_m, row_blocks = choose_rows(num_heads * max_draft, max_m=32)
        return TileConfig(block_m, tail_m, row_blocks, block_n=16, num_warps=4, num_stages=2)
    block_m, tail_m, row_blocks = choose_rows(num_heads * max_draft)
    # Hopper: 64-token KV steps, 2 stages, one wave of programs (see _split_plan). The sweep of
    # HOPPER_CANDIDATES (H200) found deeper KV pipelines (32/16-token steps with 3-7 stages, slot ids
    # prefetched or loaded asynchronously) slower at 16k+ contexts. Without a tail tile, carrying the
    # next step's slot ids is 1.1-1.7x faster (the loop waits on that load otherwise); with one, the
    # tail's registers make it slower (docs/verify-kernel-log.md#triton-and-composed-trials).
    return TileConfig(block_m, tail_m, row_blocks, block_n=64, programs_per_sm=1,
                      idx_prefetch=tail_m == 0)


# Hopper variants swept by scripts/bench_verify.py (overrides of the default config) and
# checked against the reference by tests/test_mla_verify.py.
HOPPER_CANDIDATES: list[dict] = [
    dict(),  # the default itself
    dict(block_n=64, num_stages=2, tail_block_n=0, idx_prefetch=True),
    dict(block_n=32, num_stages=4, tail_block_n=32, idx_prefetch=True),
    dict(block_n=32, num_stages=3, tail_block_n=32, idx_prefetch=True),
    dict(block_n=32, num_stages=7, tail_block_n=32),
    dict(block_n=32, num_stages=5, tail_block_n=32),
    dict(block_n=16, num_stages=10, tail_block_n=16),
    dict(block_n=16, num_stages=8, tail_block_n=16, idx_prefetch=True),
    dict(block_n=32, num_stages=7, tail_block_n=32, min_chunk=128),
    dict(block_n=32, num_stages=7, tail_block_n=32, min_chunk=64, programs_per_sm=0.5),
    dict(block_n=32, num_stages=4, tail_block_n=32, idx_prefetch=True, min_chunk=64,
         programs_per_sm=0.5),
]


def hopper_candidates(num_heads: int = 8, max_draft: int = 9) -> list[TileConfig]:
    """The default Hopper config with each of ``HOPPER_CANDIDATES`` applied."""
    base = default_config(num_heads, max_draft, arch_major=9)
    return [replace(base, **c) for c in HOPPER_CANDIDATES]


@dataclass(frozen=True)
class Sm90Config:
    """Launch settings of the Hopper kernel (the tile shapes are fixed in its source).

    The defaults are the sweep's choice (docs/verify-kernel-log.md#the-own-sm90-kernel-page-size-1; 8 heads x
    9 drafts): the setting whose worst ratio to FlashMLA's time over the benchmark's rows is lowest.
    min_tiles: fewest 64-token KV tiles per CTA; the batch's tiles are spread evenly over one
    CTA per SM (per row block), so this only matters for short contexts. 1 and 2 tie from 16k
    on; 4 is slower below 64k.
    pdl: launch the combine kernel as a programmatic dependent of the split kernel, so its launch
    and tree part overlap the split kernel's end. 1-4 µs faster on batches and below 16k (one
    request of 1k: 20.5 against 24.2 µs), 2-3 µs slower for one request of 16k-185k.
    evict_first: stream the KV pool through L2 with the evict-first policy (the partials, read
    right after, stay); only with one row block, since several row blocks re-read the KV.
    4-9% faster at 64k-185k.
    combine_slices: CTAs of the combine kernel per query row (1, 2 or 4), each for that share of
    the 512 values; 0 picks by the batch (``combine_slices``).
    short_batches: a batch with no more 64-token tiles than CTAs along the KV (each would get one
    tile or none) runs its rows in blocks of 48 instead of 72 (the kernel decides per call from
    the lengths): more CTAs, each computing fewer rows. 8 heads x 9 drafts on an H100: 2 x 1k
    21.7 -> 19.1 µs, 8 x 1k 26.0 -> 24.6, 2 x 4k 27.8 -> 26.0, level from 4 x 4k on.
    tma_runs: 16 tokens of a tile whose slot ids run on (every full tile of a pool in 64-token
    pages; runs in a page-1 pool, as a sorted free list leaves them) are copied by TMA, one box
    per 64 values, instead of gathered 16 bytes per thread; each producer warp checks its 16 ids
    on the device. 8 heads x 9 drafts on an H100, page 64: one request of 185k 104.2 -> 97.5 µs,
    8 of 56k-131k 394.8 -> 368.5; page 1 in runs, 5 of 3k-150k 160.0 -> 149.6; level with
    shuffled slots.
    """

    min_tiles: int = 1
    pdl: bool = True
    evict_first: bool = True
    combine_slices: int = 0
    short_batches: bool = True
    tma_runs: bool = True

    def __post_init__(self) -> None:
        if self.combine_slices not in (0, 1, 2, 4):
            raise ValueError("combine_slices must be 0 (by the batch), 1, 2 or 4, "
                             f"got {self.combine_slices}")


# Slices per row only while the combine grid is at most this many CTAs per SM.
COMBINE_SLICE_CTAS_PER_SM = 3


def combine_slices(rows: int, num_sms: int) -> int:
    """CTAs per query row for the combine kernel: the most of 4, 2 and 1 whose grid is at most 3
    CTAs per SM, else 1.

    A row's splits are merged by its CTAs' threads in parallel: one request (few rows, a split per
    SM) wants 4 and two requests 2, but from four requests on a slice per row is as fast or faster,
    since each CTA computes the row's tree scores again, and the kernel then loads three draft keys
    at a time while the grid fits 5 CTAs per SM (docs/verify-kernel-log.md#the-own-sm90-kernel-page-size-1).
    """
    return next((s for s in (4, 2) if rows * s <= COMBINE_SLICE_CTAS_PER_SM * num_sms), 1)


def composed_refusal(page_size: Optional[int], max_draft: int) -> Optional[str]:
    """Why the composed path cannot serve this pool and draft width, or None if it can."""
    if page_size is None or page_size % mla_verify_composed.PAGE:
        got = "unknown" if page_size is None else str(page_size)
        return (f"needs the KV pool in {mla_verify_composed.PAGE}-token pages (SGLang --page-size "
                f"{mla_verify_composed.PAGE}), page size {got}")
    if max_draft > mla_verify_composed.MAX_TREE:
        return (f"serves at most {mla_verify_composed.MAX_TREE} drafts per request, "
                f"max_draft={max_draft}")
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def select_backend(requested: Backend, capability: Optional[tuple[int, int]],
                   load_library: Callable[[], object],
                   load_flash: Optional[Callable[[], object]] = None,
                   page_size: Optional[int] = None, max_draft: int = 1) -> str:
    """'composed', 'sm90' or 'triton' for a device of ``capability`` (None: not a CUDA device).

    "auto" takes the composed path on compute capability 9.0 where ``load_flash`` returns
    FlashMLA and ``composed_refusal`` has nothing against the pool (one warning line names the
    reason where it has), else the Hopper kernel if ``load_library`` returns it (it warns once
    and returns None where nvcc is missing or the build fails), else Triton. Without
    ``load_flash`` the composed path is not considered. "composed" and "sm90" insist
    (ValueError for the wrong device or pool, RuntimeError if the piece cannot be had).
    """
    if requested not in ("auto", "composed", "sm90", "triton"):
        raise ValueError(f"backend must be auto, composed, sm90 or triton, got {requested!r}")
    if requested == "triton":
        return "triton"
    hopper = capability == (9, 0)
    if requested == "composed":
        if not hopper:
            raise ValueError(f"the composed backend needs compute capability 9.0, got {capability}")
        why = composed_refusal(page_size, max_draft)
        if why is not None:
            raise ValueError(f"the composed backend {why}")
        if load_flash is None or load_flash() is None:
            raise RuntimeError("the composed backend needs sgl_flash_mla (see the warning above)")
        return "composed"
    if requested == "sm90":
        if not hopper:
            raise ValueError(f"the sm90 backend needs compute capability 9.0, got {capability}")
        if load_library() is None:
            raise RuntimeError("the sm90 backend could not be built (see the warning above)")
        return "sm90"
    own = "sm90" if hopper and load_library() is not None else "triton"
    if hopper and load_flash is not None:
        why = composed_refusal(page_size, max_draft)
        if why is None:
            if load_flash() is not None:  # it warns itself where it does not import
                return "composed"
        else:
            _warn_once(f"moeplace: the composed MLA verify path (FlashMLA) {why}; the {own} "
                       "kernel runs")
    return own


def prefer_composed(num_heads: int, max_draft: int, own_backend: str = "sm90") -> bool:
    """Whether "auto" runs the composed path (host-known shapes only, so the choice is fixed per
    captured CUDA graph; the contexts live on the device): where the own sm90 kernel would need
    several row blocks (more than 72 query rows, each block re-reading the KV) or cannot run. At 8
    heads x 9 drafts the own kernel is at or under the composed path's time on one request and on
    the mixed long batches, and within 1.5 µs either way on short ones
    (docs/verify-kernel-log.md#segment-cost-in-the-split-plan)."""
    if max_draft > mla_verify_composed.MAX_TREE:
        return False
    one_block = num_heads * max_draft <= mla_verify_sm90.ROWS_PER_BLOCK[-1]
    return not (own_backend == "sm90" and one_block)


def sm90_rows(rows: int) -> tuple[int, int, int]:
    """(variant, rows per block, row blocks) of the Hopper kernel for ``rows`` = H * D_max.

    At most 72 rows per CTA (40 + 32 over two consumer warpgroups: their fp32 accumulators,
    512 x rows / 128 threads, fill the registers); more rows take several row blocks, each
    re-reading the KV (mostly from L2: the row blocks of one KV range are adjacent in the grid).
    """
    sizes = mla_verify_sm90.ROWS_PER_BLOCK
    blocks = math.ceil(rows / sizes[-1])
    per_block = math.ceil(rows / blocks)
    variant = next(i for i, n in enumerate(sizes) if n >= per_block)
    return variant, sizes[variant], blocks


class MlaVerify:
    """MLA target-verify attention with a preallocated split workspace.

    Workspace (Triton): partial outputs [split_slots, R_pad, 512] bf16 and their log-sum-exp
    [split_slots, R_pad] fp32, R_pad = row_blocks * (block_m + tail_m). A batch of B requests
    gets split_slots // B splits per request at most (capped at 256).
    Workspace (sm90): the same tensors with split_slots = grid_x + max_bs (one CTA per SM and
    row block along the KV; a CTA whose tiles span requests writes one partial per request).
    Composed: the own kernel's workspace (it serves what ``prefer_composed`` leaves to it) plus
    ``ComposedVerify``'s block table, lengths and padded queries. ``page_size``: tokens per page
    of the KV pool (the composed path needs a multiple of 64; None: unknown, so not composed).
    """

    def __init__(
        self,
        num_heads: int,
        max_draft: int,
        max_bs: int,
        device: torch.device | str = "cuda",
        sm_scale: Optional[float] = None,
        split_slots: Optional[int] = None,
        config: Optional[TileConfig] = None,
        backend: Backend = "auto",
        sm90_config: Optional[Sm90Config] = None,
        page_size: Optional[int] = None,
        merge_config: Optional[mla_verify_composed.MergeConfig] = None,
    ) -> None:
        if num_heads < 1 or max_draft < 1 or max_bs < 1:
            raise ValueError(f"need num_heads, max_draft, max_bs >= 1, got "
                             f"{num_heads}, {max_draft}, {max_bs}")
        self.device = torch.device(device)
        self.num_heads = num_heads
        self.max_draft = max_draft
        self.max_bs = max_bs
        self.sm_scale = sm_scale if sm_scale is not None else KV_DIM ** -0.5
        cuda = self.device.type == "cuda"
        capability = torch.cuda.get_device_capability(self.device) if cuda else None
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if cuda else 8)
        if backend == "auto":
            # An explicit Triton tile config asks for the Triton kernel.
            backend = "triton" if config is not None else os.environ.get(BACKEND_ENV, "auto")
        if max_draft > mla_verify_sm90.MAX_DRAFT and backend == "auto":
            backend = "triton"
        self.forced = backend != "auto"
        self.page_size = page_size
        self.backend = select_backend(backend, capability, mla_verify_sm90.load,
                                      mla_verify_composed.load_flash_mla if cuda else None,
                                      page_size, max_draft)
        self.composed = None
        self.own_backend = self.backend
        if self.backend == "composed":
            self.composed = mla_verify_composed.ComposedVerify(
                mla_verify_composed.load_flash_mla(), num_heads, max_draft, max_bs, self.device,
                merge_config)
            self.own_backend = select_backend("auto", capability, mla_verify_sm90.load)
        if self.own_backend == "sm90":
            self._init_sm90(sm90_config or Sm90Config())
        else:
            major = capability[0] if capability else 9
            self._init_triton(config or default_config(num_heads, max_draft, major), split_slots)

    def _init_triton(self, config: TileConfig, split_slots: Optional[int]) -> None:
        self.config = config
        self.split_slots = split_slots or max(2 * self.num_sms, 8 * self.max_bs)
        self.rows_pad = config.row_blocks * (config.block_m + config.tail_m)
        self._alloc_workspace()

    def _init_sm90(self, config: Sm90Config) -> None:
        if self.max_draft > mla_verify_sm90.MAX_DRAFT:
            raise ValueError(f"the sm90 kernel serves at most {mla_verify_sm90.MAX_DRAFT} draft "
                             f"tokens per request, got max_draft={self.max_draft}")
        self.sm90_config = config
        self.sm90 = mla_verify_sm90.load()
        self.sm90.setup(self.device.index if self.device.index is not None
                        else torch.cuda.current_device())
        rows = self.num_heads * self.max_draft
        self.variant, rows_per_block, self.row_blocks = sm90_rows(rows)
        # The short-batch layout (Sm90Config.short_batches): blocks of the library's short rows,
        # where a block holds more rows than that.
        short = self.sm90.short_rows
        self.short_blocks = math.ceil(rows / short) if config.short_batches and \
            rows_per_block > short else 0
        self.rows_pad = max(self.row_blocks * rows_per_block, self.short_blocks * short)
        self.grid_x = max(1, min(mla_verify_sm90.MAX_SPLITS, self.num_sms // self.row_blocks))
        self.split_slots = self.grid_x + self.max_bs
        self._alloc_workspace()
        self._split_args = mla_verify_sm90.SplitParams()
        self._combine_args = mla_verify_sm90.CombineParams()

    def _alloc_workspace(self) -> None:
        self.o_part = torch.empty((self.split_slots, self.rows_pad, V_DIM),
                                  dtype=torch.bfloat16, device=self.device)
        self.l_part = torch.empty((self.split_slots, self.rows_pad),
                                  dtype=torch.float32, device=self.device)

    @property
    def path(self) -> str:
        """The kernel that serves every batch: 'composed', 'sm90' or 'triton'."""
        if self.backend == "composed" and (self.forced or prefer_composed(
                self.num_heads, self.max_draft, self.own_backend)):
            return "composed"
        return self.own_backend

    def reserve_kv(self, kv_tokens: int) -> None:
        """Size the composed path's per-batch buffers for kv_indices of ``kv_tokens`` slot ids
        (call outside graph capture, as SGLang's ``init_cuda_graph_state`` is); else a no-op."""
        if self.composed is not None:
            self.composed.reserve(self.max_bs, kv_tokens)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
             kv_indices: torch.Tensor) -> Optional[mla_verify_composed.ComposedPlan]:
        """Per-batch state for ``forward(..., plan=)``: FlashMLA's block table, lengths and
        scheduler metadata where the composed path serves this batch, else None (the own kernels
        derive their split plan inside each launch). Device work only: graph-capturable."""
        if self.path != "composed":
            return None
        return self.composed.plan(qo_indptr, kv_indptr, kv_indices)

    def max_splits(self, bs: int) -> int:
        """Split grid size per request for a batch of ``bs`` (fixed per captured graph)."""
        return max(1, min(256, self.split_slots // bs))

    def forward(
        self,
        q: torch.Tensor,
        k_ext: torch.Tensor,
        v_ext: torch.Tensor,
        kv_pool: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        mask_layout: MaskLayout = "causal",
        mask_indptr: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        plan: Optional[mla_verify_composed.ComposedPlan] = None,
    ) -> torch.Tensor:
        """Attention of every draft row over its request's prefix and (tree-masked) drafts.

        q [T, H, 576] bf16; k_ext [T, 1|H_kv, 576]; v_ext [T, 1, >=512] (first 512 read);
        kv_pool [slots, 1, 576] bf16 (V = first 512); qo_indptr [B+1] int32 (draft rows of
        request b are qo_indptr[b]:qo_indptr[b+1], at most max_draft); kv_indptr [B+1],
        kv_indices [>= kv_indptr[B]] one slot id per token (any page size); mask uint8/bool
        laid out as ``mask_layout`` ("qlen_only": D x D per request at b * D_max^2 or mask_indptr[b];
        "full": SGLang FULL_MASK, D x (N + D) at mask_indptr[b], prefix columns ignored);
        out [T, H, 512]; lse [T, H] fp32 natural-log log-sum-exp, optional.
        plan: ``self.plan(...)`` of this batch (the same kv_indptr and kv_indices tensors); the
        composed path plans itself without it (once per call instead of once per batch).
        Returns out. No host sync, and no allocation when ``out`` is given (the composed path:
        FlashMLA allocates its own outputs, from the graph's pool inside a capture).
        """
        bs = qo_indptr.shape[0] - 1
        path = self.path
        self._check(q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, kv_indices, mask,
                    mask_layout, mask_indptr, out, bs, path)
        if out is None:
            out = torch.empty((q.shape[0], q.shape[1], V_DIM), dtype=q.dtype, device=q.device)
        if path == "composed":
            if plan is None or plan.bs != bs or plan.kv_indptr is not kv_indptr \
                    or plan.kv_indices is not kv_indices:
                plan = self.composed.plan(qo_indptr, kv_indptr, kv_indices)
            self.composed.forward(plan, q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, mask,
                                  _MASK_MODES[mask_layout], mask_indptr, out, lse, self.sm_scale)
            return out
        if path == "sm90":
            self._forward_sm90(q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, kv_indices, mask,
                               mask_layout, mask_indptr, out, lse, bs)
            return out
        cfg = self.config
        max_splits = self.max_splits(bs)
        target = max(1, math.ceil(cfg.programs_per_sm * self.num_sms / cfg.row_blocks))
        if cfg.tail_m and bs == 1:
            # One request: half as many splits puts each split's main and tail programs in the
            # same wave, sharing its KV through L2 (faster at 64k+); batches gain from more.
            target = max(1, target // 2)
        tiles = cfg.row_blocks * (2 if cfg.tail_m > 0 else 1) * cfg.dv_split
        mode = _MASK_MODES[mask_layout]
        # Dummies for absent optional tensors: never read (the constexpr flags say so).
        mask_arg = mask.view(torch.uint8) if mask is not None else kv_indptr
        mask_indptr_arg = mask_indptr if mask_indptr is not None else kv_indptr
        lse_arg = lse if lse is not None else self.l_part
        self.last_split_kernel = _verify_split_kernel[(tiles, max_splits, bs)](
            q, k_ext, v_ext, kv_pool, kv_indptr, kv_indices, qo_indptr, mask_arg,
            mask_indptr_arg, self.o_part, self.l_part,
            bs, self.num_heads, max_splits, target, self.rows_pad, self.sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv_pool.stride(0), k_ext.stride(0), v_ext.stride(0),
            D_MAX=self.max_draft, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m, BLOCK_N=cfg.block_n,
            BLOCK_D=max(16, triton.next_power_of_2(self.max_draft)), MIN_CHUNK=cfg.min_chunk,
            MASK_MODE=mode, HAS_MASK_INDPTR=mask_indptr is not None, DN=V_DIM, DP=ROPE_DIM,
            UPCAST=_INTERPRET, DV_SPLIT=cfg.dv_split,
            TAIL_BLOCK_N=cfg.tail_block_n or cfg.block_n, IDX_PREFETCH=cfg.idx_prefetch,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        block_dv = 128
        _verify_merge_kernel[(bs * self.max_draft, self.num_heads, V_DIM // block_dv)](
            self.o_part, self.l_part, kv_indptr, qo_indptr, out, lse_arg,
            bs, self.num_heads, max_splits, target, self.rows_pad,
            out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
            D_MAX=self.max_draft, SPLITS_P2=max(16, triton.next_power_of_2(max_splits)),
            SPLIT_CHUNK=16, BLOCK_DV=block_dv, BLOCK_N=cfg.block_n, MIN_CHUNK=cfg.min_chunk,
            HAS_LSE=lse is not None, DN=V_DIM, num_warps=4,
        )
        return out

    def _forward_sm90(self, q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, kv_indices, mask,
                      mask_layout, mask_indptr, out, lse, bs) -> None:
        """Fill the two kernels' argument structs and launch on the current stream."""
        cfg = self.sm90_config
        scale_log2 = self.sm_scale * LOG2E
        sp = self._split_args
        sp.q, sp.kv, sp.kv_indices = q.data_ptr(), kv_pool.data_ptr(), kv_indices.data_ptr()
        sp.kv_indptr, sp.qo_indptr = kv_indptr.data_ptr(), qo_indptr.data_ptr()
        sp.o_part, sp.l_part = self.o_part.data_ptr(), self.l_part.data_ptr()
        sp.q_stride_t, sp.q_stride_h, sp.kv_stride = q.stride(0), q.stride(1), kv_pool.stride(0)
        sp.idx64 = kv_indices.dtype == torch.int64
        sp.kvp64 = kv_indptr.dtype == torch.int64
        sp.qop64 = qo_indptr.dtype == torch.int64
        sp.batch, sp.heads, sp.row_blocks, sp.rows_pad = bs, self.num_heads, self.row_blocks, \
            self.rows_pad
        sp.grid_x, sp.min_tiles = self.grid_x, cfg.min_tiles
        sp.evict_first = cfg.evict_first and self.row_blocks == 1
        sp.scale_log2 = scale_log2
        sp.short_blocks = self.short_blocks
        sp.tma_runs, sp.kv_rows = cfg.tma_runs, kv_pool.shape[0]
        cp = self._combine_args
        cp.q, cp.k_ext, cp.v_ext = q.data_ptr(), k_ext.data_ptr(), v_ext.data_ptr()
        cp.mask = mask.data_ptr() if mask is not None else 0
        cp.mask_indptr = mask_indptr.data_ptr() if mask_indptr is not None else 0
        cp.mip64 = mask_indptr is not None and mask_indptr.dtype == torch.int64
        cp.kv_indptr, cp.qo_indptr = kv_indptr.data_ptr(), qo_indptr.data_ptr()
        cp.o_part, cp.l_part = self.o_part.data_ptr(), self.l_part.data_ptr()
        cp.out = out.data_ptr()
        cp.lse = lse.data_ptr() if lse is not None else 0
        cp.q_stride_t, cp.q_stride_h = q.stride(0), q.stride(1)
        cp.ke_stride, cp.ve_stride = k_ext.stride(0), v_ext.stride(0)
        cp.out_stride_t, cp.out_stride_h = out.stride(0), out.stride(1)
        cp.lse_stride_t, cp.lse_stride_h = (lse.stride(0), lse.stride(1)) if lse is not None \
            else (0, 0)
        cp.kvp64, cp.qop64 = sp.kvp64, sp.qop64
        cp.mask_mode = _MASK_MODES[mask_layout]
        cp.batch, cp.heads, cp.d_max, cp.rows_pad = bs, self.num_heads, self.max_draft, \
            self.rows_pad
        cp.grid_x, cp.min_tiles, cp.scale_log2 = self.grid_x, cfg.min_tiles, scale_log2
        cp.slices = cfg.combine_slices or combine_slices(bs * self.max_draft * self.num_heads,
                                                         self.num_sms)
        cp.short_blocks, cp.grid_size = self.short_blocks, self.grid_x * self.row_blocks
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.sm90.forward(self.variant, sp, cp, stream, q.device.index, cfg.pdl)

    def _check(self, q, k_ext, v_ext, kv_pool, qo_indptr, kv_indptr, kv_indices, mask,
               mask_layout, mask_indptr, out, bs, path) -> None:
        """Raise ValueError on a malformed call; reads shapes, dtypes and strides only."""
        if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != KV_DIM:
            raise ValueError(f"q must be [T, {self.num_heads}, {KV_DIM}], got {tuple(q.shape)}")
        if kv_pool.dim() != 3 or kv_pool.shape[1] != 1 or kv_pool.shape[2] != KV_DIM:
            raise ValueError(f"kv_pool must be [slots, 1, {KV_DIM}], got {tuple(kv_pool.shape)}")
        if k_ext.shape[0] != q.shape[0] or k_ext.shape[-1] != KV_DIM:
            raise ValueError(f"k_ext must be [T, 1, {KV_DIM}], got {tuple(k_ext.shape)}")
        if v_ext.shape[0] != q.shape[0] or v_ext.shape[-1] < V_DIM:
            raise ValueError(f"v_ext must be [T, 1, >={V_DIM}], got {tuple(v_ext.shape)}")
        for name, t in (("q", q), ("k_ext", k_ext), ("v_ext", v_ext), ("kv_pool", kv_pool)):
            if t.dtype != torch.bfloat16:
                raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q on {q.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
        if bs > self.max_bs or bs < 1:
            raise ValueError(f"batch of {bs} requests outside 1..max_bs={self.max_bs}")
        if q.shape[0] > bs * self.max_draft:
            raise ValueError(f"{q.shape[0]} draft rows exceed {bs} x max_draft={self.max_draft}")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            if t.dtype not in (torch.int32, torch.int64) or t.shape != (bs + 1,):
                raise ValueError(f"{name} must be int32/int64 [B+1={bs + 1}], got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if kv_indices.dtype not in (torch.int32, torch.int64) or kv_indices.dim() != 1:
            raise ValueError(f"kv_indices must be a 1-d int32/int64 tensor")
        if mask_layout not in _MASK_MODES:
            raise ValueError(f"mask_layout must be one of {sorted(_MASK_MODES)}")
        if (mask is None) != (mask_layout == "causal"):
            raise ValueError("give a mask exactly when mask_layout is not 'causal'")
        if mask is not None and mask.dtype not in (torch.bool, torch.uint8, torch.int8):
            raise ValueError(f"mask must be bool/uint8, got {mask.dtype}")
        if mask_layout == "full" and mask_indptr is None:
            raise ValueError("the 'full' mask layout needs mask_indptr")
        if path != "triton":
            # The kernels (FlashMLA's too) load whole rows with 16-byte vector loads.
            for name, t in (("q", q), ("k_ext", k_ext), ("v_ext", v_ext), ("kv_pool", kv_pool)):
                if t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
                    raise ValueError(f"{name} rows must be 16-byte aligned for the sm90 kernel")
        # The sm90 combine kernel stores four output values at a time.
        if path == "sm90" and out is not None and (
                out.data_ptr() % 8 or out.stride(-1) != 1 or any(st % 4 for st in out.stride()[:-1])):
            raise ValueError("out rows must be 8-byte aligned for the sm90 kernel")
