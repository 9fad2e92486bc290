"""The MoE cost of one rank in one step: ``a * distinct_experts + b * tokens + c`` (microseconds).

At low batch a rank's grouped-GEMM time is set by how many distinct experts' weights it reads,
not by how many tokens it runs, so ``a`` dominates. The commands derive a, b, c for the model's
experts (``moeplace.cost_derive``) or read them from a file (``--cost-model``). The defaults here
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


# A coefficient above this (a second per expert, token or launch of one layer) is no GPU's: a file
# holding one is refused before its costs overflow to inf.
MAX_COEFFICIENT_US = 1e6


@dataclass(frozen=True)
class CostModel:
    a_us_per_expert: float = 33.15
    b_us_per_token: float = 0.5
    c_us: float = 8.6
    provenance: dict[str, Any] = field(default_factory=lambda: {
        "source": "early rough fit (H200, bf16 Kimi-K2-shaped experts, 1-16 per rank; b assumed)"})
    source: str = field(default="", compare=False)   # what the user is told: a file, or how it was derived

    def cost(self, distinct: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Cost in µs of each rank-step; distinct, tokens: same shape, e.g. [S, R]."""
        return self.a_us_per_expert * distinct + self.b_us_per_token * tokens + self.c_us

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the user: where the model comes from and its coefficients."""
        what = self.source or self.provenance.get("source") or "given coefficients"
        return (f"{what}; per rank and layer {self.a_us_per_expert:.2f} µs/expert + "
                f"{self.b_us_per_token:.3f} µs/token + {self.c_us:.1f} µs")


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Read a cost-model JSON file: ``{"a_us_per_expert", "b_us_per_token", "c_us", "provenance"}``."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise FormatError(path, e.strerror or "cannot read") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(path, "not valid JSON") from None
    try:
        values = {k: float(d[k]) for k in ("a_us_per_expert", "b_us_per_token", "c_us")}
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(path, f"cost model needs numeric a_us_per_expert, b_us_per_token, c_us ({e})") from None
    if not all(np.isfinite(v) and 0 <= v <= MAX_COEFFICIENT_US for v in values.values()):
        raise FormatError(path, f"cost model coefficients must be finite and non-negative, at most "
                                f"{MAX_COEFFICIENT_US:g} µs (got {', '.join(f'{k} {v:g}' for k, v in values.items())})")
    provenance = d.get("provenance") if isinstance(d.get("provenance"), dict) else {}
    return CostModel(**values, provenance=provenance, source=f"file {os.fspath(path)}")
