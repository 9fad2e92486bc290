"""Balanced dispatch inside SGLang: each MoE layer's logical top-k ids -> physical slots by moeplace's rule.

``MOEPLACE_DISPATCH=balanced`` replaces SGLang's ``topk_ids_logical_to_physical`` (an AROUND hook through
``HookRegistry``; ``topk.py`` imported the name, the registry patches it there too). Per MoE layer and
forward pass, all of the step's tokens for an expert go to one of its replicas, chosen so that the
busiest rank reads as few distinct experts as possible (``moeplace.dispatch.balanced``; the GPU kernel is
``moeplace_kernels.balanced_dispatch``).

``MOEPLACE_DISPATCH=cost`` runs moeplace's rule by cost instead (``moeplace.dispatch.by_cost``): the balanced
rule, then, on a batch of at least ``q`` (token, expert) pairs or with an expert past its first row block, up
to 16 moves or splits of an expert's tokens between its replicas where they pay. It needs one of
``MOEPLACE_DISPATCH_Q``, q: how many pairs one expert read costs, or ``MOEPLACE_DISPATCH_WEIGHTS``,
``read,pair,block,block_m``: the rule's integer weights with the row-block term (``rule_weights``);
``moeplace launch`` sets the one the placement's cost model needs.

* Every rank must pick the same replicas, so the rule reads only the router's ids, which are the same
  on every rank when attention is tensor-parallel: with ``--moe-a2a-backend none`` (SGLang marks the
  dispatch ``rank_invariant``: every rank runs the MoE over the same tokens and the outputs are summed)
  or an all-to-all backend such as DeepEP without DP attention. Under DP attention each rank routes its
  own tokens and no rank sees the others' ids: the first call refuses to run, with one line.
* Batches of more than ``MOEPLACE_DISPATCH_MAX_TOKENS`` rows (default 64 for the balanced rule; 1024 for the
  rule by cost, every batch its kernel takes at top-8: SGLang's dynamic rule with as many spare slots measured
  26% slower at 576 tokens, far more than the kernel's time; BENCHMARKS.md#the-rule-by-cost), or of more than the kernel's 8192 ids, go to SGLang's own rule, which balances tokens. The
  threshold is a host fact (the tensor's shape), so a CUDA graph captures one branch or the other.
* CUDA-graph safe: the layer's replica tables are derived on the device on the first (eager) call,
  with no host sync, and cached by the address of SGLang's per-layer map (which SGLang's updater writes in
  place: after a re-placement ``refresh`` re-derives the tables into the same tensors); the output goes to one of
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
from typing import Any, Callable, Mapping

import numpy as np

from moeplace.dispatch.by_cost import MAX_WEIGHT, RuleWeights

logger = logging.getLogger("moeplace.dispatch")

TARGET = "sglang.srt.eplb.expert_location_dispatch.topk_ids_logical_to_physical"
PLACEMENT = "sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata"
RULES = ("balanced", "cost")
# rows; the rule by cost takes every batch its kernel takes at top-8 (8192 ids): BENCHMARKS.md#the-rule-by-cost
DEFAULT_MAX_TOKENS = {"balanced": 64, "cost": 1024}
MAX_KERNEL_RANKS = 32
MAX_BLOCK_M = 8192   # rows of a row block at most: the kernel's ids (moeplace_kernels.balanced_dispatch.MAX_ENTRIES)
# MOEPLACE_DISPATCH_MAX_TOKENS at most: a batch of more rows holds more than the kernel's 8192 ids at any top-k, so it
# keeps SGLang's rule anyway, and each layer preallocates two buffers of this many rows
MAX_TOKENS_SETTING = 8192


@dataclass(frozen=True)
class DispatchConfig:
    """rule: "balanced" or "cost"; max_tokens: the largest batch (rows) the rule takes; q: the rule by cost's
    weights (None for the balanced rule)."""

    rule: str
    max_tokens: int = DEFAULT_MAX_TOKENS["balanced"]
    q: RuleWeights | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DispatchConfig":
        """Read ``MOEPLACE_DISPATCH``, ``MOEPLACE_DISPATCH_MAX_TOKENS`` and ``MOEPLACE_DISPATCH_Q`` or
        ``MOEPLACE_DISPATCH_WEIGHTS`` from ``env`` (default: this process's); ValueError says what is wrong."""
        env = os.environ if env is None else env
        rule = env.get("MOEPLACE_DISPATCH", "").strip().lower()
        if rule not in RULES:
            raise ValueError(f"MOEPLACE_DISPATCH must be one of {', '.join(RULES)}, got {rule!r}")
        raw = env.get("MOEPLACE_DISPATCH_MAX_TOKENS", str(DEFAULT_MAX_TOKENS[rule])).strip()
        max_tokens = _int_or_zero(raw)
        if not 1 <= max_tokens <= MAX_TOKENS_SETTING:
            raise ValueError(f"MOEPLACE_DISPATCH_MAX_TOKENS must be a positive integer up to {MAX_TOKENS_SETTING:,} "
                             f"(a larger batch holds more ids than the kernel takes), got {raw!r}")
        return cls(rule, max_tokens, _weights_from_env(env) if rule == "cost" else None)


def _weights_from_env(env: Mapping[str, str]) -> RuleWeights:
    """The rule by cost's weights from ``MOEPLACE_DISPATCH_Q`` or ``MOEPLACE_DISPATCH_WEIGHTS`` (exactly one)."""
    raw_q = env.get("MOEPLACE_DISPATCH_Q", "").strip()
    raw_w = env.get("MOEPLACE_DISPATCH_WEIGHTS", "").strip()
    if raw_q and raw_w:
        raise ValueError("set one of MOEPLACE_DISPATCH_Q and MOEPLACE_DISPATCH_WEIGHTS, not both")
    if raw_w:
        parts = [_int_or_zero(v) if v.strip().isdigit() else -1 for v in raw_w.split(",")]
        read, pair, block, block_m = parts if len(parts) == 4 else (-1, -1, -1, -1)
        if RuleWeights(read, pair, block, block_m).problem(MAX_BLOCK_M):
            raise ValueError(f"MOEPLACE_DISPATCH_WEIGHTS must be read,pair,block,block_m: integers, read from 1 and "
                             f"pair and block from 0 to {MAX_WEIGHT}, block_m a power of two up to {MAX_BLOCK_M} where "
                             f"block > 0 (moeplace launch sets it from the placement's cost model), got {raw_w!r}")
        return RuleWeights(read, pair, block, block_m if block else 0)
    q = _int_or_zero(raw_q)
    if not 1 <= q <= MAX_WEIGHT:
        raise ValueError(f"MOEPLACE_DISPATCH=cost needs MOEPLACE_DISPATCH_Q, the (token, expert) pairs one "
                         f"expert read costs, an integer from 1 to {MAX_WEIGHT}, or MOEPLACE_DISPATCH_WEIGHTS "
                         f"(read,pair,block,block_m; moeplace launch sets one from the placement's cost model), "
                         f"got {raw_q!r}")
    return RuleWeights(q)


def _int_or_zero(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        return 0


class _Layer:
    """One MoE layer's replica tables on the device and its two output buffers."""

    def __init__(self, info: Any, ranks: int, max_tokens: int) -> None:
        self.info, self.ranks = info, ranks
        self.slots, self.masks = self.tables()
        self.max_tokens = max_tokens
        self.buffers: list = []
        self.calls = 0

    def tables(self) -> tuple[Any, Any]:
        """(slots [E, R] int32, masks [E] int32) from the map SGLang holds now (``info``'s views of it)."""
        import torch

        info, ranks = self.info, self.ranks
        l2p = info.partial_logical_to_all_physical_map                 # [E, X] slots by id, -1 padded
        per_rank = info.num_physical_experts // ranks
        valid = l2p >= 0
        big = info.num_physical_experts
        rank = torch.where(valid, l2p // per_rank, ranks)               # the padding goes to column R
        slots = torch.full((l2p.shape[0], ranks + 1), big, dtype=torch.int64, device=l2p.device)
        slots.scatter_reduce_(1, rank, torch.where(valid, l2p, big).to(torch.int64), reduce="amin")
        slots = slots[:, :ranks]
        has = slots < big
        return (torch.where(has, slots, -1).to(torch.int32).contiguous(),
                (has.to(torch.int64) << torch.arange(ranks, device=l2p.device)).sum(dim=1).to(torch.int32))

    def refresh(self) -> None:
        """Re-derive the tables after SGLang moved experts, in place: CUDA graphs captured their addresses."""
        slots, masks = self.tables()
        self.slots.copy_(slots)
        self.masks.copy_(masks)

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
    """The AROUND hook's state: the configuration and each layer's tables (the balanced rule or the rule by
    cost, as ``config.rule`` says)."""

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
                raise SystemExit(f"moeplace: MOEPLACE_DISPATCH={self.config.rule} cannot run here: {problem}")
            self.checked = True
        layer = self.layers.get(info.partial_logical_to_all_physical_map.data_ptr())
        if layer is None:
            layer = _Layer(info, ep_size(), self.config.max_tokens)
            self.layers[info.partial_logical_to_all_physical_map.data_ptr()] = layer
        if not topk_ids.is_cuda:
            return dispatch_on_host(topk_ids, layer, num_token_non_padded(), self.config.q)
        from moeplace_kernels.balanced_dispatch import MAX_ENTRIES, balanced_dispatch, cost_dispatch, prepare

        if topk_ids.numel() > MAX_ENTRIES:   # the kernel's limit (more than 8192 ids: a prefill)
            return original(topk_ids, info, log2phy_prob)
        if topk_ids.device not in self.prepared:   # build the kernel before any graph is captured
            prepare(topk_ids.device)
            self.prepared.add(topk_ids.device)
        if self.config.q is not None:
            return cost_dispatch(topk_ids, layer.masks, layer.slots, self.config.q, num_rows=num_token_non_padded(),
                                 out=layer.out_for(topk_ids))
        return balanced_dispatch(topk_ids, layer.masks, layer.slots, num_rows=num_token_non_padded(),
                                 out=layer.out_for(topk_ids))


def dispatch_on_host(topk_ids, layer: _Layer, num_rows=None, q: RuleWeights | int | None = None):
    """The same rule for CPU tensors (SGLang's CPU backend, tests), through ``moeplace.dispatch.balanced`` (or, with
    ``q``, ``moeplace.dispatch.by_cost``: a split expert's valid entries take its ranks in increasing rank order,
    in entry order, as the kernel's)."""
    import torch

    from moeplace.dispatch.by_cost import cost_rule_step

    ids = topk_ids.numpy().astype(np.int64)
    valid_rows = ids.shape[0] if num_rows is None else int(num_rows)
    masks = layer.masks.numpy().astype(np.int64) & ((1 << layer.slots.shape[1]) - 1)
    slots = layer.slots.numpy()
    live = ids[:valid_rows]
    counts = np.bincount(live[live >= 0], minlength=masks.shape[0])
    ends = np.cumsum(cost_rule_step(counts, masks, slots.shape[1], q), axis=1)   # q None: the balanced rule
    first = np.argmax(slots >= 0, axis=1)                # the lowest rank holding each expert
    e = np.maximum(ids, 0).ravel()
    valid = (ids >= 0).ravel() & (np.arange(ids.size) < valid_rows * ids.shape[1])
    order = np.argsort(np.where(valid, e, -1), kind="stable")     # entry order within each expert
    grouped = np.where(valid, e, -1)[order]
    position = np.empty(ids.size, np.int64)
    position[order] = np.arange(ids.size) - np.searchsorted(grouped, grouped, side="left")
    rank = np.where(valid, (position[:, None] >= ends[e]).sum(axis=1), first[e])
    out = np.where(ids.ravel() >= 0, slots[e, rank], -1).reshape(ids.shape)
    return torch.from_numpy(out).to(topk_ids.dtype)


def refresh() -> None:
    """Every cached layer's tables from the map SGLang holds now (online re-placement calls it between passes, after
    SGLang's updater wrote the new map in place)."""
    if _DISPATCH is not None:
        for layer in _DISPATCH.layers.values():
            layer.refresh()


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
        rule = _DISPATCH.config.rule if _DISPATCH is not None else "balanced"
        print(f"moeplace: MOEPLACE_DISPATCH={rule} cannot run here: {problem}; "
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
    if config.q is None:
        logger.info("moeplace balanced dispatch on (up to %d rows a batch)", config.max_tokens)
    else:
        w = config.q
        logger.info("moeplace cost dispatch on (a rank costs %d per expert read + %d per pair + %d per row block of "
                    "%d beyond an expert's first; up to %d rows a batch)", w.read, w.pair, w.block, w.block_m,
                    config.max_tokens)
    return _DISPATCH
