"""GPU overhead of the live tracer on a Kimi-K2-shaped router, under CUDA-graph replay.

Question: What GPU time does the live tracer add per step under CUDA-graph replay?
Baseline: the same emulated router without the tracer, interleaved in the same process.
Output: a table on stdout, also written to DIR/bench_tracer.json with --out DIR.

Shape: 9 tokens (batch 1 x 9 verify rows), 384 experts, top-8, 60 MoE layers. The router is emulated
with the tensor ops of SGLang's torch-native top-k (softmax, topk, int32 ids); the tracer's hook is
the real ``RoutingTracer.on_router`` (one staging ``copy_`` per layer) and ``end_pass`` (one
``index_select`` into the ring per pass, outside the graph) with the drain thread writing shards.

Run: PYTHONPATH=. python scripts/bench_tracer.py [--out DIR]
Prints a table and writes it to DIR/bench_tracer.json. Both variants run in one process, interleaved.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig

TOKENS, EXPERTS, TOP_K, LAYERS = 9, 384, 8, 60


def router_step(logits: torch.Tensor, ids_out: list, tracer: RoutingTracer | None) -> None:
    """logits: [LAYERS, TOKENS, EXPERTS]; one router per layer, as SGLang's torch-native top-k."""
    for layer in range(LAYERS):
        probs = torch.softmax(logits[layer], dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        ids = ids.to(torch.int32)
        ids_out[layer] = ids
        if tracer is not None:
            tracer.on_router(layer, ids)


def capture(logits, tracer):
    ids_out = [None] * LAYERS
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up outside capture (the tracer allocates its buffers here)
            router_step(logits, ids_out, tracer)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # A host sync (.item(), .cpu(), a pageable copy) inside capture raises: capture succeeding is the proof.
    with torch.cuda.graph(g):
        router_step(logits, ids_out, tracer)
    return g, ids_out


def time_replays(g, n, tracer=None):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        g.replay()
        if tracer is not None:
            tracer.end_pass(5, TOKENS)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / n  # us per step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    out_dir = Path(args.out or tempfile.mkdtemp())
    torch.manual_seed(0)
    logits = torch.randn(LAYERS, TOKENS, EXPERTS, device="cuda", dtype=torch.bfloat16)

    trace_dir = Path(tempfile.mkdtemp()) / "shards"
    cfg = TracerConfig(trace_dir, max_tokens=64, capacity=1024, flush_steps=256, prefix="bench")
    tracer = RoutingTracer(cfg, lambda: Layout("kimi-k2-shaped", LAYERS, EXPERTS, EXPERTS))

    g_plain, _ = capture(logits, None)
    g_hook, ids_hook = capture(logits, tracer)
    tracer.end_pass(5, TOKENS)  # lock the layer set and allocate the ring (first pass, outside timing)

    # Correctness under replay: new logits, replay, the ring slot holds exactly the router's ids.
    logits.copy_(torch.randn_like(logits))
    g_hook.replay()
    slot = tracer._pos % cfg.capacity
    tracer.end_pass(5, TOKENS)
    torch.cuda.synchronize()
    want = torch.stack([x.to(torch.int16) for x in ids_hook])  # [L, T, K]
    got = tracer.ring_ids[slot][:, :TOKENS, :]
    replay_ok = bool(torch.equal(got, want))

    plain, graph_hook, graph_hook_pass = [], [], []
    for _ in range(args.repeats):
        plain.append(time_replays(g_plain, args.steps))
        graph_hook.append(time_replays(g_hook, args.steps))
        graph_hook_pass.append(time_replays(g_hook, args.steps, tracer))
    tracer.close()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    p, h, hp = med(plain), med(graph_hook), med(graph_hook_pass)
    res = {
        "shape": dict(tokens=TOKENS, experts=EXPERTS, top_k=TOP_K, moe_layers=LAYERS),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "us_per_step_plain_graph": p,
        "us_per_step_graph_with_hook": h,
        "us_per_step_graph_with_hook_and_end_pass": hp,
        "us_added_per_layer_in_graph": (h - p) / LAYERS,
        "us_added_per_layer_incl_end_pass": (hp - p) / LAYERS,
        "us_end_pass_per_step": hp - h,
        "ratio_hook_over_plain": h / p,
        "ratio_hook_end_pass_over_plain": hp / p,
        "replay_ids_match": replay_ok,
        "graph_captured_with_hook": True,
        "steps_written": tracer.written_steps,
        "steps_dropped": tracer.dropped_steps,
        "shards": [s.name for s in tracer.shards],
        "raw": dict(plain=plain, hook=graph_hook, hook_end_pass=graph_hook_pass),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_tracer.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        if k != "raw":
            print(f"{k:45s} {v:.3f}" if isinstance(v, float) else f"{k:45s} {v}")


if __name__ == "__main__":
    main()
