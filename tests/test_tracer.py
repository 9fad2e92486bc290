"""The live tracer's core on CPU tensors: ring, drain thread, shards, full disk, concurrent reads, crash.

Dimension letters: H hidden layers, L MoE layers, K top-k, P physical slots.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig  # noqa: E402
from moeplace.trace.store import UNFINISHED, ShardWriter, TraceReader  # noqa: E402

H, MOE, E, K = 6, (1, 2, 4), 16, 4


def _layout() -> Layout:
    return Layout("toy-moe", H, E, E)


def _run_passes(tracer: RoutingTracer, sizes: list[int], modes: list[int], seed: int = 0) -> list[np.ndarray]:
    """Feed passes through the tracer as the hooks would; returns each pass's ids [n, L, K]."""
    g = torch.Generator().manual_seed(seed)
    fed = []
    for n, mode in zip(sizes, modes):
        per_layer = []
        for layer in MOE:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).int()
            tracer.on_router(layer, ids)
            per_layer.append(ids.numpy())
        tracer.end_pass(mode, n)
        fed.append(np.stack(per_layer, axis=1))
    return fed


def _read_all(path: Path, include_partial: bool = True):
    reader = TraceReader(path, include_partial=include_partial)
    chunks = list(reader)
    return reader, chunks


def test_ids_and_counts_round_trip(tmp_path):
    cfg = TracerConfig(tmp_path, max_tokens=8, capacity=16, flush_steps=4, prefix="t")
    tracer = RoutingTracer(cfg, _layout)
    sizes = [3, 1, 8, 20, 2, 5, 7, 1, 1]  # 20 > max_tokens: kept as counts
    modes = [2, 2, 5, 1, 2, 5, 5, 2, 2]
    fed = _run_passes(tracer, sizes, modes)
    tracer.close()
    assert tracer.dropped_steps == 0 and tracer.written_steps == len(sizes)
    reader, chunks = _read_all(tmp_path)
    assert not reader.damaged
    assert reader.model.moe_layers == MOE and reader.model.top_k == K
    from moeplace.trace.steps import concat_steps

    steps = concat_steps(chunks)
    assert steps.modes.tolist() == modes and steps.num_tokens.tolist() == sizes
    count_step = sizes.index(20)
    assert steps.count_steps.tolist() == [count_step]
    for s, n in enumerate(sizes):
        if s == count_step:
            want = np.stack([np.bincount(fed[s][:, j].ravel(), minlength=E) for j in range(len(MOE))])
            np.testing.assert_array_equal(steps.counts[0], want)
        else:
            np.testing.assert_array_equal(steps.topk_ids[steps.token_offsets[s]:steps.token_offsets[s + 1]], fed[s])


def test_ring_full_drops_and_never_waits(tmp_path):
    cfg = TracerConfig(tmp_path, max_tokens=4, capacity=4, flush_steps=2, prefix="t")
    tracer = RoutingTracer(cfg, _layout)
    gate = threading.Event()
    original = tracer._write
    tracer._write = lambda arrays, n: (gate.wait(10), original(arrays, n))  # a disk that hangs
    _run_passes(tracer, [1] * 40, [2] * 40)
    assert tracer.dropped_steps > 0  # the forward side dropped instead of blocking
    gate.set()
    tracer.close()
    assert tracer.written_steps + tracer.dropped_steps == 40


def test_full_disk_is_counted_not_raised(tmp_path, monkeypatch):
    cfg = TracerConfig(tmp_path, max_tokens=4, capacity=16, flush_steps=2, prefix="t")
    tracer = RoutingTracer(cfg, _layout)
    calls = {"n": 0}
    real_append = ShardWriter.append_arrays

    def full_disk(self, arrays):
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, arrays)

    monkeypatch.setattr(ShardWriter, "append_arrays", full_disk)
    _run_passes(tracer, [2] * 4, [2] * 4)  # chunk 1 written, chunk 2 hits ENOSPC
    import time

    deadline = time.time() + 10
    while tracer.write_errors == 0 and time.time() < deadline:
        time.sleep(0.01)
    tracer._backoff_until = 0.0  # the disk has space again
    _run_passes(tracer, [2] * 4, [2] * 4, seed=1)
    tracer.close()
    assert tracer.write_errors >= 1 and tracer.dropped_steps >= 2
    assert tracer.written_steps + tracer.dropped_steps == 8
    reader, chunks = _read_all(tmp_path)
    assert sum(c.num_steps for c in chunks) == tracer.written_steps


def test_concurrent_readers_see_whole_chunks(tmp_path):
    cfg = TracerConfig(tmp_path, max_tokens=4, capacity=32, flush_steps=2, shard_bytes=2000, prefix="t")
    tracer = RoutingTracer(cfg, _layout)
    errors, stop = [], threading.Event()

    def reader_loop():
        while not stop.is_set():
            try:
                # A live folder's readers see finished shards only (``.part`` is the one being written).
                if any(tmp_path.glob("*.mptrace")):
                    reader, chunks = _read_all(tmp_path, include_partial=False)
                    assert not reader.damaged
            except Exception as e:
                errors.append(e)

    t = threading.Thread(target=reader_loop)
    t.start()
    _run_passes(tracer, [3] * 60, [2] * 60)
    tracer.close()
    stop.set()
    t.join()
    assert not errors, errors[:3]
    assert len(tracer.shards) > 1  # size-based rotation happened
    reader, chunks = _read_all(tmp_path)
    # The reader thread competes for the GIL, so the drain may fall behind: passes are then dropped, never waited for.
    assert tracer.written_steps + tracer.dropped_steps == 60 and tracer.written_steps > 0
    assert sum(c.num_steps for c in chunks) == tracer.written_steps and not reader.damaged


CRASH = textwrap.dedent('''
    import os, sys, torch
    from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig
    cfg = TracerConfig(__import__("pathlib").Path(sys.argv[1]), max_tokens=4, capacity=16, flush_steps=2, prefix="t")
    tracer = RoutingTracer(cfg, lambda: Layout("toy-moe", 6, 16, 16))
    for p in range(8):
        for layer in (1, 2, 4):
            tracer.on_router(layer, torch.zeros(2, 4, dtype=torch.int32) + p)
        tracer.end_pass(2, 2)
    import time
    while tracer.written_steps < 8:
        time.sleep(0.01)
    part = next(cfg.out_dir.glob("*.part"))
    # Die in the middle of writing a chunk: half a chunk lands on disk, no atexit, no rename.
    with open(part, "ab") as f:
        f.write(b"MPCK" + b"\\x10\\x00\\x00\\x00" + b"\\x00" * 7)
        f.flush()
    os._exit(9)
''')


def test_crash_mid_shard_is_detected_and_skipped(tmp_path):
    res = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 9, res.stderr[-2000:]
    assert not list(tmp_path.glob("*.mptrace")) and list(tmp_path.glob("*.mptrace.part"))
    reader, chunks = _read_all(tmp_path)   # a folder's .part shards are read
    assert sum(c.num_steps for c in chunks) == 8  # every whole chunk survives
    assert [why for _, why in reader.damaged] == [UNFINISHED, "cut inside a chunk header"]


def test_each_pass_is_labelled_with_the_map_it_ran_under(tmp_path):
    """A re-placement changes the map between passes (at the end of ``ModelRunner.forward``, before the tracer's
    ``end_pass``): a pass is labelled with the map noted at its start, a new map starts a new shard, and the window
    reads each pass's ids back through its own map."""
    rng = np.random.default_rng(0)
    maps = [np.stack([rng.permutation(E) for _ in range(H)]) for _ in range(2)]
    live = {"map": maps[0]}
    cfg = TracerConfig(tmp_path, max_tokens=8, capacity=16, flush_steps=4, prefix="t", window=100)
    tracer = RoutingTracer(cfg, lambda: Layout("toy-moe", H, E, E, maps[0]))
    tracer.live_map = lambda: live["map"]
    fed = []
    for i in range(10):
        tracer.begin_pass()
        if i == 5:
            live["map"] = maps[1]   # applied during this pass, after its router ran: the pass ran under map 0
        fed += _run_passes(tracer, [2], [5], seed=i)
    tracer.close()
    shards = sorted(tmp_path.glob("t-*.mptrace"))
    assert len(shards) == 2
    for shard, want, passes in zip(shards, maps, (6, 4)):
        reader, chunks = _read_all(shard)
        assert np.array_equal(np.asarray(reader.headers[0].physical_to_logical_map), want[list(MOE)])
        assert sum(c.modes.shape[0] for c in chunks) == passes
    window = tracer.window.steps()
    layer = np.arange(len(MOE))[None, :, None]
    expected = np.concatenate([np.where(f >= 0, maps[0 if i < 6 else 1][np.array(MOE)][layer, np.maximum(f, 0)], -1)
                               for i, f in enumerate(fed)])
    assert np.array_equal(window.topk_ids, expected)
