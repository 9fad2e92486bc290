"""``moeplace report``: how imbalanced is a trace under a placement."""

from __future__ import annotations

import click

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.baselines import contiguous
from moeplace.commands.common import (check_ranks, echo_json, fitted_here_note, mode_chunks, open_source,
                                      scoring_rule)
from moeplace.commands.costing import cost_model_line, resolve_costing
from moeplace.commands.options import trace_options
from moeplace.files.outputs import check_outputs
from moeplace.files.placement import Placement, load_placement
from moeplace.analysis.optimize import DEFAULT_SAMPLE_STEPS
from moeplace.analysis.staleness import staleness
from moeplace.analysis.report import (check_plotting, comparison_rows, evaluate, format_table, hottest_experts, plot_context,
                                      steps_phrase, write_plots)
from moeplace.trace.steps import RoutingSteps


@click.command()
@trace_options
@click.option("--placement", "placement_path", type=click.Path(exists=True, dir_okay=False),
              help="Placement to measure (moeplace JSON or SGLang --init-expert-location file); "
                   "default: SGLang's contiguous layout.")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON instead of a table.")
@click.option("--plot-dir", type=click.Path(file_okay=False), help="Write PNG heatmaps and distributions here.")
@click.option("--no-stale-check", is_flag=True,
              help="With --placement, skip the check against a placement fitted on TRACE now and the naive layout.")
def report(trace: str, ranks: int, mode: str, dispatch: str, model_ref: str | None, cost_model_path: str | None,
           gpu: str | None, window: int, top_k: int | None, max_steps: int, placement_path: str | None, as_json: bool,
           plot_dir: str | None, no_stale_check: bool) -> None:
    """Measure per-step expert imbalance of TRACE under a placement.

    TRACE is a moeplace trace (file or folder of shards), an SGLang expert-distribution dump (.pt),
    an SGLang logical_count .json, or a per-token top-k ids .npz.

    A placement is scored under the dispatch rule it was made for (`optimize --dispatch`, recorded in its
    file), unless --dispatch is given; the placement line says which rule and why.

    With --placement (one in service) on a newer capture, one line says whether it has gone stale: its
    E[max distinct] on the capture's last 30% of steps against a placement fitted now on the first 70%
    (same ranks and spare slots) and against the naive layout, e.g. "re-place: 7% to gain"; --json puts it
    under "staleness" for monitoring.

    \b
    Example:
      moeplace report traces/gptoss20b-sample.mptrace --ranks 8 --plot-dir plots/
      moeplace report /var/moeplace/new-capture.mptrace --ranks 8 --placement placement.json --json
    """
    check_outputs({}, folders={"--plot-dir": plot_dir})
    check_plotting(plot_dir)
    src = open_source(trace, window, top_k)
    model = src.model
    costing = resolve_costing(model, cost_model_path, model_ref, gpu_name=gpu)
    if placement_path:
        placement = load_placement(placement_path, model=model, ranks=ranks)
        name = placement.algorithm
    else:
        check_ranks(src, ranks)
        empty = PlacementProblem(model, RoutingSteps.empty(model), ranks)
        placement = Placement(model, ranks, contiguous(empty), algorithm="contiguous")
        name = "contiguous"
    scoring = scoring_rule(placement, placement_path or name, dispatch)
    dispatch = scoring.rule
    cost_model = costing.ep(placement.phy2log.shape[1] // ranks)
    ev = evaluate({name: placement}, mode_chunks(src, mode, max_steps), cost_model, dispatch)[0]
    s = ev.summary
    hot = hottest_experts(ev.sums.expert_tokens, model.moe_layers)
    result = {"trace": trace, "source": src.header.source, "model": model.to_json(), "mode": mode,
              "ranks": ranks, "dispatch": dispatch, "dispatch_from": scoring.source, "placement": name,
              "aggregate_only": src.header.aggregate_only,
              "cost_model": cost_model.to_json(), "metrics": s, "hottest_experts": hot}
    stale = None
    if placement_path and not no_stale_check and not src.header.aggregate_only:
        limit = min(max_steps, DEFAULT_SAMPLE_STEPS) if max_steps else DEFAULT_SAMPLE_STEPS
        stale = staleness(src.load(mode, limit), placement, dispatch, cost_model)
        result["staleness"] = stale.to_json() if stale else None
    if plot_dir:
        result["plots"] = write_plots([ev], plot_dir, plot_context(trace, mode, s["steps"], "", ranks))
    if as_json:
        echo_json(result)
        return
    scored = f"{'the first' if max_steps and s['steps'] >= max_steps else 'all'} {steps_phrase(s['steps'], mode)}"
    click.echo(f"trace     {trace}  ({src.header.source}; scored on {scored})")
    click.echo(f"model     {model.name}: {model.num_moe_layers} MoE layers, {model.num_experts} experts, "
               f"top-{model.top_k}")
    click.echo(f"placement {name} on {ranks} ranks, dispatch {dispatch}"
               + (f" ({scoring.why(placement_path)})" if placement_path else ""))
    note = fitted_here_note(placement_path, placement, trace) if placement_path else None
    if note:
        click.echo(note)
    click.echo("")
    if src.header.aggregate_only:
        click.echo("aggregate counts only (no per-step information): per-step metrics cannot be measured")
        click.echo(f"token balancedness {s['token_balancedness']:.3f}")
    else:
        click.echo(format_table(comparison_rows([ev]), None))
        click.echo(cost_model_line({name: cost_model}))
        worst = sorted(range(model.num_moe_layers), key=lambda i: -s["per_layer"]["e_max_distinct"][i])[:3]
        click.echo("")
        click.echo("worst layers by E[max distinct]: " + ", ".join(
            f"{model.moe_layers[i]} ({s['per_layer']['e_max_distinct'][i]:.2f})" for i in worst))
    click.echo(f"token balancedness across layers: median {s['balancedness_p50']:.3f}, "
               f"10th percentile {s['balancedness_p10']:.3f} (9 in 10 layers are above), "
               f"worst {s['balancedness_worst']:.3f}")
    click.echo("hottest experts: " + ", ".join(
        f"L{h['layer']}/E{h['expert']} {100 * h['share']:.1f}%" for h in hot)
        + f"  (uniform {100 / model.num_experts:.1f}%)")
    if stale:
        click.echo(stale.line)
    if plot_dir:
        click.echo(f"plots: {', '.join(result['plots'])}")

