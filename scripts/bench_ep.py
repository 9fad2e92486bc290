"""Expert parallelism measured across GPUs with NCCL: each placement and dispatch rule in real distributed time.

Question: How long does a verify step's MoE take across real GPUs (NCCL) under each placement and dispatch rule?
Baseline: the contiguous and DeepSeek EPLB placements under SGLang's dynamic rule, timed in the same processes.
Output: prepare --out DIR (placements and steps); run --out DIR writes the timings as JSON there.

One process per GPU (torch.distributed, NCCL). Each GPU holds only the expert slots its placement
gives it, bf16, laid out as SGLang's fused MoE Triton kernel expects them (``w13 [slots, 2I, H]``,
``w2 [slots, H, I]``). A verify step (9 tokens) goes through what SGLang 0.5.23 does with
``--moe-a2a-backend none`` and tensor-parallel attention: the router's top-k ids -> the dispatch rule
(logical -> physical slot: ``dynamic``, or moeplace's ``balanced``) -> ids of other ranks' slots
become -1 -> ``moe_align_block_size``'s block layout (+1 bucket convention, its buffer size) -> gate/up
GEMM (SGLang's ``invoke_fused_moe_kernel``), SiLU-and-mul, down GEMM with the router weights, sum
over top-k -> all-reduce of the hidden states. Every rank runs its local experts over all tokens.

Each step is captured once as a CUDA graph per rank (the all-reduce of every layer inside) and
replayed back to back; a step's time is the median per replay. In the same run: the same graph
without the all-reduce (each rank's compute alone, slowest rank), a graph of the all-reduces alone,
and the single-GPU emulation of ``scripts/replay_placement.py`` (each rank's workload timed alone,
slowest rank per layer) for the same steps with N ranks, each GPU timing a share of the workloads.

Placements are made for N ranks (``--gpus N``): EP over N GPUs is one rank per GPU, so 2 GPUs run a
2-rank placement (16 GPT-OSS experts, 192 Kimi experts a GPU), 8 GPUs an 8-rank one. That is what a
deployment on N GPUs runs; an 8-rank placement folded onto 2 GPUs would be a different (and unserved)
layout. Compared: contiguous, deepseek, stepaware (no spare slots, dynamic rule), balanced dispatch on
stepaware's balanced placement with E/4 spare slots, and TP-MoE (1/N of every expert, all-reduce).
A GPU holds as many MoE layers as its memory allows (all 24 of GPT-OSS; Kimi-shaped 384-expert layers
of 17-21 GB a GPU: about 5 on an H200 with 2 GPUs), and a step's time is scaled to the model's layers.

    python scripts/bench_ep.py prepare --gpus 2 --out out/ep2                # here: placements, steps
    python3 scripts/bench_ep.py run --work out/ep2 --out $OUT/ep2.json       # on the GPUs (one per rank)
    python scripts/bench_ep.py report --work out/ep2 --times ep2.json        # here: the table
    python scripts/bench_ep.py cpu-check                                     # gloo, 2 processes, torch MoE

``cpu-check`` runs the same per-rank code on 2 CPU processes (gloo) with a plain torch MoE over the
same block layout in place of the Triton kernel, and checks the all-reduced output of every placement
against a dense MoE of the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from calibrate_cost import align_layout, load_sglang_moe  # noqa: E402
from replay_placement import (GPTOSS, TRACES, WorkIndex, fit_placements, index_workloads,  # noqa: E402
                              job_deadlines, load_test, load_trace, placement_label, predicted_us, replayed_ms,
                              stale_jobs, time_workloads, write_report)

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM (it can take a shared host's GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STEPS = 16              # held-out verify steps per trace
MODEL_LAYERS = {"gptoss": 24, "kimi": 60}


def bench_tags(num_experts: int) -> list[str]:
    """EP placements compared across GPUs (``replay_placement.placement_specs`` tags), then TP-MoE."""
    return ["contiguous", "deepseek", "stepaware", f"balanced+r{num_experts // 4}"]


# ---------------------------------------------------------------------------------------------
# Pure parts: which slot each (token, k) pair goes to (SGLang's block layout: calibrate_cost.align_layout).

def pair_slots(steps, layer: int, phy2log: np.ndarray | None, ranks: int, dispatch: str) -> np.ndarray:
    """[T, K] physical slot of every (token row, k) pair at one layer (-1 where the id is -1).

    phy2log: [P] this layer's map, or None for TP-MoE (every rank holds every expert: the logical id).
    """
    from moeplace.dispatch.loads import token_slots
    _, _, ids = steps.layer(layer)
    if phy2log is None:
        return ids.astype(np.int64)
    out = np.full(ids.shape, -1, np.int64)
    out[ids >= 0] = token_slots(steps, layer, phy2log, ranks, dispatch)[1]
    return out


def local_ids(slots: np.ndarray, rank: int, slots_per_rank: int) -> np.ndarray:
    """[T, K] local slot of each pair on ``rank`` (rank r owns slots r*spr ... (r+1)*spr - 1), -1 elsewhere."""
    local = slots - rank * slots_per_rank
    return np.where((slots >= 0) & (local >= 0) & (local < slots_per_rank), local, -1)


def rank_weights(w13: np.ndarray, w2: np.ndarray, phy2log: np.ndarray | None, rank: int, ranks: int):
    """One rank's (w13 [slots, 2I', H], w2 [slots, H, I']) from the logical experts' w13 [E, 2I, H], w2 [E, H, I].

    EP (phy2log [P]): the experts of the rank's slots. TP-MoE (None): 1/ranks of every expert's
    intermediate dimension (its gate rows, its up rows, its down columns), so the ranks' outputs sum
    to the whole expert.
    """
    if phy2log is not None:
        spr = phy2log.shape[0] // ranks
        experts = phy2log[rank * spr:(rank + 1) * spr]
        return w13[experts], w2[experts]
    inter = w2.shape[2]
    part = slice(rank * inter // ranks, (rank + 1) * inter // ranks)
    gate, up = w13[:, :inter], w13[:, inter:]
    return np.concatenate([gate[:, part], up[:, part]], axis=1), w2[:, :, part]


def dense_moe(x: np.ndarray, topk_ids: np.ndarray, topk_w: np.ndarray, w13: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """fp64 reference MoE [T, H]: sum_k w[t, k] * down(silu(gate x) * up x) of expert ids[t, k]."""
    inter = w2.shape[2]
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = topk_ids[t, k]
            if e < 0:
                continue
            h = w13[e].astype(np.float64) @ x[t]
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            out[t] += topk_w[t, k] * (w2[e].astype(np.float64) @ act)
    return out


def step_summary(us: np.ndarray) -> dict:
    """Median, p10, p90 and mean of per-step µs (NaN steps left out)."""
    v = us[np.isfinite(us)]
    if v.size == 0:
        return {"steps": 0}
    return {"steps": int(v.size), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
            "p90": float(np.percentile(v, 90)), "mean": float(v.mean())}


# ---------------------------------------------------------------------------------------------
# Preparing (CPU): placements for N ranks, held-out steps, each rank's pair slots.

def prepare_trace(index: WorkIndex, name: str, train, test, label: str, ranks: int, effort: float,
                  hidden: int, inter: int, model_layers: int, log) -> tuple[dict, dict]:
    """(arrays, meta) of one trace: placements for ``ranks``, pair slots, router weights, emulation work."""
    E = test.model.num_experts
    tags = bench_tags(E)
    placements = fit_placements(train, ranks, effort, log, only=tags)
    arrays = {f"phy2log/{tag}": p for tag, (p, _) in placements.items()}
    arrays.update(index_workloads(index, name, test, placements, ranks, hidden, inter))
    save_steps(arrays, test, placements, ranks, seed=1)
    meta = {"label": label, "train_steps": train.num_steps, "test_steps": test.num_steps,
            "layers": test.model.num_moe_layers, "model_layers": model_layers, "experts": E,
            "top_k": test.model.top_k, "ranks": ranks, "effort": effort, "hidden": hidden, "inter": inter,
            "tags": tags + ["tp"], "dispatch": {tag: d for tag, (_, d) in placements.items()}}
    return arrays, meta


def write_work(out: Path, index: WorkIndex, traces: dict) -> None:
    """work.json and <trace>.npz, <trace>_test.npz. traces: name -> (arrays, meta, test steps)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, (arrays, _, test) in traces.items():
        np.savez_compressed(out / f"{name}.npz", **arrays)
        np.savez_compressed(out / f"{name}_test.npz", topk_ids=test.topk_ids, token_offsets=test.token_offsets,
                            model=json.dumps(test.model.to_json()))
    meta = {name: m for name, (_, m, _) in traces.items()}
    (out / "work.json").write_text(json.dumps({"jobs": index.jobs, "traces": meta}))


def prepare(args) -> None:
    index, traces = WorkIndex(), {}
    for name in TRACES:
        if args.only and name not in args.only.split(","):
            continue
        train, test, label = load_trace(name, args.gptoss, test_steps=args.steps)
        arrays, meta = prepare_trace(index, name, train, test, label, args.gpus, args.effort, TRACES[name]["hidden"],
                                     TRACES[name]["inter"], MODEL_LAYERS[name],
                                     lambda m: print(f"{name} {m}", flush=True))
        traces[name] = (arrays, meta, test)
    write_work(Path(args.out), index, traces)
    for job, j in index.jobs.items():
        print(f"job {job}: {len(j['keys'])} distinct rank workloads (emulation)", flush=True)


def save_steps(arrays: dict, test, placements: dict, ranks: int, seed: int) -> None:
    """slots/<tag> [T, L, K] pair slots per placement (TP: logical ids), router weights [T, L, K], offsets."""
    L = test.model.num_moe_layers
    for tag, (phy2log, dispatch) in [*placements.items(), ("tp", (None, "dynamic"))]:
        arrays[f"slots/{tag}"] = np.stack(
            [pair_slots(test, layer, None if phy2log is None else phy2log[layer], ranks, dispatch)
             for layer in range(L)], axis=1).astype(np.int32)
    w = np.random.default_rng(seed).random(test.topk_ids.shape).astype(np.float32) + 0.1
    arrays["topk_w"] = w / w.sum(axis=-1, keepdims=True)
    arrays["token_offsets"] = test.token_offsets


# ---------------------------------------------------------------------------------------------
# One rank's MoE layer: SGLang's kernel on the GPU, a torch stand-in over the same layout on the CPU.

@dataclass
class LayerInput:
    """One layer of one step on one rank, on the device. ids [T, K] local slots (-1: other ranks')."""

    ids: object
    topk_w: object
    sorted_ids: object
    expert_ids: object
    padded: object
    config: dict


class TritonExperts:
    """SGLang's ``invoke_fused_moe_kernel`` (from the wheel, unmodified) with SGLang's config lookup."""

    def __init__(self, sgl) -> None:
        self.kernels, self.cfgmod, self.version = sgl

    def config(self, num_local: int, inter: int, hidden: int, tokens: int, top_k: int) -> dict:
        configs = self.cfgmod.get_moe_configs(num_local, inter, None, 0, 0, per_channel_quant=False, down_moe=False)
        if configs:
            return dict(configs[min(configs, key=lambda m: abs(m - tokens))])
        return dict(self.cfgmod.get_default_config(tokens, num_local, inter, hidden, top_k, None, False, None))

    def gemm(self, a, w, c, inp: LayerInput, routed: bool, top_k: int) -> None:
        import triton.language as tl
        self.kernels.invoke_fused_moe_kernel(
            a, w, None, c, None, None, None, inp.topk_w, inp.ids, inp.sorted_ids, inp.expert_ids, inp.padded,
            routed, top_k, inp.config, tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False,
            use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False, block_shape=None)


class TorchExperts:
    """The kernel's contract in torch (CPU): each block of the layout runs its expert; -1 blocks write zeros."""

    version = "torch stand-in"

    def config(self, num_local: int, inter: int, hidden: int, tokens: int, top_k: int) -> dict:
        return {"BLOCK_SIZE_M": 4}

    def gemm(self, a, w, c, inp: LayerInput, routed: bool, top_k: int) -> None:
        bm = inp.config["BLOCK_SIZE_M"]
        numel = inp.ids.numel()
        flat_w = inp.topk_w.reshape(-1)
        for b in range(int(inp.padded[0]) // bm):
            rows = inp.sorted_ids[b * bm:(b + 1) * bm]
            rows = rows[rows < numel].long()
            e = int(inp.expert_ids[b])
            if e < 0:
                c[rows] = 0
                continue
            out = a[rows // top_k].float() @ w[e].float().t()
            c[rows] = (out * flat_w[rows, None] if routed else out).to(c.dtype)


class RankLayers:
    """A rank's expert weights (w13 [slots, 2I, H], w2 [slots, H, I] per layer) and one step's buffers."""

    def __init__(self, experts, w13: list, w2: list, tokens: int, top_k: int, hidden: int, inter: int,
                 dtype, device) -> None:
        import torch
        self.torch, self.experts, self.w13, self.w2, self.inter = torch, experts, w13, w2, inter
        gen = torch.Generator(device=device).manual_seed(7)   # the same hidden states on every rank
        self.x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.c1 = torch.empty(tokens * top_k, 2 * inter, device=device, dtype=dtype)
        self.c2 = torch.empty(tokens * top_k, inter, device=device, dtype=dtype)
        self.c3 = torch.empty(tokens * top_k, hidden, device=device, dtype=dtype)
        self.out = torch.zeros(tokens, hidden, device=device, dtype=dtype)

    def layer(self, layer: int, inp: LayerInput, all_reduce: bool):
        """SGLang's EP layer with --moe-a2a-backend none: local experts over all tokens, then all-reduce."""
        torch = self.torch
        T, K = inp.ids.shape
        n = T * K
        self.experts.gemm(self.x[:T], self.w13[layer], self.c1[:n], inp, False, K)
        torch.mul(torch.nn.functional.silu(self.c1[:n, :self.inter]), self.c1[:n, self.inter:], out=self.c2[:n])
        self.experts.gemm(self.c2[:n], self.w2[layer], self.c3[:n], inp, True, 1)
        torch.sum(self.c3[:n].view(T, K, -1), dim=1, out=self.out[:T])
        if all_reduce:
            torch.distributed.all_reduce(self.out[:T])
        return self.out[:T]

    def step(self, inputs: list[LayerInput], all_reduce: bool = True):
        """All layers of one step (the same hidden states into each: the layers between are not run)."""
        for layer, inp in enumerate(inputs):
            out = self.layer(layer, inp, all_reduce)
        return out

    def all_reduces(self, layers: int, tokens: int) -> None:
        for _ in range(layers):
            self.torch.distributed.all_reduce(self.out[:tokens])


def rank_ids(slots: np.ndarray, rank: int, slots_per_rank: int, tp: bool) -> np.ndarray:
    """[T, K] local slots of ``rank``: TP-MoE holds every expert (the logical id), EP its own slots."""
    return slots if tp else local_ids(slots, rank, slots_per_rank)


def layer_inputs(experts, ids: np.ndarray, topk_w: np.ndarray, num_local: int, inter: int, hidden: int,
                 device) -> LayerInput:
    """The device inputs of one layer and step on one rank. ids: [T, K] local slots, topk_w: [T, K]."""
    import torch
    T, K = ids.shape
    cfg = experts.config(num_local, inter, hidden, T, K)
    sorted_ids, expert_ids, padded = align_layout(ids, num_local, cfg["BLOCK_SIZE_M"])
    dev = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=device)  # noqa: E731
    return LayerInput(dev(ids, torch.int32), dev(topk_w, torch.float32), dev(sorted_ids, torch.int32),
                      dev(expert_ids, torch.int32), dev([padded], torch.int32), cfg)


# ---------------------------------------------------------------------------------------------
# Timing (GPU): a step captured as a CUDA graph, replayed back to back.

def time_us(fn, use_graph: bool, rounds: int = 3, inner: int = 5) -> float:
    """Median µs of one call of ``fn``: ``rounds`` timings of ``inner`` back-to-back calls (graph replays).

    Every rank must call this in the same order: the all-reduces inside ``fn`` pair them up.
    """
    import torch
    if not torch.cuda.is_initialized():   # cpu-check: one call on the wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    run = fn
    fn()
    torch.cuda.synchronize()
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def graphs_work(rank_layers: RankLayers) -> bool:
    """Whether an NCCL all-reduce can be captured and replayed in a CUDA graph here (all ranks agree)."""
    import torch
    try:
        time_us(lambda: rank_layers.all_reduces(1, 1), True, rounds=1, inner=1)
        ok = 1
    except Exception as e:  # noqa: BLE001 - any capture failure means: time eagerly
        print(f"CUDA graph capture of an all-reduce failed ({type(e).__name__}: {str(e)[:200]}); timing eagerly",
              flush=True)
        ok = 0
    flag = torch.tensor([ok], device="cuda")
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------------------------------------
# One rank's run.

class Deadline:
    """Rank 0's clock decides for all ranks (a broadcast), so every rank runs the same collectives."""

    def __init__(self, end: float, device) -> None:
        self.end, self.device = end, device

    def more(self) -> bool:
        import torch
        flag = torch.tensor([int(time.time() < self.end)], device=self.device)
        torch.distributed.broadcast(flag, 0)
        return bool(flag.item())


def logical_weights(E: int, hidden: int, inter: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logical experts' w13 [E, 2I, H], w2 [E, H, I] (float32, the same on every rank), bf16-exact values."""
    rng = np.random.default_rng(seed)
    w13 = rng.standard_normal((E, 2 * inter, hidden)) / np.sqrt(hidden)
    w2 = rng.standard_normal((E, hidden, inter)) / np.sqrt(inter)
    bf16 = lambda a: (a.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)  # noqa: E731
    return bf16(w13), bf16(w2)


def check_placements(experts, arrays: dict, meta: dict, rank: int, ranks: int, device, dtype,
                     hidden: int, inter: int, layer: int = 0, step: int = 0) -> dict[str, float]:
    """Relative error of the all-reduced output of one layer and step, per placement, vs a dense MoE.

    Small experts (hidden x inter) with the trace's routing, placements and dispatch: what is checked
    is the path (slots, layout, kernel contract, combine), not the expert size.
    """
    import torch
    E, tokens = meta["experts"], arrays["token_offsets"]
    rows = slice(int(tokens[step]), int(tokens[step + 1]))
    topk_w = arrays["topk_w"][rows, layer]
    w13, w2 = logical_weights(E, hidden, inter, seed=3)
    cast = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device).to(dtype)  # noqa: E731
    errors = {}
    for tag in meta["tags"]:
        tp = tag == "tp"
        p = None if tp else arrays[f"phy2log/{tag}"][layer]
        lw13, lw2 = rank_weights(w13, w2, p, rank, ranks)
        spr = lw13.shape[0]
        slots = arrays[f"slots/{tag}"][rows, layer]
        layers = RankLayers(experts, [cast(lw13)], [cast(lw2)], slots.shape[0], slots.shape[1], hidden,
                            lw2.shape[2], dtype, device)
        inp = layer_inputs(experts, rank_ids(slots, rank, spr, tp), topk_w, spr, lw2.shape[2], hidden, device)
        out = layers.step([inp]).float().cpu().numpy()
        x = layers.x.float().cpu().numpy()
        logical = slots if tp else np.where(slots >= 0, p[np.maximum(slots, 0)], -1)
        ref = dense_moe(x, logical, topk_w, w13, w2)
        errors[tag] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return errors


def emulation_order(arrays: dict, tags: list[str], jobs: dict, layers: int) -> dict[str, list[int]]:
    """Per job, the workload ids the first ``layers`` layers need, step by step (a time cut drops late steps)."""
    order: dict[str, dict[int, None]] = {job: {} for job in jobs}
    steps = arrays[f"idx/{tags[0]}"].shape[0]
    for s in range(steps):
        for tag in tags:
            job = str(arrays[f"job/{tag}"])
            for k in arrays[f"idx/{tag}"][s, :layers].ravel():
                order[job].setdefault(int(k))
    return {job: list(ids) for job, ids in order.items()}


def emulate(timer, jobs: dict, order: dict, rank: int, ranks: int, end: float) -> dict[str, list]:
    """Each job's workload µs (NaN where untimed); GPU r times the needed ids r, r + N, ... (replay's method).

    timer(shape, keys, end) -> µs of each key timed before ``end`` (``replay_placement.time_workloads``).
    """
    import torch
    mine = {}
    ends = job_deadlines([len(ids) for ids in order.values()], time.time(), end - time.time())
    for (job, ids), job_end in zip(order.items(), ends):
        keys = [jobs[job]["keys"][k] for k in ids[rank::ranks]]
        mine[job] = timer(jobs[job]["shape"], keys, job_end)
    gathered = [None] * ranks
    torch.distributed.all_gather_object(gathered, mine)
    out = {}
    for job, ids in order.items():
        us = np.full(len(jobs[job]["keys"]), np.nan)
        for r, part in enumerate(gathered):
            mine_ids = ids[r::ranks][:len(part[job])]
            us[mine_ids] = part[job]
        out[job] = us.tolist()
    return out


def layers_that_fit(meta: dict, arrays: dict, ranks: int, reserve_gb: float) -> int:
    """MoE layers whose experts fit in this GPU's free memory (bf16), at most the trace's layers."""
    import torch
    if not torch.cuda.is_initialized():
        return meta["layers"]
    E, H, I = meta["experts"], meta["hidden"], meta["inter"]
    slots = max(arrays[f"phy2log/{t}"].shape[1] // ranks for t in meta["tags"] if t != "tp")
    per_layer = 2 * 3 * H * max(slots * I, E * -(-I // ranks))
    free = torch.cuda.mem_get_info()[0] - reserve_gb * 2**30
    return max(1, min(meta["layers"], int(free // per_layer)))


def bench_trace(experts, name: str, meta: dict, arrays: dict, rank: int, ranks: int, device, dtype,
                deadline: Deadline, use_graph: bool, layers: int, log) -> dict:
    """Per step and placement: the whole distributed step, its compute alone, and the all-reduces alone."""
    import torch
    H, I, E = meta["hidden"], meta["inter"], meta["experts"]
    tokens = arrays["token_offsets"]
    T, K = int(np.diff(tokens).max()), meta["top_k"]
    shapes = {tag: (E, -(-I // ranks)) if tag == "tp" else (arrays[f"phy2log/{tag}"].shape[1] // ranks, I)
              for tag in meta["tags"]}   # (slots, intermediate width) a rank holds
    # One pool of weights per layer, viewed as each placement's slots (values do not change the time).
    pool_elems = max(s * 3 * H * w for s, w in shapes.values())
    pools = [torch.empty(pool_elems, dtype=dtype, device=device).normal_() for _ in range(layers)]

    def weights(spr: int, w: int) -> tuple[list, list]:
        n13 = spr * 2 * w * H
        return ([p[:n13].view(spr, 2 * w, H) for p in pools],
                [p[n13:n13 + spr * H * w].view(spr, H, w) for p in pools])

    result = {tag: {"full_us": [], "compute_us": []} for tag in meta["tags"]}
    for s in range(len(tokens) - 1):
        if not deadline.more():
            break
        rows = slice(int(tokens[s]), int(tokens[s + 1]))
        for tag, (spr, width) in shapes.items():
            slots = arrays[f"slots/{tag}"][rows]
            inputs = [layer_inputs(experts, rank_ids(slots[:, layer], rank, spr, tag == "tp"),
                                   arrays["topk_w"][rows, layer], spr, width, H, device) for layer in range(layers)]
            rl = RankLayers(experts, *weights(spr, width), T, K, H, width, dtype, device)
            result[tag]["full_us"].append(time_us(lambda: rl.step(inputs, True), use_graph))
            result[tag]["compute_us"].append(time_us(lambda: rl.step(inputs, False), use_graph))
        log(f"{name} step {s + 1}/{len(tokens) - 1}: " + " ".join(
            f"{tag} {result[tag]['full_us'][-1] / 1e3:.2f}" for tag in meta["tags"]) + " ms")
    rl = RankLayers(experts, [], [], T, K, H, 1, dtype, device)
    allreduce = time_us(lambda: rl.all_reduces(layers, T), use_graph, rounds=5, inner=10)
    pools.clear()   # free the weights before the next trace
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return {"layers": layers, "placements": result, "allreduce_us": allreduce}


def gather(value, ranks: int) -> list:
    import torch
    out = [None] * ranks
    torch.distributed.all_gather_object(out, value)
    return out


def rank_main(rank: int, ranks: int, opts: dict) -> None:
    """One process: NCCL (or gloo for cpu-check), the checks, the emulation and the distributed bench."""
    for k, v in SAFE_ENV.items():
        if os.environ.get(k) != v:
            raise SystemExit(f"rank {rank}: {k} must be {v} in every process")
    import torch
    import torch.distributed as dist
    cpu = opts["cpu"]
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if cpu:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{opts['port']}",
                            rank=rank, world_size=ranks, **({} if cpu else {"device_id": device}))
    log = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    try:
        work = Path(opts["work"])
        meta_all = json.loads((work / "work.json").read_text())
        sgl = None
        if cpu:
            experts = TorchExperts()
        else:
            sgl = load_sglang_moe(opts["sglang_wheel"])
            experts = TritonExperts(sgl)
        result = {"ranks": ranks, "backend": "gloo" if cpu else "nccl", "kernel": experts.version,
                  "env": {k: os.environ.get(k) for k in SAFE_ENV}, "traces": {}}
        if not cpu:
            result.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                          nccl=str(torch.cuda.nccl.version()))
        dtype = torch.float32 if cpu else torch.bfloat16
        if cpu:   # a stand-in for the emulation's GPU timer: the plumbing is what is checked
            timer = lambda shape, keys, end: [float(len(k) + sum(k)) for k in keys]  # noqa: E731
        else:
            timer = lambda shape, keys, end: time_workloads(sgl, shape, keys, 9, opts["reps"], end)  # noqa: E731
        start = time.time()
        names = list(meta_all["traces"])
        share = opts["budget_s"] / len(names)
        for i, name in enumerate(names):
            meta, arrays = meta_all["traces"][name], dict(np.load(work / f"{name}.npz"))
            errors = check_placements(experts, arrays, meta, rank, ranks, device, dtype, opts["check_hidden"],
                                      opts["check_inter"])
            log(f"{name}: all-reduced output vs dense MoE, rel err "
                + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
            t0 = start + i * share
            layers = min(gather(layers_that_fit(meta, arrays, ranks, opts["reserve_gb"]), ranks))
            jobs = {j: v for j, v in meta_all["jobs"].items() if j.split("-")[0] == name}
            order = emulation_order(arrays, meta["tags"], jobs, layers)
            entry = {"check_rel_err": errors,
                     "emulation_us": emulate(timer, jobs, order, rank, ranks, t0 + opts["emulation_share"] * share)}
            log(f"{name}: emulation done at {time.time() - start:.0f} s")
            entry["graph"] = not cpu and graphs_work(RankLayers(experts, [], [], 1, 1, 8, 1, dtype, device))
            entry.update(bench_trace(experts, name, meta, arrays, rank, ranks, device, dtype,
                                     Deadline(t0 + share, device), entry["graph"], layers, log))
            per_rank = gather(entry["placements"], ranks)
            entry["placements"] = {tag: {k: [g[tag][k] for g in per_rank] for k in ("full_us", "compute_us")}
                                   for tag in meta["tags"]}
            entry["allreduce_us"] = gather(entry["allreduce_us"], ranks)
            result["traces"][name] = entry
            if rank == 0:
                write_json(opts["out"], result)
            log(f"{name}: done at {time.time() - start:.0f} s")
    finally:
        dist.destroy_process_group()


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"bench_ep: {message}", file=sys.stderr)
    sys.exit(2)


def write_json(path: str, doc: dict) -> None:
    from moeplace.files.atomic import atomic_write_text
    atomic_write_text(path, json.dumps(doc))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, opts: dict) -> None:
    """One process per rank; the multicast-off variables are set here so every child inherits them."""
    os.environ.update(SAFE_ENV)
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(ranks, {**opts, "port": free_port()}), nprocs=ranks, join=True)


def run(args) -> None:
    import torch
    meta = json.loads((Path(args.work) / "work.json").read_text())
    ranks = {m["ranks"] for m in meta["traces"].values()}.pop()
    gpus = args.gpus or ranks
    if gpus != ranks:
        fail(f"{args.work} was prepared for {ranks} ranks; run it with --gpus {ranks} (or prepare again with "
             f"--gpus {gpus})")
    if stale_jobs(meta["jobs"]):
        fail(f"{args.work} was prepared before the emulation built SGLang's layout (no top_k); prepare it again")
    if torch.cuda.device_count() < gpus:
        fail(f"--gpus {gpus}: only {torch.cuda.device_count()} GPUs here")
    launch(gpus, {"cpu": False, "work": args.work, "out": args.out, "budget_s": args.budget_s,
                  "emulation_share": args.emulation_share, "reps": args.reps, "reserve_gb": args.reserve_gb,
                  "sglang_wheel": args.sglang_wheel, "check_hidden": 256, "check_inter": 128})


def cpu_check(args) -> int:
    """prepare + run on 2 gloo processes with tiny experts; exit 1 when any output is off."""
    with tempfile.TemporaryDirectory() as tmp:
        prepare_tiny(Path(tmp), args.ranks, args.hidden, args.inter)
        out = Path(tmp) / "check.json"
        launch(args.ranks, {"cpu": True, "work": tmp, "out": str(out), "budget_s": 60, "emulation_share": 0.5,
                            "reps": 1, "reserve_gb": 0, "check_hidden": args.hidden, "check_inter": args.inter})
        doc = json.loads(out.read_text())
        report(argparse.Namespace(work=tmp, times=str(out), out=""))
    worst = max(e for t in doc["traces"].values() for e in t["check_rel_err"].values())
    print(f"cpu-check: {args.ranks} gloo ranks, worst rel err vs dense MoE {worst:.1e}")
    return 0 if worst < 1e-4 else 1


def prepare_tiny(out: Path, ranks: int, hidden: int, inter: int) -> None:
    """A small synthetic trace (32 experts, top-4, 2 layers, tiny experts) prepared as ``prepare`` does."""
    from moeplace.model.spec import ModelSpec
    from moeplace.trace.synthetic import synthetic_steps
    model = ModelSpec("SYNTHETIC tiny", 3, (1, 2), 32, 4)
    _, steps = synthetic_steps(40, tokens_per_step=9, model=model, seed=2)
    train, test = steps.take(np.arange(36)), steps.take(np.arange(36, 40))
    index = WorkIndex()
    arrays, meta = prepare_trace(index, "tiny", train, test, "SYNTHETIC tiny", ranks, 1e5, hidden, inter, 2,
                                 lambda m: None)
    write_work(out, index, {"tiny": (arrays, meta, test)})


# ---------------------------------------------------------------------------------------------
# Report (CPU).

def full_steps(entry: dict) -> int:
    """Steps every placement was timed on."""
    return min(len(p["full_us"][0]) for p in entry["placements"].values())


def report(args) -> None:
    work = Path(args.work)
    meta_all = json.loads((work / "work.json").read_text())
    doc = json.loads(Path(args.times).read_text())
    lines = [f"{doc.get('gpu', '?')} x {doc['ranks']}, torch {doc.get('torch')}, NCCL {doc.get('nccl')}, "
             f"kernel: SGLang {doc['kernel']} fused MoE (Triton), bf16.", ""]
    summary = {}
    for name, entry in doc["traces"].items():
        meta, arrays = meta_all["traces"][name], dict(np.load(work / f"{name}.npz"))
        test = load_test(work, name)
        ranks, layers = meta["ranks"], entry["layers"]
        scale = (meta["model_layers"] or meta["layers"]) / layers
        ar_us = float(np.median(entry["allreduce_us"]))
        jobs = entry["emulation_us"]
        lines += [f"**{meta['label']}**: {ranks} EP ranks = {ranks} GPUs; {layers} of {meta['model_layers']} MoE "
                  f"layers held per GPU, times scaled x{scale:g}; a step's time = the median of its "
                  f"{'CUDA graph' if entry['graph'] else 'eager'} replays, then over {full_steps(entry)} steps; all-reduce of [9, {meta['hidden']}] "
                  f"bf16 alone: {ar_us / layers:.1f} µs per layer.", "",
                  "| placement | mode | measured ms/step: mean (median) [p10-p90] | all-reduce share | compute alone (slowest rank) "
                  "| emulation (replay, N ranks) | cost model | cost model + all-reduce | emulation err | model err "
                  "| model+AR err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = {}
        for tag in meta["tags"]:
            p = entry["placements"][tag]
            full = np.max(np.array(p["full_us"], float), axis=0)      # ranks agree (the all-reduce syncs them)
            compute = np.max(np.array(p["compute_us"], float), axis=0)
            S = full.size
            steps = test.take(np.arange(S))
            dispatch = meta["dispatch"].get(tag, "dynamic")
            phy2log = arrays.get(f"phy2log/{tag}")
            idx = arrays[f"idx/{tag}"][:S, :layers]
            us = np.array(jobs[str(arrays[f"job/{tag}"])], float)
            emul = replayed_ms(np.nan_to_num(us, nan=np.inf), idx)
            emul[~np.isfinite(emul)] = np.nan
            model = predicted_us(name, steps, tag, phy2log, ranks, dispatch, range(layers), meta["hidden"],
                                 meta["inter"])
            m = step_summary(full * scale)
            e, c, pm = (np.nanmean(v * scale) if np.isfinite(v).any() else np.nan for v in (emul, compute, model))
            mean = m["mean"]
            pm_ar = pm + ar_us * scale
            rows[tag] = {"measured": m, "compute_ms": c / 1e3, "emulation_ms": e / 1e3, "model_ms": pm / 1e3,
                         "model_plus_allreduce_ms": pm_ar / 1e3, "allreduce_ms": ar_us * scale / 1e3}
            lines.append(f"| {tag.split('+')[0]} | {placement_label(tag, dispatch, ranks)} | {mean / 1e3:.2f} "
                         f"({m['median'] / 1e3:.2f}) [{m['p10'] / 1e3:.2f}-{m['p90'] / 1e3:.2f}] | "
                         f"{ar_us * scale / mean:.0%} | {c / 1e3:.2f} | "
                         f"{e / 1e3:.2f} | {pm / 1e3:.2f} | {pm_ar / 1e3:.2f} | {e / mean - 1:+.1%} | "
                         f"{pm / mean - 1:+.1%} | {pm_ar / mean - 1:+.1%} |")
        base = rows.get("deepseek")
        lines.append("")
        for tag, r in rows.items():
            if base and tag != "deepseek":
                lines.append(f"{tag} vs deepseek: {r['measured']['mean'] / base['measured']['mean'] - 1:+.1%} "
                             f"measured (means), {r['model_ms'] / base['model_ms'] - 1:+.1%} predicted.")
        ep = {t: r for t, r in rows.items() if t != "tp"}
        best = min(ep, key=lambda t: ep[t]["measured"]["mean"])
        tp = rows["tp"]["measured"]["mean"]
        best_pred = min(ep, key=lambda t: ep[t]["model_ms"])
        lines += [f"EP vs TP-MoE at 9 tokens on {ranks} GPUs: measured best EP ({best}) "
                  f"{ep[best]['measured']['mean'] / 1e3:.2f} vs TP {tp / 1e3:.2f} ms/step -> "
                  f"{'EP' if ep[best]['measured']['mean'] <= tp else 'TP-MoE'}; the cost model says "
                  f"{'EP' if ep[best_pred]['model_ms'] <= rows['tp']['model_ms'] else 'TP-MoE'} "
                  f"({best_pred} {ep[best_pred]['model_ms']:.2f} vs TP {rows['tp']['model_ms']:.2f} ms).", ""]
        summary[name] = rows
    write_report(lines, summary, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare", help="placements for N ranks and the held-out steps (CPU)")
    a.add_argument("--gpus", type=int, required=True, help="GPUs = EP ranks the placements are made for")
    a.add_argument("--out", required=True)
    a.add_argument("--gptoss", type=Path, default=GPTOSS, help=f"GPT-OSS-20B top-k ids .npz (default: {GPTOSS})")
    a.add_argument("--steps", type=int, default=STEPS, help="held-out verify steps per trace")
    a.add_argument("--effort", type=float, default=2e8)
    a.add_argument("--only", default="", help="comma list of traces (gptoss, kimi)")
    b = sub.add_parser("run", help="the bench on N GPUs, one process each (NCCL)")
    b.add_argument("--work", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--gpus", type=int, default=0, help="default: the ranks the work was prepared for")
    b.add_argument("--budget-s", type=float, default=150, help="wall-clock seconds for all traces")
    b.add_argument("--emulation-share", type=float, default=0.5, help="share of each trace's time for the emulation")
    b.add_argument("--reps", type=int, default=5, help="replays per emulated workload")
    b.add_argument("--reserve-gb", type=float, default=16, help="GPU memory left free by the expert weights")
    b.add_argument("--sglang-wheel", default=".whl/sglang-*.whl")
    c = sub.add_parser("report", help="the table: measured vs emulation vs cost model (CPU)")
    c.add_argument("--work", required=True)
    c.add_argument("--times", required=True)
    c.add_argument("--out", default="")
    d = sub.add_parser("cpu-check", help="the same per-rank code on 2 gloo processes, torch MoE, vs a dense MoE")
    d.add_argument("--ranks", type=int, default=2)
    d.add_argument("--hidden", type=int, default=32)
    d.add_argument("--inter", type=int, default=24)
    args = p.parse_args()
    if args.cmd == "cpu-check":
        sys.exit(cpu_check(args))
    try:
        {"prepare": prepare, "run": run, "report": report}[args.cmd](args)
    except (OSError, ValueError, KeyError) as e:   # a missing or foreign work folder or times file
        fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
