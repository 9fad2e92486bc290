"""``moeplace optimize`` and ``moeplace compare``."""

from __future__ import annotations

import click

from moeplace.algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from moeplace.commands.common import (Progress, check_ranks, echo_json, fitted_here_note, mode_chunks, open_source,
                                      rules_phrase, scoring_rule, sized_progress, trace_inputs)
from moeplace.files.atomic import all_or_nothing
from moeplace.commands.costing import (Costing, cost_model_line, memory_warning, resolve_costing, slot_gb,
                                      trace_batch)
from moeplace.commands.options import (MAX_GB, FiniteFloatRange, effort_option, holdout_option, out_option,
                                       ranks_count, seed_option, sglang_out_option, slots_count, trace_options)
from moeplace.analysis.layouts import check_split
from moeplace.analysis.optimize import holdout_cut
from moeplace.analysis.optimize import optimize as run_optimize
from moeplace.analysis.report import (check_plotting, comparison_rows, evaluate, format_table, plot_context, steps_phrase,
                                      write_plots)
from moeplace.errors import MoeplaceError
from moeplace.files.outputs import check_outputs
from moeplace.files.placement import Placement, load_placement, save_placement, save_sglang
from moeplace.model.spec import ModelSpec

# The written placement's held-out E[max distinct] more than this share away from its fitted one is
# warned about. Rows that are not fitted at all (contiguous) moved by at most 1.8% between the two
# parts of real and synthetic traces; stepaware fitted on a few hundred steps of 128 experts, 9.4%.
FIT_GAP = 0.05


def replica_gb(model: ModelSpec, ranks: int, redundant: int, costing: Costing, moe_tp: int = 1) -> float:
    """Extra expert weights per GPU that ``redundant`` spare slots over ``ranks`` EP ranks hold, in GB."""
    return redundant / ranks * slot_gb(model, costing, moe_tp)


def spare_slots(model: ModelSpec, ranks: int, redundant: int | None, replica_memory: float | None,
                costing: Costing, moe_tp: int = 1) -> int:
    """--redundant, or the most spare slots (a multiple of the EP ranks) that --replica-memory GB per GPU holds."""
    if replica_memory is None:
        return redundant or 0
    if redundant is not None:
        raise click.UsageError("give --redundant or --replica-memory, not both")
    per_gpu = int(replica_memory // slot_gb(model, costing, moe_tp))
    per_gpu = min(per_gpu, model.num_experts - model.num_experts // ranks)   # a rank never holds an expert twice
    if per_gpu < 1:
        raise click.BadParameter(f"{replica_memory:g} GB per GPU holds no spare slot: one costs "
                                 f"{slot_gb(model, costing, moe_tp):.2f} GB "
                                 f"({costing.shape.describe()})", param_hint="--replica-memory")
    return per_gpu * ranks


@click.command()
@trace_options
@click.option("--nodes", type=ranks_count(), default=1, show_default=True,
              help="Nodes the ranks span; > 1 places hierarchically (nodes, then ranks), and the table adds each "
                   "placement's cross-node token traffic (share of (token, expert) sends to another node).")
@click.option("--ep-size", type=ranks_count(), default=None,
              help="EP groups (SGLang's --ep-size with --tp-size set to --ranks): each expert is split over the "
                   "--ranks / EP-SIZE GPUs of its group (SGLang's MoE TP), and the placement is for the groups. "
                   "Default: --ranks (plain EP). `moeplace advise` says which split is fastest.")
@click.option("--redundant", type=slots_count(), default=None,
              help="Spare physical slots for replicas (SGLang's --ep-num-redundant-experts; default 0). "
                   "With --dispatch balanced, replicas let each step pick where an expert runs.")
@click.option("--replica-memory", type=FiniteFloatRange(0, MAX_GB), default=None, metavar="GB",
              help="Spare slots by memory instead: as many per GPU as fit in GB of extra expert weights "
                   "(the experts' shape and format from --model or the trace's known model).")
@click.option("--algorithm", type=click.Choice(list(ALGORITHMS)), default=DEFAULT_ALGORITHM, show_default=True,
              help="stepaware minimises the expected per-step maximum rank load; deepseek* balance average "
                   "token counts (DeepSeek EPLB); contiguous is SGLang's default layout; naive-spares is DeepSeek "
                   "EPLB plus one replica of each of the hottest experts (a row of the table under --dispatch "
                   "balanced with spare slots).")
@holdout_option(0.3, "Share of the trace's last steps held out: the placement is fitted on the rest and the "
                     "table reports the held-out steps, with a fitted column (0: fit and report on all steps).")
@seed_option("The same seed gives the same placement.")
@effort_option(None, "2.4e9: about 5 s of search on 20,000 Kimi-K2-sized steps, 2 cores")
@click.option("--balance-floor", type=FiniteFloatRange(0, 1), default=None,
              help="stepaware aims to keep each layer's token balancedness on the fitted steps at least this share "
                   "of DeepSeek EPLB's (default 0.98). Lower it for decode/verify-only traffic: fewer distinct "
                   "experts on the busiest rank, less even token counts (BENCHMARKS.md#token-balance-floor has the trade-off).")
@out_option("Where to write the placement (moeplace JSON).")
@sglang_out_option("Also write SGLang's --init-expert-location JSON here (`moeplace launch` names it the same).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--plot-dir", type=click.Path(file_okay=False), help="Write before/after PNG plots here.")
def optimize(trace: str, ranks: int, mode: str, dispatch: str, model_ref: str | None, cost_model_path: str | None,
             gpu: str | None, window: int, top_k: int | None, max_steps: int, nodes: int, ep_size: int | None,
             redundant: int | None, replica_memory: float | None, algorithm: str, holdout: float,
             seed: int, effort: float | None, balance_floor: float | None, out: str, sglang_out: str | None,
             as_json: bool, plot_dir: str | None) -> None:
    """Compute an expert placement for TRACE that minimises per-step imbalance.

    Fits on the first part of the trace, then prints contiguous, DeepSeek EPLB and the chosen
    algorithm side by side on the held-out steps: E[max distinct experts on a rank per step]
    (what decides low-batch MoE latency) beside the same on the fitted steps, its lower bound, the
    change against DeepSeek EPLB (the baseline) and the share of its gap to the bound closed, token
    balancedness, and the predicted MoE time per step (cost model derived for the model's experts;
    the table says which). A warning line says when the written placement loses to another row on
    the held-out steps, or when its held-out figure is more than 5% away from its fitted one.

    With spare slots (--redundant or --replica-memory) the table starts with what SGLang runs without
    moeplace, and compares against it: DeepSeek EPLB, no spare slots, SGLang's own rule (static under
    --dispatch static, else dynamic). With --dispatch balanced, replicas go where moeplace's per-step
    replica choice (the plugin's MOEPLACE_DISPATCH=balanced) gains most; --dispatch cost places them alike
    and scores moeplace's rule by cost. With --ep-size G the placement is for G EP groups on the --ranks
    GPUs, each expert split over the GPUs of its group (`moeplace advise` compares the splits).

    \b
    Example:
      moeplace optimize traces/gptoss20b-sample.mptrace --ranks 8 --mode verify \\
          -o placement.json --sglang-out init_expert_location.json
      moeplace optimize traces/gptoss20b-sample.mptrace --ranks 8 --mode verify \\
          --dispatch balanced --replica-memory 3 -o placement.json --sglang-out init_expert_location.json
      moeplace optimize traces/gptoss20b-sample.mptrace --ranks 8 --ep-size 4 --mode verify -o placement.json
    """
    check_outputs({"-o": out, "--sglang-out": sglang_out}, inputs=trace_inputs(trace, cost_model_path, model_ref),
                  folders={"--plot-dir": plot_dir})
    check_plotting(plot_dir)
    src = open_source(trace, window, top_k)
    model = src.model
    costing = resolve_costing(model, cost_model_path, model_ref,
                              derived_needed=cost_model_path is None or replica_memory is not None, gpu_name=gpu)
    groups = ep_size or ranks
    moe_tp = ranks // groups
    if ep_size is not None:
        check_split(ranks, groups, model.num_experts, costing.shape.intermediate)
    redundant = spare_slots(model, groups, redundant, replica_memory, costing, moe_tp)
    check_ranks(src, groups, redundant)
    memory = memory_warning(model, groups, redundant, costing, moe_tp)   # the flags and the model only: said now
    if memory:
        click.echo(f"warning: {memory}", err=True)
    batch = trace_batch(src, mode)       # SGLang's kernel config and launch grid follow the trace's batch
    cost_model = costing.group((model.num_experts + redundant) // groups, moe_tp, batch)
    today_cost = (costing.group(model.num_experts // groups, moe_tp, batch)   # the reference row: no spare slot
                  if model.num_experts % groups == 0 else cost_model)
    result = run_optimize(src, groups, algorithm, mode, nodes, redundant, dispatch, cost_model, holdout,
                          seed, max_steps, effort, balance_floor,
                          progress=Progress(model.num_moe_layers, f"{algorithm}: placing", "layers"),
                          reference_cost_model=today_cost,
                          choice_progress=sized_progress("spare slots: scoring the candidate layouts",
                                                         "held-out fits"))
    rows = comparison_rows(result.evaluations, result.baseline)
    for row, fitted in zip(rows, result.fitted):
        row["fitted_e_max_distinct"] = fitted
    fitted_steps = result.fitted_steps
    which = "held-out" if holdout else "fitted"
    warnings = quality_warnings(rows, algorithm, which, result.fit_steps, redundant > 0) + result.warnings
    if ep_size is not None:   # what `moeplace launch` passes to SGLang
        result.placement.metrics["ep_split"] = {"gpus": ranks, "ep_size": groups, "moe_tp": moe_tp}
    split = (f"{ranks} ranks" if ep_size is None else
             f"{groups} EP groups x MoE TP {moe_tp} on {ranks} GPUs (SGLang --tp-size {ranks} --ep-size {groups})")
    with all_or_nothing():   # the placement, SGLang's file and the plots: all of them or none
        plots = (write_plots(result.evaluations, plot_dir,
                             plot_context(trace, mode, result.eval_steps, which, groups)) if plot_dir else [])
        if sglang_out:
            save_sglang(sglang_out, result.placement)
        save_placement(out, result.placement)
    for line in warnings:
        click.echo(f"warning: {line}", err=True)
    if as_json:
        echo_json({"placement": out, "sglang_out": sglang_out, "fit_steps": result.fit_steps,
                   "eval_steps": result.eval_steps, "evaluated_on": f"{which} steps", "note": result.note,
                   "fitted_column_steps": fitted_steps, "baseline": result.baseline, "rows": rows,
                   "warnings": warnings + ([memory] if memory else []), "cost_model": cost_model.to_json(), "plots": plots,
                   "spare_slots": redundant, "ep_size": groups, "moe_tp": moe_tp,
                   "replica_gb_per_gpu": replica_gb(model, groups, redundant, costing, moe_tp)})
        return
    table_on = f"the last {result.eval_steps:,}, held out" if holdout else "the same steps"
    click.echo(f"fitted on the first {steps_phrase(result.fit_steps, mode)}; table on {table_on}; "
               f"{split}, {redundant} redundant, dispatch {dispatch}")
    if result.note:
        click.echo(f"note: {result.note}")
    if redundant:
        click.echo(f"spare slots: {redundant} ({redundant // groups} per {'GPU' if moe_tp == 1 else 'EP group'}) hold "
                   f"{replica_gb(model, groups, redundant, costing, moe_tp):.2f} GB of extra expert weights per GPU "
                   f"({costing.shape.describe()})")
    click.echo(format_table(rows, result.baseline))
    if result.fitted:
        exact = " (the per-step optimum of rows with spare slots, as balanced dispatch reaches it)" \
            if dispatch == "balanced" and redundant else ""
        click.echo(f"fitted: E[max distinct] on {fitted_steps:,} of the {result.fit_steps:,} fitted steps, "
                   f"evenly spaced{exact} (every other column: the held-out steps)")
    models = {e.name: today_cost if redundant and e.name == result.baseline != "deepseek" else cost_model
              for e in result.evaluations}
    click.echo(cost_model_line(models))
    click.echo(f"wrote {out}" + (f" and {sglang_out}" if sglang_out else "")
               + (f"; plots in {plot_dir}" if plots else ""))


def quality_warnings(rows: list[dict], chosen: str, which: str, fit_steps: int, spares: bool) -> list[str]:
    """Lines that say the written placement may not hold: another row of the table beats it on the
    ``which`` steps, or (with a fitted column) its held-out E[max distinct] is more than FIT_GAP away
    from its fitted one. Every row other than ``chosen`` counts as a baseline."""
    mine = next(r for r in rows if r["placement"] == chosen)
    lines = []
    best = min((r for r in rows if r is not mine), key=lambda r: r["e_max_distinct"], default=None)
    if best is not None and mine["e_max_distinct"] > best["e_max_distinct"] + 1e-9:
        lines.append(f"the written placement ({chosen}) is worse than {best['placement']} on the {which} steps: "
                     f"E[max distinct] {mine['e_max_distinct']:.3f} against {best['e_max_distinct']:.3f} "
                     f"(fitted on {fit_steps:,} steps; a longer trace may help)")
    fitted = mine.get("fitted_e_max_distinct")
    if fitted and abs(mine["e_max_distinct"] / fitted - 1) > FIT_GAP:
        lines.append(f"{chosen}: E[max distinct] {mine['e_max_distinct']:.3f} on the held-out steps against "
                     f"{fitted:.3f} on the fitted ones ({100 * (mine['e_max_distinct'] / fitted - 1):+.1f}%, more "
                     f"than {100 * FIT_GAP:.0f}% apart): the trace may be too short ({fit_steps:,} fitted steps)"
                     + (" for the spare slots asked for" if spares else "") + ", or its traffic changed")
    return lines


@click.command()
@trace_options
@click.argument("placements", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@holdout_option(0.0, "Score only this share of the trace's last steps: with the --holdout that optimize fitted "
                     "a placement with, the steps it did not see (0: every step, fitted ones included).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--plot-dir", type=click.Path(file_okay=False), help="Write side-by-side PNG plots here.")
def compare(trace: str, ranks: int, mode: str, dispatch: str, model_ref: str | None, cost_model_path: str | None,
            gpu: str | None, window: int, top_k: int | None, max_steps: int, placements: tuple[str, ...],
            holdout: float, as_json: bool, plot_dir: str | None) -> None:
    """Compare existing PLACEMENTS on TRACE (moeplace JSON, or SGLang .json/.pt written by hand or exported).

    The first placement is the baseline for the "vs baseline" and "gap closed" columns. The first
    line says which steps are scored: all of them unless --holdout keeps only the last share, as a
    placement fitted on the same trace by optimize (whose default holds out the last 30%) did not see.
    Each placement is scored under the dispatch rule it was made for (recorded in its file by
    `optimize --dispatch`), unless --dispatch is given; the first line says which.

    \b
    Example:
      moeplace compare traces/gptoss20b-sample.mptrace old.json new.json --ranks 8 --holdout 0.3
    """
    check_outputs({}, folders={"--plot-dir": plot_dir})
    check_plotting(plot_dir)
    src = open_source(trace, window, top_k)
    loaded: dict[str, Placement] = {}
    for path in placements:
        p = load_placement(path, model=src.model, ranks=ranks)
        if path in loaded:
            raise MoeplaceError(f"{path} is given twice")
        loaded[path] = p
    scoring = {path: scoring_rule(p, path, dispatch) for path, p in loaded.items()}
    costing = resolve_costing(src.model, cost_model_path, model_ref, gpu_name=gpu)
    costs = {path: costing.ep(p.phy2log.shape[1] // ranks) for path, p in loaded.items()}
    total = src.count(mode)
    if total == 0:
        raise src.no_steps_error(mode)
    skip = holdout_cut(total, holdout) if holdout else 0
    evals = evaluate(loaded, mode_chunks(src, mode, max_steps, skip=skip, total=total), costs,
                     {path: rule.rule for path, rule in scoring.items()})
    rows = comparison_rows(evals, placements[0])
    steps = evals[0].summary["steps"]
    scored = (f"the last {steps:,} of the trace's {steps_phrase(total, mode)} (--holdout {holdout:g})" if holdout
              else f"{'the first ' if steps < total else 'all '}{steps_phrase(steps, mode)}"
                   + (f" of {total:,}" if steps < total else "")
                   + " (no --holdout: a placement fitted on this trace is scored on its fitted steps too)")
    notes = [] if holdout else [note for path, p in loaded.items() if (note := fitted_here_note(path, p, trace))]
    plots = write_plots(evals, plot_dir, plot_context(trace, mode, steps, "held-out" if holdout else "", ranks)) \
        if plot_dir else []
    if as_json:
        echo_json({"steps": steps, "trace_steps": total, "holdout": holdout, "scored_on": scored,
                   "dispatch": {path: {"rule": r.rule, "from": r.source} for path, r in scoring.items()},
                   "baseline": placements[0], "rows": rows,
                   "cost_models": {k: c.to_json() for k, c in costs.items()}, "plots": plots})
        return
    click.echo(f"scored on {scored}; {ranks} ranks, {rules_phrase(scoring)}")
    for note in notes:
        click.echo(note)
    click.echo(format_table(rows, placements[0]))
    click.echo(cost_model_line(costs))

