"""``moeplace advise``: at this trace's traffic, is EP (best placement) or TP-MoE faster, and where does it flip."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from moeplace.trace.resample import resample_batches

from moeplace.analysis.advise import BATCH_GRID, BatchVerdict, flip_batch, flip_batches, model_check
from moeplace.commands.common import Progress, check_ranks, echo_json, open_source
from moeplace.commands.costing import Costing, experts_gb, memory_warning, resolve_costing, spares_that_fit
from moeplace.commands.options import effort_option, holdout_option, slots_count, trace_options
from moeplace.cost.model import CostModel, load_cost_model
from moeplace.dispatch.by_cost import acts_as_balanced, rule_weights
from moeplace.dispatch.loads import max_step_tokens
from moeplace.errors import MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace.load import DEFAULT_WINDOW
from moeplace.analysis.layouts import (EVEN, Layout, LayoutCosts, candidate_layouts, compare_layouts, fastest,
                                       fastest_column, layer_sample, layout_flips, scaled, split_refusal)
from moeplace.analysis.optimize import DEFAULT_SAMPLE_STEPS, evenly_spaced, split_steps
from moeplace.analysis.report import steps_phrase

FIT_STEPS = 2000      # fitted steps the placements are fit on (evenly spaced)
EVAL_STEPS = 256      # held-out steps (or resampled batches) each cost is averaged over (evenly spaced)
HOLDOUT = 0.3         # --holdout's default, as optimize's: the pick's optimize command names it only if it differs


@click.command()
@trace_options(dispatch=False)
@click.option("--tp-cost-model", "tp_cost_path", type=click.Path(exists=True, dir_okay=False),
              help="TP-MoE cost model (one rank, 1/R of every expert) to use instead of the one derived for "
                   "the model's experts.")
@click.option("--redundant", type=slots_count(), default=0, show_default=True,
              help="Spare slots of the layouts with spares (default: E/4, rounded down to a multiple of --ranks, or "
                   "the most the GPU holds beside the experts where fewer); given, the EP-vs-TP verdict is for EP R "
                   "with them, where they load.")
@effort_option(2e8, "2e8")
@holdout_option(HOLDOUT, "Share of the trace's last steps held out: the placements are fitted on the rest and every "
                     "cost is measured on the held-out steps (0: all steps for both).")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
def advise(trace: str, ranks: int, mode: str, model_ref: str | None, cost_model_path: str | None,
           gpu: str | None, window: int, top_k: int | None, max_steps: int, tp_cost_path: str | None, redundant: int,
           effort: float, holdout: float, as_json: bool) -> None:
    """Say which layout runs TRACE's MoE layers fastest: EP, TP-MoE, or EP groups with MoE TP inside.

    One comparison of every layout SGLang can run on the --ranks GPUs (--tp-size R --ep-size G: G EP
    groups, each expert split over R/G GPUs; EP R, ..., TP-MoE), each without spare slots (the better of
    DeepSeek EPLB and step-aware placements, one replica per expert, so the replica choice does not matter) and
    with them (moeplace's cost rule, balanced dispatch at verify batch), at the trace's batch and at every
    batch size, and the batches where the fastest changes; its EP R and TP-MoE rows give the EP-vs-TP
    verdict. A layout's cost per layer is its slowest GPU's. Cost models are derived for the model's
    experts (shape from --model or the trace's model name, its top-k; --gpu's measurements of SGLang's fused
    MoE kernel, or a cost set `moeplace calibrate` wrote) with SGLang's kernel config and launch grid for each
    batch size, unless --cost-model / --tp-cost-model give single-line files. Communication is not counted.
    The placements are fitted on up to 2,000 steps of the trace's first part, every cost is measured on up to
    256 of its last --holdout share, and batches of other sizes are built from those held-out steps.

    The fastest column keeps a layout until another is more than 1% faster; the flips are its changes. The
    spare slots, where --redundant is not given, are as many as fit the GPU beside the experts, up to a quarter
    of the experts; a --redundant that cannot load is costed but never picked. The last lines are the commands
    that run the pick: `moeplace optimize` for its placement, then `moeplace launch` with SGLang's flags.

    \b
    Example:
      moeplace advise traces/gptoss20b-sample.mptrace --ranks 8 --mode verify
    """
    src = open_source(trace, window, top_k)
    check_ranks(src, ranks, redundant)
    model_check(src.model, ranks, redundant)
    model = src.model
    which = "held-out" if holdout else "fitted"
    costing = resolve_costing(model, cost_model_path, model_ref,
                              derived_needed=not (cost_model_path and tp_cost_path), gpu_name=gpu)
    tp_file = load_cost_model(tp_cost_path) if tp_cost_path else None
    # A GPU holds (E + spares) / ranks experts' bytes in every EP x TP split, so one check covers them all;
    # it depends on the flags and the model only, so it comes before the work.
    spares = SpareSlots.choose(model, ranks, redundant, costing)
    if spares.memory:
        click.echo(f"warning: the layouts with spare slots: {spares.memory}", err=True)
    # never empty once check_ranks passed: EP --ranks (MoE TP 1) holds the experts, and the spares where asked
    candidates = candidate_layouts(ranks, model.num_experts, costing.shape.intermediate, spares.count)
    tp_refusal = split_refusal(ranks, 1, model.num_experts, costing.shape.intermediate)
    steps = src.load(mode, max_steps or DEFAULT_SAMPLE_STEPS)
    if steps.num_steps == 0:
        raise src.no_steps_error(mode)
    if steps.count_steps.size:
        raise MoeplaceError(f"{trace}: advise needs per-token routing (token rows); this trace has only counts")
    steps, layer_factor = layer_sample(steps)   # a deep, wide model: a sample of its layers, scaled to all
    layers_used = steps.model.num_moe_layers
    fitted, held_out = split_steps(steps, holdout)
    fit, sample = evenly_spaced(fitted, FIT_STEPS), evenly_spaced(held_out, EVAL_STEPS)
    trace_batch = max(1, int(np.median(sample.num_tokens)))
    samples = {batch: resample_batches(held_out, batch, EVAL_STEPS // 4) for batch in BATCH_GRID}

    def layout_cost(layout: Layout, batch: int) -> CostModel:
        """A GPU of ``layout`` at steps of ``batch`` tokens: SGLang's kernel config and grid for that batch."""
        if layout.ep == 1 and tp_file:
            return tp_file
        return costing.layout(layout, model.num_experts, batch)
    progress = Progress(len(candidates), "placing and costing", "layouts")
    progress(0)   # a line at once: the first layout takes seconds
    layouts = compare_layouts(steps.model, fit, sample, samples, candidates, layout_cost, trace_batch, effort,
                              progress)
    layouts = [scaled(r, layer_factor) for r in layouts]
    # the pick, the fastest column and its flips: only layouts that load
    runnable = [r for r in layouts if spares.load or not r.layout.spares]
    column = fastest_column(runnable)
    flips = layout_flips(runnable)
    best = fastest(runnable)
    ep_layout = Layout(ranks, ranks, redundant if spares.load else 0)   # the verdict's EP: --redundant's, if it loads
    ep_row = next((r for r in layouts if r.layout == ep_layout), layouts[0])
    tp_row = next((r for r in layouts if r.layout.ep == 1), None)   # None where TP-MoE cannot run
    here = ep_vs_tp(ep_row, tp_row) if tp_row else None
    grid = [ep_vs_tp(ep_row, tp_row, batch) for batch in BATCH_GRID] if tp_row else []
    flip = flip_batch(grid) if tp_row else None
    flips_ep_tp = flip_batches(grid) if tp_row else []
    ep_cost = layout_cost(ep_row.layout, trace_batch)
    tp_cost = layout_cost(tp_row.layout, trace_batch) if tp_row else None
    rule = (None if not best.layout.spares else
            "balanced" if acts_as_balanced(rule_weights(layout_cost(best.layout, trace_batch)),
                                           max_step_tokens(sample), model.top_k) else "cost")
    run = pick_commands(best.layout, rule, trace, mode, model_ref, cost_model_path, gpu, window, top_k, max_steps,
                        holdout, model.name)
    if as_json:
        def row(v):
            return {"batch": v.batch, "ep_us": v.ep_us, "tp_us": v.tp_us, "ep_placement": v.ep_placement,
                    "winner": v.winner, "speedup": v.speedup}
        echo_json({"trace": trace, "ranks": ranks, "fit_steps": fit.num_steps, "eval_steps": sample.num_steps,
                   "evaluated_on": f"{which} steps", "layers_costed": layers_used,
                   "at_trace": row(here) if here else None, "grid": [row(v) for v in grid],
                   "tp_moe_refused": tp_refusal,
                   "flip_batch": flip, "flips": [{"batch": at, "below": lo, "above": hi} for at, lo, hi in flips_ep_tp],
                   "ep_cost_model": ep_cost.to_json(), "tp_cost_model": tp_cost.to_json() if tp_cost else None,
                   "spare_slots": {"count": spares.count, "load": spares.load, "note": spares.note},
                   "layouts": [{"name": r.layout.name, "ep_size": r.layout.ep, "moe_tp": r.layout.moe_tp,
                                "spares": r.layout.spares, "rule": r.layout.rule, "at_trace_us": r.at_trace,
                                "loads": spares.load or not r.layout.spares,
                                "grid_us": {str(b): v for b, v in r.grid.items()},
                                "placement": {str(b): v for b, v in r.placement.items()},
                                "kernel_block_m": {str(b): layout_cost(r.layout, b).provenance.get(
                                    "kernel_config", [None])[0] for b in r.grid}} for r in layouts],
                   "fastest_layout_at_trace": best.layout.name,
                   "fastest_by_batch": {str(b): r.layout.name for b, r in column.items()},
                   "layout_flips": [{"batch": at, "below": lo, "above": hi} for at, lo, hi in flips],
                   "pick": {"layout": best.layout.name, "ep_size": best.layout.ep, "spares": best.layout.spares,
                            "dispatch": rule, "commands": run}})
        return
    click.echo(f"placements fitted on {fit.num_steps:,} of the first {steps_phrase(fitted.num_steps, mode)}; "
               + (f"costs on {sample.num_steps:,} of the last {held_out.num_steps:,}, held out" if holdout else
                  f"costs on {sample.num_steps:,} of the same steps (--holdout 0)")
               + " (the table's batches are built from those)"
               + ("" if layers_used == model.num_moe_layers else
                  f"; on {layers_used} of the {model.num_moe_layers} MoE layers, evenly spaced, scaled to all"))
    if here is None:
        click.echo(f"TP-MoE cannot run on {ranks} GPUs ({tp_refusal}): the layouts below are EP splits only.")
    else:
        name = {"ep": f"EP ({ep_row.layout.name}, {here.ep_placement} placement)",
                "tp": f"TP-MoE ({tp_row.layout.name})"}
        click.echo(f"At this trace's traffic ({here.batch} tokens per step, {sample.num_steps} {which} steps): "
                   f"{name[here.winner]} is faster, {here.speedup:.2f}x (EP {here.ep_us / 1e3:.2f} ms vs TP-MoE "
                   f"{here.tp_us / 1e3:.2f} ms of MoE per step, {model.num_moe_layers} layers)"
                   + ep_tp_flips(flips_ep_tp) + ".")
    unmeasured = [r.layout.name for r in layouts if any(
        isinstance(layout_cost(r.layout, b).provenance.get("derived_from"), list) for b in (trace_batch, *r.grid))]
    if spares.note:
        click.echo(spares.note)
    echo_layouts(layouts, runnable, column, flips, ranks, trace_batch, unmeasured)
    click.echo("Costs are compute only (no EP dispatch/combine, no TP all-reduce). Each batch's cost models follow "
               "SGLang's kernel config for it (16-row blocks while the step's tokens are at most the GPU's slots, "
               "64-row blocks above: its default, no tuned file ships for these shapes) and its launch grid.")
    click.echo(f"EP cost model at {trace_batch} tokens per step: {ep_cost.describe()}")
    if tp_cost:
        click.echo(f"TP cost model at {trace_batch} tokens per step: {tp_cost.describe()}")
    echo_run(best.layout, rule, run)


def ep_tp_flips(flips: list[tuple[float, str, str]]) -> str:
    """Every flip of EP against TP-MoE over the batch grid, as a clause of the verdict line ("" if none)."""
    if not flips:
        return ""
    names = {"ep": "EP", "tp": "TP-MoE"}
    parts = [f"{names[flips[0][1]]} up to about {flips[0][0]:.0f} tokens per step"]
    parts += [f"{names[below]} up to about {at:.0f}" for at, below, _ in flips[1:]]
    parts.append(f"{names[flips[-1][2]]} above")
    return "; by batch size, the faster of the two is " + ", then ".join(parts)


def ep_vs_tp(ep: LayoutCosts, tp: LayoutCosts, batch: int | None = None) -> BatchVerdict:
    """EP R against TP-MoE, read from the layouts comparison at ``batch`` (None: at the trace's batch)."""
    if batch is None:
        return BatchVerdict(ep.trace_batch, ep.at_trace, tp.at_trace, ep.at_trace_placement)
    return BatchVerdict(batch, ep.grid[batch], tp.grid[batch], ep.placement[batch])


def echo_layouts(results: list[LayoutCosts], runnable: list[LayoutCosts], column: dict[int, LayoutCosts],
                 flips: list[tuple[float, str, str]], gpus: int, trace_batch: int, unmeasured: list[str]) -> None:
    """The layouts table: MoE ms per step of each layout at each batch, the fastest (``column``, of the ``runnable``
    layouts: those that load), the fastest at the trace's batch and where the column changes (``flips``);
    ``unmeasured``: the layouts whose GPU shape has no measured cost file for the kernel config of some batch
    (marked *)."""
    names = [r.layout.name + ("*" if r.layout.name in unmeasured else "") for r in results]
    spares = next((r.layout.spares for r in results if r.layout.spares), 0)
    left_out = len(runnable) < len(results)
    click.echo(f"Layouts on {gpus} GPUs (SGLang --tp-size {gpus} --ep-size G: EPG, each expert split over the "
               f"{gpus}/G GPUs of its group as xTP{gpus}/G; TP{gpus} is TP-MoE"
               + (f"; +{spares}: {spares} spare slots, moeplace's cost rule" if spares else "")
               + (", which cannot load (see the warning): the fastest column leaves them out" if left_out else "")
               + "), MoE ms per step:")
    widths = [max(7, len(n)) for n in names]
    click.echo("tokens/step " + " ".join(n.rjust(w) for n, w in zip(names, widths)) + "   fastest")
    for batch in sorted(results[0].grid):
        click.echo(f"{batch:>11} " + " ".join(f"{r.grid[batch] / 1e3:{w}.2f}" for r, w in zip(results, widths))
                   + f"   {column[batch].layout.name}")
    best = fastest(runnable)
    second = min((r for r in runnable if r is not best), key=lambda r: r.at_trace, default=None)
    if second is None:
        versus = ""
    elif second.at_trace / best.at_trace - 1 <= EVEN:
        versus = f", even with {second.layout.name} (within {100 * EVEN:.0f}%)"
    else:
        versus = f", {second.at_trace / best.at_trace:.2f}x faster than {second.layout.name}"
    faster = fastest(results)
    click.echo(f"At this trace's traffic ({trace_batch} tokens per step) the fastest layout is {best.layout.name}, "
               f"{best.at_trace / 1e3:.2f} ms of MoE per step" + versus
               + (f" ({faster.layout.name}, {faster.at_trace / 1e3:.2f} ms, cannot load)" if faster is not best else "")
               + ".")
    if not flips:
        click.echo(f"The fastest layout does not change by more than {100 * EVEN:.0f}% from {min(column)} to "
                   f"{max(column)} tokens per step: {column[min(column)].layout.name}.")
    else:
        parts = [f"{flips[0][1]} up to about {flips[0][0]:.0f} tokens per step"]
        parts += [f"{below} up to about {at:.0f}" for at, below, _ in flips[1:]]
        parts.append(f"{flips[-1][2]} above")
        click.echo("The fastest layout flips: " + ", then ".join(parts)
                   + f" (the fastest column: it changes only where another layout is more than {100 * EVEN:.0f}% "
                     "faster).")
    if unmeasured:
        click.echo("*: at some batch sizes no measured cost file covers that GPU's expert shape and kernel config; its "
                   "model there is derived from the experts' bytes (a TP slice of small experts measured up to 1.4x "
                   "slower than derived, BENCHMARKS.md#derived-model; `moeplace calibrate` measures every one on your "
                   "GPU; scripts/replay_placement.py times the layouts).")


@dataclass(frozen=True)
class SpareSlots:
    """The spare slots of the layouts with spares: ``count``, whether SGLang can load them (``load``), the warning
    where it cannot (``memory``), and a line where the default was lowered so that they load (``note``)."""

    count: int
    load: bool = True
    memory: str | None = None
    note: str | None = None

    @classmethod
    def choose(cls, model: ModelSpec, ranks: int, redundant: int, costing: Costing) -> SpareSlots:
        """--redundant as given (it may not load: then warned about and left out of the pick); by default a quarter
        of the experts, rounded down to a multiple of ``ranks``, or the most that load where those do not."""
        if redundant:
            memory = memory_warning(model, ranks, redundant, costing, fewer="fewer (--redundant)")
            return cls(redundant, memory is None, memory)
        default = model.num_experts // 4 // ranks * ranks
        count = spares_that_fit(model, ranks, default, costing)
        if count == default:
            return cls(count)
        gpu, have, need = costing.gpu.name, costing.gpu.memory_gb, experts_gb(model, ranks, count, costing)
        held = (f"{count}, the most that fit an {gpu} beside the experts ({need:.1f} of its {have:.1f} GB per "
                "GPU; the other weights and the KV cache need room too: --redundant sets fewer)" if count else
                f"none: the routed experts alone take {need:.1f} GB per GPU of an {gpu}'s {have:.1f}"
                + ("" if need <= have else ", more than it holds"))
        return cls(count, note=f"Spare slots: {held}; the default, a quarter of the experts ({default}), would take "
                               f"{experts_gb(model, ranks, default, costing):.1f} GB.")


def pick_commands(layout: Layout, rule: str | None, trace: str, mode: str, model_ref: str | None,
                  cost_model_path: str | None, gpu: str | None, window: int, top_k: int | None, max_steps: int | None,
                  holdout: float, model_name: str) -> list[list[str]]:
    """The commands that run ``layout`` (argv each): ``moeplace optimize`` with every flag its placement depends on
    (the split, the spare slots and their rule ``rule``, the steps read as advise read them), then ``moeplace
    launch`` with SGLang's flags for it; for TP-MoE, SGLang alone (no placement)."""
    gpus = layout.gpus
    server = ["--model-path", launch_model(model_ref, model_name), "--tp-size", str(gpus)]
    if layout.ep == 1:
        return [["python", "-m", "sglang.launch_server", *server]]
    server += ["--ep-size", str(layout.ep)]
    fit = ["moeplace", "optimize", trace, "--ranks", str(gpus)] + (["--ep-size", str(layout.ep)] if layout.ep < gpus
                                                                   else []) + ["--mode", mode]
    if layout.spares:
        fit += ["--redundant", str(layout.spares), "--dispatch", rule or "balanced"]
        server += ["--ep-num-redundant-experts", str(layout.spares)]
    for flag, value in (("--model", model_ref), ("--cost-model", cost_model_path), ("--gpu", gpu),
                        ("--top-k", top_k),
                        ("--max-steps", max_steps), ("--window", None if window == DEFAULT_WINDOW else window),
                        ("--holdout", None if holdout == HOLDOUT else f"{holdout:g}")):
        if value is not None:
            fit += [flag, str(value)]
    return [[*fit, "-o", "placement.json"], ["moeplace", "launch", "--placement", "placement.json", "--", *server]]


def launch_model(model_ref: str | None, model_name: str) -> str:
    """--model-path for SGLang: advise's --model (the folder where it names a config.json), else the trace's model
    name where it reads as a Hugging Face id, else MODEL."""
    if model_ref:
        return str(Path(model_ref).parent) if Path(model_ref).is_file() else model_ref
    return model_name if re.fullmatch(r"[\w.-]+/[\w.-]+", model_name) else "MODEL"


def echo_run(layout: Layout, rule: str | None, commands: list[list[str]]) -> None:
    """What to run for the pick: one line saying what the commands do, then each command."""
    if layout.ep == 1:
        what = f"To run {layout.name}, start SGLang with every expert split over the {layout.gpus} GPUs (no placement)"
    else:
        what = (f"To run {layout.name}, fit its placement on this trace, then start SGLang with it (`moeplace launch` "
                "checks the placement against the flags"
                + (f" and sets MOEPLACE_DISPATCH={rule} for its spare slots" if layout.spares else "") + ")")
    shown = [shlex.join(argv) for argv in commands]
    click.echo(what + "; add your server's other flags at the end"
               + ("; MODEL: your model's folder or Hugging Face id" if any("MODEL" in argv for argv in commands) else "")
               + ":")
    for line in shown:
        click.echo(f"  {line}")
