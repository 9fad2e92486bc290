"""``moeplace trace merge``: join the shards that each rank wrote into one trace file."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import click
import numpy as np

from moeplace.commands.common import Progress, model_config_file, warn_damage
from moeplace.commands.options import FiniteFloatRange, count, out_option, seed_option
from moeplace.model.spec import MAX_EXPERTS
from moeplace.errors import FormatError, MoeplaceError
from moeplace.files.outputs import check_outputs, check_writable, nearest_existing, output_inside
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.load import DEFAULT_WINDOW, open_trace
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import (SHARD_SUFFIX, TraceHeader, TraceReader, shard_identity, shard_path, split_chunks,
                                  write_chunks)
from moeplace.trace.synthetic import SHAPES, SyntheticRouting, synthetic_chunks, working_bytes


@dataclass
class MergeResult:
    out: Path
    steps: int = 0
    shards_used: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)  # ranks that routed the same tokens as a kept one
    ranks_kept: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    same_tokens: str = ""   # why ranks were dropped, if any


def _shard_readers(inputs: list[Path], include_partial: bool, out: Path) -> list[tuple[Path, TraceReader]]:
    """One reader per shard file, in input order (folders expanded, sorted).

    Refuses a shard given twice (by two paths, or as two copies, or inside a merged trace that is
    also given), and the output file itself: each would count its steps twice.
    """
    targets = {out.resolve(), out.with_name(out.name + SHARD_SUFFIX).resolve()}
    by_file: dict[Path, Path] = {}
    by_content: dict[str, Path] = {}
    readers = []
    for p in inputs:
        for shard in TraceReader(p, include_partial=include_partial).shards:
            real = shard.resolve()
            if real in targets:
                raise MoeplaceError(f"{shard}: is the output of this merge (-o); write the merged trace "
                                    f"outside the shard folder")
            if real in by_file:
                raise MoeplaceError(f"{shard}: given twice (also as {by_file[real]}); merge each shard once")
            by_file[real] = shard
            reader = TraceReader(shard)
            for identity in _identities(shard, reader):
                if identity in by_content:
                    raise MoeplaceError(f"{shard} and {by_content[identity]} hold the same steps (a copy, or a "
                                        f"merged trace and a shard merged into it); merge each shard once")
                by_content[identity] = shard
            readers.append((shard, reader))
    if not readers:
        raise MoeplaceError("no trace shards given")
    return readers


def _identities(shard: Path, reader: TraceReader) -> list[str]:
    """The shard's own identity and those of the shards merged into it (``shard_identity``)."""
    return [x for x in [shard_identity(shard), *reader.headers[0].merged_from] if x]


def merge_traces(inputs: list[str | os.PathLike], out: str | os.PathLike, include_partial: bool = True) -> MergeResult:
    """Join shards of one capture into one shard at ``out`` (written to a temp name, then renamed).

    Ranks that routed the same tokens (no DP attention: tensor-parallel attention, with or without
    EP) are kept once (``drop_same_token_ranks``); with DP attention each group's tokens are its own.
    A folder's ``.part`` shards (never finished: a server killed hard) are read unless
    ``include_partial`` is False, their whole chunks only. Ids come out logical; steps are ordered rank by rank, each rank in its own time order. A merge
    that would hold no step (every shard empty or cut before its first whole chunk) writes nothing.
    """
    for source in inputs:   # the next merge of that folder would read the output as one of its shards
        if Path(source).is_dir() and output_inside(shard_path(out).parent, source, at_depth=0):
            raise MoeplaceError(f"-o {out}: is inside the folder {source} this merge reads; write the merged "
                                f"trace outside it")
    check_outputs({"-o": out})
    out = Path(out)
    check_writable("-o", shard_path(out))
    readers = _shard_readers([Path(p) for p in inputs], include_partial, out)
    first = readers[0][1].header
    for shard, r in readers:
        if r.model != first.model:
            raise FormatError(shard, f"shard is for model {r.model.name!r} ({r.model.num_experts} experts, "
                                     f"layers {len(r.model.moe_layers)}), the first for {first.model.name!r}")
    chosen, skipped, dedup_note = drop_same_token_ranks(readers)
    maps = {json.dumps(h.physical_to_logical_map) for _, r in chosen for h in [r.header]}
    p2l = chosen[0][1].header.physical_to_logical_map if len(maps) == 1 else None
    notes = [f"merged from {len(chosen)} shard(s)"] + ([dedup_note] if dedup_note else [])
    if len(maps) > 1:
        notes.append("the physical-to-logical map changed during capture (ids are logical)")
    parts = [x for shard, reader in chosen for x in _identities(shard, reader)]
    header = TraceHeader(model=first.model, source="moeplace trace merge", id_space="logical",
                         physical_to_logical_map=p2l, ep_size=first.ep_size, tp_size=first.tp_size,
                         nodes=first.nodes, ranks=sorted({x for _, r in chosen for x in r.header.ranks}),
                         attn_dp_size=first.attn_dp_size,
                         notes="; ".join(notes + ([first.notes] if first.notes else [])), merged_from=parts)
    result = MergeResult(out, shards_skipped=[str(s) for s in skipped], ranks_kept=header.ranks,
                         same_tokens=dedup_note)

    def chunks() -> Iterator[RoutingSteps]:
        for shard, reader in chosen:
            for steps in reader:
                result.steps += steps.num_steps
                yield steps
            result.shards_used.append(str(shard))
            result.damaged += [f"{p}: {why}" for p, why in reader.damaged]
        if result.steps == 0:   # raised inside the writer: it removes its temp file
            why = "; ".join(result.damaged) or "every shard is empty"
            raise MoeplaceError(f"no step to merge ({why}); nothing written")

    # id_space logical + a map is a record of the placement in force; the writer validates nothing here.
    result.out = write_or_explain(out, header, chunks())
    return result


# Steps compared when the headers do not say how the ranks' attention was split.
FINGERPRINT_STEPS = 64


def drop_same_token_ranks(readers: list[tuple[Path, TraceReader]]
                          ) -> tuple[list[tuple[Path, TraceReader]], list[Path], str]:
    """Keep one rank of every group of ranks that routed the same tokens: (kept, dropped shards, note).

    Without DP attention every rank runs the router over the batch's tokens (tensor-parallel attention,
    EP or not), so merging every rank counts each step once per rank. The tracer's headers say which
    attention DP group a rank belongs to (``attn_dp_rank``); for shards without it (older tracers,
    other writers) the ranks whose first ``FINGERPRINT_STEPS`` steps are identical are one group.
    Shards holding several ranks (merged traces) are kept as they are.
    """
    by_rank: dict[int, list[tuple[Path, TraceReader]]] = {}
    for shard, reader in readers:
        if len(reader.header.ranks) == 1:
            by_rank.setdefault(reader.header.ranks[0], []).append((shard, reader))
    if len(by_rank) < 2:
        return readers, [], ""
    headers = [r.header for group in by_rank.values() for _, r in group]
    if all(h.attn_dp_size is not None and h.attn_dp_rank is not None for h in headers):
        group_of = {rank: group[0][1].header.attn_dp_rank for rank, group in by_rank.items()}
        how = "the same attention group (tensor-parallel attention, from the shard headers)"
    else:
        group_of = {rank: _first_steps_fingerprint(group) for rank, group in by_rank.items()}
        how = f"identical first {FINGERPRINT_STEPS} steps"
    keep = {min(r for r in by_rank if group_of[r] == g) for g in set(group_of.values())}
    if len(keep) == len(by_rank):
        return readers, [], ""
    dropped_ranks = sorted(set(by_rank) - keep)
    kept = [(s, r) for s, r in readers if len(r.header.ranks) != 1 or r.header.ranks[0] in keep]
    dropped = [s for s, r in readers if len(r.header.ranks) == 1 and r.header.ranks[0] not in keep]
    note = (f"kept rank(s) {sorted(keep)}, dropped rank(s) {dropped_ranks}: they routed the same tokens "
            f"({how})")
    return kept, dropped, note


def _first_steps_fingerprint(group: list[tuple[Path, TraceReader]]) -> bytes:
    """The first FINGERPRINT_STEPS steps of one rank's shards (in name order): modes, sizes and ids."""
    parts: list[RoutingSteps] = []
    have = 0
    for _, reader in sorted(group, key=lambda x: x[0].name):
        for steps in reader:
            parts.append(steps)
            have += steps.num_steps
            if have >= FINGERPRINT_STEPS:
                break
        if have >= FINGERPRINT_STEPS:
            break
    if not parts:
        return b""
    steps = concat_steps(parts)
    n = min(FINGERPRINT_STEPS, steps.num_steps)
    head = steps.take(np.arange(n))
    return b"".join(a.tobytes() for a in (head.modes, head.num_tokens, head.token_offsets, head.topk_ids,
                                           head.counts))


def write_or_explain(out: Path, header: TraceHeader, chunks: Iterable[RoutingSteps],
                     progress: Callable[[int], None] = lambda steps: None) -> Path:
    """``write_chunks``, with a failure to write (no space, no permission) as one line."""
    try:
        return write_chunks(out, header, chunks, progress)[0]
    except OSError as e:
        raise MoeplaceError(f"{e.filename or out}: cannot write ({e.strerror or e})") from None


@click.group()
def trace() -> None:
    """Work with trace files: merge the shards a live capture wrote, convert another format (an SGLang
    recorder dump, a top-k .npz) to one .mptrace file, or make a synthetic trace."""


@trace.command()
@click.argument("shards", nargs=-1, required=True, type=click.Path(exists=True))
@out_option("Merged trace file (.mptrace).")
@click.option("--skip-partial", is_flag=True,
              help="Leave out *.mptrace.part shards (never finished: a server killed hard, or one still "
                   "running). By default their whole chunks are read, with a warning.")
@click.option("--include-partial", is_flag=True, hidden=True)   # the default since .part shards are read
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def merge(shards: tuple[str, ...], out: str, skip_partial: bool, include_partial: bool, as_json: bool) -> None:
    """Join the shards of one capture (all ranks) into one trace.

    Give the whole trace folder: ranks that routed the same tokens (every rank, unless the server ran
    DP attention) are kept once, and the output says which were dropped.

    \b
    Example:
      moeplace trace merge moeplace-traces/ -o kimi-run1.mptrace
    """
    res = merge_traces(list(shards), out, include_partial=not skip_partial)
    if as_json:
        click.echo(json.dumps({**res.__dict__, "out": str(res.out)}, indent=1))
        return
    click.echo(f"wrote {res.out}: {res.steps} steps from {len(res.shards_used)} shard(s), ranks {res.ranks_kept}")
    if res.same_tokens:
        click.echo(f"{res.same_tokens}; skipped {len(res.shards_skipped)} shard(s)")
    for d in res.damaged:
        click.echo(f"warning: {d}", err=True)


@trace.command()
@click.argument("source", type=click.Path(exists=True))
@out_option("Trace file to write (.mptrace).")
@click.option("--window", type=count(), default=DEFAULT_WINDOW, show_default=True,
              help="For per-token decode runs (.npz): consecutive tokens per emulated verify step.")
@click.option("--top-k", type=count(1, MAX_EXPERTS), default=None,
              help="For logical_count JSON files, which do not record it (default 8).")
def convert(source: str, out: str, window: int, top_k: int | None) -> None:
    """Turn any trace moeplace reads into one .mptrace file.

    For an SGLang recorder dump (.pt), which needs torch to read: convert it on a machine that has
    torch, then report and optimize anywhere (they need only numpy).

    \b
    Example:
      moeplace trace convert /tmp/expert_distribution_recorder_1767000000.123.pt -o run1.mptrace
    """
    check_outputs({"-o": shard_path(out)}, inputs={"SOURCE": source})
    src = open_trace(source, window=window, top_k=top_k)
    src.on_damage = warn_damage
    steps = [0]

    def chunks() -> Iterator[RoutingSteps]:
        for chunk in src.chunks():
            steps[0] += chunk.num_steps
            yield from split_chunks(chunk)
        if steps[0] == 0:
            raise src.no_steps_error("all")

    path = write_or_explain(Path(out), src.header, chunks())
    click.echo(f"wrote {path}: {steps[0]:,} steps")


SYNTH_MODES = {"verify": M.TARGET_VERIFY, "decode": M.DECODE, "prefill": M.EXTEND}
# Past these the generator's law no longer changes (the weights saturate), and far past them its
# floats overflow; topics cost a probability table per layer each.
MAX_SKEW, MAX_COACTIVATION, MAX_TOPICS = 20.0, 100.0, 1024
# Zlib packs Kimi-K2-shaped synthetic ids to 0.69 of their raw size (BENCHMARKS.md#synthetic-traces);
# a trace that would not fit even at this share of it is refused before it starts.
MIN_PACKED_SHARE = 0.25


@trace.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), default=None,
              help="Model whose MoE layout the trace takes (default kimi-k2).")
@click.option("--model", "model_ref", metavar="PATH|ID",
              help="Take the layout from this model's config.json instead: a folder, the file, or a Hugging Face "
                   "id in the local cache (offline).")
@click.option("--steps", type=count(1, 2**62), required=True, help="Steps (forward passes) to make.")
@click.option("--tokens-per-step", type=count(), default=9, show_default=True,
              help="Tokens per step (9: a speculative verify of 9 draft tokens).")
@click.option("--mode", type=click.Choice(list(SYNTH_MODES)), default="verify", show_default=True,
              help="Forward mode the steps are labelled with.")
@click.option("--skew", type=FiniteFloatRange(0, MAX_SKEW), default=1.0, show_default=True,
              help=f"Zipf exponent of expert popularity in each layer (0: all experts equally popular; by "
                   f"{MAX_SKEW:g} every token takes the layer's top experts).")
@click.option("--coactivation", type=FiniteFloatRange(0, MAX_COACTIVATION), default=0.7, show_default=True,
              help=f"How strongly the tokens of one step share experts (0: independent tokens; by "
                   f"{MAX_COACTIVATION:g} every token of a step takes its topic's top experts).")
@click.option("--topics", type=click.IntRange(1, MAX_TOPICS), default=16, show_default=True,
              help="Latent topics per layer; a step routes by one of them.")
@seed_option("Same seed, same steps.")
@out_option("Trace file to write (.mptrace).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def synth(shape: str | None, model_ref: str | None, steps: int, tokens_per_step: int, mode: str, skew: float,
          coactivation: float, topics: int, seed: int, out: str, as_json: bool) -> None:
    """Write a SYNTHETIC routing trace: made-up steps shaped like a real model's MoE layers.

    Expert popularity is skewed (Zipf) and the tokens of a step share experts through latent topics,
    as real decode traffic does; the header says SYNTHETIC. For trying the tools and for benchmarks,
    not for placing a real service: capture its routing instead. Streams to disk in bounded memory
    (200,000 Kimi-K2-shaped steps: about 3 minutes and 250 MB on a 2-core machine).

    \b
    Example:
      moeplace trace synth --shape kimi-k2 --steps 20000 -o kimi-synth.mptrace
      moeplace optimize kimi-synth.mptrace --ranks 8 -o placement.json
    """
    if shape and model_ref:
        raise click.BadParameter("give --shape or --model, not both", param_hint="--model")
    check_outputs({"-o": shard_path(out)}, inputs={"--model": model_config_file(model_ref)})
    model, origin = synth_model(shape or "kimi-k2", model_ref)
    routing = SyntheticRouting(model, tokens_per_step, skew, coactivation, topics, SYNTH_MODES[mode], seed)
    check_machine_holds(routing, steps, shard_path(out))
    header = routing.header(notes=f"layout of {origin}")
    start = time.perf_counter()
    path = write_or_explain(Path(out), header, synthetic_chunks(routing, steps), Progress(steps, "synth"))
    seconds = time.perf_counter() - start
    summary = {"out": str(path), "steps": steps, "model": model.to_json(), "layout_of": origin,
               "bytes": path.stat().st_size, "seconds": round(seconds, 1)}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(f"wrote {path}: {steps:,} SYNTHETIC {mode} steps of {tokens_per_step} tokens, layout of {origin} "
               f"({model.num_moe_layers} MoE layers, {model.num_experts} experts, top-{model.top_k}); "
               f"{summary['bytes'] / 1e6:.0f} MB in {seconds:.0f} s")


def check_machine_holds(routing: SyntheticRouting, steps: int, out: Path) -> None:
    """Refuse, in one line, a synthetic trace whose making needs more memory than is available or
    whose file cannot fit on the free disk space at ``out``."""
    need = working_bytes(routing)
    have = available_memory()
    if have is not None and need > have:
        raise MoeplaceError(f"--tokens-per-step {routing.tokens_per_step:,}: making the steps would take about "
                            f"{need / 2**30:,.1f} GiB of memory, {have / 2**30:,.1f} GiB are available")
    m = routing.model
    raw = steps * routing.tokens_per_step * m.num_moe_layers * m.top_k * 2
    free = shutil.disk_usage(nearest_existing(out)).free
    if raw * MIN_PACKED_SHARE > free:
        raise MoeplaceError(f"--steps {steps:,}: the trace would hold {raw / 1e9:,.1f} GB of ids (at least "
                            f"{raw * MIN_PACKED_SHARE / 1e9:,.1f} GB packed), {free / 1e9:,.1f} GB are free at "
                            f"{out.absolute().parent}")


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def synth_model(shape: str, model_ref: str | None) -> tuple[ModelSpec, str]:
    """The model layout for ``trace synth`` and what it is of (a Hugging Face id or a folder's name)."""
    if model_ref is None:
        return SHAPES[shape][1], SHAPES[shape][0]
    from moeplace.model.hf_resolve import model_name, resolve_model_dir
    from moeplace.model.config import model_spec_from_folder

    folder = resolve_model_dir(model_ref)
    origin = model_name(folder)
    return dataclasses.replace(model_spec_from_folder(folder), name=f"SYNTHETIC {origin}-shaped"), origin
