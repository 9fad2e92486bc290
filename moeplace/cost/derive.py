"""A rank's MoE cost model derived from its experts' shape, calibrated once per GPU on the measured files.

Each packaged ``moeplace/cost/measured/cost_<gpu>_*.json`` is a line ``a * distinct + b * tokens + c`` (µs)
measured on one rank shape (``scripts/calibrate_cost.py``: SGLang's fused Triton MoE with its
default kernel config, 9-token verify steps, CUDA-graph replay). Those lines are explained here by a
few physical terms, fitted once per GPU, so that any expert shape and weight format gets a model:

* ``a = us_per_byte * expert bytes``: a rank reads each distinct expert's weights once. Fitted
  through the origin on the files whose reads fill the GPU (bf16 and fp8; int4 is not read-bound in
  SGLang's w4a16 Triton kernel: its measured cost per weight is used instead).
* ``c = launch_us + us_per_program * programs + extra[format]``: the fused MoE kernel's grid covers
  SGLang's whole sorted-token buffer (``moe_align_block_size``): one row block per ``BLOCK_SIZE_M``
  rows, times ``N / BN`` column blocks for each GEMM; most row blocks exit at once but still cost a
  launch. SGLang sizes the buffer from the step's (token, k) pairs P (every rank sees all of them
  with ``--moe-a2a-backend none``, other ranks' as -1) and the rank's local slots E:
  ``P * BM`` rows when P < E + 1, else ``P + (E + 1) * (BM - 1)`` (``sglang_row_blocks``). So the
  grid is the same for every rank of a step whatever its share, and grows with the step's tokens
  until P reaches E + 1 (Kimi TP-MoE at 8 ranks, 384 slots: 72 row blocks at a 9-token verify step,
  where the files' layout launched 360; all 385 buckets padded from 49 tokens on). ``extra``: fp8's
  activation quantisation, int4's dequantisation set-up, measured as what the bf16 terms leave
  unexplained.
* The packaged files were measured with an earlier emulation layout (``Measured.sglang_layout``
  False): a buffer of the rank's own pairs n plus ``local_slots * (BM - 1)`` rows, so their c paid
  for ``local_slots * (BM - 1) / BM`` row blocks and their b for ``1 / BM`` of a row block per
  pair. The calibration is fitted on the files as measured, then predicts SGLang's grid: a measured
  line used for its own rank shape has its c and b moved by ``us_per_program`` x column blocks x
  the row-block difference (``measured_line``).
* When a step has more tokens than the rank has local experts (GPT-OSS under EP: 4 per rank),
  SGLang picks its large-block config (BM 64, BN 64, BK 32): a layer costs a fixed pipeline time per
  K step (``us_per_k_step``) and each extra expert a share of its reads (``read_share``: 0.6 for
  GPT-OSS's 2880 x 2880 experts, above 1 for Kimi K2's slices); both averaged over the files measured
  in that regime, for shapes none of them covers.
* ``b``: the files' median once the row blocks of their layout are taken out (under 2% of a verify
  step's cost).

SGLang's kernel config follows the step (``sglang_default_config``: no tuned file ships for the
shapes modelled, tests/test_cost_derive.py asks SGLang's own lookup), and so does the model: a
16-row-block line while the step's tokens are at most the rank's slots, a 64-row-block one above
(an expert costs 1.4-1.8x more to read there, Kimi K2 slices). The config sweeps
(``cost_h200_bf16_*_bm16/_bm64.json``, ``calibrate_cost.py``'s ``CONFIG_SWEEPS``) give a measured line
for each expert slice of the EP x TP layouts at each config it runs, measured at that config's
smallest batch (``Measured.step_tokens``) with SGLang's layout; they feed the large-block terms but
not the others (those stay the verify-step files'). A rank shape with a measured line for its
(hidden, intermediate, weight format, config) uses it, the file of the nearest slot count, moved to
the step's and the rank's grid (``measured_line``): spare slots change only the grid. A config sweep also
measured its c at the config's largest batch (576 tokens for 64-row blocks, as many tokens as slots for
16-row ones) and ``r``, what each row block past an expert's first costs (``moeplace.cost.model``): c goes
linearly in the step between its two measured steps, since at 64-row blocks it grows faster than the grid
(SGLang's kernel writes zeros to the buffer rows of other ranks' pairs), and a line or derived model
without its own r takes the measured files' median r / a for its block size. BENCHMARKS.md#derived-model and
#model-against-the-replay compare both with GPU replays. The output rows SGLang zeroes for other ranks' pairs
(a few µs a layer at verify batch) are counted only where a config sweep measured c at a larger step.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from statistics import median

import numpy as np

from moeplace.cost.model import CostModel, cost_model_from_json, load_cost_model, read_cost_json
from moeplace.errors import MoeplaceError
from moeplace.model.expert_shape import ExpertShape

DEFAULT_GPU = "NVIDIA H200"   # the GPU every packaged file was first measured on (``moeplace.cost.gpus``)
STEP_TOKENS = 9          # tokens of the verify step the files were measured for (1 + 8 drafts)
SMALL_M, LARGE_M, FP8_BLOCK = (16, 32, 64), (64, 64, 32), (64, 128, 128)


def sglang_default_config(step_tokens: int, local_experts: int, weights: str) -> tuple[int, int, int]:
    """(BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K) SGLang 0.5.23's fused MoE picks without a tuned file
    (``get_default_config``): block fp8 uses its 128x128 weight blocks; otherwise small blocks when the
    step's tokens M <= the rank's local experts E, large ones when M > E."""
    if weights == "fp8":
        return FP8_BLOCK
    return SMALL_M if step_tokens <= local_experts else LARGE_M


def sglang_sorted_rows(step_pairs: int, local_slots: int, block_m: int) -> int:
    """Rows of the sorted-token buffer SGLang 0.5.23's ``moe_align_block_size`` allocates.

    step_pairs: ``topk_ids.numel()``, the step's tokens x top-k (every pair of the step: with
    ``--moe-a2a-backend none`` each rank gets all of them, other ranks' as -1); local_slots: the
    rank's experts (``num_experts``; SGLang adds a bucket for the -1 pairs). Rounded up to 4 for the
    align kernel's int4 stores.
    """
    buckets = local_slots + 1
    rows = step_pairs * block_m if step_pairs < buckets else step_pairs + buckets * (block_m - 1)
    return -(-rows // 4) * 4


def sglang_row_blocks(step_pairs: int, local_slots: int, block_m: int) -> int:
    """Row blocks each GEMM of the fused MoE kernel launches: its grid covers the whole sorted buffer."""
    return -(-sglang_sorted_rows(step_pairs, local_slots, block_m) // block_m)


def column_blocks(shape: ExpertShape, config: tuple[int, int, int]) -> int:
    """Column blocks of both GEMMs together: gate/up (N = 2I) and down (N = H)."""
    bn = config[1]
    return -(-2 * shape.intermediate // bn) + -(-shape.hidden // bn)


def k_steps(shape: ExpertShape, config: tuple[int, int, int]) -> int:
    """K-loop iterations of one program of each GEMM, summed: gate/up over H, down over I."""
    bk = config[2]
    return -(-shape.hidden // bk) + -(-shape.intermediate // bk)


@dataclass(frozen=True)
class Measured:
    """One packaged cost file with the rank shape it was measured on.

    top_k: the step's top-k the file was measured for (its provenance's ``top_k``; None for the
    packaged files, measured before it mattered). sglang_layout: whether the file was measured with
    SGLang's sorted-token buffer (``scripts/calibrate_cost.py`` writes ``"align_layout": "sglang"``
    since it builds that buffer) rather than the earlier one (see the module docstring). Such a
    file's sweep points each ran the grid of their own step; its c is read as the verify step's.
    """

    name: str
    cost: CostModel
    shape: ExpertShape
    local_slots: int
    config: tuple[int, int, int]
    top_k: int | None = None
    sglang_layout: bool = False
    step_tokens: int = STEP_TOKENS      # the step its c was measured at (a config sweep: its config's smallest batch)
    fits_terms: bool = True             # whether the GPU's terms are fitted on it (not the config sweeps)
    c_at_steps: tuple[tuple[int, float], ...] = ()   # (step tokens, c) where c was measured at several steps

    @property
    def tuned(self) -> bool:
        """Whether the line ran another config than SGLang's default at its step (a tuned file picked it)."""
        return self.config != sglang_default_config(self.step_tokens, self.local_slots, self.shape.weights)

    @property
    def measured_r(self) -> bool:
        """Whether the file measured its own row-block term (a config sweep's uneven points; 0 is a value)."""
        return bool(self.c_at_steps) or self.cost.r_us_per_block > 0

    def __post_init__(self) -> None:
        if self.sglang_layout and self.top_k is None:
            raise MoeplaceError(f"{self.name}: measured with SGLang's layout but no top_k in its provenance")

    @property
    def row_blocks(self) -> float:
        """Row blocks of the kernel's grid that the file's c paid for (at a verify step)."""
        bm = self.config[0]
        if self.sglang_layout:
            return sglang_row_blocks(self.step_tokens * self.top_k, self.local_slots, bm)
        return self.local_slots * (bm - 1) / bm

    @property
    def row_blocks_per_pair(self) -> float:
        """Row blocks of the grid that the file's b paid for per pair on the rank."""
        return 0.0 if self.sglang_layout else 1 / self.config[0]


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
    b_us_per_token: float               # per pair, the grid's row blocks taken out
    files: tuple[Measured, ...]
    row_block_share: dict[int, float] = field(default_factory=dict)   # BLOCK_SIZE_M -> r / a where r was measured

    def row_block_us(self, a: float, block_m: int, m: Measured | None = None) -> float:
        """r of a line: its file's own where it measured one (a config sweep: its uneven points, 0 where the
        pairs' term took their cost), else ``row_block_share[block_m]`` of its a."""
        if m is not None and m.measured_r:
            return m.cost.r_us_per_block
        return self.row_block_share.get(block_m, 0.0) * a

    def grid_us(self, shape: ExpertShape, config: tuple[int, int, int], row_blocks: float) -> float:
        """µs of ``row_blocks`` row blocks of both GEMMs' grids (launches only)."""
        return self.us_per_program * column_blocks(shape, config) * row_blocks

    def net_b(self, m: Measured) -> float:
        """A file's b without the grid row blocks its layout added per pair (not below 0)."""
        return max(0.0, m.cost.b_us_per_token - self.grid_us(m.shape, m.config, m.row_blocks_per_pair))


def measured_line_of(name: str, cost: CostModel) -> Measured:
    """A measured line with the rank shape its provenance names (a packaged file, or a line of a cost set)."""
    prov = cost.provenance
    s = prov["shape"]
    shape = ExpertShape(int(s["hidden"]), int(s["expert_intermediate"]), prov["dtype"], name)
    slots = int(s["local_slots"])
    top_k = int(prov["top_k"]) if "top_k" in prov else None
    tokens = int(prov.get("step_tokens", STEP_TOKENS))
    config = (tuple(int(x) for x in prov["kernel_config"]) if "kernel_config" in prov
              else sglang_default_config(tokens, slots, shape.weights))
    at_steps = tuple(sorted((int(t), float(c)) for t, c in prov.get("c_us_at_step_tokens", {}).items()))
    return Measured(name, cost, shape, slots, config, top_k, prov.get("align_layout") == "sglang",
                    tokens, fits_terms="kernel_config" not in prov, c_at_steps=at_steps)


def packaged_measurements(folder: os.PathLike | None = None) -> list[Measured]:
    """Every line shipped in ``moeplace/cost/measured`` (or ``folder``) with the rank shape its provenance names: a
    ``cost_*.json`` file each, and every line of each ``set_*.json`` (a cost set ``moeplace calibrate`` wrote, its
    lines named ``set_*.json:label``)."""
    out = []
    folder = folder or resources.files("moeplace.cost").joinpath("measured")
    for path in sorted(Path(str(folder)).iterdir(), key=lambda p: p.name):
        if path.suffix != ".json":
            continue
        if path.name.startswith("cost_"):
            out.append(measured_line_of(path.name, load_cost_model(path)))
        elif path.name.startswith("set_"):
            out += set_measurements(read_cost_json(path), path)
    return out


def set_lines(doc: dict, path: os.PathLike) -> dict[str, CostModel]:
    """label -> line of a cost set's JSON (``moeplace.cost.cost_set``), each line's provenance naming the set's GPU."""
    out = {}
    for label, raw in doc["lines"].items():
        line = cost_model_from_json(raw, path)
        out[label] = replace(line, provenance={**line.provenance, "gpu": doc["gpu"]})
    return out


def set_measurements(doc: dict, path: os.PathLike) -> list[Measured]:
    """The lines of a cost set's JSON, each a measurement of the set's GPU named ``file:label``."""
    return [measured_line_of(f"{Path(path).name}:{label}", line) for label, line in set_lines(doc, path).items()]


def calibrate(files: list[Measured]) -> Calibration:
    """Fit the terms on one GPU's measured files (see the module docstring for which file sets what)."""
    if len({m.cost.provenance.get("gpu") for m in files}) != 1:
        raise MoeplaceError("calibrate: the files must come from one GPU")
    every = files
    large = [m for m in every if m.config == LARGE_M]       # the large-block terms: every file of that config
    # the rest: the files measured at a verify step; a cost set of config sweeps only (``moeplace calibrate``)
    # fits them on its small-block lines, each measured at its own step with SGLang's buffer
    files = [m for m in every if m.fits_terms] or [m for m in every if m.config != LARGE_M]
    read_bound = [m for m in files if m.shape.weights in ("bf16", "fp8") and m.config != LARGE_M]
    bf16 = [m for m in read_bound if m.shape.weights == "bf16"]
    if len(bf16) < 2:
        raise MoeplaceError("calibrate: needs at least two bf16 files measured with small-block configs")
    x = np.array([m.shape.bytes for m in read_bound])
    us_per_byte = float(x @ np.array([m.cost.a_us_per_expert for m in read_bound]) / (x @ x))
    progs = np.array([[1.0, column_blocks(m.shape, m.config) * m.row_blocks] for m in bf16])
    (launch_us, us_per_program), *_ = np.linalg.lstsq(progs, np.array([m.cost.c_us for m in bf16]), rcond=None)

    def fixed(m: Measured) -> float:
        return launch_us + us_per_program * column_blocks(m.shape, m.config) * m.row_blocks

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
    cal = Calibration(
        gpu=files[0].cost.provenance["gpu"], us_per_byte=us_per_byte, launch_us=float(launch_us),
        us_per_program=float(us_per_program), extra_us={k: float(np.mean(v)) for k, v in extra.items()},
        us_per_weight={k: float(np.mean(v)) for k, v in per_weight.items()}, read_share=read_share,
        us_per_k_step=per_k, b_us_per_token=0.0, files=tuple(every), row_block_share=row_block_share(every))
    return replace(cal, b_us_per_token=float(median(cal.net_b(m) for m in files)))


def row_block_share(files: list[Measured]) -> dict[int, float]:
    """BLOCK_SIZE_M -> the median r / a of the files that measured a row-block term with that block size
    (the config sweeps): the r of a line measured without one, or derived from bytes."""
    shares: dict[int, list[float]] = {}
    for m in files:
        if m.cost.r_us_per_block > 0 and m.cost.a_us_per_expert > 0:
            shares.setdefault(m.config[0], []).append(m.cost.r_us_per_block / m.cost.a_us_per_expert)
    return {bm: float(median(v)) for bm, v in shares.items()}


@lru_cache(maxsize=None)
def gpu_calibration(gpu: str = DEFAULT_GPU) -> Calibration:
    """The calibration of ``gpu`` from the packaged files (computed once per process)."""
    files = [m for m in packaged_measurements() if m.cost.provenance.get("gpu") == gpu]
    if not files:
        raise MoeplaceError(f"no packaged cost measurements for {gpu}; pass --cost-model FILE")
    return calibrate(files)


def formula_cost(cal: Calibration, shape: ExpertShape, local_slots: int, top_k: int,
                 step_tokens: int = STEP_TOKENS, config_tokens: int | None = None) -> tuple[float, float, float]:
    """(a, b, c) of the derived terms for a step of ``step_tokens`` tokens of ``top_k`` pairs each,
    without looking for a measured line; SGLang's kernel config for ``config_tokens`` (default: the step's)."""
    config = sglang_default_config(config_tokens or step_tokens, local_slots, shape.weights)
    if shape.weights in cal.us_per_weight:
        a = cal.us_per_weight[shape.weights] * shape.num_weights
    else:
        a = cal.us_per_byte * shape.bytes
    c = cal.launch_us + cal.grid_us(shape, config, sglang_row_blocks(step_tokens * top_k, local_slots, config[0]))
    c += cal.extra_us.get(shape.weights, 0.0)
    if config == LARGE_M:
        a *= cal.read_share
        c += cal.us_per_k_step * k_steps(shape, config)
    return a, cal.b_us_per_token, c


def measured_line(cal: Calibration, m: Measured, top_k: int, step_tokens: int = STEP_TOKENS,
                  local_slots: int | None = None) -> tuple[float, float, float]:
    """(a, b, c) of a measured file for a step of ``step_tokens`` x ``top_k`` pairs on a rank of
    ``local_slots`` slots (default: the file's): its line with the grid moved from the layout and step it
    was measured with to SGLang's for this step and rank (c: the step's row blocks instead of the file's;
    b: without the row blocks the file's layout added per pair). Slots change only the grid: a rank reads
    and computes only the experts a step activates."""
    rows = sglang_row_blocks(step_tokens * top_k, local_slots or m.local_slots, m.config[0])
    c = m.cost.c_us + cal.grid_us(m.shape, m.config, rows - m.row_blocks)
    if len(m.c_at_steps) >= 2 and step_tokens > m.step_tokens:
        # c measured at larger steps too (the config sweeps): what the grid missed at each, linearly in the step
        # between the two measured steps around this one (past the last, the last two's line). At 64-row blocks c
        # grows faster than the grid (SGLang's kernel writes zeros to the buffer rows of other ranks' pairs, ~1 TB/s
        # of row bytes, BENCHMARKS.md#measured-lines); below the file's step the grid alone.
        def missed(t: int, c_t: float) -> float:
            rows_t = sglang_row_blocks(t * m.top_k, m.local_slots, m.config[0])
            return c_t - m.cost.c_us - cal.grid_us(m.shape, m.config, rows_t - m.row_blocks)
        steps = [t for t, _ in m.c_at_steps]
        hi = min(max(bisect.bisect_left(steps, step_tokens), 1), len(steps) - 1)
        (t0, c0), (t1, c1) = m.c_at_steps[hi - 1], m.c_at_steps[hi]
        m0 = missed(t0, c0)
        c = max(c + m0 + (missed(t1, c1) - m0) * (step_tokens - t0) / (t1 - t0), 0.0)
    return m.cost.a_us_per_expert, cal.net_b(m), c


def measured_for(cal: Calibration, shape: ExpertShape, local_slots: int, config: tuple[int, int, int],
                 step_tokens: int = STEP_TOKENS) -> Measured | None:
    """The measured file of this expert shape and kernel config: one whose measured steps reach nearest to
    ``step_tokens`` (a file measured at a 9-token step knows the latency-bound few experts of a verify step, a
    config sweep's larger steps the rest), then the nearest slot count (the same slots first); None where that
    shape never ran that config. On a tie a config sweep (SGLang's own buffer layout) goes first."""
    alike = [m for m in cal.files if (m.shape.hidden, m.shape.intermediate, m.shape.weights) ==
             (shape.hidden, shape.intermediate, shape.weights)]
    # Where SGLang's tuned file picked another config than its default, a line measured on the GPU ran that one:
    # where no line ran the default config, a tuned line of the nearest step stands for it.
    same = [m for m in alike if m.config == config] or [m for m in alike if m.tuned]

    def step_gap(m: Measured) -> int:
        steps = [t for t, _ in m.c_at_steps] or [m.step_tokens]
        return max(min(steps) - step_tokens, step_tokens - max(steps), 0)
    return min(same, key=lambda m: (step_gap(m), abs(m.local_slots - local_slots), m.fits_terms, m.local_slots),
               default=None)


def derive_cost_model(shape: ExpertShape, local_slots: int, top_k: int, gpu: str = DEFAULT_GPU,
                      step_tokens: int = STEP_TOKENS, config_tokens: int | None = None,
                      calibration: Calibration | None = None) -> CostModel:
    """The cost model of one rank holding ``local_slots`` experts of ``shape``, for steps of
    ``step_tokens`` tokens routed to ``top_k`` experts each (a verify step by default), on ``gpu``'s packaged
    measurements or on ``calibration`` (a cost set's, ``moeplace.cost.cost_set``) where given.

    config_tokens: the tokens SGLang's kernel config is chosen for (default: ``step_tokens``). A
    caller comparing batch sizes can hold it at one batch so that only the launch grid follows the
    batch: the other configs are measured for few shapes (see BENCHMARKS.md#derived-model).
    """
    if local_slots < 1:
        raise MoeplaceError(f"a rank needs at least one expert slot, got {local_slots}")
    if top_k < 1 or step_tokens < 1 or (config_tokens is not None and config_tokens < 1):
        raise MoeplaceError(f"a step needs tokens and a top-k of at least 1, got {step_tokens} and {top_k}")
    cal = calibration or gpu_calibration(gpu)
    gpu = cal.gpu
    where = f"{gpu}, {shape.describe()}, {local_slots} per rank"
    config = sglang_default_config(config_tokens or step_tokens, local_slots, shape.weights)
    grid = f"SGLang's launch grid for {step_tokens} tokens x top-{top_k}"
    if config_tokens and config_tokens != step_tokens:
        grid += f", kernel config for {config_tokens}"
    m = measured_for(cal, shape, local_slots, config, step_tokens)
    if m is not None:
        a, b, c = measured_line(cal, m, top_k, step_tokens, local_slots)
        moved = "" if m.local_slots == local_slots else f", its grid moved from {m.local_slots} slots"
        r = cal.row_block_us(a, config[0], m)
        return CostModel(round(a, 4), round(b, 4), round(c, 3),
                         {**m.cost.provenance, "derived_from": m.name, "top_k": top_k, "step_tokens": step_tokens,
                          "config_tokens": config_tokens or step_tokens, "kernel_config": list(config),
                          "local_slots": local_slots,
                          "row_block_term": "measured" if m.measured_r else "the measured files' share of a"},
                         f"{where}: measured ({m.name}{moved}; {grid}, BLOCK_SIZE_M {config[0]})",
                         round(r, 4), config[0])
    a, b, c = formula_cost(cal, shape, local_slots, top_k, step_tokens, config_tokens)
    prov = {"derived_from": [m.name for m in cal.files], "gpu": gpu, "weights": shape.weights,
            "shape": {"hidden": shape.hidden, "expert_intermediate": shape.intermediate,
                      "local_slots": local_slots}, "step_tokens": step_tokens, "top_k": top_k,
            "config_tokens": config_tokens or step_tokens, "kernel_config": list(config),
            "calibration": {"us_per_byte": cal.us_per_byte, "launch_us": cal.launch_us,
                            "us_per_program": cal.us_per_program, "extra_us": cal.extra_us,
                            "us_per_weight": cal.us_per_weight, "read_share": cal.read_share,
                            "us_per_k_step": cal.us_per_k_step}}
    prov["calibration"]["row_block_share"] = cal.row_block_share
    return CostModel(round(a, 4), round(b, 4), round(c, 3), prov,
                     f"{where}: derived from expert bytes ({len(cal.files)} measured files; {grid}, "
                     f"BLOCK_SIZE_M {config[0]})", round(cal.row_block_us(a, config[0]), 4), config[0])
