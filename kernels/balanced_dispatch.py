"""Balanced dispatch on the GPU: moeplace's fast rule (``moeplace.dispatch.balanced``) inside SGLang's router.

Dimension letters: N token rows, K top-k, E logical experts, R ranks (<= 32).

Per MoE layer and forward pass, :func:`balanced_dispatch` turns the router's logical top-k ids into
physical slot ids, replacing SGLang's ``topk_ids_logical_to_physical``: every active expert's tokens go
to one of its replicas, chosen by ``moeplace.dispatch.balanced.fast_rule_step`` (bit for bit, ties included), so
that the busiest rank reads as few distinct experts as possible. The ids are the same on every rank and
the rule is a fixed function of them, so every rank picks the same replicas.

Two kernels compute it, each as a single program (the rule is sequential and small):

* ``cuda`` (``balanced_dispatch.cu``, design in its opening comment): built on first use by
  ``torch.utils.cpp_extension`` and cached; the default where it builds.
* ``triton`` (``balanced_dispatch_triton.py``): the fallback, and what runs in Triton's CPU interpreter
  (``TRITON_INTERPRET=1``) for the CI.

``MOEPLACE_DISPATCH_BACKEND=cuda|triton`` (default ``auto``) or ``backend=`` chooses. BENCHMARKS.md#balanced-dispatch-kernel
has the graph-replay times of both against SGLang's ``dynamic`` rule.

:func:`cost_dispatch` runs moeplace's rule by cost (``moeplace.dispatch.by_cost.cost_rule_step``): the same
balanced rule, then, on a step of at least ``q`` (token, expert) pairs or, with the row-block term, with an
expert past its first row block, up to ``max_rounds`` moves or splits of an expert's tokens between its replicas; a split expert's entries go to its ranks in increasing rank
order, in entry order (``moeplace.dispatch.by_cost.pair_slots``). Integer arithmetic and fixed ties: every
rank computes the same slots from the same ids.

Forward-time calls with ``out`` given allocate nothing and never synchronise with the host, so they can
be captured in a CUDA graph and replayed with new ids in the same buffers. Call :func:`prepare` once per
device before capture: it builds (or finds) the CUDA kernel and warms up the Triton one outside the graph.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from moeplace.dispatch.balanced import MAX_AUGMENT
from moeplace.dispatch.by_cost import MAX_ROUNDS, MAX_WEIGHT, RuleWeights, as_weights
from moeplace_kernels import balanced_dispatch_cuda

MAX_ENTRIES = 8192   # N * K (576 token rows of top-8 is 4608): the token field of the packed rank key is 14 bits
MAX_EXPERTS = 4096   # the tested bound; CUDA kernel: 8E + 9 min(E, N*K) + N*K*id bytes of shared memory
MAX_RANKS = 32       # a rank is a lane of one warp; masks are 32-bit
UNLIMITED = 1 << 30  # max_augment=None: augment until the rule stops by itself (the exact optimum)
MAX_MOVES = 32       # rule by cost: rows of the CUDA kernel's table of split experts
TRITON_COST_EXPERTS = 1023   # the Triton fallback's rule by cost: its compile grows with the padded expert count
BACKENDS = ("auto", "cuda", "triton")


def balanced_dispatch(topk_ids: torch.Tensor, masks: torch.Tensor, slots: torch.Tensor,
                      num_rows: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                      max_augment: Optional[int] = MAX_AUGMENT, *, backend: str = "auto") -> torch.Tensor:
    """Physical slot ids [N, K] of ``topk_ids`` by the balanced rule.

    topk_ids: [N, K] int32 or int64 logical ids, -1 = none (stays -1; so does any id outside [0, E))
    masks: [E] int32, bit r set when expert e has a replica on rank r
    slots: [E, R] int32, physical slot of e's replica on rank r, -1 where none (``dispatch_tables``)
    num_rows: device scalar (int32 or int64) or None: rows >= num_rows are padding, ignored by the
        rule; their entries get the slot on the lowest rank holding the expert
    out: [N, K] preallocated, dtype of ``topk_ids``; may be ``topk_ids`` itself (in place)
    max_augment: augmenting paths per step (``moeplace.dispatch.balanced.MAX_AUGMENT``); None: no cap
    """
    return _dispatch(topk_ids, masks, slots, num_rows, out, max_augment, None, 0, backend)


def cost_dispatch(topk_ids: torch.Tensor, masks: torch.Tensor, slots: torch.Tensor, weights: RuleWeights | int,
                  num_rows: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                  max_augment: Optional[int] = MAX_AUGMENT, max_rounds: int = MAX_ROUNDS, *,
                  backend: str = "auto") -> torch.Tensor:
    """Physical slot ids [N, K] of ``topk_ids`` by the rule by cost (``moeplace.dispatch.by_cost``).

    weights: ``moeplace.dispatch.by_cost.RuleWeights`` (``rule_weights`` of a cost model), or an int q, the
    (token, expert) pairs one expert read costs (``RuleWeights(q)``); read 1 to MAX_WEIGHT, pair and block 0
    to MAX_WEIGHT, block_m a power of two up to MAX_ENTRIES where block > 0 (SGLang's row blocks always are).
    max_rounds: moves after the balanced rule, 0 to MAX_MOVES. The rest as :func:`balanced_dispatch`. Where no step can search a move (fewer pairs than one
    read costs, N * K * pair < read, and no expert past a row block, N <= block_m: a verify batch of 9 tokens
    against q = 281) or no move is allowed, the rule is the balanced one, and the balanced kernel runs (the
    same output, sooner).
    """
    w = check_weights(weights)
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or not 0 <= max_rounds <= MAX_MOVES:
        raise ValueError(f"max_rounds must be an int from 0 to {MAX_MOVES}, got {max_rounds!r}")
    rows = topk_ids.shape[0] if topk_ids.dim() else 0
    blocks = w.block > 0 and rows > w.block_m
    if max_rounds == 0 or (w.pair * topk_ids.numel() < w.read and not blocks):   # shapes known at capture:
        return balanced_dispatch(topk_ids, masks, slots, num_rows, out, max_augment, backend=backend)   # the same
    return _dispatch(topk_ids, masks, slots, num_rows, out, max_augment, w, max_rounds, backend)      # kernel always


def check_weights(weights: RuleWeights | int) -> RuleWeights:
    """``weights`` as RuleWeights, or ValueError (one line) for values the kernels cannot take."""
    weights = as_weights(weights)
    if not isinstance(weights, RuleWeights):
        raise ValueError(f"q must be an int from 1 to {MAX_WEIGHT} (or weights, RuleWeights), got {weights!r}")
    problem = weights.problem(MAX_ENTRIES)
    if problem:
        raise ValueError(problem)
    return weights


def _dispatch(topk_ids, masks, slots, num_rows, out, max_augment, weights: Optional[RuleWeights], max_rounds: int,
              backend: str) -> torch.Tensor:
    _check(topk_ids, masks, slots, num_rows, out, max_augment)
    if out is None:
        out = torch.empty_like(topk_ids)
    if topk_ids.numel() == 0:
        return out
    augment = UNLIMITED if max_augment is None else int(max_augment)
    chosen = _backend_for(topk_ids.device, backend)
    if chosen == "triton" and weights is not None and slots.shape[0] > TRITON_COST_EXPERTS:
        raise ValueError(f"the Triton fallback's rule by cost takes at most {TRITON_COST_EXPERTS} experts (past that "
                         f"its compile takes many minutes), got {slots.shape[0]}; the CUDA kernel takes {MAX_EXPERTS}")
    if chosen == "cuda":
        library = balanced_dispatch_cuda.load(torch.cuda.get_device_capability(topk_ids.device))
        launch_cuda(library, topk_ids, masks, slots, num_rows, out, augment, weights, max_rounds)
    else:
        from moeplace_kernels import balanced_dispatch_triton

        balanced_dispatch_triton.launch(topk_ids, masks, slots, num_rows, out, augment, weights, max_rounds)
    return out


def dispatch_tables(layout, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(masks [E] int32, slots [E, R] int32) on ``device`` from a ``moeplace.dispatch.balanced.ReplicaLayout``.

    Masks of 32 ranks keep bit 31 as the sign bit of int32 (the kernels read them unsigned).
    """
    import numpy as np

    if layout.ranks > MAX_RANKS:
        raise ValueError(f"balanced dispatch on the GPU supports at most {MAX_RANKS} ranks, got {layout.ranks}")
    masks = np.asarray(layout.masks, np.int64).astype(np.uint32).view(np.int32)
    return (torch.from_numpy(masks.copy()).to(device),
            torch.from_numpy(np.asarray(layout.slots).astype(np.int32)).to(device))


def prepare(device: torch.device | str, backend: str = "auto") -> str:
    """Build or find the kernel for ``device`` outside any CUDA graph; returns the backend in use."""
    device = torch.device(device)
    chosen = _backend_for(device, backend)
    if chosen == "triton":   # compile the Triton kernel now, not in a capture
        balanced_dispatch(torch.zeros(1, 1, dtype=torch.int32, device=device),
                          torch.ones(1, dtype=torch.int32, device=device),
                          torch.zeros(1, 1, dtype=torch.int32, device=device), backend="triton")
    return chosen


# ----------------------------------------------------------------------------- backend choice

def select_backend(requested: str, capability: Optional[tuple[int, int]]) -> str:
    """'cuda' or 'triton' for a device of ``capability`` (None: not a CUDA device).

    ``requested`` is "auto" (then $MOEPLACE_DISPATCH_BACKEND, else the CUDA kernel where it builds: it
    warns once and falls back to Triton), "cuda" (RuntimeError if it cannot be built) or "triton".
    """
    if requested == "auto":
        requested = os.environ.get("MOEPLACE_DISPATCH_BACKEND", "auto")
    if requested not in BACKENDS:
        raise ValueError(f"balanced dispatch backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if capability is None:
        if requested == "cuda":
            raise ValueError("the cuda balanced-dispatch backend needs CUDA tensors")
        return "triton"
    if requested == "triton":
        return "triton"
    if balanced_dispatch_cuda.load(capability) is not None:
        return "cuda"
    if requested == "cuda":
        raise RuntimeError("the cuda balanced-dispatch backend could not be built (see the warning above)")
    return "triton"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _backend_for(device: torch.device, requested: str) -> str:
    return select_backend(requested, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)


def launch_cuda(library: balanced_dispatch_cuda.DispatchLibrary, topk_ids: torch.Tensor, masks: torch.Tensor,
                slots: torch.Tensor, num_rows: Optional[torch.Tensor], out: torch.Tensor, max_augment: int,
                weights: Optional[RuleWeights | int] = None, max_rounds: int = MAX_ROUNDS) -> None:
    """One launch of ``library`` (the CUDA kernel, or a benchmark build of it) on checked inputs; with
    ``weights`` (``check_weights``), the rule by cost."""
    rows, k = topk_ids.shape
    experts, ranks = slots.shape
    common = (topk_ids.data_ptr(), out.data_ptr(), masks.data_ptr(), slots.data_ptr(),
              None if num_rows is None else num_rows.data_ptr(),
              num_rows is not None and num_rows.dtype == torch.int64,
              topk_ids.dtype == torch.int64, rows, k, experts, ranks, max_augment)
    stream = torch.cuda.current_stream(topk_ids.device).cuda_stream
    if weights is None:
        library.launch(*common, stream)
    else:
        w = check_weights(weights)
        library.launch_cost(*common, (w.read, w.pair, w.block, max(w.block_m, 1)), max_rounds, stream)


# ----------------------------------------------------------------------------- input checks

def _check(topk_ids, masks, slots, num_rows, out, max_augment) -> None:
    """Raise TypeError/ValueError (one line) for inputs the kernels cannot take; reads metadata only."""
    _tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2)
    _tensor("masks", masks, (torch.int32,), 1)
    _tensor("slots", slots, (torch.int32,), 2)
    rows, k = topk_ids.shape
    experts, ranks = slots.shape
    device = topk_ids.device
    if rows * k > MAX_ENTRIES:
        raise ValueError(f"balanced_dispatch takes at most {MAX_ENTRIES} ids (N*K), got {rows}x{k}; "
                         "hand larger batches to SGLang's own rule")
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"balanced_dispatch supports 1 to {MAX_RANKS} ranks, slots has {ranks} columns")
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"balanced_dispatch supports 1 to {MAX_EXPERTS} experts, slots has {experts} rows")
    if masks.shape[0] != experts:
        raise ValueError(f"masks has {masks.shape[0]} experts, slots {experts}")
    named = [("masks", masks), ("slots", slots)]
    if num_rows is not None:
        _tensor("num_rows", num_rows, (torch.int32, torch.int64), None)
        if num_rows.numel() != 1:
            raise ValueError(f"num_rows must hold one value, got shape {tuple(num_rows.shape)}")
        named.append(("num_rows", num_rows))
    if out is not None:
        _tensor("out", out, (topk_ids.dtype,), 2)
        if out.shape != topk_ids.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, topk_ids {tuple(topk_ids.shape)}")
        named.append(("out", out))
    for name, tensor in named:
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, topk_ids on {device}")
    if max_augment is not None and (isinstance(max_augment, bool) or not isinstance(max_augment, int)
                                    or max_augment < 0):
        raise ValueError(f"max_augment must be a non-negative int or None, got {max_augment!r}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"balanced_dispatch needs CUDA tensors (or TRITON_INTERPRET=1 for Triton's CPU "
                         f"interpreter), got topk_ids on {device}")


def _tensor(name: str, value, dtypes: tuple, ndim: Optional[int]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {value.stride()}); pass .contiguous()")
