"""The MoE cost of one rank in one step: ``a * distinct_experts + r * extra_row_blocks + b * tokens + c``
(microseconds).

At low batch a rank's grouped-GEMM time is set by how many distinct experts' weights it reads,
not by how many tokens it runs, so ``a`` dominates. SGLang's fused MoE kernel runs an expert's pairs in
row blocks of ``block_m`` (its kernel config's BLOCK_SIZE_M); an expert with more pairs than that runs
one more block per ``block_m``, each a pass over its weights' tiles again: ``r`` per block beyond an
expert's first (0.3-0.7 of ``a`` on the H200, BENCHMARKS.md#measured-lines). A step of at most ``block_m`` tokens has
none (an expert gets at most one pair per token). The commands derive a, b, c for the model's
experts (``moeplace.cost.derive``) or read them from a file (``--cost-model``). The defaults here
are an early rough fit (H200, bf16 Kimi-K2-shaped experts: 41, 142, 274, 406, 539 µs for 1, 4, 8,
12, 16 distinct experts; ``b`` assumed), kept for library callers that give no model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moeplace.errors import FormatError


@dataclass(frozen=True)
class CostModel:
    a_us_per_expert: float = 33.15
    b_us_per_token: float = 0.5
    c_us: float = 8.6
    provenance: dict[str, Any] = field(default_factory=lambda: {
        "source": "early rough fit (H200, bf16 Kimi-K2-shaped experts, 1-16 per rank; b assumed)"})
    source: str = field(default="", compare=False)   # what the user is told: a file, or how it was derived
    r_us_per_block: float = 0.0     # each row block beyond an expert's first on the rank
    block_m: int = 0                # the rows of a block (0: the model has no row-block term)

    def cost(self, distinct: np.ndarray, tokens: np.ndarray, extra_blocks: np.ndarray | int = 0) -> np.ndarray:
        """Cost in µs of each rank-step; distinct, tokens, extra_blocks (``extra_row_blocks`` of the rank's
        per-slot pairs; 0, exact for steps of at most ``block_m`` tokens): same shape, e.g. [S, R]."""
        return (self.a_us_per_expert * distinct + self.r_us_per_block * extra_blocks
                + self.b_us_per_token * tokens + self.c_us)

    def needs_blocks(self, step_tokens: int) -> bool:
        """Whether steps of ``step_tokens`` tokens can run experts of several row blocks under this model."""
        return self.r_us_per_block > 0 and step_tokens > self.block_m

    def extra_blocks(self, slot_pairs: np.ndarray) -> np.ndarray:
        """[...] row blocks beyond each expert's first, summed over the last axis of ``slot_pairs [..., slots]``
        (pairs per slot, or expected pairs); 0 for a model without the term."""
        if self.r_us_per_block <= 0:
            return np.zeros(np.shape(slot_pairs)[:-1])
        return extra_row_blocks(slot_pairs, self.block_m)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the user: where the model comes from and its coefficients."""
        what = self.source or self.provenance.get("source") or "given coefficients"
        blocks = (f"{self.r_us_per_block:.2f} µs per row block of {self.block_m} beyond an expert's first + "
                  if self.r_us_per_block > 0 else "")
        return (f"{what}; per rank and layer {self.a_us_per_expert:.2f} µs/expert + {blocks}"
                f"{self.b_us_per_token:.3f} µs/token + {self.c_us:.1f} µs")


def blocks_past_first(pairs: np.ndarray, block_m: int) -> np.ndarray:
    """Elementwise ``max(ceil(pairs / block_m) - 1, 0)``: the row blocks SGLang's fused MoE kernel runs beyond
    the first of an expert with ``pairs`` on one rank (float: expected pairs are fine)."""
    return np.maximum(np.ceil(np.asarray(pairs, np.float64) / block_m) - 1, 0)


def extra_row_blocks(slot_pairs: np.ndarray, block_m: int) -> np.ndarray:
    """[...] ``blocks_past_first`` summed over the last axis: the row blocks beyond each active expert's first."""
    return blocks_past_first(slot_pairs, block_m).sum(axis=-1)


def read_cost_json(path: str | os.PathLike) -> Any:
    """A cost file's parsed JSON (a FormatError line where it cannot be read or parsed)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise FormatError(path, e.strerror or "cannot read") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(path, "not valid JSON") from None


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Read a cost-model JSON file: ``{"a_us_per_expert", "b_us_per_token", "c_us", "provenance"}``, with
    ``"r_us_per_block"`` and ``"block_m"`` where the model has a row-block term."""
    return cost_model_from_json(read_cost_json(path), path)


def cost_model_from_json(d: Any, path: str | os.PathLike) -> CostModel:
    """A cost model from a file's parsed JSON, checked (``moeplace.cost.schema``)."""
    from moeplace.cost.schema import CostModelSchema
    from moeplace.model.schema import validate

    checked = validate(CostModelSchema, d, path, "cost model")
    values = {k: float(getattr(checked, k)) for k in ("a_us_per_expert", "b_us_per_token", "c_us", "r_us_per_block")}
    block_m, provenance = checked.block_m, dict(checked.provenance)
    return CostModel(**values, block_m=block_m, provenance=provenance, source=f"file {os.fspath(path)}")
