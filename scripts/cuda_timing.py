"""CUDA-graph timing shared by the GPU benchmark scripts (run on the device, not in tests)."""

from __future__ import annotations

import statistics


def graph_time_us(fn, reps: int = 50, warmup_replays: int = 1) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph (compile and warm-up outside)."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup_replays):
        g.replay()
    torch.cuda.synchronize()
    return replay_us(g, reps)


def replay_us(graph, reps: int) -> float:
    """Median µs of one replay of a captured CUDA graph, each replay timed by its own pair of events."""
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)
