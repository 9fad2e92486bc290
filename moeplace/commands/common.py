"""Glue shared by commands: open a trace with the common options, pick placements, print results."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import click
import numpy as np
from click.core import ParameterSource

from moeplace.dispatch.loads import DISPATCH_RULES
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement
from moeplace.trace import modes as M
from moeplace.trace.load import Trace, open_trace
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.store import UNFINISHED


def open_source(trace: str, window: int, top_k: int | None) -> Trace:
    """Open TRACE for a command: what the reader had to guess, and every cut shard tail a read meets,
    is a warning on stderr."""
    src = open_trace(trace, window=window, top_k=top_k)
    src.on_damage = warn_damage
    for guess in src.guesses:
        click.echo(f"warning: {guess}", err=True)
    return src


def trace_inputs(trace: str, cost_model_path: str | None = None, model_ref: str | None = None
                 ) -> dict[str, str | Path | None]:
    """The files a trace command reads, named as its options are (for ``files.outputs.check_outputs``)."""
    return {"TRACE": trace, "--cost-model": cost_model_path, "--model": model_config_file(model_ref)}


def model_config_file(model_ref: str | None) -> str | Path | None:
    """The config.json in ``--model`` when it is a folder, else ``--model`` itself (a file, or a Hugging
    Face id, which names no local file and so is no input to guard)."""
    return Path(model_ref) / "config.json" if model_ref and Path(model_ref).is_dir() else model_ref


def warn_damage(shard: Path, why: str) -> None:
    rest = "" if why == UNFINISHED else "; the rest of that shard was skipped"
    click.echo(f"warning: {shard}: {why}{rest}", err=True)


def mode_chunks(trace: Trace, mode: str, max_steps: int | None = None, skip: int = 0, total: int | None = None,
                label: str = "reading") -> Iterator[RoutingSteps]:
    """The trace's steps of ``mode`` after the first ``skip`` of them (at most ``max_steps`` of those),
    chunk by chunk, with progress on stderr when the read takes more than a second.

    total: ``trace.count(mode)`` if the caller has it (a read of the steps' modes only).
    """
    total = trace.count(mode) if total is None else total
    if total == 0:
        raise trace.no_steps_error(mode)
    wanted = total - skip if max_steps is None else min(max_steps, total - skip)
    progress = Progress(wanted, label, quiet_for=1.0)
    seen = kept = 0
    for chunk in trace.chunks():
        idx = np.flatnonzero(M.mode_mask(chunk.modes, mode))
        lo = min(max(skip - seen, 0), idx.size)
        seen += idx.size
        idx = idx[lo:lo + wanted - kept]
        kept += idx.size
        if idx.size:
            progress(idx.size)
            yield chunk.take(idx)
        if kept >= wanted:
            break
    progress.finish()


class Progress:
    """Progress of long work on stderr: a line rewritten in place on a terminal, else a line every 10%.

    Call it with the amount just done (in ``unit``); nothing shows before the first call, nor before
    ``quiet_for`` seconds have passed (work that ends sooner shows nothing).
    """

    def __init__(self, total: float, label: str, unit: str = "steps", quiet_for: float = 0.0) -> None:
        self.total, self.label, self.unit, self.done, self.shown = total, label, unit, 0.0, -1
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.quiet_for = quiet_for

    def __call__(self, amount: float) -> None:
        self.done += amount
        share = self.done / self.total if self.total else 1.0
        elapsed = time.perf_counter() - self.start
        if elapsed < self.quiet_for or (not self.tty and int(10 * share) == self.shown):
            return
        self.shown = int(10 * share)
        rate = self.done / max(elapsed, 1e-9)
        line = (f"{self.label}: {self.done:,.0f} of {self.total:,.0f} {self.unit} ({100 * share:.0f}%"
                + (f", {rate:,.0f}/s)" if self.unit == "steps" else ")"))
        click.echo(f"\r{line}" if self.tty else line, err=True, nl=not self.tty or share >= 1)

    def finish(self) -> None:
        """End a line left open on a terminal (work that stopped short of its total)."""
        if self.tty and self.shown >= 0 and self.done < self.total:
            click.echo("", err=True)


def sized_progress(label: str, unit: str) -> Callable[[int, int], None]:
    """A callback for work that learns its size as it starts: called with (done so far, total), it shows a
    ``Progress`` line from its first call on (done 0: a line at once)."""
    shown: list[Progress] = []

    def report(done: int, total: int) -> None:
        if not shown:
            shown.append(Progress(total, label, unit))
        shown[0](done - shown[0].done)
    return report


def check_ranks(trace: Trace, ranks: int, redundant: int | None = None) -> None:
    """Reject rank counts that cannot hold the trace's experts (one line, before any work). redundant: the
    command's --redundant (None where it has none); where the slots do not split, the line names the fewest
    spare slots from there up that do."""
    E = trace.model.num_experts
    spare = redundant or 0
    if spare > E * (ranks - 1):
        raise click.BadParameter(f"{spare} spare slots over {ranks} ranks: the slots per rank exceed the {E} "
                                 f"experts (a rank never holds an expert twice), so at most {E * (ranks - 1)} spare "
                                 f"slots", param_hint="--redundant")
    if (E + spare) % ranks:
        fits = spare + (-(E + spare)) % ranks
        hint = f"; --redundant {fits} would" if redundant is not None and fits <= E * (ranks - 1) else ""
        raise click.BadParameter(f"{E} experts + {spare} redundant slots do not split evenly over "
                                 f"{ranks} ranks{hint}", param_hint="--ranks")


def echo_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")


@dataclass(frozen=True)
class ScoringRule:
    """The dispatch rule a placement is scored under and where it comes from: ``source`` is "--dispatch" (the
    user gave it), "placement" (the rule the file says it was made for) or "default" (neither);
    ``made_for``: the rule the file records, if any."""

    rule: str
    source: str
    made_for: str | None = None

    def why(self, name: str) -> str:
        """Where the rule comes from, in words, for the placement called ``name``."""
        if self.source == "--dispatch":
            return "--dispatch" + (f"; {name} was made for {self.made_for}"
                                   if self.made_for and self.made_for != self.rule else "")
        if self.source == "placement":
            return f"the rule {name} was made for"
        return f"the default; {name} records no rule"


def scoring_rule(placement: Placement, name: str, dispatch: str) -> ScoringRule:
    """The rule to score ``placement`` (the file ``name``) under: ``dispatch`` where the user gave --dispatch,
    else the rule the file records it was made for (``optimize`` writes ``metrics["dispatch"]``, which
    ``moeplace launch`` reads too), else --dispatch's default. A recorded rule moeplace does not know is one
    line, unless --dispatch overrides it."""
    made_for = placement.metrics.get("dispatch")
    known = made_for if made_for in DISPATCH_RULES else None
    if click.get_current_context().get_parameter_source("dispatch") not in (None, ParameterSource.DEFAULT):
        return ScoringRule(dispatch, "--dispatch", known)
    if made_for is not None and known is None:
        raise MoeplaceError(f"{name} says it was made for dispatch {made_for!r}, not one of "
                            f"{', '.join(DISPATCH_RULES)}: give --dispatch")
    return ScoringRule(known, "placement", known) if known else ScoringRule(dispatch, "default")


def rules_phrase(scoring: dict[str, ScoringRule]) -> str:
    """Which dispatch rule each placement (by file name) is scored under, and why; once where they agree."""
    rules = list(scoring.items())
    path, first = rules[0]
    if len(rules) == 1:
        return f"dispatch {first.rule} ({first.why(path)})"
    if first.source == "--dispatch":
        other = [f"{p} for {r.made_for}" for p, r in rules if r.made_for and r.made_for != r.rule]
        return f"dispatch {first.rule} (--dispatch" + (f"; made for another rule: {', '.join(other)}" if other else "") + ")"
    unrecorded = [p for p, r in rules if r.source == "default"]
    if any(r.rule != first.rule for _, r in rules):
        return "each placement under the rule it was made for: " + ", ".join(
            f"{p} {r.rule}" + (" (the default: it records none)" if r.source == "default" else "") for p, r in rules)
    if len(unrecorded) == len(rules):
        return f"dispatch {first.rule} (the default; no placement records a rule)"
    return (f"dispatch {first.rule} (the rule each placement was made for"
            + (f"; the default for {', '.join(unrecorded)}, which record{'s' if len(unrecorded) == 1 else ''} none"
               if unrecorded else "") + ")")


def fitted_here_note(name: str, placement: Placement, trace: str) -> str | None:
    """A line where ``optimize`` fitted ``placement`` on ``trace`` (the same file or folder): figures on every
    step include the steps it was fitted on, which optimize's table left out."""
    made_from = placement.trace
    if not (made_from and os.path.exists(made_from) and os.path.samefile(made_from, trace)):
        return None
    share = placement.metrics.get("holdout")
    return (f"note: {name} was fitted on this trace; its figures include its fitted steps"
            + (f" (optimize's table scored only the steps it did not see, as `moeplace compare --holdout {share:g}` "
               f"does)" if isinstance(share, (int, float)) and share else ""))
