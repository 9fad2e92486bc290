"""``moeplace calibrate``: measure SGLang's fused MoE kernel on this GPU for one model, and write its cost set."""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass

import click

from moeplace.commands.common import echo_json
from moeplace.commands.options import count, out_option, ranks_count, slots_count
from moeplace.errors import MoeplaceError
from moeplace.model.expert_shape import ExpertShape

DEFAULT_BUDGET_S = 300
DEFAULT_REPS = 9


@dataclass(frozen=True)
class CalibratedModel:
    """What the calibration needs of the model: its experts' shape, how many, and its top-k."""

    name: str
    shape: ExpertShape
    experts: int
    top_k: int

    def to_json(self) -> dict:
        return {"name": self.name, "hidden": self.shape.hidden, "intermediate": self.shape.intermediate,
                "experts": self.experts, "top_k": self.top_k, "weights": self.shape.weights}


def calibrated_model(model_ref: str) -> CalibratedModel:
    """``--model``: a known model's name, else a model folder, its config.json or a Hugging Face id in the cache."""
    from pathlib import Path

    from moeplace.model.expert_shape import known_model_named, known_shape

    known = known_model_named(model_ref)
    if known is not None and not Path(model_ref).exists():
        return CalibratedModel(known.pattern, known_shape(known), known.experts, known.top_k)
    from moeplace.model.config import expert_shape_from_hf_config, model_spec_from_hf_config, read_hf_config
    from moeplace.model.hf_resolve import resolve_model_dir

    folder = resolve_model_dir(model_ref)
    config = read_hf_config(folder)
    spec = model_spec_from_hf_config(config, path=folder / "config.json")
    shape = expert_shape_from_hf_config(config, f"--model {model_ref}", folder / "config.json")
    return CalibratedModel(spec.name if spec.name != "model" else folder.name, shape, spec.num_experts, spec.top_k)


def gpu_or_refusal() -> tuple[str, float, int]:
    """(name, memory GB, SMs) of this machine's first GPU; one line where torch, SGLang (looked up, not yet
    imported: that takes seconds) or a CUDA GPU is missing."""
    import importlib.util

    for package, what in (("torch", "torch with CUDA"), ("sglang", "SGLang (its fused MoE kernel is what is timed)")):
        if importlib.util.find_spec(package) is None:
            raise MoeplaceError(f"moeplace calibrate needs {what} on the GPU that serves; {package} is not installed "
                                f"here")
    import torch
    if not torch.cuda.is_available():
        raise MoeplaceError("moeplace calibrate times SGLang's MoE kernel on a GPU: torch finds no CUDA GPU here; "
                            "run it on the serving machine")
    props = torch.cuda.get_device_properties(0)
    return torch.cuda.get_device_name(0), props.total_memory / 1e9, props.multi_processor_count


def sglang_or_refusal():
    """SGLang's fused MoE modules (``moeplace.sglang.fused_moe_timing.load_fused_moe``); one line without SGLang."""
    from moeplace.sglang.fused_moe_timing import load_fused_moe
    try:
        return load_fused_moe()
    except ImportError as e:
        raise MoeplaceError(f"moeplace calibrate times SGLang's own fused MoE kernel: SGLang cannot be imported "
                            f"here ({e})") from None


def planned_sweeps(model: CalibratedModel, ranks: int, redundant: int | None, memory_gb: float):
    """The sweeps of every layout ``advise`` costs on ``ranks`` GPUs (EP first, TP-MoE last), with ``redundant``
    spare slots (default: a quarter of the experts, fewer where they do not fit the GPU's memory)."""
    from moeplace.analysis.advise import BATCH_GRID
    from moeplace.analysis.layouts import candidate_layouts
    from moeplace.commands.costing import Costing, spares_that_fit
    from moeplace.cost.gpus import Gpu
    from moeplace.cost.sweeps import plan_sweeps
    from moeplace.model.spec import ModelSpec

    spec = ModelSpec.all_moe(model.name, 1, model.experts, model.top_k)
    costing = Costing(model.shape, model.top_k, gpu=Gpu("this GPU", "", memory_gb))
    if redundant is None:
        redundant = spares_that_fit(spec, ranks, model.experts // 4 // ranks * ranks, costing)
    layouts = candidate_layouts(ranks, model.experts, model.shape.intermediate, redundant)
    slices = [(model.shape.tp_slice(l.moe_tp).intermediate, l.local_slots(model.experts), l.ep) for l in layouts]
    return plan_sweeps(model.shape.hidden, slices, model.top_k, BATCH_GRID), redundant


@click.command()
@click.option("--model", "model_ref", required=True, metavar="MODEL",
              help="The model whose experts are timed: a known name (gpt-oss-20b, qwen3-30b-a3b, ...), its folder, "
                   "its config.json, or its Hugging Face id in the local cache.")
@click.option("--ranks", type=ranks_count(), default=8, show_default=True,
              help="GPUs the server spreads the experts over: every EP, EP x TP and TP-MoE split of them is timed.")
@click.option("--redundant", type=slots_count(), default=None,
              help="Spare slots the layouts with spares hold (default: a quarter of the experts, as many as fit "
                   "this GPU's memory).")
@click.option("--budget", "budget_s", type=count(1, 3600), default=DEFAULT_BUDGET_S, show_default=True,
              help="Seconds of timing: no new sweep starts after them (the most needed sweeps run first).")
@click.option("--reps", type=count(1, 1000), default=DEFAULT_REPS, show_default=True,
              help="CUDA-graph replays each point's median is taken over.")
@out_option(help="The cost set to write (pass it to optimize, advise, report and compare as --cost-model).")
@click.option("--json", "as_json", is_flag=True, help="Print the fit of each sweep as JSON.")
def calibrate(model_ref: str, ranks: int, redundant: int | None, budget_s: int, reps: int, out: str,
              as_json: bool) -> None:
    """Time SGLang's fused MoE kernel on this GPU for MODEL's experts, fit the cost model, and write it to -o.

    Run it on the machine that serves (a CUDA GPU, torch and SGLang installed): every command's MoE µs, the
    dispatch rule by cost and advise's layout then come from this GPU's own measurements instead of the shipped
    ones (H200, H100). One sweep per GPU shape the layouts on --ranks GPUs meet (each expert slice, its local
    slots, and each kernel config SGLang runs it with between 1 and 1,024 tokens a step: its tuned file where it
    ships one, else its default), through SGLang's own kernel and buffer layout in CUDA graphs. Each sweep's line is
    fitted on its points and its error printed; the file names the GPU, SGLang's version, the model and the
    date. The experts are timed as bf16 (as SGLang's Triton path runs bf16 and mxfp4 checkpoints on Hopper).

    \b
    Example:
      moeplace calibrate --model gpt-oss-20b --ranks 8 -o cost-h100.json
      moeplace advise traces/gptoss20b-sample.mptrace --ranks 8 --cost-model cost-h100.json
    """
    from moeplace.cost.cost_set import KIND, VERSION, cost_set_from_json, cost_set_json
    from moeplace.cost.derive import LARGE_M
    from moeplace.cost.sweeps import sweep_line
    from moeplace.files.atomic import atomic_write_text
    from moeplace.files.outputs import check_outputs

    check_outputs({"-o": out})
    model = calibrated_model(model_ref)
    if model.shape.weights != "bf16":
        raise MoeplaceError(f"--model {model_ref}: its experts are served as {model.shape.weights}; moeplace "
                            f"calibrate times SGLang's bf16 path only (bf16 and mxfp4 checkpoints)")
    gpu, memory_gb, sms = gpu_or_refusal()
    click.echo(f"{model.name}: {model.experts} experts {model.shape.hidden}x{model.shape.intermediate}, "
               f"top-{model.top_k}; loading SGLang's kernel on {gpu}", err=True)
    sgl = sglang_or_refusal()
    from moeplace.sglang.fused_moe_timing import measure_sweep

    sweeps, spares = planned_sweeps(model, ranks, redundant, memory_gb)
    if not sweeps:
        raise MoeplaceError(f"{model.name}: SGLang can run none of its experts' splits over {ranks} GPUs")
    click.echo(f"{gpu} ({memory_gb:.1f} GB, {sms} SMs), SGLang {sgl[2]}: {len(sweeps)} sweeps for {model.name} "
               f"on {ranks} GPUs ({spares} spare slots), budget {budget_s} s", err=True)
    start = time.perf_counter()
    lines, fits, raw = {}, {}, {}
    meta = {"date": datetime.date.today().isoformat(), "sglang": sgl[2],
            "kernel": "SGLang's fused_moe_kernel via invoke_fused_moe_kernel, its config lookup; gate/up GEMM + "
                      "SiLU-and-mul + down GEMM (moeplace calibrate, CUDA-graph replay medians)"}
    for i, sweep in enumerate(sweeps):
        if time.perf_counter() - start > budget_s:
            click.echo(f"[{i + 1}/{len(sweeps)}] {sweep.label}: not run (--budget {budget_s} s spent)", err=True)
            continue
        t0 = time.perf_counter()
        points = measure_sweep(sgl, sweep, reps, sms)
        shape = {"hidden": sweep.hidden, "inter": sweep.inter, "n_local": sweep.local_slots, "top_k": sweep.top_k}
        line = sweep_line(shape, points, sweep.step_tokens, gpu, sms, meta)
        lines[sweep.label], raw[sweep.label] = line, {"shape": shape, "step_tokens": sweep.step_tokens,
                                                     "points": points}
        prov = line["provenance"]
        fits[sweep.label] = {"mean_rel_err": prov["fit_mean_rel_err"], "max_rel_err": prov["fit_max_rel_err"],
                             "points": len(points)}
        click.echo(f"[{i + 1}/{len(sweeps)}] {sweep.label}: {len(points)} points in {time.perf_counter() - t0:.1f} s, "
                   f"BLOCK_SIZE_M {line['block_m']}: {line['a_us_per_expert']:.2f} µs/expert, "
                   f"fit error mean {prov['fit_mean_rel_err']:.1%}, max {prov['fit_max_rel_err']:.1%}", err=True)
    doc = {"kind": KIND, "version": VERSION, "gpu": gpu, "gpu_memory_gb": memory_gb, "sglang": sgl[2],
           "date": meta["date"], "model": model.to_json(), "ranks": ranks, "lines": lines}
    small = [label for label, line in lines.items() if tuple(line["provenance"]["kernel_config"]) != LARGE_M]
    if len(small) < 2:
        raise MoeplaceError(f"only {len(lines)} of {len(sweeps)} sweeps ran within --budget {budget_s} s, "
                            f"{len(small)} of them at 16-row blocks: the fit needs two; give a larger --budget")
    cost_set = cost_set_from_json(doc, out)
    atomic_write_text(out, json.dumps({**cost_set_json(cost_set, fits), "sweeps": raw}, indent=1) + "\n")
    if as_json:
        echo_json({"out": out, "gpu": gpu, "sweeps": fits})
    else:
        click.echo(f"wrote {out}: {len(lines)} of {len(sweeps)} sweeps, {time.perf_counter() - start:.0f} s")
