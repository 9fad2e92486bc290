"""A rank's MoE cost model derived from its experts' shape, calibrated once per GPU on the measured files.

Each packaged ``moeplace/data/cost_<gpu>_*.json`` is a line ``a * distinct + b * tokens + c`` (µs)
measured on one rank shape (``scripts/calibrate_cost.py``: SGLang's fused Triton MoE with its
default kernel config, 9-token verify steps, CUDA-graph replay). Those lines are explained here by a
few physical terms, fitted once per GPU, so that any expert shape and weight format gets a model:

* ``a = us_per_byte * expert bytes``: a rank reads each distinct expert's weights once. Fitted
  through the origin on the files whose reads fill the GPU (bf16 and fp8; int4 is not read-bound in
  SGLang's w4a16 Triton kernel: its measured cost per weight is used instead).
* ``c = launch_us + us_per_program * programs + extra[format]``: SGLang pads each local expert's
  rows to whole ``BLOCK_SIZE_M`` blocks, so both GEMMs launch about ``local_slots * (BM-1)/BM``
  row blocks times ``N / BN`` column blocks, most of which exit at once but still cost a launch
  (137 µs with 384 local slots, 27 µs with 32). ``extra``: fp8's activation quantisation, int4's
  dequantisation set-up, measured as what the bf16 terms leave unexplained.
* When a step has more tokens than the rank has local experts (GPT-OSS under EP: 4 per rank),
  SGLang picks its large-block config (BM 64, BN 64, BK 32): few programs per expert, so a layer
  costs a fixed pipeline time per K step (``us_per_k_step``) and each extra expert only part of its
  reads (``read_share``); both from the files measured in that regime.
* ``b``: the files' median (under 2% of a verify step's cost).

A rank shape that was measured itself (same hidden, intermediate, weight format, local slots) uses
its measured line. ``BENCHMARKS.md`` ("Derived cost model") compares both with GPU replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from statistics import median

import numpy as np

from moeplace.costmodel import CostModel, load_cost_model
from moeplace.errors import MoeplaceError
from moeplace.expert_shape import ExpertShape

STEP_TOKENS = 9          # tokens of the verify step the files were measured for (1 + 8 drafts)
DEFAULT_GPU = "NVIDIA H200"
SMALL_M, LARGE_M, FP8_BLOCK = (16, 32, 64), (64, 64, 32), (64, 128, 128)


def sglang_default_config(step_tokens: int, local_experts: int, weights: str) -> tuple[int, int, int]:
    """(BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K) SGLang 0.5.23's fused MoE picks without a tuned file
    (``get_default_config``): block fp8 uses its 128x128 weight blocks; otherwise small blocks when the
    step's tokens M <= the rank's local experts E, large ones when M > E."""
    if weights == "fp8":
        return FP8_BLOCK
    return SMALL_M if step_tokens <= local_experts else LARGE_M


def launched_programs(shape: ExpertShape, local_slots: int, config: tuple[int, int, int]) -> float:
    """Programs both GEMMs launch for the padding rows: local_slots * (BM-1)/BM row blocks x column blocks."""
    bm, bn, _ = config
    columns = -(-2 * shape.intermediate // bn) + -(-shape.hidden // bn)
    return local_slots * (bm - 1) / bm * columns


def k_steps(shape: ExpertShape, config: tuple[int, int, int]) -> int:
    """K-loop iterations of one program of each GEMM, summed: gate/up over H, down over I."""
    bk = config[2]
    return -(-shape.hidden // bk) + -(-shape.intermediate // bk)


@dataclass(frozen=True)
class Measured:
    """One packaged cost file with the rank shape it was measured on."""

    name: str
    cost: CostModel
    shape: ExpertShape
    local_slots: int
    config: tuple[int, int, int]


@dataclass(frozen=True)
class Calibration:
    """One GPU's terms (see the module docstring); ``files`` are the measurements they come from."""

    gpu: str
    us_per_byte: float
    launch_us: float
    us_per_program: float
    extra_us: dict[str, float]
    us_per_weight: dict[str, float]     # formats whose cost is not their reads (int4)
    read_share: float                   # large-block config: share of an extra expert's reads paid
    us_per_k_step: float                # large-block config: fixed pipeline time per K step
    b_us_per_token: float
    files: tuple[Measured, ...]


def packaged_measurements() -> list[Measured]:
    """Every ``moeplace/data/cost_*.json`` with the rank shape its provenance names."""
    out = []
    for path in sorted(resources.files("moeplace").joinpath("data").iterdir(), key=lambda p: p.name):
        if not (path.name.startswith("cost_") and path.name.endswith(".json")):
            continue
        cost = load_cost_model(str(path))
        prov = cost.provenance
        s = prov["shape"]
        shape = ExpertShape(int(s["hidden"]), int(s["expert_intermediate"]), prov["dtype"], path.name)
        slots = int(s["local_slots"])
        out.append(Measured(path.name, cost, shape, slots,
                            sglang_default_config(STEP_TOKENS, slots, shape.weights)))
    return out


def calibrate(files: list[Measured]) -> Calibration:
    """Fit the terms on one GPU's measured files (see the module docstring for which file sets what)."""
    if len({m.cost.provenance.get("gpu") for m in files}) != 1:
        raise MoeplaceError("calibrate: the files must come from one GPU")
    large = [m for m in files if m.config == LARGE_M]
    read_bound = [m for m in files if m.shape.weights in ("bf16", "fp8") and m.config != LARGE_M]
    bf16 = [m for m in read_bound if m.shape.weights == "bf16"]
    if len(bf16) < 2:
        raise MoeplaceError("calibrate: needs at least two bf16 files measured with small-block configs")
    x = np.array([m.shape.bytes for m in read_bound])
    us_per_byte = float(x @ np.array([m.cost.a_us_per_expert for m in read_bound]) / (x @ x))
    progs = np.array([[1.0, launched_programs(m.shape, m.local_slots, m.config)] for m in bf16])
    (launch_us, us_per_program), *_ = np.linalg.lstsq(progs, np.array([m.cost.c_us for m in bf16]), rcond=None)

    def fixed(m: Measured) -> float:
        return launch_us + us_per_program * launched_programs(m.shape, m.local_slots, m.config)

    extra: dict[str, list[float]] = {}
    per_weight: dict[str, list[float]] = {}
    for m in files:
        if m.shape.weights != "bf16" and m.config != LARGE_M:
            extra.setdefault(m.shape.weights, []).append(m.cost.c_us - fixed(m))
        if m.shape.weights not in ("bf16", "fp8"):
            per_weight.setdefault(m.shape.weights, []).append(m.cost.a_us_per_expert / m.shape.num_weights)
    large_bf16 = [m for m in large if m.shape.weights == "bf16"]
    read_share = (float(np.mean([m.cost.a_us_per_expert / (us_per_byte * m.shape.bytes) for m in large_bf16]))
                  if large_bf16 else 1.0)
    per_k = (float(np.mean([(m.cost.c_us - fixed(m)) / k_steps(m.shape, m.config) for m in large_bf16]))
             if large_bf16 else 0.0)
    return Calibration(
        gpu=files[0].cost.provenance["gpu"], us_per_byte=us_per_byte, launch_us=float(launch_us),
        us_per_program=float(us_per_program), extra_us={k: float(np.mean(v)) for k, v in extra.items()},
        us_per_weight={k: float(np.mean(v)) for k, v in per_weight.items()}, read_share=read_share,
        us_per_k_step=per_k, b_us_per_token=float(median(m.cost.b_us_per_token for m in files)),
        files=tuple(files))


@lru_cache(maxsize=None)
def gpu_calibration(gpu: str = DEFAULT_GPU) -> Calibration:
    """The calibration of ``gpu`` from the packaged files (computed once per process)."""
    files = [m for m in packaged_measurements() if m.cost.provenance.get("gpu") == gpu]
    if not files:
        raise MoeplaceError(f"no packaged cost measurements for {gpu}; pass --cost-model FILE")
    return calibrate(files)


def formula_cost(cal: Calibration, shape: ExpertShape, local_slots: int,
                 step_tokens: int = STEP_TOKENS) -> tuple[float, float, float]:
    """(a, b, c) of the derived terms, without looking for a measured line."""
    config = sglang_default_config(step_tokens, local_slots, shape.weights)
    if shape.weights in cal.us_per_weight:
        a = cal.us_per_weight[shape.weights] * shape.num_weights
    else:
        a = cal.us_per_byte * shape.bytes
    c = cal.launch_us + cal.us_per_program * launched_programs(shape, local_slots, config)
    c += cal.extra_us.get(shape.weights, 0.0)
    if config == LARGE_M:
        a *= cal.read_share
        c += cal.us_per_k_step * k_steps(shape, config)
    return a, cal.b_us_per_token, c


def derive_cost_model(shape: ExpertShape, local_slots: int, gpu: str = DEFAULT_GPU,
                      step_tokens: int = STEP_TOKENS) -> CostModel:
    """The cost model of one rank holding ``local_slots`` experts of ``shape`` (one verify step)."""
    if local_slots < 1:
        raise MoeplaceError(f"a rank needs at least one expert slot, got {local_slots}")
    cal = gpu_calibration(gpu)
    where = f"{gpu}, {shape.describe()}, {local_slots} per rank"
    for m in cal.files:
        if (m.shape.hidden, m.shape.intermediate, m.shape.weights, m.local_slots) == \
                (shape.hidden, shape.intermediate, shape.weights, local_slots) and step_tokens == STEP_TOKENS:
            return CostModel(m.cost.a_us_per_expert, m.cost.b_us_per_token, m.cost.c_us,
                             {**m.cost.provenance, "derived_from": m.name}, f"{where}: measured ({m.name})")
    a, b, c = formula_cost(cal, shape, local_slots, step_tokens)
    prov = {"derived_from": [m.name for m in cal.files], "gpu": gpu, "weights": shape.weights,
            "shape": {"hidden": shape.hidden, "expert_intermediate": shape.intermediate,
                      "local_slots": local_slots}, "step_tokens": step_tokens,
            "calibration": {"us_per_byte": cal.us_per_byte, "launch_us": cal.launch_us,
                            "us_per_program": cal.us_per_program, "extra_us": cal.extra_us,
                            "us_per_weight": cal.us_per_weight, "read_share": cal.read_share,
                            "us_per_k_step": cal.us_per_k_step}}
    return CostModel(round(a, 4), round(b, 4), round(c, 3), prov,
                     f"{where}: derived from expert bytes ({len(cal.files)} measured files)")

