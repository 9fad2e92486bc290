"""What a trace or placement needs to know about the model: layer layout, experts, top-k."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moeplace.errors import MoeplaceError

# What the program can hold: expert and slot ids, and rank ids, are int16 in memory (RoutingSteps).
MAX_EXPERTS = 32767
MAX_RANKS = 32767
MAX_LAYERS = 4096        # no model has near as many; bounds every [.., L, ..] array


@dataclass(frozen=True)
class ModelSpec:
    """The MoE shape of a model.

    ``moe_layers`` are indices into ``range(num_hidden_layers)``; dense layers are the rest.
    """

    name: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.top_k < 1 or self.top_k > self.num_experts:
            raise MoeplaceError(
                f"model {self.name!r}: need 1 <= top_k <= num_experts, got top_k={self.top_k}, "
                f"num_experts={self.num_experts}")
        if self.num_experts > MAX_EXPERTS or not 1 <= self.num_hidden_layers <= MAX_LAYERS:
            raise MoeplaceError(f"model {self.name!r}: {self.num_experts} experts over {self.num_hidden_layers} "
                                f"layers; moeplace holds up to {MAX_EXPERTS} experts and {MAX_LAYERS} layers")
        if not self.moe_layers:
            raise MoeplaceError(f"model {self.name!r}: no MoE layers")
        layers = tuple(int(x) for x in self.moe_layers)
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.num_hidden_layers:
            raise MoeplaceError(
                f"model {self.name!r}: moe_layers must be increasing indices below "
                f"num_hidden_layers={self.num_hidden_layers}")
        object.__setattr__(self, "moe_layers", layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelSpec":
        try:
            return cls(name=str(d["name"]), num_hidden_layers=int(d["num_hidden_layers"]),
                       moe_layers=tuple(int(x) for x in d["moe_layers"]),
                       num_experts=int(d["num_experts"]), top_k=int(d["top_k"]))
        except (KeyError, TypeError, ValueError) as e:
            raise MoeplaceError(f"model description is missing or has a bad field: {e}") from None

    @classmethod
    def all_moe(cls, name: str, num_layers: int, num_experts: int, top_k: int) -> "ModelSpec":
        """A model whose every layer is MoE (GPT-OSS, Mixtral)."""
        return cls(name, num_layers, tuple(range(num_layers)), num_experts, top_k)

