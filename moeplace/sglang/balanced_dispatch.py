"""Balanced dispatch inside SGLang: each MoE layer's logical top-k ids -> physical slots by moeplace's rule.

``MOEPLACE_DISPATCH=balanced`` replaces SGLang's ``topk_ids_logical_to_physical`` (an AROUND hook through
``HookRegistry``; ``topk.py`` imported the name, the registry patches it there too). Per MoE layer and
forward pass, all of the step's tokens for an expert go to one of its replicas, chosen so that the
busiest rank reads as few distinct experts as possible (``moeplace.balanced``; the GPU kernel is
``moeplace_kernels.balanced_dispatch``).

* Every rank must pick the same replicas, so the rule reads only the router's ids, which are the same
  on every rank when attention is tensor-parallel: with ``--moe-a2a-backend none`` (SGLang marks the
  dispatch ``rank_invariant``: every rank runs the MoE over the same tokens and the outputs are summed)
  or an all-to-all backend such as DeepEP without DP attention. Under DP attention each rank routes its
  own tokens and no rank sees the others' ids: the first call refuses to run, with one line.
* Batches of more than ``MOEPLACE_DISPATCH_MAX_TOKENS`` rows (default 64: prefill), or of more than the
  kernel's 1024 ids, go to SGLang's own rule, which balances tokens. The threshold is a host fact (the
  tensor's shape), so a CUDA graph captures one branch or the other.
* CUDA-graph safe: the layer's replica tables are derived on the device on the first (eager) call,
  with no host sync, and cached by the address of SGLang's per-layer map; the output goes to one of
  two preallocated buffers per layer, alternated per call, so the two micro-batches of two-batch
  overlap never share one. Rows past the forward's ``num_token_non_padded`` are padding: the rule
  ignores them, and SGLang masks them afterwards.
* Draft models (no dispatch info) and ``--ep-dispatch-algorithm lp`` keep SGLang's behaviour.
* A server with nothing to choose stops at start, with one line: expert parallelism of size 1 (one GPU
  holds every expert) or no expert with a second replica. SGLang then never calls the remap at all
  (or only with single replicas), so the rule would be silently off. Checked where SGLang builds its
  initial expert placement (``compute_initial_expert_location_metadata``, an AFTER hook).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

logger = logging.getLogger("moeplace.dispatch")

TARGET = "sglang.srt.eplb.expert_location_dispatch.topk_ids_logical_to_physical"
PLACEMENT = "sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata"
RULES = ("balanced",)
DEFAULT_MAX_TOKENS = 64
MAX_KERNEL_RANKS = 32


@dataclass(frozen=True)
class DispatchConfig:
    rule: str
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def from_env(cls) -> "DispatchConfig":
        """Read ``MOEPLACE_DISPATCH`` and ``MOEPLACE_DISPATCH_MAX_TOKENS``; ValueError says what is wrong."""
        rule = os.environ.get("MOEPLACE_DISPATCH", "").strip().lower()
        if rule not in RULES:
            raise ValueError(f"MOEPLACE_DISPATCH must be one of {', '.join(RULES)}, got {rule!r}")
        raw = os.environ.get("MOEPLACE_DISPATCH_MAX_TOKENS", str(DEFAULT_MAX_TOKENS)).strip()
        try:
            max_tokens = int(raw)
        except ValueError:
            max_tokens = 0
        if max_tokens < 1:
            raise ValueError(f"MOEPLACE_DISPATCH_MAX_TOKENS must be a positive integer, got {raw!r}")
        return cls(rule, max_tokens)


class _Layer:
    """One MoE layer's replica tables on the device and its two output buffers."""

    def __init__(self, info: Any, ranks: int, max_tokens: int) -> None:
        import torch

        l2p = info.partial_logical_to_all_physical_map                 # [E, X] slots by id, -1 padded
        per_rank = info.num_physical_experts // ranks
        valid = l2p >= 0
        big = info.num_physical_experts
        rank = torch.where(valid, l2p // per_rank, ranks)               # the padding goes to column R
        slots = torch.full((l2p.shape[0], ranks + 1), big, dtype=torch.int64, device=l2p.device)
        slots.scatter_reduce_(1, rank, torch.where(valid, l2p, big).to(torch.int64), reduce="amin")
        slots = slots[:, :ranks]
        has = slots < big
        self.slots = torch.where(has, slots, -1).to(torch.int32).contiguous()
        self.masks = (has.to(torch.int64) << torch.arange(ranks, device=l2p.device)).sum(dim=1).to(torch.int32)
        self.max_tokens = max_tokens
        self.buffers: list = []
        self.calls = 0

    def out_for(self, topk_ids):
        """A preallocated [N, K] buffer for this call's output (two per layer, alternated)."""
        import torch

        n, k = topk_ids.shape
        if not self.buffers or self.buffers[0].shape[1] != k or self.buffers[0].dtype != topk_ids.dtype:
            self.buffers = [torch.empty((self.max_tokens, k), dtype=topk_ids.dtype, device=topk_ids.device)
                            for _ in range(2)]
        self.calls += 1
        return self.buffers[self.calls % 2][:n]


class BalancedDispatch:
    """The AROUND hook's state: the configuration and each layer's tables."""

    def __init__(self, config: DispatchConfig) -> None:
        self.config = config
        self.layers: dict[int, _Layer] = {}
        self.prepared: set = set()
        self.checked = False

    def __call__(self, original: Callable, topk_ids, info, log2phy_prob=None):
        if info is None or info.ep_dispatch_algorithm == "lp" or topk_ids.dim() != 2 \
                or topk_ids.shape[0] > self.config.max_tokens:
            return original(topk_ids, info, log2phy_prob)
        if not self.checked:
            problem = configuration_problem(info)
            if problem:
                raise SystemExit(f"moeplace: MOEPLACE_DISPATCH=balanced cannot run here: {problem}")
            self.checked = True
        layer = self.layers.get(info.partial_logical_to_all_physical_map.data_ptr())
        if layer is None:
            layer = _Layer(info, ep_size(), self.config.max_tokens)
            self.layers[info.partial_logical_to_all_physical_map.data_ptr()] = layer
        if not topk_ids.is_cuda:
            return dispatch_on_host(topk_ids, layer, num_token_non_padded())
        from moeplace_kernels.balanced_dispatch import MAX_ENTRIES, balanced_dispatch, prepare

        if topk_ids.numel() > MAX_ENTRIES:   # the kernel's limit (more than 1024 ids: a prefill)
            return original(topk_ids, info, log2phy_prob)
        if topk_ids.device not in self.prepared:   # build the kernel before any graph is captured
            prepare(topk_ids.device)
            self.prepared.add(topk_ids.device)
        return balanced_dispatch(topk_ids, layer.masks, layer.slots, num_rows=num_token_non_padded(),
                                 out=layer.out_for(topk_ids))


def dispatch_on_host(topk_ids, layer: _Layer, num_rows=None):
    """The same rule for CPU tensors (SGLang's CPU backend, tests), through ``moeplace.balanced``."""
    import torch

    from moeplace.balanced import fast_rule_step

    ids = topk_ids.numpy().astype(np.int64)
    valid_rows = ids.shape[0] if num_rows is None else int(num_rows)
    masks = layer.masks.numpy().astype(np.int64)
    slots = layer.slots.numpy()
    live = ids[:valid_rows]
    counts = np.bincount(live[live >= 0], minlength=masks.shape[0])
    pick = fast_rule_step(counts, masks, slots.shape[1])
    first = np.argmax(slots >= 0, axis=1)                # the lowest rank holding each expert
    e = np.maximum(ids, 0)
    rank = np.where(np.arange(ids.shape[0])[:, None] < valid_rows, pick[e], first[e])
    out = np.where(ids >= 0, slots[e, np.maximum(rank, 0)], -1)
    return torch.from_numpy(out).to(topk_ids.dtype)


def configuration_problem(info: Any) -> str | None:
    """Why this server's ranks could pick different replicas (or the kernel cannot run), else None."""
    try:
        ranks = ep_size()
    except Exception as e:   # noqa: BLE001 (SGLang's context raises several kinds)
        return f"the expert-parallel size is not known ({e})"
    if ranks > MAX_KERNEL_RANKS:
        return f"the dispatch kernel handles up to {MAX_KERNEL_RANKS} expert-parallel ranks, this server has {ranks}"
    if info.rank_invariant:
        return None
    try:
        from sglang.srt.runtime_context import get_parallel

        dp = int(get_parallel().attn_dp_size)
    except Exception as e:   # noqa: BLE001
        return f"cannot tell whether DP attention is on ({e})"
    if dp > 1:
        return ("with DP attention each rank routes its own tokens, so ranks cannot agree on replicas; "
                "use tensor-parallel attention (no --enable-dp-attention)")
    return None


def nothing_to_choose(metadata: Any) -> str | None:
    """Why a server with this initial placement gives the rule no replica to choose, else None."""
    if metadata is None:
        return "SGLang built no expert placement"
    if int(metadata.ep_size) < 2:
        return ("this server runs expert parallelism of size 1 (one GPU holds every expert, so there "
                "is no replica to choose); use --ep-size 2 or more with spare slots")
    if int(metadata.logical_to_all_physical_map_num_valid.max()) < 2:
        return ("no expert has a second replica (start with spare slots: a placement from "
                "`moeplace optimize --dispatch balanced --redundant R`, through `moeplace launch`)")
    return None


def check_placement(metadata: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on SGLang's initial expert placement: stop a server where the rule has nothing to do."""
    problem = nothing_to_choose(metadata)
    if problem:
        print(f"moeplace: MOEPLACE_DISPATCH=balanced cannot run here: {problem}; "
              f"unset MOEPLACE_DISPATCH to serve with SGLang's own dispatch", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return None


def ep_size() -> int:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return int(get_global_expert_location_metadata().ep_size)


def num_token_non_padded():
    """The forward's count of real rows (a device scalar), or None outside a forward context."""
    from sglang.srt.model_executor.forward_context import get_forward_context, has_forward_context

    if not has_forward_context():
        return None
    bound = get_forward_context().moe_num_token_non_padded
    return bound() if bound is not None else None


_DISPATCH: BalancedDispatch | None = None


def install(config: DispatchConfig | None = None) -> BalancedDispatch:
    """Register the AROUND hook with SGLang's HookRegistry (SGLang applies it at plugin load).

    A bad ``MOEPLACE_DISPATCH*`` value stops the process with one line (exit 2) before SGLang starts.
    """
    global _DISPATCH
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if config is None:
        try:
            config = DispatchConfig.from_env()
        except ValueError as e:
            print(f"moeplace: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    _DISPATCH = BalancedDispatch(config)
    HookRegistry.register(TARGET, _DISPATCH, HookType.AROUND)
    HookRegistry.register(PLACEMENT, check_placement, HookType.AFTER)
    logger.info("moeplace balanced dispatch on (up to %d rows a batch)", config.max_tokens)
    return _DISPATCH
