"""A cost set: the lines ``moeplace calibrate`` measured on one GPU for one model, in one file.

Each line is a ``moeplace.cost.model`` line with the provenance ``moeplace.cost.derive`` reads (the slice, local
slots, kernel config and the steps its c was measured at), so a set stands where the packaged measurements
stand: ``Calibration`` from its lines, and every GPU shape of the model's layouts costed from its own line. The
file names the GPU, its memory, SGLang's version, the model and the date, and keeps each line's fit error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import Field

from moeplace.cost.derive import Calibration, calibrate, measured_line_of, set_lines
from moeplace.cost.model import CostModel, cost_model_from_json, read_cost_json
from moeplace.cost.schema import CostModelSchema
from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.schema import Schema, validate

KIND = "moeplace cost set"
VERSION = 1


class SetModelSchema(Schema):
    name: str
    hidden: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    weights: str


class CostSetSchema(Schema):
    kind: str
    version: int = Field(ge=1, le=VERSION)
    gpu: str = Field(min_length=1)
    gpu_memory_gb: float = Field(gt=0)
    sglang: str
    date: str
    model: SetModelSchema
    ranks: int = Field(ge=1)
    lines: dict[str, CostModelSchema] = Field(min_length=1)


@dataclass(frozen=True)
class CostSet:
    """One GPU's lines for one model (``lines``: label -> line) and what the file says about where they come from."""

    gpu: str
    gpu_memory_gb: float
    sglang: str
    date: str
    model: dict[str, Any]
    ranks: int
    lines: dict[str, CostModel]
    path: str = ""

    @cached_property
    def calibration(self) -> Calibration:
        """The GPU's terms fitted on the set's lines (``moeplace.cost.derive.calibrate``; once per set)."""
        return calibrate([measured_line_of(label, line) for label, line in self.lines.items()])


def is_cost_set(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND


def load_cost_file(path: str | os.PathLike) -> CostModel | CostSet:
    """A ``--cost-model`` file: one line (``CostModel``, for whole experts at one rank shape) or a cost set."""
    doc = read_cost_json(path)
    return cost_set_from_json(doc, path) if is_cost_set(doc) else cost_model_from_json(doc, path)


def cost_set_from_json(doc: dict[str, Any], path: str | os.PathLike) -> CostSet:
    """A cost set from its parsed JSON; one line (FormatError) where a field is wrong or its lines cannot make
    a calibration."""
    checked = validate(CostSetSchema, doc, path, "cost set")
    if checked.kind != KIND:
        raise FormatError(path, f"kind {checked.kind!r} is not {KIND!r}")
    cost_set = CostSet(checked.gpu, checked.gpu_memory_gb, checked.sglang, checked.date, checked.model.model_dump(),
                       checked.ranks, set_lines(doc, path), os.fspath(path))
    try:
        cost_set.calibration
    except (KeyError, TypeError, ValueError, MoeplaceError) as e:
        raise FormatError(path, f"its lines cannot be read as measurements ({e})") from None
    return cost_set


def cost_set_json(cost_set: CostSet, fit: dict[str, Any]) -> dict[str, Any]:
    """The file's JSON; ``fit``: each line's fit error and points, kept beside the lines for the reader."""
    return {"kind": KIND, "version": VERSION, "gpu": cost_set.gpu, "gpu_memory_gb": round(cost_set.gpu_memory_gb, 3),
            "sglang": cost_set.sglang, "date": cost_set.date, "model": cost_set.model, "ranks": cost_set.ranks,
            "lines": {label: line.to_json() for label, line in cost_set.lines.items()}, "fit": fit}
