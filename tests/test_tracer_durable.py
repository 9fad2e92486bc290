"""Durable traces: the tracer writes waiting passes while the server idles, and a stop through SGLang's
own ``kill_process_tree`` (what SIGTERM and SIGINT of a server end in) leaves whole shards, no ``.part``.

The stop runs as in a server: a launcher process that loaded the plugin through SGLang's
``load_plugins`` starts a child that records passes, then calls SGLang's real ``kill_process_tree``,
which SIGKILLs the child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig, finish_shards  # noqa: E402
from moeplace.trace.steps import concat_steps  # noqa: E402
from moeplace.trace.store import UNFINISHED, TraceReader  # noqa: E402

LAYERS, E, K = (1, 2), 16, 4


def _feed(tracer: RoutingTracer, passes: int, rows: int = 2) -> None:
    for p in range(passes):
        for layer in LAYERS:
            tracer.on_router(layer, torch.full((rows, K), p % E, dtype=torch.int32))
        tracer.end_pass(5, rows)


def _steps(folder: Path, include_partial: bool = True) -> int:
    return sum(c.num_steps for c in TraceReader(folder, include_partial=include_partial))


def _wait(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_an_idle_server_has_its_passes_on_disk_within_the_flush_time(tmp_path):
    cfg = TracerConfig(tmp_path, max_tokens=8, capacity=64, flush_steps=32, flush_seconds=0.3,
                       poll_seconds=0.05, prefix="idle")
    tracer = RoutingTracer(cfg, lambda: Layout("toy", 4, E, E))
    _feed(tracer, 5)   # fewer than flush_steps, and then no pass at all
    assert _wait(lambda: tracer.written_steps == 5, 5.0), tracer.written_steps
    assert _steps(tmp_path) == 5 and list(tmp_path.glob("*.mptrace.part"))  # still open, already readable
    tracer.close()
    assert _steps(tmp_path, include_partial=False) == 5 and not list(tmp_path.glob("*.part"))
    assert not list(tmp_path.glob(".*.live"))


def test_finish_shards_closes_every_rank_and_later_passes_are_not_kept(tmp_path):
    tracers = []
    for rank in (0, 1):
        cfg = TracerConfig(tmp_path, max_tokens=8, capacity=64, flush_steps=32, poll_seconds=0.05, prefix="run")
        tracers.append(RoutingTracer(cfg, lambda r=rank: Layout("toy", 4, E, E, rank=r)))
        _feed(tracers[-1], 7)
    assert len(list(tmp_path.glob(".run-r*.live"))) == 2
    assert finish_shards(tracers[0].config, wait=10.0) == []
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob(".run*"))
    assert _steps(tmp_path) == 14
    _feed(tracers[0], 3)   # a pass after the stop: the server is going down, nothing is opened again
    tracers[0].close()
    assert not list(tmp_path.glob("*.part")) and _steps(tmp_path) == 14


def test_finish_shards_without_live_ranks_returns_at_once(tmp_path):
    cfg = TracerConfig(tmp_path, prefix="none")
    start = time.monotonic()
    assert finish_shards(cfg, wait=10.0) == [] and time.monotonic() - start < 1.0
    assert not (tmp_path / ".none.stop").exists()


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from sglang.srt.plugins import load_plugins
    load_plugins()                      # the plugin, as in a scheduler process
    from moeplace.sglang import tracer as tr
    t = tr._TRACER
    t.config.poll_seconds = 0.05
    t._describe = lambda: tr.Layout("toy", 4, 16, 16, rank=int(sys.argv[1]))
    for p in range({passes}):
        for layer in (1, 2):
            t.on_router(layer, torch.full((2, 4), p % 16, dtype=torch.int32))
        t.end_pass(5, 2)
    print("recorded", flush=True)
    time.sleep(600)                     # serving on, until SGLang kills it
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from sglang.srt.plugins import load_plugins
    load_plugins()                      # the launcher: before SGLang parses its arguments
    children = [subprocess.Popen([sys.executable, "-c", sys.argv[1], str(r)], stdout=subprocess.PIPE, text=True)
                for r in (0, 1)]
    for c in children:
        assert c.stdout.readline().strip() == "recorded"
    from sglang.srt.utils import kill_process_tree   # as sglang.launch_server imports it
    if sys.argv[2] == "signal":
        import signal
        signal.signal(signal.SIGTERM, lambda *a: (kill_process_tree(os.getpid(), include_parent=False),
                                                  sys.exit(0)))
        print("ready", flush=True)
        time.sleep(600)
    kill_process_tree(os.getpid(), include_parent=False)
    print("stopped", [c.wait() for c in children], flush=True)
""")


@pytest.mark.sglang
@pytest.mark.parametrize("how", ["call", "signal"])
def test_sglang_kill_process_tree_leaves_whole_shards(tmp_path, how):
    """SGLang's own stop path: kill_process_tree SIGKILLs the ranks; the launcher's hook lets them
    finish first, so every recorded pass is in a finished shard and no .part is left."""
    pytest.importorskip("sglang")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEPLACE_")}
    env.update(MOEPLACE_TRACE_DIR=str(tmp_path), MOEPLACE_TRACE_FLUSH_STEPS="1000")
    child = CHILD.format(passes=9)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, child, how], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if how == "signal":   # as an operator or a process manager stops the server
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    if how == "call":
        assert "stopped [-9, -9]" in out, out   # SGLang's SIGKILL, after the shards were finished
    assert not list(tmp_path.glob("*.part")), sorted(p.name for p in tmp_path.iterdir())
    assert not list(tmp_path.glob(".*")), sorted(p.name for p in tmp_path.iterdir())
    reader = TraceReader(tmp_path)
    steps = concat_steps(list(reader))
    assert not reader.damaged and steps.num_steps == 18 and sorted(set(steps.ranks.tolist())) == [0, 1]
    prefixes = {p.name.rsplit("-r", 1)[0] for p in tmp_path.glob("*.mptrace")}
    assert len(prefixes) == 1   # every process wrote under the launcher's prefix


HARD = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig
    cfg = TracerConfig(Path(sys.argv[1]), max_tokens=8, capacity=64, flush_steps=64, flush_seconds=0.3,
                       poll_seconds=0.05, prefix="hard")
    t = RoutingTracer(cfg, lambda: Layout("toy", 4, 16, 16))
    for p in range(6):
        for layer in (1, 2):
            t.on_router(layer, torch.full((2, 4), p, dtype=torch.int32))
        t.end_pass(5, 2)
    while t.written_steps < 6:
        time.sleep(0.01)
    os.kill(os.getpid(), 9)            # out of memory, kill -9: no atexit, no rename
""")


def test_a_hard_kill_keeps_what_waited_longer_than_the_flush_time(tmp_path):
    res = subprocess.run([sys.executable, "-c", HARD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr[-2000:]
    part = list(tmp_path.glob("*.mptrace.part"))
    assert part and not list(tmp_path.glob("*.mptrace"))
    reader = TraceReader(tmp_path)
    steps = concat_steps(list(reader))
    assert steps.num_steps == 6 and reader.damaged == [(part[0], UNFINISHED)]
    np.testing.assert_array_equal(steps.topk_ids[::2, 0, 0], np.arange(6))
