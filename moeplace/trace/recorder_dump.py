"""SGLang ``expert_distribution_recorder`` dumps (``.pt``) -> moeplace routing steps.

Dimension letters: T recorded passes, H hidden layers (SGLang's dumps cover every hidden layer; dense
layers stay all-zero), L MoE layers, E logical experts, P physical slots, K top-k, n tokens of a pass.

SGLang 0.5.23 writes (``sglang/srt/eplb/expert_distribution.py``):

* ``stat`` / ``stat_approx`` (rank 0 only, ``expert_distribution_recorder_{time}.pt``):
  ``{"rank", "logical_count": int32 [T, H, E], "average_utilization_rate_over_window"}``. ``T`` is a
  circular buffer (``--expert-distribution-recorder-buffer-size``): once wrapped its rows are not in
  time order, unfilled rows are zero. Counts are all-reduced over every rank, so with plain TP each
  token is counted TP times. No forward mode is kept.
* ``per_pass`` (every rank, ``expert_distribution_recorder_{time}_{rank}.pt``):
  ``{"records": [{forward_pass_id, rank, gatherer_key, global_physical_count: [H, P]}],
  "last_physical_to_logical_map": [H, P]}``. No forward mode either.
* ``per_token`` (every rank): the same, and each record also holds ``input_ids``, ``positions``,
  ``extend_seq_lens``, ``forward_mode`` (ForwardMode int), ``misc_objects`` and
  ``topk_ids_of_layer``: int32 [H, n, 8] physical slot ids, -1 = none (8 columns whatever the
  model's top-k: unused columns stay -1).

What comes back is always in logical ids. MoE layers are the hidden layers with any routed token
in the dump (pass ``model`` to fix them instead: a layer that saw no token would otherwise be
taken for dense). All-zero passes (unfilled buffer rows, draft-model passes, idle ranks) are dropped.
"""

from __future__ import annotations

import math
import os
import warnings
from functools import reduce
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.store import TraceHeader

DUMP_PREFIX = "expert_distribution_recorder_"
# SGLang ForwardMode values past DRAFT_EXTEND_V2 (6) that moeplace folds into its own codes.
_EXTRA_MODES = {7: M.DECODE, 8: M.EXTEND, 9: M.EXTEND}  # PREBUILT, SPLIT_PREFILL, DLLM_EXTEND


def find_dumps(folder: str | os.PathLike) -> list[Path]:
    """The recorder dumps in ``folder``, oldest first (SGLang names them by ``time.time()``)."""
    return sorted(Path(folder).glob(f"{DUMP_PREFIX}*.pt"), key=lambda p: (p.stat().st_mtime, p.name))


def read_recorder_dump(path: str | os.PathLike | list, model: ModelSpec | None = None,
                       top_k: int | None = None) -> tuple[TraceHeader, RoutingSteps]:
    """Read one dump, a list of dumps (one per rank) or a folder of them into logical-id steps.

    model: the model's MoE shape; without it the MoE layers are those with any activity, the expert
    count comes from the dump and top-k from ``top_k``, the per-token ids, or (counts only) the gcd
    of the per-pass totals. Raises FormatError naming the file for anything unreadable.
    """
    paths = _expand(path)
    loaded = [(p, _load(p)) for p in paths]
    kinds = {p: _kind(p, d) for p, d in loaded}
    if len(set(kinds.values())) > 1:
        raise FormatError(paths[0], f"dumps of different recorder modes mixed: {sorted(set(kinds.values()))}")
    kind = kinds[paths[0]]
    if kind == "stat":
        if len(loaded) > 1:
            raise FormatError(paths[1], "more than one stat dump given (stat dumps are already summed over ranks)")
        return _from_stat(paths[0], loaded[0][1], model, top_k)
    return _from_records(loaded, kind, model, top_k)


# ------------------------------------------------------------------ input checks


def _expand(path: str | os.PathLike | list) -> list[Path]:
    if isinstance(path, (list, tuple)):
        paths = [Path(p) for p in path]
    else:
        p = Path(path)
        paths = find_dumps(p) if p.is_dir() else [p]
        if p.is_dir() and not paths:
            raise FormatError(p, f"folder holds no {DUMP_PREFIX}*.pt dumps")
    if not paths:
        raise MoeplaceError("no recorder dump given")
    for p in paths:
        if not p.is_file():
            raise FormatError(p, "no such file")
    return paths


def require_torch(needed_for: str, alternative: str = "") -> ModuleType:
    """torch, or a one-line MoeplaceError saying how to get it (``needed_for``: what wants it)."""
    try:
        import torch  # lazily: `import moeplace` never imports torch
    except ImportError:
        raise MoeplaceError(f"{needed_for} needs torch, which is not installed here: pip install 'moeplace[sglang]' "
                            f"(or just torch){alternative}") from None
    return torch


def load_pt(path: Path, needed_for: str, alternative: str = "") -> Any:
    """``torch.load`` of an SGLang .pt file (weights only: dicts, lists, numbers and tensors, never code),
    any failure one FormatError line; torch's own warnings about the file stay quiet (the error says it)."""
    torch = require_torch(needed_for, alternative)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types (UnpicklingError, RuntimeError, EOFError...)
        raise FormatError(path, load_problem(e)) from None


def _load(path: Path) -> dict[str, Any]:
    data = load_pt(path, f"{path}: reading an SGLang recorder dump (.pt)",
                   "; or turn it into a .mptrace where torch is: moeplace trace convert DUMP -o TRACE.mptrace")
    if not isinstance(data, dict):
        raise FormatError(path, f"expected a dict, found {type(data).__name__}")
    return data


def load_problem(error: Exception) -> str:
    """Why ``torch.load(..., weights_only=True)`` failed, in one phrase, without torch's advice to load
    with weights_only=False (which would run code from the file: moeplace never does)."""
    text = " ".join(str(error).split())
    if "WeightsUnpickler error:" in text:
        cause = text.split("WeightsUnpickler error:", 1)[1].strip()
        if cause.startswith("Unsupported global: GLOBAL "):
            name = cause.removeprefix("Unsupported global: GLOBAL ").split()[0]
            return f"holds a {name} object, not only tensors, lists and numbers (not an SGLang file)"
        return f"not a readable torch file ({cause.split('. ')[0].split(' Check the documentation')[0]})"
    return f"not a readable torch file ({text.split('. ')[0] or type(error).__name__})"


def _kind(path: Path, data: dict) -> str:
    if "logical_count" in data:
        return "stat"
    if "records" in data and "last_physical_to_logical_map" in data:
        records = data["records"]
        if not isinstance(records, list):
            raise FormatError(path, "'records' is not a list")
        return "per_token" if records and "topk_ids_of_layer" in records[0] else "per_pass"
    raise FormatError(path, f"not an SGLang expert distribution dump (keys: {sorted(map(str, data))[:6]})")


def _array(path: Path, value: Any, what: str, ndim: int) -> np.ndarray:
    try:
        arr = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    except Exception:
        raise FormatError(path, f"{what} is not an array") from None
    if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
        raise FormatError(path, f"{what} must be an integer array of {ndim} dims, got {arr.dtype} {list(arr.shape)}")
    return arr


# ------------------------------------------------------------------ model shape


def _model_for(path: Path, active: np.ndarray, num_experts: int, top_k: int, model: ModelSpec | None) -> ModelSpec:
    """active: [H] bool, layers with any routed token."""
    H = active.shape[0]
    if model is not None:
        if model.num_hidden_layers != H or model.num_experts != num_experts:
            raise FormatError(path, f"dump has {H} layers x {num_experts} experts, model "
                                    f"{model.name!r} {model.num_hidden_layers} x {model.num_experts}")
        return model
    if not active.any():
        raise FormatError(path, "dump holds no routed token (was recording started?)")
    return ModelSpec(f"sglang-dump-{H}x{num_experts}", H, tuple(np.flatnonzero(active).tolist()),
                     num_experts, top_k)


def _infer_top_k(totals: np.ndarray, num_experts: int) -> int:
    """totals: per (pass, MoE layer) routed count = tokens * top_k; their gcd is a multiple of top_k."""
    nz = [int(x) for x in totals.ravel() if x > 0]
    g = reduce(math.gcd, nz, 0) if nz else 1
    return max(1, min(g, num_experts))


# ------------------------------------------------------------------ core


def _from_stat(path: Path, data: dict, model: ModelSpec | None, top_k: int | None) -> tuple[TraceHeader, RoutingSteps]:
    counts = _array(path, data["logical_count"], "logical_count", 3)  # [T, H, E]
    if counts.size and counts.min() < 0:
        raise FormatError(path, "logical_count holds negative counts")
    filled = counts.reshape(counts.shape[0], -1).any(axis=1)
    counts = counts[filled]
    active = counts.any(axis=(0, 2))
    E = counts.shape[2]
    k = model.top_k if model else top_k or _infer_top_k(counts[:, active].sum(axis=2), E)
    model = _model_for(path, active, E, k, model)
    steps = RoutingSteps.from_counts(model, counts[:, list(model.moe_layers)], M.UNKNOWN)
    notes = ("SGLang stat dump: passes are rows of a circular buffer (not in time order once it wrapped; "
             "empty rows dropped); counts are summed over all ranks (with plain TP each token is counted "
             "TP times); no forward modes recorded")
    if model.name.startswith("sglang-dump") and not top_k:
        notes += f"; top_k {k} inferred from per-pass totals; MoE layers = layers with any activity"
    header = TraceHeader(model=model, source=f"sglang-recorder:stat:{path.name}", aggregate_only=True,
                         ranks=[int(data.get("rank", 0))], notes=notes)
    return header, steps


def _from_records(loaded: list[tuple[Path, dict]], kind: str, model: ModelSpec | None,
                  top_k: int | None) -> tuple[TraceHeader, RoutingSteps]:
    path0 = loaded[0][0]
    p2l = _array(path0, loaded[0][1]["last_physical_to_logical_map"], "last_physical_to_logical_map", 2)  # [H, P]
    H, P = p2l.shape
    E = int(p2l.max()) + 1 if model is None else model.num_experts
    if p2l.min() < 0 or p2l.max() >= E:
        raise FormatError(path0, f"last_physical_to_logical_map holds ids outside [0, {E})")
    records = []  # (forward_pass_id, rank, path, record)
    for path, data in loaded:
        other = _array(path, data["last_physical_to_logical_map"], "last_physical_to_logical_map", 2)
        if not np.array_equal(other, p2l):
            raise FormatError(path, "physical-to-logical map differs from the other ranks' dumps")
        for i, rec in enumerate(data["records"]):
            if not isinstance(rec, dict) or "global_physical_count" not in rec:
                raise FormatError(path, f"record {i} has no global_physical_count")
            records.append((int(rec.get("forward_pass_id", i)), int(rec.get("rank", 0)), path, rec))
    records.sort(key=lambda r: (r[0], r[1]))
    if not records:
        raise FormatError(path0, "the recorder recorded no forward pass (no traffic reached the server "
                                 "between start and stop of the recording)")
    if kind == "per_pass":
        return _per_pass(path0, records, p2l, E, model, top_k)
    return _per_token(path0, records, p2l, E, model)


def _per_pass(path0: Path, records: list, p2l: np.ndarray, E: int, model: ModelSpec | None,
              top_k: int | None) -> tuple[TraceHeader, RoutingSteps]:
    H, P = p2l.shape
    phys = np.zeros((len(records), H, P), np.int64)
    for i, (_, _, path, rec) in enumerate(records):
        gpc = _array(path, rec["global_physical_count"], "global_physical_count", 2)
        if gpc.shape != (H, P):
            raise FormatError(path, f"global_physical_count has shape {list(gpc.shape)}, map {[H, P]}")
        phys[i] = gpc
    keep = phys.reshape(len(records), -1).any(axis=1)
    phys, records = phys[keep], [r for r, k in zip(records, keep) if k]
    logical = np.zeros((phys.shape[0], H, E), np.int64)
    for layer in range(H):
        np.add.at(logical[:, layer, :], (slice(None), p2l[layer]), phys[:, layer, :])
    active = logical.any(axis=(0, 2))
    k = model.top_k if model else top_k or _infer_top_k(logical[:, active].sum(axis=2), E)
    model = _model_for(path0, active, E, k, model)
    ranks = np.array([r[1] for r in records], np.int16)
    steps = RoutingSteps.from_counts(model, logical[:, list(model.moe_layers)], M.UNKNOWN, ranks=ranks)
    return _record_header(path0, "per_pass", model, p2l, sorted(set(ranks.tolist())),
                          "no forward modes recorded; each rank's pass counted where its router ran "
                          "(with plain TP every rank routes the same tokens: merge keeps one rank)"), steps


def _per_token(path0: Path, records: list, p2l: np.ndarray, E: int,
               model: ModelSpec | None) -> tuple[TraceHeader, RoutingSteps]:
    H, P = p2l.shape
    id_rows, sizes, modes, ranks = [], [], [], []
    for _, rank, path, rec in records:
        ids = _array(path, rec["topk_ids_of_layer"], "topk_ids_of_layer", 3)  # [H, n, 8]
        if ids.shape[0] != H:
            raise FormatError(path, f"topk_ids_of_layer has {ids.shape[0]} layers, the map {H}")
        if ids.size and (ids.min() < -1 or ids.max() >= P):
            raise FormatError(path, f"topk_ids_of_layer holds slot ids outside [-1, {P})")
        if not (ids >= 0).any():
            continue  # idle rank, draft-model pass or a pass recorded before any layer ran
        logical = np.where(ids >= 0, p2l[np.arange(H)[:, None, None], np.maximum(ids, 0)], -1)
        id_rows.append(logical.transpose(1, 0, 2))  # [n, H, 8]
        sizes.append(ids.shape[1])
        mode = int(rec.get("forward_mode", M.UNKNOWN) or 0)
        modes.append(mode if mode in M.MODE_NAMES else _EXTRA_MODES.get(mode, M.UNKNOWN))
        ranks.append(rank)
    if not id_rows:
        raise FormatError(path0, "dump holds no routed token (was recording started?)")
    ids = np.concatenate(id_rows)  # [T, H, 8]
    active = (ids >= 0).any(axis=(0, 2))
    used_cols = int((ids >= 0).any(axis=(0, 1)).sum()) if model is None else model.top_k
    model = _model_for(path0, active, E, max(used_cols, 1), model)
    ids = ids[:, list(model.moe_layers), :model.top_k]
    steps = RoutingSteps.from_topk(model, ids.astype(np.int16), np.array(sizes), np.array(modes, np.uint8),
                                   np.array(ranks, np.int16))
    return _record_header(path0, "per_token", model, p2l, sorted(set(ranks)),
                          "ids mapped to logical with the dump's last physical-to-logical map"), steps


def _record_header(path0: Path, kind: str, model: ModelSpec, p2l: np.ndarray, ranks: list[int],
                   notes: str) -> TraceHeader:
    if model.name.startswith("sglang-dump"):
        notes += "; MoE layers = hidden layers with any routed token"
    # Ids are already logical; the map in force is kept for per-rank load under the old placement.
    return TraceHeader(model=model, source=f"sglang-recorder:{kind}:{path0.name}", id_space="logical",
                       physical_to_logical_map=p2l[list(model.moe_layers)].tolist(), ranks=ranks, notes=notes)
