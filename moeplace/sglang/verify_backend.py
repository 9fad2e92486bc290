"""Route SGLang 0.5.23's MLA TARGET_VERIFY attention to moeplace's split-KV tree kernel.

Route: an AROUND hook on ``TritonAttnBackend.__init__`` and ``init_cuda_graph_state``
rather than a new backend name. A new name trips SGLang's name checks for draft backends
(``srt/speculative/draft_utils.py``) and for topk > 1 with page size > 1
(``srt/arg_groups/speculative_hook.py``). ``TritonAttnBackend.forward_extend`` already
has a verify seam: when ``use_verify_shared_kv`` is set it calls ``verify_shared_kv_fwd``
(same arguments as ``extend_attention_fwd``) on TARGET_VERIFY and falls back to
``extend_attention_fwd`` when that returns False. We fill the seam with
``moeplace_verify_fwd`` for MLA models; everything else stays SGLang's Triton backend.

The verify mask: we read whatever layout SGLang's tree builder wrote, as the backend's
``verify_mask`` names it (FULL_MASK, ``draft x (context + draft)`` cells per request, on GPUs;
the kernel reads only the tree columns). We never swap in a smaller layout: NGRAM builds its
FULL_MASK without asking the backend and copies it into the captured buffer, so a QLEN_ONLY
buffer broke the target-verify graph capture (seen in a live server: 648 vs 720 cells at
batch 8 x 9 drafts).

Per-batch plan: the composed path (FlashMLA's decode for the prefix, on sm_90 with
``--page-size 64``) needs a block table, lengths and FlashMLA's scheduler metadata per batch. We
build them where SGLang builds its own metadata, after ``init_forward_metadata`` (eager) and after
``init_forward_metadata_in_graph`` (recorded into the target-verify graph, so every replay
rebuilds them from the graph's kv_indptr / kv_indices buffers): AROUND hooks, both no-ops outside
TARGET_VERIFY. Every layer's ``forward`` then reuses the plan (``MlaVerify`` checks it was made
from the tensors it is given, and plans anew otherwise).

Enabled only when ``MOEPLACE_VERIFY_KERNEL=1`` (checked by ``install``). torch, triton and
SGLang are imported inside the functions: ``import moeplace`` never imports them.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

ENV_FLAG = "MOEPLACE_VERIFY_KERNEL"
_INSTALLED_ATTR = "_moeplace_verify_installed"


def enabled() -> bool:
    """Whether the environment asks for the verify kernel."""
    from moeplace.sglang.settings import switch

    return switch(ENV_FLAG)


def install() -> None:
    """Patch SGLang's TritonAttnBackend (idempotent). A no-op unless MOEPLACE_VERIFY_KERNEL=1."""
    if not enabled():
        return
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if getattr(TritonAttnBackend, _INSTALLED_ATTR, False):
        return
    orig_init = TritonAttnBackend.__init__
    orig_graph_state = TritonAttnBackend.init_cuda_graph_state
    orig_metadata = TritonAttnBackend.init_forward_metadata
    orig_in_graph = TritonAttnBackend.init_forward_metadata_in_graph

    @functools.wraps(orig_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        attach(self)

    @functools.wraps(orig_graph_state)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any,
                              **kwargs: Any) -> None:
        orig_graph_state(self, max_bs, max_num_tokens, *args, **kwargs)
        state = getattr(self, "_moeplace_verify", None)
        if state is not None:
            state.reserve(max_bs)  # workspace for the largest captured batch, before any capture

    @functools.wraps(orig_metadata)
    def init_forward_metadata(self, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
        orig_metadata(self, forward_batch, *args, **kwargs)
        plan_batch(self, forward_batch)

    @functools.wraps(orig_in_graph)
    def init_forward_metadata_in_graph(self, forward_batch: Any, *args: Any,
                                       **kwargs: Any) -> None:
        orig_in_graph(self, forward_batch, *args, **kwargs)
        plan_batch(self, forward_batch)

    TritonAttnBackend.__init__ = __init__
    TritonAttnBackend.init_cuda_graph_state = init_cuda_graph_state
    TritonAttnBackend.init_forward_metadata = init_forward_metadata
    TritonAttnBackend.init_forward_metadata_in_graph = init_forward_metadata_in_graph
    setattr(TritonAttnBackend, _INSTALLED_ATTR, True)


def plan_batch(backend: Any, forward_batch: Any) -> None:
    """After SGLang's metadata of a TARGET_VERIFY batch: the kernels' per-batch plan."""
    state = getattr(backend, "_moeplace_verify", None)
    if state is not None and forward_batch.forward_mode.is_target_verify():
        state.plan(backend.forward_metadata)


def attach(backend: Any) -> bool:
    """Point ``backend``'s verify seam at the moeplace kernel if it is an MLA target backend."""
    if not getattr(backend, "use_mla", False) or getattr(backend, "is_draft_runner", False):
        return False
    # Any page size: SGLang's Triton backend lists one slot id per token (kv_indptr is the
    # cumulative sequence length; its kernels' paged address math reduces to slot * stride).
    # With pages of 64 (or a multiple) the slot ids are page-aligned, which the composed path
    # (FlashMLA) needs: MlaVerify is told the page size and says so where it cannot use it.
    # Decode-context parallelism shards the prefix across ranks: not ours.
    if not getattr(backend, "num_draft_tokens", None) or getattr(backend, "dcp_size", 1) != 1:
        return False
    state = VerifyState(backend)
    backend._moeplace_verify = state
    backend.use_verify_shared_kv = True
    backend.verify_shared_kv_fwd = state.forward
    return True


class VerifyState:
    """Per-backend kernel objects (one per head count) and the fallback rules."""

    announced = False

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.max_draft = int(backend.num_draft_tokens)
        self.page_size = int(getattr(backend, "page_size", 1) or 1)
        self.max_bs = 1
        self.ops: dict[int, Any] = {}
        self.plans: dict[int, Any] = {}  # per head count: MlaVerify.plan of the current batch

    def reserve(self, max_bs: int) -> None:
        """Allocate workspaces for batches up to ``max_bs`` (call outside graph capture)."""
        self.max_bs = max(self.max_bs, max_bs)
        self.ops.clear()
        self.plans.clear()
        op = self._op(int(self.backend.num_head))
        graph_kv = getattr(self.backend, "cuda_graph_kv_indices", None)
        if graph_kv is not None:  # the graphs' kv_indices buffer: plan tables sized before capture
            op.reserve_kv(graph_kv.numel())
        if not VerifyState.announced:   # one line per process: the kernel is on, and which build serves
            VerifyState.announced = True
            chunks = op.composed.chunks if op.composed is not None and op.path == "composed" else 0
            batched = max((b for b in range(2, self.max_bs + 1) if op.composed.chunks_for(b)),
                          default=0) if chunks else 0
            print(f"moeplace verify kernel on: {op.backend} backend, {op.num_heads} heads x {self.max_draft} "
                  f"drafts, batches up to {self.max_bs}"
                  + (f"; one-request batches as {chunks} FlashMLA chunk requests" if chunks else "")
                  + (f", batches of 2-{batched} requests too" if batched else "")
                  + (f"; every batch on the {op.path} kernel" if op.path != op.backend else ""),
                  file=sys.stderr, flush=True)

    def _op(self, num_heads: int) -> Any:
        op = self.ops.get(num_heads)
        if op is None:
            from moeplace_kernels.mla_verify_api import MlaVerify

            op = MlaVerify(num_heads, self.max_draft, self.max_bs, device=self.backend.device,
                           page_size=self.page_size)
            self.ops[num_heads] = op
        return op

    def plan(self, metadata: Any) -> None:
        """Per-batch plans from SGLang's ForwardMetadata (qo_indptr, kv_indptr, kv_indices)."""
        import torch

        bs = metadata.qo_indptr.shape[0] - 1
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if bs > self.max_bs and not capturing:
            self.reserve(bs)
        elif not self.ops and not capturing:
            self._op(int(self.backend.num_head))
        self.plans = {heads: op.plan(metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices)
                      for heads, op in self.ops.items() if bs <= op.max_bs}

    def mask_layout(self) -> str:
        """'qlen_only' when the backend's verify buffer is laid out D x D, else 'full'."""
        vm = getattr(self.backend, "_verify_mask", None)
        if vm is not None and getattr(vm.mode, "name", "") == "QLEN_ONLY":
            return "qlen_only"
        return "full"

    def forward(self, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                sm_scale=None, logit_cap=0.0, sliding_window_size=-1, sinks=None,
                window_kv_offsets=None, xai_temperature_len=-1, max_bs=None, **_: Any) -> bool:
        """``verify_shared_kv_fwd``'s contract: True if o was written, False to fall back.

        q [T, H, 576]; k [T, 1, 576]; v [T, 1, 512]; o [T, H, 512]; k_buffer [slots, 1, 576]
        (v_buffer is its first 512 values). Decided from shapes and flags only: no host sync.
        """
        import torch

        layout = "causal" if custom_mask is None else self.mask_layout()
        bs = qo_indptr.shape[0] - 1
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        refusal = None
        if not self.supports(q, k, v, k_buffer, custom_mask, is_causal, k_scale, v_scale,
                             logit_cap, sliding_window_size, sinks, xai_temperature_len):
            refusal = "unsupported dtype, scale, cap, window or sinks"
        elif q.shape[0] > bs * self.max_draft:
            refusal = f"{q.shape[0]} draft rows for {bs} requests exceed {self.max_draft} each"
        elif bs > self.max_bs and capturing:
            refusal = f"batch {bs} above the reserved {self.max_bs} inside a graph capture"
        if refusal is not None:
            if layout == "qlen_only":  # SGLang's kernel would misread the D x D mask
                raise RuntimeError(f"moeplace verify kernel cannot serve this call ({refusal}) "
                                   f"and the verify mask is QLEN_ONLY; unset {ENV_FLAG}")
            return False
        if bs > self.max_bs:
            self.reserve(bs)
        op = self._op(q.shape[1])
        if sm_scale is not None:
            op.sm_scale = float(sm_scale)
        if layout != "full":
            mask_indptr = None  # none, or D x D per request at b * D^2
        op.forward(q, k, v, k_buffer, qo_indptr, kv_indptr, kv_indices, mask=custom_mask,
                   mask_layout=layout, mask_indptr=mask_indptr, out=o,
                   plan=self.plans.get(q.shape[1]))
        return True

    def supports(self, q, k, v, k_buffer, custom_mask, is_causal, k_scale, v_scale, logit_cap,
                 sliding_window_size, sinks, xai_temperature_len) -> bool:
        """Only plain bf16 MLA verify (576/512, one latent head, no scales/caps/windows)."""
        import torch

        if sinks is not None or (logit_cap or 0) > 0 or (xai_temperature_len or -1) > 0:
            return False
        if sliding_window_size is not None and sliding_window_size > 0:
            return False
        if k_scale not in (None, 1.0) or v_scale not in (None, 1.0):
            return False
        if q.dim() != 3 or q.shape[2] != 576 or v.shape[-1] != 512 or k.shape[-1] != 576:
            return False
        if k_buffer.dim() != 3 or k_buffer.shape[1:] != (1, 576):
            return False
        if custom_mask is None and not is_causal:
            return False
        return all(t.dtype == torch.bfloat16 for t in (q, k, v, k_buffer))
