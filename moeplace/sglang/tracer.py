"""Live routing tracer: every MoE layer's top-k ids of every forward pass, written to trace shards.

Dimension letters: H hidden layers, L MoE layers, M max token rows kept per pass, K routed top-k,
P physical slots (router ids are physical under EP), C ring slots (passes), C_c ring slots for
count passes.

How it stays cheap and CUDA-graph safe
--------------------------------------
* Per MoE layer, inside the forward (``select_experts``, AFTER hook): one ``copy_`` of the router's
  ``[n, K]`` ids into a fixed staging buffer ``stage_ids[H, M, K]`` int16 at row ``layer``. The
  address is fixed, so a CUDA graph that captures this copy replays it correctly; no host sync, no
  allocation (the int32 -> int16 cast happens inside the copy kernel). Passes with more than M
  rows (prefill) add into ``stage_counts[H, P]`` instead (a few kernels, eager only in practice).
* Per pass, after the forward returns (``ModelRunner.forward``, AROUND hook; outside any graph):
  one ``index_select(out=ring[slot])`` of the MoE rows of the stage into the device ring
  ``ring_ids[C, L, M, K]`` at ``slot = pos % C``. The host knows ``pos`` (it counts passes), so no
  device-side counter is needed: graphs only ever write the stage. Mode, token count and rank are
  host facts, kept in a host list beside the slot.
* A background thread drains the ring every ``flush_steps`` passes (or ``flush_seconds``): it waits
  on a CUDA event recorded after the copies (on a side stream; only this thread blocks), copies the
  slots to a pinned host buffer, frees the slots and appends a chunk to the current shard through
  ``ShardWriter``, rotating shards at ``shard_bytes``.
* Bounded: GPU memory is the stage plus the rings; host memory is one pinned batch plus a queue of
  at most ``C / flush_steps`` batches. When the ring is full (disk slow, thread behind) the pass is
  dropped and counted (``dropped_steps``); the forward never waits. Write errors (ENOSPC included)
  drop the chunk, count it and back off; they never reach the server.
* Shards are ``{MOEPLACE_TRACE_DIR}/{prefix}-r{rank:03d}-{seq:05d}.mptrace`` (``.part`` while written);
  a new one starts every ``MOEPLACE_TRACE_SHARD_MB`` (256) or when the physical-to-logical map
  changes. ``moeplace trace merge DIR -o OUT`` joins the ranks' shards. The first process to read the
  configuration (SGLang's launcher) fixes the prefix in ``MOEPLACE_TRACE_PREFIX``, so every process it
  starts writes under the same one.
* Durable: the drain thread wakes every ``poll_seconds`` and writes passes that waited longer than
  ``flush_seconds`` even when no new pass comes, so a hard kill (SIGKILL, out of memory) loses at most
  the last seconds; the whole chunks of a ``.part`` it leaves are read (with a warning).
* Clean stops: SGLang ends its scheduler processes with SIGKILL (``kill_process_tree``), so nothing in
  them runs at exit. A BEFORE hook on ``kill_process_tree`` in the launcher first asks every rank's
  tracer to finish (a ``.{prefix}.stop`` file in the trace folder, seen by the drain threads within
  ``poll_seconds``); each writes what it holds, renames its shard and removes its
  ``.{prefix}-r{rank}.live`` file; the launcher waits for those (at most ``STOP_WAIT_SECONDS``), then
  SGLang kills. SIGTERM and SIGINT of the server both end there. ``close()`` (atexit) does the same
  for a process that exits by itself.

Known limits: two-batch overlap runs the router twice per pass (the second micro-batch overwrites
the first's rows); under CUDA-graph replay the token count is the batch's (``input_ids``), padded
rows hold -1 (SGLang masks them).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import STEP_ARRAYS, RoutingSteps
from moeplace.trace.store import ShardWriter, TraceHeader
from moeplace.trace.window import PassWindow, logical_ids

logger = logging.getLogger("moeplace.tracer")

DEFAULT_DIR = "moeplace-traces"
LAUNCHER_ENV = "MOEPLACE_TRACE_LAUNCHER_PID"  # the process whose children write the shards


@dataclass
class TracerConfig:
    """Sizes and places; ``from_env`` reads the ``MOEPLACE_TRACE_*`` variables."""

    out_dir: Path
    max_tokens: int = 128  # M: passes with more router rows are kept as counts
    capacity: int = 256  # C ring slots (passes); count passes get max(8, C // 16)
    flush_steps: int = 64  # passes per drained batch
    flush_seconds: float = 2.0
    shard_bytes: int = 256 << 20
    prefix: str = "trace"
    poll_seconds: float = 0.5  # the drain thread's wake-up: idle flushes and stop requests
    write_shards: bool = True  # False: the passes only feed the window (online re-placement without MOEPLACE_TRACE)
    window: int = 0            # passes of decode and verify the host keeps for online re-placement (0: none)

    @property
    def stop_file(self) -> Path:
        """Written by the launcher before SGLang kills the ranks: finish your shards now."""
        return self.out_dir / f".{self.prefix}.stop"

    def live_file(self, rank: int) -> Path:
        """Present while rank ``rank``'s tracer may still write (removed once its shard is whole)."""
        return self.out_dir / f".{self.prefix}-r{rank:03d}.live"

    @classmethod
    def from_env(cls) -> "TracerConfig":
        """The ``MOEPLACE_TRACE_*`` variables; ValueError names a bad one. Fixes the prefix for child processes."""
        env = os.environ
        out = env.get("MOEPLACE_TRACE_DIR") or DEFAULT_DIR
        prefix = env.get("MOEPLACE_TRACE_PREFIX") or f"trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if not prefix.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"MOEPLACE_TRACE_PREFIX must be letters, digits, '-', '_' or '.', got {prefix!r}")
        env["MOEPLACE_TRACE_PREFIX"] = prefix  # the processes this one starts share it
        env.setdefault(LAUNCHER_ENV, str(os.getpid()))  # ... and know who started them
        cfg = cls(Path(out),
                  max_tokens=env_number("MOEPLACE_TRACE_MAX_TOKENS", 128, int),
                  capacity=env_number("MOEPLACE_TRACE_SLOTS", 256, int),
                  flush_steps=env_number("MOEPLACE_TRACE_FLUSH_STEPS", 64, int),
                  flush_seconds=env_number("MOEPLACE_TRACE_FLUSH_SECONDS", 2.0, float),
                  shard_bytes=int(env_number("MOEPLACE_TRACE_SHARD_MB", 256, float) * (1 << 20)),
                  prefix=prefix)
        cfg.flush_steps = max(1, min(cfg.flush_steps, cfg.capacity // 2))
        cfg.poll_seconds = min(cfg.poll_seconds, cfg.flush_seconds)
        return cfg


# The tracer's numeric settings: variable -> (default, type).
NUMBER_SETTINGS = {"MOEPLACE_TRACE_MAX_TOKENS": (128, int), "MOEPLACE_TRACE_SLOTS": (256, int),
                   "MOEPLACE_TRACE_FLUSH_STEPS": (64, int), "MOEPLACE_TRACE_FLUSH_SECONDS": (2.0, float),
                   "MOEPLACE_TRACE_SHARD_MB": (256, float)}
# Past these a buffer would not fit any GPU, or a wait outlast any run (and overflow a platform timeout).
MAX_SETTING = {"MOEPLACE_TRACE_MAX_TOKENS": 1 << 20, "MOEPLACE_TRACE_SLOTS": 1 << 20,
               "MOEPLACE_TRACE_FLUSH_STEPS": 1 << 20, "MOEPLACE_TRACE_FLUSH_SECONDS": 86400.0,
               "MOEPLACE_TRACE_SHARD_MB": float(1 << 20)}


def check_env(env: Mapping[str, str]) -> None:
    """Every ``MOEPLACE_TRACE_*`` number in ``env``, then the folder; ValueError names the first bad one and what
    it takes."""
    for name, (default, kind) in NUMBER_SETTINGS.items():
        env_number(name, default, kind, env)
    check_trace_dir(env)


def check_trace_dir(env: Mapping[str, str]) -> None:
    """``MOEPLACE_TRACE_DIR`` (default DEFAULT_DIR) must be a folder the tracer can write (``check_writable``), so
    that a tracer that cannot write stops the server at start rather than at its first shard."""
    check_writable("MOEPLACE_TRACE_DIR", env.get("MOEPLACE_TRACE_DIR") or DEFAULT_DIR)


def check_writable(variable: str, raw: str) -> None:
    """``raw`` must be a folder this process can write, or one it can make in the nearest folder above that exists:
    a file is written there and removed (nothing else is made). ValueError names ``variable`` and says why not."""
    out = Path(raw).absolute()
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"{variable}={raw!r}: {existing} is a file, not a folder")
    try:
        handle, probe = tempfile.mkstemp(prefix=".moeplace-write-check-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{variable}={raw!r}: cannot write in {existing} ({e.strerror or e})") from None


def env_number(name: str, default: float, kind: type, env: Mapping[str, str] | None = None,
               top: float | None = None, from_zero: bool = False) -> Any:
    """A positive number (from 0 with ``from_zero``) from the environment, at most ``top`` (default MAX_SETTING[name]);
    ValueError names the variable and what it takes."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    top = MAX_SETTING.get(name, float("inf")) if top is None else top
    if value is None or not (0 <= value if from_zero else 0 < value) or not value <= top or value == float("inf"):
        what = "a number from 0" if from_zero else f"a positive {'integer' if kind is int else 'number'}"
        raise ValueError(f"{name} must be {what}"
                         + (f" up to {top if kind is float else int(top):,}" if top < float("inf") else "") + f", got {raw!r}")
    return value


@dataclass
class Layout:
    """What the tracer learns from the server once its model is loaded.

    physical_to_logical_map: [H, P] when router ids are physical (EP remapping on), else None.
    """

    model_name: str
    num_hidden_layers: int
    num_experts: int
    num_slots: int
    physical_to_logical_map: Any = None
    ep_size: int = 1
    tp_size: int = 1
    nodes: int = 1
    rank: int = 0
    attn_dp_size: int | None = None  # data-parallel attention groups (1: every rank routes the same tokens)
    attn_dp_rank: int | None = None


class RoutingTracer:
    """Records router top-k ids into a device ring and drains it to shards (see module docstring).

    ``describe()`` returns the Layout; it is called once, at the first router call.
    """

    def __init__(self, config: TracerConfig, describe: Callable[[], Layout]) -> None:
        self.config = config
        self._describe = describe
        self.layout: Layout | None = None
        self.dropped_steps = 0
        self.written_steps = 0
        self.write_errors = 0
        self.truncated_steps = 0
        self.shards: list[Path] = []
        self._ready = False
        self._moe_layers: tuple[int, ...] | None = None
        self._seen: set[int] = set()
        self._rows = -1  # router rows of this pass seen by an eager hook call; -1 = none (graph replay)
        self._count_pass = False
        self._pos = 0  # passes put in the ring
        self._cpos = 0  # count passes put in the count ring
        self._released = 0  # ring slots freed by the drain thread
        self._creleased = 0
        self._pending: list[tuple] = []  # (kind, slot, mode, num_tokens, rows, map version) not yet handed over
        self._maps: list[Any] = [None]  # the maps passes ran under, by version: [H, P] numpy (None: logical ids)
        self._pass_version = -1  # the version the pass in progress runs under (-1: not noted, the latest)
        self.live_map: Callable[[], Any] = _live_physical_to_logical_map   # the map in force now ([H, P])
        self.window: PassWindow | None = None
        self.listeners: list[Callable[[Any], None]] = []   # called with the model runner after every pass
        self._last_flush = time.monotonic()
        self._queue: queue.Queue = queue.Queue(maxsize=max(2, config.capacity // config.flush_steps))
        self._thread: threading.Thread | None = None
        self._writer: ShardWriter | None = None
        self._writer_version = -1
        self._shard_seq = 0
        self._backoff_until = 0.0
        self._closed = False
        self._stopping = False  # set once the shard is being finished: later passes are not kept
        self._event: Any = None  # recorded after each pass's ring copy (the drain waits on it)
        self._lock = threading.RLock()

    # ------------------------------------------------------------ forward-side (hot path)

    def on_router(self, layer: int, topk_ids: Any) -> None:
        """Inside the forward, once per MoE layer. topk_ids: [n, K] routed ids (physical under EP)."""
        if not self._ready and not self._setup(topk_ids):
            return
        if layer >= self.layout.num_hidden_layers:
            return  # a draft/MTP layer past the target's layers
        n, k = topk_ids.shape[0], min(topk_ids.shape[1], self._k)
        self._seen.add(layer)
        self._rows = n
        if n <= self.config.max_tokens:
            self.stage_ids[layer, :n, :k].copy_(topk_ids[:, :k])
        else:
            self._count_pass = True
            flat = topk_ids[:, :k].reshape(-1).long()
            valid = flat >= 0
            self.stage_counts[layer].index_add_(0, flat.clamp(min=0), valid.int())

    def begin_pass(self) -> None:
        """Before the forward (outside any graph): note the map the pass runs under. A re-placement (SGLang's
        rebalancer or moeplace's) changes the map between passes, at the end of ``ModelRunner.forward``, so the map
        read here, not at ``end_pass``, is the one the pass's router ids were remapped with."""
        if not self._ready or self._maps[0] is None:
            return
        live = self.live_map()
        if live is not None and not np.array_equal(live, self._maps[-1]):
            self._maps.append(np.array(live, copy=True))
        self._pass_version = len(self._maps) - 1

    def end_pass(self, mode: int, batch_tokens: int) -> None:
        """After the forward returns (outside any CUDA graph). batch_tokens: tokens of the batch."""
        if not self._ready or self._stopping:
            return
        torch = self._torch
        rows, self._rows = self._rows, -1
        count_pass, self._count_pass = self._count_pass, False
        version, self._pass_version = self._pass_version, -1
        if version < 0:
            version = len(self._maps) - 1
        if self._moe_layers is None:
            if not self._seen:
                return
            self._lock_layers()
        n = rows if rows >= 0 else batch_tokens
        if count_pass:
            if self._cpos - self._creleased >= self._ccap:
                self.dropped_steps += 1
                self.stage_counts.zero_()
                return
            slot = self._cpos % self._ccap
            torch.index_select(self.stage_counts, 0, self._moe_idx, out=self.ring_counts[slot])
            self.stage_counts.zero_()
            self._cpos += 1
            entry = ("c", slot, mode, n, 0, version)
        else:
            if self._pos - self._released >= self.config.capacity:
                self.dropped_steps += 1  # ring full: the drain is behind; never wait
                return
            slot = self._pos % self.config.capacity
            torch.index_select(self.stage_ids, 0, self._moe_idx, out=self.ring_ids[slot])
            self._pos += 1
            kept = min(n, self.config.max_tokens)
            self.truncated_steps += kept < n
            entry = ("t", slot, mode, n, kept, version)
        if self._event is not None:
            self._event.record()  # on the forward's stream, after this pass's copies
        with self._lock:
            self._pending.append(entry)
        if len(self._pending) >= self.config.flush_steps or \
                time.monotonic() - self._last_flush > self.config.flush_seconds:
            self._hand_over()

    # ------------------------------------------------------------ setup

    def _setup(self, sample: Any) -> bool:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # never allocate the persistent buffers inside a graph's private pool
        self._torch = torch
        self.layout = self._describe()
        if self.layout.physical_to_logical_map is not None:
            self._maps = [np.array(self.layout.physical_to_logical_map, copy=True)]
        H, M = self.layout.num_hidden_layers, self.config.max_tokens
        self._k = int(sample.shape[1])
        self.device = sample.device
        # -1 = no expert: rows past a pass's tokens stay -1 after the first use only if the router wrote
        # -1 there; readers keep only the pass's own rows, so stale rows are never read.
        self.stage_ids = torch.full((H, M, self._k), -1, dtype=torch.int16, device=self.device)
        self.stage_counts = torch.zeros((H, self.layout.num_slots), dtype=torch.int32, device=self.device)
        self._ccap = max(8, self.config.capacity // 16)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._event = torch.cuda.Event() if self._side is not None else None
        if self.config.write_shards:
            self._mark_live()
        self._thread = threading.Thread(target=self._drain_loop, name="moeplace-tracer", daemon=True)
        self._thread.start()
        self._ready = True
        return True

    def _lock_layers(self) -> None:
        torch = self._torch
        self._moe_layers = tuple(sorted(self._seen))
        L, C, M = len(self._moe_layers), self.config.capacity, self.config.max_tokens
        self._moe_idx = torch.tensor(self._moe_layers, dtype=torch.long, device=self.device)
        self.ring_ids = torch.full((C, L, M, self._k), -1, dtype=torch.int16, device=self.device)
        self.ring_counts = torch.zeros((self._ccap, L, self.layout.num_slots), dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._host_ids = torch.empty((self.config.flush_steps, L, M, self._k), dtype=torch.int16, pin_memory=pin)
        self._host_counts = torch.empty((self._ccap, L, self.layout.num_slots), dtype=torch.int32, pin_memory=pin)
        if self.config.window:
            self.window = PassWindow(self.model_spec(), self.config.window)

    # ------------------------------------------------------------ hand-over and drain

    def _hand_over(self) -> None:
        """Give the pending passes to the drain thread (forward side: never waits)."""
        with self._lock:  # take and queue in one step: the drain thread sees batches in pass order
            batch, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if not batch:
                return
            try:
                self._queue.put_nowait(batch)
                return
            except queue.Full:
                pass
        # The writer is behind: drop these passes rather than wait.
        self.dropped_steps += len(batch)
        self._release(batch)

    def _take_all(self) -> tuple[list[list[tuple]], bool]:
        """Every queued batch, then the passes still pending, in pass order (drain thread);
        and whether ``close`` asked to stop."""
        batches, closing = [], False
        with self._lock:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                closing |= item is None
                if item:
                    batches.append(item)
            if self._pending:
                batches.append(self._pending)
                self._pending = []
            self._last_flush = time.monotonic()
        return batches, closing

    def _release(self, batch: list[tuple]) -> None:
        with self._lock:
            self._released += sum(1 for b in batch if b[0] == "t")
            self._creleased += sum(1 for b in batch if b[0] == "c")

    def _drain_loop(self) -> None:
        """Write handed-over batches; on every wake also the passes an idle server left waiting; finish
        the shard when the launcher asks (its stop file) or ``close`` does (None in the queue)."""
        cfg = self.config
        while True:
            try:
                item = self._queue.get(timeout=cfg.poll_seconds)
            except queue.Empty:
                item = []
            stop = item is None or cfg.stop_file.exists()
            if item:
                self._drain(item)
            if stop:
                self._stopping = True  # the forward side keeps no more passes
            if stop or time.monotonic() - self._last_flush > cfg.flush_seconds:
                batches, closing = self._take_all()
                for batch in batches:
                    self._drain(batch)
                stop |= closing
            if stop:
                self._close_writer()
                self._unmark_live()
                return

    def _drain(self, batch: list[tuple]) -> None:
        try:
            arrays = self._fetch(batch, self._event)
        except Exception:  # a tracer bug must never take the server down
            logger.exception("moeplace tracer: could not read the ring; %d passes dropped", len(batch))
            self.dropped_steps += len(batch)
            self._release(batch)
            return
        self._release(batch)
        if self.window is not None:
            self._feed_window(arrays)
        if self.config.write_shards:
            self._write(arrays, len(batch))

    def _fetch(self, batch: list[tuple], event: Any) -> dict[str, np.ndarray]:
        """Copy the batch's ring slots to host and build one chunk's arrays (ids physical or logical)."""
        torch = self._torch
        t_slots = [b[1] for b in batch if b[0] == "t"]
        c_slots = [b[1] for b in batch if b[0] == "c"]
        if self._side is not None:
            with torch.cuda.stream(self._side):
                self._side.wait_event(event)
                host_ids = self._copy_slots(self.ring_ids, t_slots, self._host_ids)
                host_counts = self._copy_slots(self.ring_counts, c_slots, self._host_counts)
                self._side.synchronize()  # only this thread waits
        else:
            host_ids = self._copy_slots(self.ring_ids, t_slots, self._host_ids)
            host_counts = self._copy_slots(self.ring_counts, c_slots, self._host_counts)
        ids = host_ids.numpy()  # [t, L, M, K]
        counts = host_counts.numpy().astype(np.float64)  # [c, L, P]
        L = len(self._moe_layers)
        modes = np.array([b[2] for b in batch], np.uint8)
        num_tokens = np.array([b[3] for b in batch], np.int32)
        rows = np.array([b[4] for b in batch], np.int64)
        offsets = np.zeros(len(batch) + 1, np.int64)
        np.cumsum(rows, out=offsets[1:])
        parts = [ids[i, :, :r, :].transpose(1, 0, 2) for i, r in enumerate(rows[[b[0] == "t" for b in batch]])]
        topk = np.concatenate(parts) if parts else np.zeros((0, L, self._k), np.int16)
        return dict(modes=modes, num_tokens=num_tokens, versions=np.array([b[5] for b in batch], np.int64),
                    ranks=np.full(len(batch), self.layout.rank, np.int16), token_offsets=offsets,
                    topk_ids=topk.astype(np.int16),
                    count_steps=np.array([i for i, b in enumerate(batch) if b[0] == "c"], np.int64),
                    counts=counts)

    @staticmethod
    def _copy_slots(ring: Any, slots: list[int], host: Any) -> Any:
        """ring[slots] -> host[:len(slots)] in at most two contiguous copies (the ring may wrap)."""
        out = host[:len(slots)]
        if not slots:
            return out
        start, n, C = slots[0], len(slots), ring.shape[0]
        first = min(n, C - start)
        out[:first].copy_(ring[start:start + first], non_blocking=True)
        if first < n:
            out[first:].copy_(ring[:n - first], non_blocking=True)
        return out

    # ------------------------------------------------------------ shards

    def model_spec(self) -> ModelSpec:
        """The served model as traces name it (known once the MoE layers were seen)."""
        lay = self.layout
        return ModelSpec(lay.model_name, lay.num_hidden_layers, self._moe_layers, lay.num_experts, self._k)

    def _feed_window(self, arrays: dict[str, np.ndarray]) -> None:
        """Hand the batch's token-row passes to the window, in logical ids (each through the map it ran under)."""
        token = np.ones(arrays["modes"].shape[0], bool)
        token[arrays["count_steps"]] = False
        rows = np.diff(arrays["token_offsets"])[token]
        ids = arrays["topk_ids"]
        if self._maps[0] is not None and ids.size:
            moe = list(self._moe_layers)
            row_version = np.repeat(arrays["versions"][token], rows)
            logical = np.empty_like(ids)
            for version in np.unique(row_version):
                mine = row_version == version
                logical[mine] = logical_ids(ids[mine], self._maps[version][moe])
            ids = logical
        self.window.add(ids, rows, arrays["modes"][token], arrays["num_tokens"][token])

    def _header(self, p2l: Any) -> TraceHeader:
        lay = self.layout
        model = self.model_spec()
        physical = p2l is not None
        return TraceHeader(
            model=model, source="moeplace-tracer", id_space="physical" if physical else "logical",
            physical_to_logical_map=np.asarray(p2l)[list(self._moe_layers)].tolist() if physical else None,
            ep_size=lay.ep_size, tp_size=lay.tp_size, nodes=lay.nodes, ranks=[lay.rank],
            attn_dp_size=lay.attn_dp_size, attn_dp_rank=lay.attn_dp_rank,
            notes=f"live capture; passes with more than {self.config.max_tokens} router rows kept as counts")

    def _write(self, arrays: dict[str, np.ndarray], n: int) -> None:
        now = time.monotonic()
        if now < self._backoff_until:
            self.dropped_steps += n
            return
        try:
            # counts are [S_c, L, P] where ids are physical: slices of them are all the shard needs
            steps = RoutingSteps(self.model_spec(), *(arrays[name] for name in STEP_ARRAYS))
            for run in _runs(arrays["versions"]):   # passes under one map each: a new map starts a new shard
                part = steps.slice(int(run[0]), int(run[-1]) + 1)
                version = int(arrays["versions"][run[0]])   # a version is a map other than the one before it
                if self._writer is not None and (self._writer.bytes_written >= self.config.shard_bytes
                                                 or version != self._writer_version):
                    self._close_writer()
                if self._writer is None:
                    name = f"{self.config.prefix}-r{self.layout.rank:03d}-{self._shard_seq:05d}"
                    self._shard_seq += 1
                    self._writer = ShardWriter(self.config.out_dir / name, self._header(self._maps[version]))
                    self._writer_version = version
                self._writer.append_arrays({name: getattr(part, name) for name in STEP_ARRAYS})
                self.written_steps += run.size
        except OSError as e:  # ENOSPC, EIO, a removed folder: drop, count, back off; never raise
            self.write_errors += 1
            self.dropped_steps += n
            self._backoff_until = now + 5.0
            logger.warning("moeplace tracer: write failed (%s); %d passes dropped", e, n)
            self._close_writer()

    def _close_writer(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            self.shards.append(writer.close())
        except OSError as e:
            # Keep the .part: its whole chunks are readable, a cut tail is detected by the reader.
            logger.warning("moeplace tracer: could not finish shard %s (%s)", writer.partial_path, e)
            try:
                writer._file.close()
            except Exception:
                pass
            writer._file = None

    def close(self, timeout: float = 30.0) -> None:
        """Drain what is left and finish the shard (atexit; idempotent)."""
        if self._closed or not self._ready:
            self._closed = True
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)  # the drain thread takes what is pending, finishes the shard and ends
            self._thread.join(timeout)
        else:
            self._close_writer()
            self._unmark_live()
        if self.dropped_steps:
            logger.warning("moeplace tracer: %d passes dropped (ring full or disk errors)", self.dropped_steps)

    def _mark_live(self) -> None:
        try:
            self.config.out_dir.mkdir(parents=True, exist_ok=True)
            self.config.live_file(self.layout.rank).touch()
        except OSError as e:  # the shards will fail too, and be counted; never raise into the server
            logger.warning("moeplace tracer: cannot write to %s (%s)", self.config.out_dir, e)

    def _unmark_live(self) -> None:
        try:
            self.config.live_file(self.layout.rank).unlink(missing_ok=True)
        except OSError:
            pass


STOP_WAIT_SECONDS = 20.0


def finish_shards(config: TracerConfig, wait: float = STOP_WAIT_SECONDS) -> list[str]:
    """Ask every rank's tracer under ``config``'s prefix to finish its shard; wait until all have.

    Returns the live files still present when ``wait`` ran out (ranks whose ``.part`` stays).
    """
    live = lambda: sorted(p.name for p in config.out_dir.glob(f".{config.prefix}-r*.live"))  # noqa: E731
    if not live():
        return []
    try:
        config.stop_file.touch()
    except OSError as e:
        logger.warning("moeplace tracer: cannot ask the ranks to finish their shards (%s)", e)
        return live()
    deadline = time.monotonic() + wait
    try:
        while live() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        left = live()
        config.stop_file.unlink(missing_ok=True)
    if left:
        logger.warning("moeplace tracer: %d rank(s) did not finish their shards within %.0f s: %s",
                       len(left), wait, ", ".join(left))
    return left


def _runs(versions: np.ndarray) -> list[np.ndarray]:
    """Indices of the runs of equal values in ``versions [n]``, in order."""
    cuts = np.flatnonzero(np.diff(versions)) + 1
    return np.split(np.arange(versions.shape[0]), cuts)


# ------------------------------------------------------------------ SGLang glue

_TRACER: RoutingTracer | None = None


def _live_physical_to_logical_map() -> Any:
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        meta = get_global_expert_location_metadata()
        return None if meta is None else meta.physical_to_logical_map_cpu.numpy()
    except Exception:  # noqa: BLE001 (no SGLang context: nothing to follow)
        return None


def describe_sglang(num_experts_hint: int | None = None) -> Layout:
    """Layout of the running SGLang process: model, layers, experts, map in force, ranks."""
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    name = str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "unknown"))
    tp, ep, nodes = int(getattr(args, "tp_size", 1)), int(getattr(args, "ep_size", 1)), int(getattr(args, "nnodes", 1))
    rank = 0
    try:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        pass
    dp_size, dp_rank = _attention_dp()
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.layers.moe.topk import is_expert_remapping_enabled

    meta = get_global_expert_location_metadata()
    if meta is not None:
        p2l = meta.physical_to_logical_map_cpu.numpy() if is_expert_remapping_enabled() else None
        return Layout(name, meta.num_layers, meta.num_logical_experts, meta.num_physical_experts, p2l,
                      ep, tp, nodes, rank, dp_size, dp_rank)
    from sglang.srt.runtime_context import process_model_config

    layers = int(getattr(process_model_config().hf_text_config, "num_hidden_layers", 0) or 0)
    E = int(num_experts_hint or 0)
    return Layout(name, layers, E, E, None, ep, tp, nodes, rank, dp_size, dp_rank)


def _attention_dp() -> tuple[int | None, int | None]:
    """(attention DP groups, this rank's group) from SGLang's parallel context; None where unknown.

    Ranks of one attention DP group route the same tokens (their attention is tensor-parallel), so
    ``trace merge`` keeps one rank per group.
    """
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return int(par.attn_dp_size), int(par.attn_dp_rank)
    except Exception:  # noqa: BLE001 (an older or partly set-up context)
        return None, None


def after_select_experts(result: Any, hidden_states: Any = None, router_logits: Any = None,
                         topk_config: Any = None, *args: Any, layer_id: int | None = None, **kwargs: Any) -> None:
    """AFTER hook on ``sglang.srt.layers.moe.topk.select_experts``: hand the routed ids to the tracer."""
    tracer = _TRACER
    if tracer is None or layer_id is None or topk_config is None:
        return None
    if not getattr(topk_config, "allow_routed_experts_capture", True):
        return None  # draft-model MoE blocks
    ids = result.topk_ids
    routed = topk_config.top_k - topk_config.num_shared_topk_slots
    if not tracer._ready:
        tracer._num_experts_hint = int(router_logits.shape[-1]) if router_logits is not None else None
    tracer.on_router(int(layer_id), ids[:, :routed] if ids.shape[1] > routed else ids)
    return None


def around_model_runner_forward(original: Callable, runner: Any, forward_batch: Any, *args: Any,
                                **kwargs: Any) -> Any:
    """AROUND hook on ``ModelRunner.forward``: close the pass in the ring once the forward returns."""
    tracer = _TRACER
    if tracer is None or getattr(runner, "is_draft_worker", False):
        return original(runner, forward_batch, *args, **kwargs)
    tracer._rows, tracer._count_pass = -1, False
    try:
        tracer.begin_pass()
    except Exception:  # never let tracing break serving
        logger.exception("moeplace tracer: start of pass failed")
    output = original(runner, forward_batch, *args, **kwargs)
    try:
        ids = getattr(forward_batch, "input_ids", None)
        tracer.end_pass(int(forward_batch.forward_mode), int(ids.shape[0]) if ids is not None else 0)
    except Exception:  # never let tracing break serving
        logger.exception("moeplace tracer: end of pass failed")
    for listener in tracer.listeners:   # online re-placement: between passes, on the scheduler's thread
        try:
            listener(runner)
        except Exception:  # noqa: BLE001 (never let it break serving)
            logger.exception("moeplace: after-pass work failed")
    return output


def before_kill_process_tree(parent_pid: int | None = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on SGLang's ``kill_process_tree`` in the launcher: let the ranks finish their shards.

    SGLang SIGKILLs the scheduler processes on every stop (SIGTERM, SIGINT, a failed start); their
    tracers finish first (``finish_shards``). Only in the process that started them (the launcher,
    named by ``MOEPLACE_TRACE_LAUNCHER_PID``) and only when it kills its own children.
    """
    tracer = _TRACER
    if tracer is None or parent_pid not in (None, os.getpid()) or \
            os.environ.get(LAUNCHER_ENV) != str(os.getpid()):
        return None
    try:
        finish_shards(tracer.config)
    except Exception:  # never stand in the way of a shutdown
        logger.exception("moeplace tracer: finishing the ranks' shards failed")
    return None


SELECT_EXPERTS = "sglang.srt.layers.moe.topk.select_experts"
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
KILL_PROCESS_TREE = "sglang.srt.utils.common.kill_process_tree"


def install(config: TracerConfig | None = None,
            describe: Callable[[], Layout] | None = None) -> RoutingTracer:
    """Register the tracer's hooks with SGLang's HookRegistry (applied by ``load_plugins``).

    describe: the Layout source (default: read from the running SGLang process).
    """
    global _TRACER
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _TRACER is not None:
        return _TRACER
    config = config or TracerConfig.from_env()
    tracer = RoutingTracer(config, describe or (lambda: describe_sglang(getattr(tracer, "_num_experts_hint", None))))
    _TRACER = tracer
    HookRegistry.register(SELECT_EXPERTS, after_select_experts, HookType.AFTER)
    HookRegistry.register(MODEL_RUNNER_FORWARD, around_model_runner_forward, HookType.AROUND)
    HookRegistry.register(KILL_PROCESS_TREE, before_kill_process_tree, HookType.BEFORE)
    atexit.register(tracer.close)
    logger.info("moeplace tracer: recording router top-k ids to %s", config.out_dir)
    return tracer


def uninstall() -> None:
    """Stop tracing in this process (tests): finishes the shard; the hooks become no-ops."""
    global _TRACER
    tracer, _TRACER = _TRACER, None
    if tracer is not None:
        tracer.close()
