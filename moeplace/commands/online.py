"""``moeplace online``: the re-placement decision a server makes while it runs, on a capture, and a running
server's control (``MOEPLACE_ONLINE``)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import click

from moeplace.commands.common import Progress, echo_json, mode_chunks, open_source, scoring_rule, trace_inputs
from moeplace.commands.costing import cost_model_line, resolve_costing
from moeplace.commands.options import FiniteFloatRange, MAX_SECONDS, count, out_option, sglang_out_option, trace_options
from moeplace.errors import MoeplaceError

DEFAULT_WINDOW_STEPS = 2000   # the capture's last steps the decision reads (the server's window is its own setting)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def online() -> None:
    """Re-place experts while the server runs (SGLang plugin, MOEPLACE_ONLINE=1): the decision on a capture, and a
    running server's control.

    \b
    Example:
      moeplace online decide traces/gptoss20b-sample.mptrace --placement placement.json --mode verify -o next.json
      moeplace online request moeplace-online --dry-run
    """


@online.command()
@trace_options
@click.option("--placement", "placement_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The placement in force on the server (moeplace JSON, or SGLang's --init-expert-location file).")
@click.option("--last", "last_steps", type=count(), default=DEFAULT_WINDOW_STEPS, show_default=True,
              help="Decide on the capture's last this many steps of --mode (the server decides on its window).")
@click.option("--min-gain", type=FiniteFloatRange(0, 1, max_open=True), default=None,
              help="Share of E[max distinct] re-placing must gain out of fold (default 0.005, as "
                   "MOEPLACE_ONLINE_MIN_GAIN).")
@click.option("--horizon", type=count(), default=None,
              help="Passes a new placement is expected to serve: its gain per pass counts this many times against the "
                   "stall of the weights it moves (default 10,000, as MOEPLACE_ONLINE_HORIZON).")
@click.option("--move-gbps", type=FiniteFloatRange(0, 1e6, min_open=True), default=None,
              help="GB/s one GPU copies expert weights at while re-placing (default 50, as MOEPLACE_ONLINE_MOVE_GBPS).")
@out_option("Where to write the placement to move to (moeplace JSON); nothing is written when the decision is to keep.")
@sglang_out_option("Also write SGLang's --init-expert-location JSON of it here.")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
def decide(trace: str, ranks: int, mode: str, dispatch: str, model_ref: str | None, cost_model_path: str | None,
           gpu: str | None, window: int, top_k: int | None, max_steps: int | None, placement_path: str, last_steps: int,
           min_gain: float | None, horizon: int | None, move_gbps: float | None, out: str, sglang_out: str | None,
           as_json: bool) -> None:
    """Decide, as a server with online re-placement would, whether the placement in force should move, and where.

    Reads the last steps of TRACE (a capture of the traffic the placement serves) and the placement in force,
    then scores three candidates against it on steps each was not fitted on: the placement refined by the local
    moves that pay, one fitted from scratch, and the naive layout (DeepSeek EPLB, plus one replica of each of the
    hottest experts where there are spare slots). It re-places the layers whose gain outweighs the stall of the
    weights they move, never to a layer worse than the naive layout's, and only when the gain stands out of the
    noise of the steps. Prints the decision (what moves, what it gains) and writes the placement to move to, or
    nothing when it keeps. The dispatch rule is the placement's own (the one it was made for) unless --dispatch
    says otherwise. A running server does the same every MOEPLACE_ONLINE_PERIOD passes on its own window.

    \b
    Example:
      moeplace optimize traces/gptoss20b-sample.mptrace --ranks 8 --mode verify -o placement.json
      moeplace online decide traces/gptoss20b-sample.mptrace --placement placement.json --ranks 8 \\
          --mode verify -o next.json --sglang-out next.sglang.json
    """
    from moeplace.analysis.replace import ReplaceConfig
    from moeplace.analysis.replace import decide as run_decide
    from moeplace.files.atomic import all_or_nothing
    from moeplace.files.outputs import check_outputs
    from moeplace.files.placement import Placement, load_placement, save_placement, save_sglang
    from moeplace.trace.steps import concat_steps

    check_outputs({"-o": out, "--sglang-out": sglang_out},
                  inputs={**trace_inputs(trace, cost_model_path, model_ref), "--placement": placement_path})
    src = open_source(trace, window, top_k)
    current = load_placement(placement_path, model=src.model, ranks=ranks)
    rule = scoring_rule(current, placement_path, dispatch).rule
    costing = resolve_costing(src.model, cost_model_path, model_ref, gpu_name=gpu)
    cost_model = costing.ep(current.num_physical // ranks)
    total = src.count(mode)
    if total == 0:
        raise src.no_steps_error(mode)
    want = min(last_steps, max_steps or last_steps, total)
    steps = concat_steps(list(mode_chunks(src, mode, want, skip=total - want, total=total)))
    defaults = ReplaceConfig()
    config = ReplaceConfig(min_gain=defaults.min_gain if min_gain is None else min_gain,
                           horizon=horizon or defaults.horizon, move_gbps=move_gbps or defaults.move_gbps,
                           replica_bytes=costing.shape.bytes)
    click.echo(f"deciding on the last {steps.num_steps:,} {mode} steps of {trace}: {defaults.folds} fits out of fold "
               f"and one on them all, dispatch {rule}", err=True)
    decision = run_decide(steps, current, rule, cost_model, config,
                          Progress(defaults.folds + 1, "deciding", "fits", quiet_for=0.0))
    result = {"replace": decision.target is not None, "placement": out if decision.target is not None else None,
              "dispatch": rule, "decision": decision.to_json(), "cost_model": cost_model.to_json()}
    if decision.target is not None:
        moved = Placement(current.model, ranks, decision.target, nodes=current.nodes, algorithm="online",
                          trace=str(trace), metrics={**current.metrics, "dispatch": rule,
                                                     "online_decision": decision.to_json()})
        with all_or_nothing():
            if sglang_out:
                save_sglang(sglang_out, moved)
            save_placement(out, moved)
    if as_json:
        echo_json(result)
        return
    click.echo(decision.line)
    if decision.target is not None:
        click.echo(f"re-placed layers (MoE layer indices): {', '.join(str(i) for i in decision.layers)}")
        click.echo(cost_model_line({"placement": cost_model}))
        click.echo(f"wrote {out}" + (f" and {sglang_out}" if sglang_out else "")
                   + "; a running server moves to it with `moeplace online request DIR --placement "
                   + f"{out}`")


@online.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--dry-run", is_flag=True, help="Decide now and say what would move, without moving anything.")
@click.option("--placement", "placement_path", type=click.Path(exists=True, dir_okay=False),
              help="Move to this placement now (moeplace JSON for the served model and its EP size) instead of "
                   "deciding.")
@click.option("--wait", type=FiniteFloatRange(0, MAX_SECONDS, min_open=True), default=600.0, show_default=True,
              help="Seconds to wait for the server's answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
def request(folder: str, dry_run: bool, placement_path: str | None, wait: float, as_json: bool) -> None:
    """Ask a running server with online re-placement to decide now (and move if it pays), to say what it would do
    (--dry-run), or to move to a given placement (--placement).

    FOLDER is the server's MOEPLACE_ONLINE_DIR (default: MOEPLACE_TRACE_DIR, else ./moeplace-online), where its
    worker reads requests and writes its answers and status-r000.json (the last decision and the totals). At EP 1
    the move starts on the next pass; at EP 2 and more at SGLang's next rebalance point
    (--eplb-rebalance-num-iterations). The answer's line is printed; an error is one line and exit code 2.

    \b
    Example:
      moeplace online request moeplace-online --dry-run
      moeplace online request moeplace-online --placement next.json
    """
    from moeplace.files.atomic import atomic_write_text
    from moeplace.files.placement import load_placement

    if dry_run and placement_path:
        raise click.UsageError("give --dry-run or --placement, not both")
    folder_path = Path(folder)
    if not any(folder_path.glob("status-r*.json")):
        raise MoeplaceError(f"{folder}: no status-r*.json: no server with MOEPLACE_ONLINE=1 has started there "
                            "(its MOEPLACE_ONLINE_DIR, else MOEPLACE_TRACE_DIR, else ./moeplace-online)")
    message: dict = {"kind": "dry-run" if dry_run else "decide"}
    if placement_path:
        message = {"kind": "apply", "placement": load_placement(placement_path).phy2log.tolist()}
    request_id = uuid.uuid4().hex[:12]
    answer_path = folder_path / f"response-{request_id}.json"
    atomic_write_text(folder_path / f"request-{request_id}.json", json.dumps(message) + "\n")
    deadline = time.monotonic() + wait
    while not answer_path.exists():
        if time.monotonic() > deadline:
            (folder_path / f"request-{request_id}.json").unlink(missing_ok=True)
            raise MoeplaceError(f"no answer from the server in {wait:g} s (is it serving, with MOEPLACE_ONLINE=1 "
                                f"and MOEPLACE_ONLINE_DIR={folder}?)")
        time.sleep(0.1)
    answer = json.loads(answer_path.read_text())
    answer_path.unlink(missing_ok=True)
    if as_json:
        echo_json(answer)
    if "error" in answer:
        raise MoeplaceError(f"the server refused the request: {answer['error']}")
    if not as_json:
        click.echo(answer.get("line", json.dumps(answer)))
