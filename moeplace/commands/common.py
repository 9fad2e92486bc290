"""Glue shared by commands: open a trace with the common options, pick placements, print results."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import click
import numpy as np

from moeplace.trace import modes as M
from moeplace.trace.load import Trace, open_trace
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.store import UNFINISHED


def open_source(trace: str, window: int, top_k: int | None) -> Trace:
    """Open TRACE for a command: every cut shard tail a read meets is a warning on stderr."""
    src = open_trace(trace, window=window, top_k=top_k)
    src.on_damage = warn_damage
    return src


def warn_damage(shard: Path, why: str) -> None:
    rest = "" if why == UNFINISHED else "; the rest of that shard was skipped"
    click.echo(f"warning: {shard}: {why}{rest}", err=True)


def mode_chunks(trace: Trace, mode: str, max_steps: int | None = None, label: str = "reading"
                ) -> Iterator[RoutingSteps]:
    """The trace's chunks restricted to ``mode`` (the first ``max_steps`` such steps at most), with
    a progress line on stderr for long traces."""
    seen = 0
    progress = False
    for i, chunk in enumerate(trace.chunks()):
        idx = np.flatnonzero(M.mode_mask(chunk.modes, mode))
        if max_steps is not None:
            idx = idx[:max(max_steps - seen, 0)]
        seen += idx.size
        if i and i % 10 == 0:
            click.echo(f"\r{label}: {seen} steps", err=True, nl=False)
            progress = True
        if idx.size:
            yield chunk.take(idx)
        if max_steps is not None and seen >= max_steps:
            break
    if progress:
        click.echo(f"\r{label}: {seen} steps", err=True)
    if seen == 0:
        raise trace.no_steps_error(mode)


class Progress:
    """Progress of long work on stderr: a line rewritten in place on a terminal, else a line every 10%.

    Call it with the amount just done (in ``unit``); nothing shows before the first call.
    """

    def __init__(self, total: float, label: str, unit: str = "steps") -> None:
        self.total, self.label, self.unit, self.done, self.shown = total, label, unit, 0.0, -1
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def __call__(self, amount: float) -> None:
        self.done += amount
        share = self.done / self.total if self.total else 1.0
        if not self.tty and int(10 * share) == self.shown:
            return
        self.shown = int(10 * share)
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        line = (f"{self.label}: {self.done:,.0f} of {self.total:,.0f} {self.unit} ({100 * share:.0f}%"
                + (f", {rate:,.0f}/s)" if self.unit == "steps" else ")"))
        click.echo(f"\r{line}" if self.tty else line, err=True, nl=not self.tty or share >= 1)


def check_ranks(trace: Trace, ranks: int, redundant: int = 0) -> None:
    """Reject rank counts that cannot hold the trace's experts (one line, before any work)."""
    E = trace.model.num_experts
    if (E + redundant) % ranks:
        raise click.BadParameter(f"{E} experts + {redundant} redundant slots do not split evenly over "
                                 f"{ranks} ranks", param_hint="--ranks")


def echo_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")
