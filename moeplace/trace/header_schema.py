"""The schema of a trace's (and each shard's) header: ``TraceHeader.to_json`` (``model/schema.py`` says why
pydantic, and how a failure reads)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from moeplace.model.schema import MAX_RANKS, ModelSchema, Schema, check_map


class TraceHeaderSchema(Schema):
    format: Literal["moeplace-trace"]
    version: int
    model: ModelSchema
    source: str
    id_space: Literal["logical", "physical"] = "logical"
    physical_to_logical_map: list[list[int]] | None = None
    ep_size: int = Field(1, ge=1, le=MAX_RANKS)
    tp_size: int = Field(1, ge=1, le=MAX_RANKS)
    nodes: int = Field(1, ge=1, le=MAX_RANKS)
    ranks: list[Annotated[int, Field(ge=0, lt=MAX_RANKS)]] = Field([0], min_length=1, max_length=MAX_RANKS)
    attn_dp_size: int | None = Field(None, ge=1, le=MAX_RANKS)
    attn_dp_rank: int | None = Field(None, ge=0, lt=MAX_RANKS)
    aggregate_only: bool = False
    created: str = ""
    notes: str = ""
    merged_from: list[str] = []

    @model_validator(mode="after")
    def _agree(self) -> "TraceHeaderSchema":
        if self.id_space == "physical" and self.physical_to_logical_map is None:
            raise ValueError("physical ids need a physical_to_logical_map")
        check_map(self.physical_to_logical_map, len(self.model.moe_layers), self.model.num_experts)
        if self.attn_dp_size is not None and self.attn_dp_rank is not None and self.attn_dp_rank >= self.attn_dp_size:
            raise ValueError(f"attn_dp_rank {self.attn_dp_rank} is not below attn_dp_size {self.attn_dp_size}")
        return self
