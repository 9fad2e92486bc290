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
  changes. ``moeplace trace merge DIR -o OUT`` joins the ranks' shards.
* ``close()`` (atexit) drains what is left and renames the shard; a shard cut by a crash stays as
  ``*.mptrace.part``, whose cut chunk the reader detects and skips.

Known limits: two-batch overlap runs the router twice per pass (the second micro-batch overwrites
the first's rows); under CUDA-graph replay the token count is the batch's (``input_ids``), padded
rows hold -1 (SGLang masks them).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moeplace.model import ModelSpec
from moeplace.trace.store import ShardWriter, TraceHeader

logger = logging.getLogger("moeplace.tracer")

DEFAULT_DIR = "moeplace-traces"


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

    @classmethod
    def from_env(cls) -> "TracerConfig":
        env = os.environ
        out = env.get("MOEPLACE_TRACE_DIR") or DEFAULT_DIR
        cfg = cls(Path(out),
                  max_tokens=int(env.get("MOEPLACE_TRACE_MAX_TOKENS", 128)),
                  capacity=int(env.get("MOEPLACE_TRACE_SLOTS", 256)),
                  flush_steps=int(env.get("MOEPLACE_TRACE_FLUSH_STEPS", 64)),
                  shard_bytes=int(float(env.get("MOEPLACE_TRACE_SHARD_MB", 256)) * (1 << 20)),
                  prefix=env.get("MOEPLACE_TRACE_PREFIX", f"trace-{time.strftime('%Y%m%d-%H%M%S')}"))
        cfg.flush_steps = max(1, min(cfg.flush_steps, cfg.capacity // 2))
        return cfg


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
        self._pending: list[tuple] = []  # (kind, slot, mode, num_tokens, rows) not yet handed to the thread
        self._last_flush = time.monotonic()
        self._queue: queue.Queue = queue.Queue(maxsize=max(2, config.capacity // config.flush_steps))
        self._thread: threading.Thread | None = None
        self._writer: ShardWriter | None = None
        self._writer_p2l: Any = None
        self._shard_seq = 0
        self._backoff_until = 0.0
        self._closed = False
        self._lock = threading.Lock()

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

    def end_pass(self, mode: int, batch_tokens: int) -> None:
        """After the forward returns (outside any CUDA graph). batch_tokens: tokens of the batch."""
        if not self._ready:
            return
        torch = self._torch
        rows, self._rows = self._rows, -1
        count_pass, self._count_pass = self._count_pass, False
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
            self._pending.append(("c", slot, mode, n, 0))
        else:
            if self._pos - self._released >= self.config.capacity:
                self.dropped_steps += 1  # ring full: the drain is behind; never wait
                return
            slot = self._pos % self.config.capacity
            torch.index_select(self.stage_ids, 0, self._moe_idx, out=self.ring_ids[slot])
            self._pos += 1
            kept = min(n, self.config.max_tokens)
            self.truncated_steps += kept < n
            self._pending.append(("t", slot, mode, n, kept))
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
        H, M = self.layout.num_hidden_layers, self.config.max_tokens
        self._k = int(sample.shape[1])
        self.device = sample.device
        # -1 = no expert: rows past a pass's tokens stay -1 after the first use only if the router wrote
        # -1 there; readers keep only the pass's own rows, so stale rows are never read.
        self.stage_ids = torch.full((H, M, self._k), -1, dtype=torch.int16, device=self.device)
        self.stage_counts = torch.zeros((H, self.layout.num_slots), dtype=torch.int32, device=self.device)
        self._ccap = max(8, self.config.capacity // 16)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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

    # ------------------------------------------------------------ hand-over and drain

    def _hand_over(self) -> None:
        """Give the pending passes to the drain thread with an event marking their copies done."""
        if not self._pending:
            return
        event = None
        if self.device.type == "cuda":
            event = self._torch.cuda.Event()
            event.record()  # on the forward's current stream, after the ring copies
        batch, self._pending = self._pending, []
        self._last_flush = time.monotonic()
        try:
            self._queue.put_nowait((batch, event))
        except queue.Full:
            # The writer is behind: drop these passes rather than wait.
            self.dropped_steps += len(batch)
            self._release(batch)

    def _release(self, batch: list[tuple]) -> None:
        with self._lock:
            self._released += sum(1 for b in batch if b[0] == "t")
            self._creleased += sum(1 for b in batch if b[0] == "c")

    def _drain_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, event = item
            try:
                arrays = self._fetch(batch, event)
            except Exception:  # a tracer bug must never take the server down
                logger.exception("moeplace tracer: could not read the ring; %d passes dropped", len(batch))
                self.dropped_steps += len(batch)
                self._release(batch)
                continue
            self._release(batch)
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
        return dict(modes=modes, num_tokens=num_tokens,
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

    def _header(self, p2l: Any) -> TraceHeader:
        lay = self.layout
        model = ModelSpec(lay.model_name, lay.num_hidden_layers, self._moe_layers, lay.num_experts, self._k)
        physical = p2l is not None
        return TraceHeader(
            model=model, source="moeplace-tracer", id_space="physical" if physical else "logical",
            physical_to_logical_map=np.asarray(p2l)[list(self._moe_layers)].tolist() if physical else None,
            ep_size=lay.ep_size, tp_size=lay.tp_size, nodes=lay.nodes, ranks=[lay.rank],
            notes=f"live capture; passes with more than {self.config.max_tokens} router rows kept as counts")

    def _write(self, arrays: dict[str, np.ndarray], n: int) -> None:
        now = time.monotonic()
        if now < self._backoff_until:
            self.dropped_steps += n
            return
        try:
            p2l = self._current_p2l()
            if self._writer is not None and (self._writer.bytes_written >= self.config.shard_bytes
                                             or not _same_map(p2l, self._writer_p2l)):
                self._close_writer()
            if self._writer is None:
                name = f"{self.config.prefix}-r{self.layout.rank:03d}-{self._shard_seq:05d}"
                self._shard_seq += 1
                self._writer = ShardWriter(self.config.out_dir / name, self._header(p2l))
                self._writer_p2l = p2l
            self._writer.append_arrays(arrays)
            self.written_steps += n
        except OSError as e:  # ENOSPC, EIO, a removed folder: drop, count, back off; never raise
            self.write_errors += 1
            self.dropped_steps += n
            self._backoff_until = now + 5.0
            logger.warning("moeplace tracer: write failed (%s); %d passes dropped", e, n)
            self._close_writer()

    def _current_p2l(self) -> Any:
        """The map in force now (online EPLB may change it; a change starts a new shard)."""
        lay = self.layout
        if lay.physical_to_logical_map is None:
            return None
        fresh = _live_physical_to_logical_map()
        return fresh if fresh is not None else lay.physical_to_logical_map

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
        self._hand_over()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_writer()
        if self.dropped_steps:
            logger.warning("moeplace tracer: %d passes dropped (ring full or disk errors)", self.dropped_steps)


def _same_map(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a is b or np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ SGLang glue

_TRACER: RoutingTracer | None = None


def _live_physical_to_logical_map() -> Any:
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        meta = get_global_expert_location_metadata()
        return None if meta is None else meta.physical_to_logical_map_cpu.numpy()
    except Exception:
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
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.layers.moe.topk import is_expert_remapping_enabled

    meta = get_global_expert_location_metadata()
    if meta is not None:
        p2l = meta.physical_to_logical_map_cpu.numpy() if is_expert_remapping_enabled() else None
        return Layout(name, meta.num_layers, meta.num_logical_experts, meta.num_physical_experts, p2l,
                      ep, tp, nodes, rank)
    from sglang.srt.runtime_context import process_model_config

    layers = int(getattr(process_model_config().hf_text_config, "num_hidden_layers", 0) or 0)
    E = int(num_experts_hint or 0)
    return Layout(name, layers, E, E, None, ep, tp, nodes, rank)


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
    output = original(runner, forward_batch, *args, **kwargs)
    try:
        ids = getattr(forward_batch, "input_ids", None)
        tracer.end_pass(int(forward_batch.forward_mode), int(ids.shape[0]) if ids is not None else 0)
    except Exception:  # never let tracing break serving
        logger.exception("moeplace tracer: end of pass failed")
    return output


SELECT_EXPERTS = "sglang.srt.layers.moe.topk.select_experts"
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


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
    atexit.register(tracer.close)
    logger.info("moeplace tracer: recording router top-k ids to %s", config.out_dir)
    return tracer


def uninstall() -> None:
    """Stop tracing in this process (tests): finishes the shard; the hooks become no-ops."""
    global _TRACER
    tracer, _TRACER = _TRACER, None
    if tracer is not None:
        tracer.close()
