"""CUDA-graph timing shared by the GPU benchmark scripts (run on the device, not in tests)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

# moeplace from this checkout, also on a GPU machine where it is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeplace.sglang.fused_moe_timing import capture, graph_time_us, replay_us  # noqa: E402,F401


def smi_samples(text: str) -> tuple[float, float]:
    """Median SM clock (MHz) and board power (W) of nvidia-smi's ``clocks.sm,power.draw`` csv lines."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            rows.append((float(fields[0]), float(fields[1])))
        except (ValueError, IndexError):  # "[N/A]" or a line cut short when the sampler stopped
            continue
    if not rows:
        raise RuntimeError("nvidia-smi gave no clock and power samples")
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def held_us(fn, seconds: float, calls: int = 20, sample_ms: int = 100) -> tuple[float, float, float]:
    """``fn`` replayed without a pause for ``seconds``: (µs a call, SM clock MHz, power W).

    A one-call replay runs at the idle card's boost clock; a server holds the card busy, where a kernel
    that moves the KV from DRAM can reach the board's power limit and the clock gives way (BENCHMARKS.md,
    "Every kernel at one commit, and the kernel's halves"). The graph holds ``calls`` calls; the load runs
    half a second before nvidia-smi starts sampling the GPU every ``sample_ms``, so every sample is under
    load, and the µs are those of the sampled interval.
    """
    import subprocess
    import tempfile
    import time

    import torch

    graph = capture(fn, calls)

    def replay_for(duration: float) -> int:
        replays, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < duration:
            for _ in range(10):
                graph.replay()
            replays += 10
            torch.cuda.synchronize()
        return replays

    replay_for(0.5)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = f"GPU-{props.uuid}"  # nvidia-smi's name of this GPU, whatever CUDA_VISIBLE_DEVICES says
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen(["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", str(sample_ms)],
                               stdout=log, stderr=subprocess.DEVNULL)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replays = replay_for(seconds)
        end.record()
        end.synchronize()
        smi.terminate()
        smi.wait()
        log.seek(0)
        mhz, watts = smi_samples(log.read())
    return start.elapsed_time(end) * 1000 / (replays * calls), mhz, watts
