"""The schemas of a moeplace placement file (``placement_to_json``) and of SGLang's
``--init-expert-location`` JSON (``model/schema.py`` says why pydantic, and how a failure reads).

Checked before any array is made from the file: the map's shape and ids against the model, its width
against ``num_physical_experts`` and ``ranks`` (each rank holds P/R slots, never an expert twice, so
P/R <= E), ``nodes`` dividing ``ranks``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moeplace.model.schema import MAX_EXPERTS, MAX_RANKS, ModelSchema, Schema, check_map


class PlacementSchema(Schema):
    format: Literal["moeplace-placement"]
    version: int
    model: ModelSchema
    ranks: int = Field(ge=1, le=MAX_RANKS)
    nodes: int = Field(1, ge=1, le=MAX_RANKS)
    num_physical_experts: int | None = Field(None, ge=1, le=MAX_EXPERTS)
    algorithm: str = "unknown"
    trace: str = ""
    metrics: dict[str, Any] = {}
    physical_to_logical_map: list[list[int]]

    @model_validator(mode="after")
    def _agree(self) -> "PlacementSchema":
        m, rows = self.model, self.physical_to_logical_map
        if self.ranks % self.nodes:
            raise ValueError(f"nodes {self.nodes} does not divide ranks {self.ranks}")
        check_map(rows, len(m.moe_layers), m.num_experts)
        width = len(rows[0])
        if self.num_physical_experts is not None and self.num_physical_experts != width:
            raise ValueError(f"num_physical_experts {self.num_physical_experts} disagrees with the map's "
                             f"{width} slots per layer")
        if width % self.ranks or width // self.ranks > m.num_experts:
            raise ValueError(f"the map's {width} slots per layer do not split over ranks {self.ranks} "
                             f"(a whole number of slots per rank, at most the {m.num_experts} experts)")
        return self


class SglangPlacementSchema(Schema):
    """SGLang's file: the map alone, [layers, P] (every hidden layer, or the MoE layers only)."""

    physical_to_logical_map: list[list[int]]

    @model_validator(mode="after")
    def _shape(self) -> "SglangPlacementSchema":
        rows = self.physical_to_logical_map
        if not rows or len({len(r) for r in rows}) != 1 or not 1 <= len(rows[0]) <= MAX_EXPERTS:
            raise ValueError(f"physical_to_logical_map must be a non-empty [layers, slots] array of up to "
                             f"{MAX_EXPERTS} slots per layer")
        low, high = min(min(r) for r in rows), max(max(r) for r in rows)
        if low < 0 or high >= MAX_EXPERTS:
            raise ValueError(f"physical_to_logical_map holds expert id {low if low < 0 else high}, outside "
                             f"0..{MAX_EXPERTS - 1}")
        return self
