"""What one routed expert weighs: its shape and the format its weights are read in.

A rank's MoE time at verify batch is set by the bytes of the distinct experts it reads
(``moeplace.cost.derive``), so the cost model needs, per expert: the hidden size H, the expert's
intermediate size I (SiLU-gated: gate/up ``[2I, H]`` plus down ``[H, I]``, 3*H*I weights) and the
bytes per weight as SGLang's fused MoE kernel reads them. That comes from the model's ``config.json``
(``moeplace.model.config``), or from the table below when a trace names a known model.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeplace.model.spec import ModelSpec

# Bytes per weight as the kernel reads them, scales included: fp8 with one fp32 scale per 128x128
# block (DeepSeek V3, Kimi K2); int4 weight-only with one bf16 scale per group of 32 (Kimi K2 Thinking).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "int4": 0.5 + 2 / 32}
MXFP4_NOTE = "mxfp4 checkpoint, upcast to bf16 by SGLang's Triton MoE on Hopper"


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert (or, under TP-MoE, one rank's slice of it).

    weights: a key of WEIGHT_BYTES. source: where the shape came from, for the user.
    note: anything the user should know about the weight format (empty when nothing).
    """

    hidden: int
    intermediate: int
    weights: str
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_BYTES:
            raise ValueError(f"unknown weight format {self.weights!r}; one of {', '.join(WEIGHT_BYTES)}")

    @property
    def num_weights(self) -> int:
        """gate/up [2I, H] + down [H, I]."""
        return 3 * self.hidden * self.intermediate

    @property
    def bytes(self) -> float:
        return self.num_weights * WEIGHT_BYTES[self.weights]

    def tp_slice(self, tp: int) -> "ExpertShape":
        """One rank's share under TP-MoE: every expert cut along its intermediate dimension."""
        return ExpertShape(self.hidden, -(-self.intermediate // tp), self.weights,
                           f"{self.source}, 1/{tp} of each expert", self.note)

    def describe(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.source}: experts {self.hidden}x{self.intermediate} {self.weights}{note}"


@dataclass(frozen=True)
class KnownModel:
    pattern: str        # lower-case substring of the model name
    experts: int        # routed experts: a trace of another count is not this model
    hidden: int
    intermediate: int
    checkpoint: str     # weight format the published checkpoint ships
    top_k: int          # routed experts per token


# From each model's published config.json. More specific patterns first.
KNOWN_MODELS = (
    KnownModel("gpt-oss-20b", 32, 2880, 2880, "mxfp4", 4),
    KnownModel("gpt-oss-120b", 128, 2880, 2880, "mxfp4", 4),
    KnownModel("kimi-k2-thinking", 384, 7168, 2048, "int4", 8),
    KnownModel("kimi-k2", 384, 7168, 2048, "fp8", 8),
    KnownModel("deepseek-v3", 256, 7168, 2048, "fp8", 8),
    KnownModel("deepseek-r1", 256, 7168, 2048, "fp8", 8),
    KnownModel("qwen3-30b-a3b", 128, 2048, 768, "bf16", 8),
    KnownModel("qwen3-235b-a22b", 128, 4096, 1536, "bf16", 8),
    KnownModel("mixtral-8x7b", 8, 4096, 14336, "bf16", 2),
    KnownModel("mixtral-8x22b", 8, 6144, 16384, "bf16", 2),
)

# When nothing says the shape: a DeepSeek-V3 / Kimi-K2-sized expert in bf16 (the callers warn).
GENERIC = ExpertShape(7168, 2048, "bf16", "generic default (DeepSeek-V3-sized)")


def served_weights(checkpoint: str) -> tuple[str, str]:
    """(format the kernel reads, note) for a checkpoint's weight format."""
    if checkpoint == "mxfp4":
        return "bf16", MXFP4_NOTE
    return checkpoint, ""


def known_model_named(name: str) -> KnownModel | None:
    """The known model whose pattern ``name`` holds (case aside), None for any other name."""
    return next((k for k in KNOWN_MODELS if k.pattern in name.lower()), None)


def known_shape(known: KnownModel) -> ExpertShape:
    """A known model's experts as SGLang serves them."""
    weights, note = served_weights(known.checkpoint)
    return ExpertShape(known.hidden, known.intermediate, weights, f"known model {known.pattern}", note)


def known_expert_shape(model: ModelSpec) -> ExpertShape | None:
    """The expert shape of a known model named in ``model.name`` with its expert count, else None."""
    name = model.name.lower()
    for known in KNOWN_MODELS:
        if known.pattern in name and known.experts == model.num_experts:
            return known_shape(known)
    return None
