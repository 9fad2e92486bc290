"""Open any supported trace source, detecting its format.

Sources: a moeplace trace (shard file or folder of shards), SGLang ``expert_distribution_recorder``
dumps (``.pt``), SGLang's ``{"logical_count": ...}`` JSON (aggregate only), and the GPT-OSS-20B
per-token routing arrays (``*topk_ids*.npz``) from ``shared/traces-real``, whose decode runs are cut
into windows of consecutive tokens that stand in for speculative verify steps.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import SHARD_SUFFIX, TraceHeader, TraceReader

DEFAULT_WINDOW = 9


@dataclass
class Trace:
    """A trace opened for reading: its header and a way to stream its steps in chunks.

    damaged: (shard, why) of every cut or corrupt shard tail met so far; each is also handed once to
    ``on_damage`` (the CLI prints it as a warning) when a read reaches it. guesses: what the reader
    inferred because the file does not say it (the CLI prints each as a warning).
    """

    path: Path
    header: TraceHeader
    _reader: TraceReader | None = None
    _steps: RoutingSteps | None = None
    damaged: list = field(default_factory=list)
    on_damage: Callable[[Path, str], None] | None = None
    guesses: list[str] = field(default_factory=list)

    @property
    def model(self) -> ModelSpec:
        return self.header.model

    def chunks(self) -> Iterator[RoutingSteps]:
        """Steps in file order, a chunk at a time (memory bounded by the chunk size)."""
        if self._steps is not None:
            yield self._steps
            return
        read_any = False
        for chunk in self._reader:
            self._note_damage(warn=True)   # a shard cut before this chunk's shard
            yield chunk
            read_any = True
        # Nothing read at all: no warning, the caller's no_steps_error names the cut in its one line.
        self._note_damage(warn=read_any)

    def _note_damage(self, warn: bool) -> None:
        for found in self._reader.damaged:
            if found not in self.damaged:
                self.damaged.append(found)
                if warn and self.on_damage is not None:
                    self.on_damage(*found)

    def count(self, mode: str = "all") -> int:
        """Steps of ``mode`` in the trace: one pass that reads each chunk's modes only."""
        if self._steps is not None:
            return int(M.mode_mask(self._steps.modes, mode).sum())
        total, read_any = 0, False
        for modes in self._reader.modes():
            self._note_damage(warn=True)
            total += int(M.mode_mask(modes, mode).sum())
            read_any = True
        self._note_damage(warn=read_any)
        return total

    def step_tokens(self, mode: str = "all") -> np.ndarray:
        """[S] tokens of each step of ``mode``, in order: one pass like ``count``, no ids decoded."""
        if self._steps is not None:
            return self._steps.num_tokens[M.mode_mask(self._steps.modes, mode)]
        parts, read_any = [np.zeros(0, np.int64)], False
        for modes, tokens in self._reader.step_tokens():
            self._note_damage(warn=True)
            parts.append(tokens[M.mode_mask(modes, mode)])
            read_any = True
        self._note_damage(warn=read_any)
        return np.concatenate(parts)

    def load(self, mode: str = "all", max_steps: int | None = None, total: int | None = None) -> RoutingSteps:
        """All steps of ``mode`` in order; if more than ``max_steps``, exactly ``max_steps`` of them,
        evenly spaced (step ``floor(i * total / max_steps)`` for i < max_steps, counting steps of ``mode``).

        total: ``count(mode)`` if the caller has it (saves a pass). Memory holds the kept steps and
        one chunk, never the whole trace.
        """
        if max_steps and total is None:
            total = self.count(mode)
        picks = np.arange(max_steps, dtype=np.int64) * total // max_steps if max_steps and total > max_steps else None
        parts, seen = [], 0
        for chunk in self.chunks():
            idx = np.flatnonzero(M.mode_mask(chunk.modes, mode))
            if picks is not None:
                lo, hi = np.searchsorted(picks, [seen, seen + idx.size])
                keep = idx[picks[lo:hi] - seen]
            else:
                keep = idx
            seen += idx.size
            if keep.size == chunk.num_steps:
                parts.append(chunk)         # all of it: no copy before the join
            elif keep.size:
                parts.append(chunk.take(keep))
        if not parts:
            return RoutingSteps.empty(self.model)
        return concat_steps(parts)

    def load_counted(self, mode: str = "all", max_steps: int | None = None) -> tuple[RoutingSteps, int]:
        """(``load(mode, max_steps)``, ``count(mode)``), in one pass where the trace holds at most
        ``max_steps`` steps of ``mode`` (all of them are kept, so the count is theirs): a second read of the
        file saved. Where it holds more, the pass stops as soon as it has seen more, and the count and the
        evenly spaced load follow as ``load`` makes them. Memory holds at most ``max_steps`` steps and a chunk."""
        if not max_steps:
            steps = self.load(mode)
            return steps, steps.num_steps
        parts, seen = [], 0
        for chunk in self.chunks():
            idx = np.flatnonzero(M.mode_mask(chunk.modes, mode))
            seen += idx.size
            if seen > max_steps:
                break
            if idx.size == chunk.num_steps:
                parts.append(chunk)         # all of it: no copy before the join
            elif idx.size:
                parts.append(chunk.take(idx))
        else:
            return (concat_steps(parts) if parts else RoutingSteps.empty(self.model)), seen
        parts.clear()
        total = self.count(mode)
        return self.load(mode, max_steps, total=total), total

    def no_steps_error(self, mode: str) -> MoeplaceError:
        """The error for a read that found no step of ``mode``: a cut shard first, as the likely cause."""
        if self.damaged:
            cuts = "; ".join(f"{path}: {why}" for path, why in self.damaged)
            return MoeplaceError(f"{cuts}; no step of mode {mode!r} in the complete chunks before it")
        return MoeplaceError(f"{self.path}: no steps of mode {mode!r} (empty trace or other modes only)")


def open_trace(path: str | os.PathLike, window: int = DEFAULT_WINDOW, top_k: int | None = None) -> Trace:
    """Open ``path`` in whatever supported format it is; raise FormatError if none fits."""
    path = Path(path)
    if not path.exists():
        raise FormatError(path, "no such file or folder")
    if window < 1:
        raise MoeplaceError(f"--window must be at least 1, got {window}")
    if path.is_dir() or path.suffix == SHARD_SUFFIX or _starts_with(path, b"MPTRACE"):
        reader = TraceReader(path)
        return Trace(path, reader.header, _reader=reader)
    guesses: list[str] = []
    if path.suffix == ".npz" or zipfile.is_zipfile(path) and path.suffix != ".pt":
        header, steps = read_topk_npz(path, window, guesses)
    elif path.suffix == ".json":
        header, steps = read_logical_count_json(path, top_k)
    elif path.suffix == ".pt":
        from moeplace.trace.recorder_dump import read_recorder_dump  # needs torch

        header, steps = read_recorder_dump(path)
    else:
        raise FormatError(path, "unknown trace format (want a .mptrace file or folder, an SGLang recorder "
                                ".pt dump, a logical_count .json, or a top-k ids .npz)")
    return Trace(path, header, _steps=steps, guesses=guesses)


def _starts_with(path: Path, magic: bytes) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def read_topk_npz(path: Path, window: int = DEFAULT_WINDOW, guesses: list[str] | None = None
                  ) -> tuple[TraceHeader, RoutingSteps]:
    """Per-token decode routing (``topk_ids [N, L, K]``, ``example_offsets [X+1]``) -> verify windows.

    Each example is one sequence's decode run; every ``window`` consecutive tokens of it become one
    TARGET_VERIFY step (a speculative verify of ``window`` draft tokens sees about this co-activation).
    The last partial window of each example is dropped. Ids are 0..E-1, -1 for padding. Without
    ``num_experts`` in the file, E is the largest id + 1, said in ``guesses`` and the header's notes.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            ids = z["topk_ids"]
            offsets = z["example_offsets"] if "example_offsets" in z.files else np.array([0, ids.shape[0]])
            name = str(z["model_name"]) if "model_name" in z.files else path.stem
            given = z["num_experts"] if "num_experts" in z.files else None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise FormatError(path, f"not a top-k ids .npz ({e.__class__.__name__}: {e})") from None
    if given is not None and (given.shape != () or given.dtype.kind not in "iu"):
        raise FormatError(path, f"num_experts must be one whole number, got {given.dtype} of shape {list(given.shape)}")
    given_experts = int(given) if given is not None else None
    if ids.ndim != 3:
        raise FormatError(path, f"topk_ids must be [tokens, layers, top_k], got shape {list(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise FormatError(path, f"topk_ids must hold integer expert ids, not {ids.dtype}")
    if ids.size and int(ids.min()) < -1:
        raise FormatError(path, f"topk_ids holds id {int(ids.min())}: expert ids are 0 and up, -1 marks padding")
    notes = f"decode runs cut into verify windows of {window} consecutive tokens"
    if given_experts is not None:
        num_experts = given_experts
    elif ids.size and int(ids.max()) >= 0:
        num_experts = int(ids.max()) + 1
        guess = (f"{path.name} does not say num_experts: {num_experts} taken from its largest expert id, "
                 f"{num_experts - 1} (store num_experts in the file if the model has more)")
        notes += f"; {guess}"
        if guesses is not None:
            guesses.append(guess)
    else:
        raise FormatError(path, f"topk_ids holds no expert id ({ids.shape[0]} token rows, all padding) and the "
                                f"file does not say num_experts")
    offsets = np.asarray(offsets, np.int64)
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != ids.shape[0] or np.any(np.diff(offsets) < 0):
        raise FormatError(path, "example_offsets do not cover the token rows")
    if ids.size and int(ids.max()) >= num_experts:
        raise FormatError(path, f"expert id {int(ids.max())} outside the {num_experts} experts")
    T, L, K = ids.shape
    starts, ends = offsets[:-1], offsets[1:]
    windows = (ends - starts) // window
    if ids.shape[0] and not windows.any():
        longest = int((ends - starts).max())
        raise MoeplaceError(f"--window {window}: longer than the longest run in {path} ({longest:,} tokens), so "
                            f"no step is left; give --window {longest} or less")
    win_start = np.repeat(starts, windows) + window * _ranges_within(windows)
    rows = (win_start[:, None] + np.arange(window)).ravel()
    try:
        model = ModelSpec.all_moe(name, L, num_experts, K)
        steps = RoutingSteps.from_topk(model, ids[rows].astype(np.int16), np.full(win_start.size, window),
                                       M.TARGET_VERIFY)
    except MoeplaceError as e:  # a num_experts or top-k the model cannot have
        raise FormatError(path, str(e)) from None
    header = TraceHeader(model=model, source=f"converted:{path.name}", notes=notes)
    return header, steps


def _ranges_within(lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(n)`` for each n in lengths."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts


def read_logical_count_json(path: Path, top_k: int | None = None) -> tuple[TraceHeader, RoutingSteps]:
    """SGLang's ``{"logical_count": [L][E] or [T][L][E]}``: aggregate counts, no per-step information.

    Layers whose counts are all zero are taken as dense. The file does not say top-k: 8 unless given.
    """
    try:
        data = json.loads(path.read_text())
        counts = np.asarray(data["logical_count"], dtype=np.float64)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(path, "not valid JSON") from None
    except (KeyError, TypeError):
        raise FormatError(path, "JSON has no 'logical_count' array (not an SGLang expert distribution)") from None
    except ValueError:
        raise FormatError(path, "logical_count is not a rectangular array of numbers") from None
    if counts.ndim == 3:
        counts = counts.sum(axis=0)
    if counts.ndim != 2 or counts.size == 0:
        raise FormatError(path, f"logical_count must be [layers, experts] or [steps, layers, experts], "
                                f"got shape {list(counts.shape)}")
    if not np.all(np.isfinite(counts)) or counts.min() < 0:
        raise FormatError(path, "logical_count holds negative, NaN or infinite values")
    moe_layers = tuple(int(x) for x in np.flatnonzero(counts.sum(axis=1) > 0))
    if not moe_layers:
        raise FormatError(path, "logical_count is all zero (empty trace)")
    k = top_k or 8
    model = ModelSpec(path.stem, counts.shape[0], moe_layers, counts.shape[1], k)
    steps = RoutingSteps.from_counts(model, counts[list(moe_layers)][None], M.UNKNOWN)
    header = TraceHeader(model=model, source=f"sglang-logical-count:{path.name}", aggregate_only=True,
                         notes=f"aggregate counts only: no per-step information; top-k {k} "
                               f"{'given' if top_k else 'assumed'}")
    return header, steps
