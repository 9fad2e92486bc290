"""Expert placements: which logical expert sits in each physical slot, per MoE layer.

Dimension letters: L MoE layers, E logical experts, P physical slots (E + redundant), R ranks.
One stored truth, ``phy2log[L, P]``; rank r owns slots ``[r*P/R, (r+1)*P/R)`` (SGLang's layout).
Everything else (replica lists, slots per rank) is derived by pure functions here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.errors import FormatError, MoeplaceError, PlacementError
from moeplace.files.atomic import atomic_write_text
from moeplace.model.spec import ModelSpec

PLACEMENT_FORMAT = "moeplace-placement"
PLACEMENT_VERSION = 1


@dataclass
class Placement:
    """A placement for every MoE layer of a model.

    phy2log: [L, P] int64 logical expert held by each physical slot
    """

    model: ModelSpec
    ranks: int
    phy2log: np.ndarray
    nodes: int = 1
    algorithm: str = "unknown"
    trace: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.model.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ranks

    def rank_of_slot(self) -> np.ndarray:
        """[P] rank that owns each physical slot."""
        return np.arange(self.num_physical) // self.slots_per_rank


def placement_problems(p: Placement) -> list[str]:
    """Every reason ``p`` is not a valid placement for its model, one line each (empty if valid)."""
    m = p.model
    problems: list[str] = []
    a = np.asarray(p.phy2log)
    if p.ranks < 1 or p.nodes < 1 or p.ranks % p.nodes:
        return [f"ranks ({p.ranks}) must be a positive multiple of nodes ({p.nodes})"]
    if a.ndim != 2:
        return [f"physical_to_logical_map must be 2-D [layers, slots], got shape {list(a.shape)}"]
    L, P = a.shape
    if L != m.num_moe_layers:
        problems.append(f"placement has {L} layers, model {m.name!r} has {m.num_moe_layers} MoE layers")
    if P < m.num_experts:
        problems.append(f"placement has {P} slots per layer, fewer than the {m.num_experts} experts")
    if P % p.ranks:
        problems.append(f"{P} slots per layer do not split evenly over {p.ranks} ranks")
    if not np.issubdtype(a.dtype, np.integer):
        return problems + ["physical_to_logical_map must hold integers"]
    if a.size and (a.min() < 0 or a.max() >= m.num_experts):
        return problems + [f"expert ids must lie in [0, {m.num_experts}), found {a.min()}..{a.max()}"]
    if problems:
        return problems
    for layer in range(L):
        missing = np.setdiff1d(np.arange(m.num_experts), a[layer])
        if missing.size:
            problems.append(f"layer {layer}: experts {_few(missing)} have no slot")
        per_rank = a[layer].reshape(p.ranks, -1)
        for r in range(p.ranks):
            ids, n = np.unique(per_rank[r], return_counts=True)
            if (n > 1).any():
                problems.append(f"layer {layer}: rank {r} holds two replicas of expert(s) {_few(ids[n > 1])}")
    return problems


def check_placement(p: Placement) -> None:
    """Raise PlacementError listing what is wrong with ``p`` (at most five problems)."""
    problems = placement_problems(p)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlacementError("; ".join(problems[:5]) + more)


def _few(ids: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:5])
    return shown + (", ..." if ids.size > 5 else "")


def replica_table(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Replicas of each logical expert, sorted by physical id (SGLang's order).

    phy2log: [L, P] -> (log2phy [L, E, X] padded with -1, num_replicas [L, E]); X = max replicas.
    """
    L, P = phy2log.shape
    num_replicas = np.zeros((L, num_experts), np.int64)
    for layer in range(L):
        num_replicas[layer] = np.bincount(phy2log[layer], minlength=num_experts)
    X = max(int(num_replicas.max(initial=1)), 1)
    log2phy = np.full((L, num_experts, X), -1, np.int64)
    for layer in range(L):
        order = np.argsort(phy2log[layer], kind="stable")  # slots grouped by expert, by physical id
        experts = phy2log[layer][order]
        first = np.searchsorted(experts, experts)
        log2phy[layer, experts, np.arange(P) - first] = order
    return log2phy, num_replicas


# ----------------------------------------------------------------------------- files

def placement_to_json(p: Placement) -> dict[str, Any]:
    return {
        "format": PLACEMENT_FORMAT, "version": PLACEMENT_VERSION, "model": p.model.to_json(),
        "ranks": p.ranks, "nodes": p.nodes, "num_physical_experts": p.num_physical,
        "algorithm": p.algorithm, "trace": p.trace, "metrics": p.metrics,
        "physical_to_logical_map": np.asarray(p.phy2log).tolist(),
    }


def save_placement(path: str | os.PathLike, p: Placement) -> None:
    """Validate, then write ``p`` as moeplace placement JSON (atomically)."""
    check_placement(p)
    atomic_write_text(path, json.dumps(placement_to_json(p), indent=1) + "\n")


def sglang_physical_to_logical(p: Placement) -> np.ndarray:
    """[num_hidden_layers, P] map for SGLang; dense layers get a valid contiguous row (never read)."""
    m = p.model
    full = np.tile(np.arange(p.num_physical) % m.num_experts, (m.num_hidden_layers, 1))
    full[list(m.moe_layers)] = p.phy2log
    return full


def save_sglang(path: str | os.PathLike, p: Placement) -> None:
    """Write what SGLang 0.5.23 takes as ``--init-expert-location``: JSON with one key only.

    SGLang splats the dict into ``ExpertLocationMetadata.init_by_mapping``, so any other key
    crashes the server at start.
    """
    check_placement(p)
    data = {"physical_to_logical_map": sglang_physical_to_logical(p).tolist()}
    atomic_write_text(path, json.dumps(data) + "\n")


def load_placement(path: str | os.PathLike, model: ModelSpec | None = None, ranks: int | None = None,
                   nodes: int = 1) -> Placement:
    """Read a moeplace placement, or an SGLang ``--init-expert-location`` file (.json or .pt).

    An SGLang file carries no model or rank count: ``model`` and ``ranks`` must be given, and its
    rows for dense layers are dropped. The result is validated.
    """
    path = Path(path)
    data = _read_placement_data(path)
    if not isinstance(data, dict) or "physical_to_logical_map" not in data:
        raise FormatError(path, "no 'physical_to_logical_map' in the file (not a placement)")
    from moeplace.files.placement_schema import PlacementSchema, SglangPlacementSchema
    from moeplace.model.schema import validate

    if data.get("format") == PLACEMENT_FORMAT:
        if data.get("version") != PLACEMENT_VERSION:
            raise FormatError(path, f"placement version {data.get('version')!r} is not supported")
        checked = validate(PlacementSchema, data, path, "placement")
        phy2log = np.asarray(checked.physical_to_logical_map, np.int64)
        try:
            own_model = ModelSpec.from_json(data["model"])
        except MoeplaceError as e:  # a bad model
            raise FormatError(path, f"bad placement field: {e}") from None
        p = Placement(own_model, checked.ranks, phy2log, nodes=checked.nodes, algorithm=checked.algorithm,
                      trace=checked.trace, metrics=dict(checked.metrics))
        if model is not None and (own_model.num_experts, own_model.num_moe_layers) != (model.num_experts, model.num_moe_layers):
            raise PlacementError(f"{path}: placement is for {own_model.name!r} ({own_model.num_moe_layers} MoE layers, "
                                 f"{own_model.num_experts} experts), the trace for {model.name!r} "
                                 f"({model.num_moe_layers} MoE layers, {model.num_experts} experts)")
        if ranks is not None and ranks != p.ranks:
            raise PlacementError(f"{path}: placement is for {p.ranks} ranks, not {ranks}")
    else:
        if model is None or ranks is None:
            raise PlacementError(f"{path}: an SGLang placement file needs the model (from a trace) and --ranks")
        phy2log = np.asarray(validate(SglangPlacementSchema, data, path, "SGLang placement").physical_to_logical_map,
                             np.int64)
        if phy2log.shape[0] == model.num_hidden_layers:
            phy2log = phy2log[list(model.moe_layers)]
        elif phy2log.shape[0] != model.num_moe_layers:
            raise PlacementError(f"{path}: {phy2log.shape[0]} rows, model {model.name!r} has "
                                 f"{model.num_hidden_layers} layers ({model.num_moe_layers} MoE)")
        p = Placement(model, ranks, phy2log, nodes=nodes, algorithm="sglang-file", trace="")
    try:
        check_placement(p)
    except PlacementError as e:
        raise PlacementError(f"{path}: {e}") from None
    return p


def _read_placement_data(path: Path) -> Any:
    if path.is_dir():
        raise FormatError(path, "is a folder, not a placement file")
    if not path.is_file():
        raise FormatError(path, "no such file")
    if path.suffix == ".pt":
        from moeplace.trace.recorder_dump import load_pt   # only .pt placement files need torch

        data = load_pt(path, f"{path}: reading an SGLang .pt placement")
        if isinstance(data, dict) and "physical_to_logical_map" in data:
            data = {**data, "physical_to_logical_map": np.asarray(data["physical_to_logical_map"]).tolist()}
        return data
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(path, f"not valid JSON ({e.__class__.__name__} at byte {getattr(e, 'pos', '?')})") from None
