"""``moeplace trace merge``: join the shards that each rank wrote into one trace file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from moeplace.errors import FormatError, MoeplaceError
from moeplace.trace.store import ShardWriter, TraceHeader, TraceReader


@dataclass
class MergeResult:
    out: Path
    steps: int = 0
    shards_used: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)  # duplicate TP ranks
    ranks_kept: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def _shard_readers(inputs: list[Path], include_partial: bool) -> list[tuple[Path, TraceReader]]:
    """One reader per shard file, in input order (folders expanded, sorted)."""
    out = []
    for p in inputs:
        folder = TraceReader(p, include_partial=include_partial)
        for shard in folder.shards:
            out.append((shard, TraceReader(shard)))
    if not out:
        raise MoeplaceError("no trace shards given")
    return out


def merge_traces(inputs: list[str | os.PathLike], out: str | os.PathLike,
                 include_partial: bool = False) -> MergeResult:
    """Join shards of one capture into one shard at ``out`` (written to a temp name, then renamed).

    Plain TP (every header says ep_size 1, tp_size > 1): every rank routed the same tokens, so only
    the lowest rank's shards are kept. With EP or DP attention ranks route different tokens: all kept.
    Ids come out logical; steps are ordered rank by rank, each rank in its own time order.
    """
    readers = _shard_readers([Path(p) for p in inputs], include_partial)
    first = readers[0][1].header
    for shard, r in readers:
        if r.model != first.model:
            raise FormatError(shard, f"shard is for model {r.model.name!r} ({r.model.num_experts} experts, "
                                     f"layers {len(r.model.moe_layers)}), the first for {first.model.name!r}")
    headers = [r.header for _, r in readers]
    plain_tp = all(h.ep_size == 1 and h.tp_size > 1 for h in headers)
    if plain_tp:
        keep_rank = min(min(h.ranks) for h in headers)
        chosen = [(s, r) for s, r in readers if r.header.ranks == [keep_rank]]
        skipped = [s for s, r in readers if r.header.ranks != [keep_rank]]
    else:
        chosen, skipped = readers, []
    maps = {json.dumps(h.physical_to_logical_map) for _, r in chosen for h in [r.header]}
    p2l = chosen[0][1].header.physical_to_logical_map if len(maps) == 1 else None
    notes = [f"merged from {len(chosen)} shard(s)"]
    if plain_tp:
        notes.append(f"plain TP: kept rank {keep_rank} only (ranks route the same tokens)")
    if len(maps) > 1:
        notes.append("the physical-to-logical map changed during capture (ids are logical)")
    header = TraceHeader(model=first.model, source="moeplace trace merge", id_space="logical",
                         physical_to_logical_map=p2l, ep_size=first.ep_size, tp_size=first.tp_size,
                         nodes=first.nodes, ranks=sorted({x for _, r in chosen for x in r.header.ranks}),
                         notes="; ".join(notes + ([first.notes] if first.notes else [])))
    result = MergeResult(Path(out), shards_skipped=[str(s) for s in skipped], ranks_kept=header.ranks)
    # id_space logical + a map is a record of the placement in force; ShardWriter validates nothing here.
    with ShardWriter(out, header) as writer:
        for shard, reader in chosen:
            for steps in reader:
                writer.append(steps)
                result.steps += steps.num_steps
            result.shards_used.append(str(shard))
            result.damaged += [f"{p}: {why}" for p, why in reader.damaged]
    result.out = writer.path
    return result


@click.group()
def trace() -> None:
    """Work with trace files (shards written by the live tracer, merged traces)."""


@trace.command()
@click.argument("shards", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="Merged trace file (.mptrace).")
@click.option("--include-partial", is_flag=True,
              help="Also read *.mptrace.part shards left by a crash (their cut tails are skipped).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def merge(shards: tuple[str, ...], out: str, include_partial: bool, as_json: bool) -> None:
    """Join the shards of one capture (all ranks) into one trace.

    \b
    Example:
      moeplace trace merge moeplace-traces/ -o kimi-run1.mptrace
    """
    res = merge_traces(list(shards), out, include_partial)
    if as_json:
        click.echo(json.dumps({**res.__dict__, "out": str(res.out)}, indent=1))
        return
    click.echo(f"wrote {res.out}: {res.steps} steps from {len(res.shards_used)} shard(s), ranks {res.ranks_kept}")
    if res.shards_skipped:
        click.echo(f"skipped {len(res.shards_skipped)} shard(s) of other TP ranks (same tokens)")
    for d in res.damaged:
        click.echo(f"warning: damaged tail skipped: {d}", err=True)
