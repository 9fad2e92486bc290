"""The schema of a cost-model file (``CostModel.to_json``; ``model/schema.py`` says why pydantic, and how a
failure reads): finite, non-negative coefficients up to MAX_COEFFICIENT_US, and a row-block term only with
the rows of a block (a power of two, as SGLang's are)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from moeplace.model.schema import Schema

# A coefficient above this (a second per expert, token or launch of one layer) is no GPU's: a file
# holding one is refused before its costs overflow to inf.
MAX_COEFFICIENT_US = 1e6
MAX_BLOCK_M = 1 << 16


class CostModelSchema(Schema):
    a_us_per_expert: float = Field(ge=0, le=MAX_COEFFICIENT_US)
    b_us_per_token: float = Field(ge=0, le=MAX_COEFFICIENT_US)
    c_us: float = Field(ge=0, le=MAX_COEFFICIENT_US)
    r_us_per_block: float = Field(0.0, ge=0, le=MAX_COEFFICIENT_US)
    block_m: int = Field(0, ge=0, le=MAX_BLOCK_M)
    provenance: dict[str, Any] = {}

    @model_validator(mode="after")
    def _agree(self) -> "CostModelSchema":
        if self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m {self.block_m} is not a power of two, as SGLang's row blocks are")
        if self.r_us_per_block > 0 and self.block_m == 0:
            raise ValueError("r_us_per_block is given but no block_m (the rows of a block)")
        return self
