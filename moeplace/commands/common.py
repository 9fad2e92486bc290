"""Glue shared by commands: open a trace with the common options, pick placements, print results."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterator

import click
import numpy as np

from moeplace.costmodel import CostModel, load_cost_model
from moeplace.errors import MoeplaceError
from moeplace.trace import modes as M
from moeplace.trace.load import Trace, open_trace
from moeplace.trace.steps import RoutingSteps


def open_source(trace: str, window: int, top_k: int | None) -> Trace:
    return open_trace(trace, window=window, top_k=top_k)


def cost_model_from(path: str | None) -> CostModel:
    return load_cost_model(path) if path else CostModel()


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
        damage = "".join(f"; {path}: {why}" for path, why in trace.damaged)
        raise MoeplaceError(f"{trace.path}: no steps of mode {mode!r} (empty trace or other modes only){damage}")
    for path, why in trace.damaged:
        click.echo(f"warning: {path}: {why}; the rest of that shard was skipped", err=True)


def check_ranks(trace: Trace, ranks: int, redundant: int = 0) -> None:
    """Reject rank counts that cannot hold the trace's experts (one line, before any work)."""
    E = trace.model.num_experts
    if (E + redundant) % ranks:
        raise click.BadParameter(f"{E} experts + {redundant} redundant slots do not split evenly over "
                                 f"{ranks} ranks", param_hint="--ranks")


def echo_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")
