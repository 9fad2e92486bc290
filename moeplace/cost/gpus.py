"""Which GPU a command costs for: the one the user names (``--gpu``), its memory, and the cost models shipped for it.

The packaged measurements (``moeplace/cost/measured``) name the GPU they were made on; a GPU without any is
costed with the nearest shipped one's, and the user is told in one line that the figures are another GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from moeplace.cost.derive import DEFAULT_GPU, packaged_measurements
from moeplace.errors import MoeplaceError

MIB = 2**20
# Memory as nvidia-smi reports it (MiB), by a name's model token; GB below are 1e9 bytes.
GPU_MEMORY_MIB = {"H200": 143_771, "H100": 81_559, "H800": 81_559, "A100": 81_920, "B200": 183_359,
                  "RTX PRO 6000": 97_887}
# A GPU without shipped measurements is costed with the one of this token where it ships: the same chip.
NEAREST_SHIPPED = {"H800": "H100"}


@dataclass(frozen=True)
class Gpu:
    """The GPU a command costs for: ``measured`` names the packaged measurements it uses (its own or the
    nearest's), ``memory_gb`` what its experts must fit in, ``warning`` a line where the costs are another GPU's."""

    name: str
    measured: str
    memory_gb: float
    warning: str | None = None


def model_token(name: str) -> str | None:
    """The model token of a GPU name ("NVIDIA H100 80GB HBM3" -> "H100"), None for one not in the table."""
    upper = " ".join(name.upper().replace("NVIDIA", " ").split())
    return next((t for t in sorted(GPU_MEMORY_MIB, key=len, reverse=True) if t in upper), None)


@lru_cache(maxsize=None)
def shipped_gpus() -> tuple[str, ...]:
    """The GPUs the packaged measurements were made on, as their files name them."""
    return tuple(sorted({m.cost.provenance["gpu"] for m in packaged_measurements()}))


def resolve_gpu(asked: str | None) -> Gpu:
    """The GPU of ``--gpu`` (default: the H200 every shipped model was first measured on)."""
    shipped = shipped_gpus()
    name = asked or DEFAULT_GPU
    token = model_token(name)
    if asked is not None and not asked.strip():
        raise MoeplaceError("--gpu: empty; name a GPU, e.g. --gpu H100")
    own = next((g for g in shipped if model_token(g) == token), None) if token else None
    memory = GPU_MEMORY_MIB[token] * MIB / 1e9 if token else None
    if own is not None:
        return Gpu(own, own, memory)
    near = NEAREST_SHIPPED.get(token or "")
    nearest = next((g for g in shipped if near and model_token(g) == near), DEFAULT_GPU)
    if memory is None:
        memory = GPU_MEMORY_MIB[model_token(nearest)] * MIB / 1e9
        held = f"; its memory is not known either, so spare slots are sized for the {nearest}'s"
    else:
        held = ""
    return Gpu(name, nearest, memory,
               f"warning: no cost model ships for {name}; MoE µs are the {nearest}'s{held} (run `moeplace calibrate` "
               f"on that GPU and pass its file as --cost-model)")
