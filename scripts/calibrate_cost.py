"""Calibrate moeplace's MoE cost model: time one EP rank's fused-MoE work on a GPU, then fit it.

Question: What does one EP rank's fused-MoE work cost on this GPU, as a line in distinct experts, tokens and row
    blocks?
Baseline: the copy bandwidth and a plain per-expert cuBLAS path, measured in the same run as ceilings to read the
    fit against.
Output: measure --out FILE.json (raw timings); fit FILE.json --out-dir moeplace/cost/measured writes
    cost_<gpu>_*.json.

A rank's work in one step is a list of per-slot token counts ("counts": tokens sent to each local
expert it must run). It is run the way SGLang 0.5.23's Triton MoE path runs it with
``--moe-a2a-backend none``: every (token, k) pair of the step goes into ``moe_align_block_size``'s
layout (the pairs of other ranks' experts as -1, whose blocks the kernel fills with zeros; SGLang's
buffer size, so the kernel's grid is SGLang's), ``invoke_fused_moe_kernel`` (gate/up GEMM),
SiLU-and-mul, ``invoke_fused_moe_kernel`` (down GEMM, routed weight applied), with SGLang's own
config lookup (tuned file, else its default).
The kernel module is loaded from the sglang wheel without installing SGLang (see ``load_sglang_moe``).
A second path runs the same work as plain per-expert cuBLAS matmuls (torch) for comparison.

Times are CUDA-graph replays (median of ``--reps``); each graph runs the work on ``COPIES`` disjoint
weight sets so no expert is read twice from L2 within one replay, and the time is divided by COPIES.

    # on the GPU (writes raw timings)
    python3 scripts/calibrate_cost.py measure --sglang-wheel '.whl/sglang-*.whl' --out calib.json
    # here (fits, writes moeplace/cost/measured/cost_h200_*.json)
    python scripts/calibrate_cost.py fit calib.json --out-dir moeplace/cost/measured

``CONFIG_SWEEPS`` (``--only`` their labels) measure each expert slice of the EP x TP layouts at each
kernel config SGLang runs it with, through ``StaticStep`` (launches captured once per step size).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

# moeplace from this checkout, also on a GPU machine where it is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeplace.cost.derive import sglang_sorted_rows  # noqa: E402
from moeplace.cost.model import extra_row_blocks  # noqa: E402

COPIES = 4
L2_FLUSH_BYTES = 2 * 60 << 20   # twice the H200's L2: reads of at least this leave no weight cached for the next replay
MIN_COPIES = 2                  # a graph's launch (a few µs) is then shared by two copies of the work
VERIFY_TOKENS = 9   # tokens in a verify step (1 + 8 draft tokens): the regime the cost files are fit for
# Expert shapes. hidden, intermediate per expert (SiLU-gated: gate+up is 2*inter wide), local slots.
# SGLang (--moe-a2a-backend none) picks the kernel config by M = the step's token count T, which every
# rank sees; a sweep point of n (token, expert) pairs on one rank stands for a step of
# T = n * STEP_TOKENS_PER_PAIR[shape] tokens (EP: pairs spread over R ranks, T = n * R / K; TP: T = n / K).
STEP_TOKENS_PER_PAIR = {"kimi-ep": 8 / 8, "kimi-tp": 1 / 8, "gptoss-ep": 8 / 4, "gptoss-tp": 1 / 4}
SHAPES = {  # top_k: the model's experts per token (SGLang's buffer holds the step's tokens x top_k pairs)
    "kimi-ep": dict(hidden=7168, inter=2048, n_local=48, top_k=8),     # Kimi K2, EP 8: 384 / 8 experts a rank
    "kimi-tp": dict(hidden=7168, inter=256, n_local=384, top_k=8),     # Kimi K2, TP 8: 1/8 of every expert
    "gptoss-ep": dict(hidden=2880, inter=2880, n_local=4, top_k=4),    # GPT-OSS-20B, EP 8: 32 / 8
    "gptoss-tp": dict(hidden=2880, inter=360, n_local=32, top_k=4),    # GPT-OSS-20B, TP 8
}


# ---------------------------------------------------------------------------------------------
# Loading SGLang's Triton MoE kernel from the wheel (GPU side).

def load_sglang_moe(wheel: str | None):
    """(fused_moe_triton_kernels module, fused_moe_triton_config module, sglang version).

    The kernel module needs only small pieces of the package: platform predicates of
    ``sglang.srt.utils``, ``envs``, a padding size, the batch-invariant flag, and fp8/int8
    activation-quant helpers (unused here: activations are passed pre-quantized); ``sglang_wheel``
    says how the rest is kept out.
    """
    import torch

    from sglang_wheel import register_packages, stub, unpack

    root, version = unpack(wheel)
    register_packages(root, [
        "sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.moe",
        "sglang.kernels.ops.quantization", "sglang.kernels.jit", "sglang.srt", "sglang.srt.layers",
        "sglang.srt.layers.moe", "sglang.srt.layers.moe.moe_runner", "sglang.srt.layers.moe.moe_runner.triton_utils"])

    def unused(*a, **k):
        raise NotImplementedError("activation quant helper: pass pre-quantized activations")

    major = torch.cuda.get_device_capability()[0]
    stub("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: major >= 9)
    stub("sglang.kernels.ops.quantization.fp8_kernel", per_token_group_quant_fp8=unused,
         scaled_fp8_quant=unused, sglang_per_token_group_quant_fp8=unused)
    stub("sglang.kernels.ops.quantization.int8_kernel", per_token_group_quant_int8=unused,
         per_token_quant_int8=unused, sglang_per_token_group_quant_int8=unused)
    stub("sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=lambda: False)
    stub("sglang.srt.layers.moe.utils", get_moe_padding_size=lambda is_aiter: 0)
    stub("sglang.srt.utils", cpu_has_amx_support=lambda: False, is_cpu=lambda: False, is_cuda=lambda: True,
         is_hip=lambda: False, is_sm90_supported=lambda: major == 9,
         get_device_name=lambda device_id=0: torch.cuda.get_device_name(device_id))
    det = types.SimpleNamespace(deterministic=types.SimpleNamespace(enable_deterministic_inference=False))
    stub("sglang.srt.runtime_context", get_exec=lambda: det)
    kernels = importlib.import_module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
    config = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    return kernels, config, version


# ---------------------------------------------------------------------------------------------
# One rank's MoE work (GPU side).

def align_layout(ids: np.ndarray, num_local: int, block_m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """SGLang 0.5.23's ``moe_align_block_size`` of one rank: (sorted_ids, expert_ids, padded total).

    ids: [T, K] local slots, -1 for pairs of other ranks. Pairs are grouped by bucket ``id + 1`` (bucket
    0: the -1 pairs, whose blocks the kernel fills with zeros), each bucket padded to whole blocks of
    ``block_m``; a pad holds the sentinel ``T*K``. The buffer has SGLang's size
    (``moeplace.cost.derive.sglang_sorted_rows``); the kernel's grid covers all of it (blocks past the
    padded total exit at once, their expert ids are -1).
    """
    flat = ids.reshape(-1)
    numel = flat.size
    size = sglang_sorted_rows(numel, num_local, block_m)
    sorted_ids = np.full(size, numel, np.int32)
    expert_ids = np.full(-(-size // block_m), -1, np.int32)
    bucket = flat + 1
    counts = np.bincount(bucket, minlength=num_local + 1)
    padded = -(-counts // block_m) * block_m
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    order = np.argsort(bucket, kind="stable")
    rank_in_bucket = np.arange(numel) - np.concatenate([[0], np.cumsum(counts)[:-1]])[bucket[order]]
    sorted_ids[starts[bucket[order]] + rank_in_bucket] = order
    for b in np.flatnonzero(counts):
        expert_ids[starts[b] // block_m: (starts[b] + padded[b]) // block_m] = b - 1
    return sorted_ids, expert_ids, int(padded.sum())


def rank_pairs(counts: list[int], step_pairs: int) -> np.ndarray:
    """[step_pairs, 1] local slot of each pair of the step: slot s for the next counts[s] pairs, then -1
    for the pairs that go to other ranks."""
    own = np.repeat(np.arange(len(counts)), counts)
    if own.size > step_pairs:
        raise ValueError(f"{own.size} pairs on the rank but only {step_pairs} in the step")
    return np.concatenate([own, np.full(step_pairs - own.size, -1)])[:, None]


class RankMoe:
    """Weights of ``COPIES`` EP ranks of one shape and dtype; ``work(counts)`` returns a launch closure.

    top_k: the model's experts per token (a step of T tokens has T * top_k pairs in SGLang's layout).
    dtype: "bf16" | "fp8" (block [128, 128] weights, per-token-group activations, as Kimi K2 ships)
           | "int4" (weight-only, group 32, as Kimi K2 Thinking ships). path: "triton" | "torch".
    """

    def __init__(self, sgl, hidden: int, inter: int, n_local: int, top_k: int, dtype: str = "bf16",
                 path: str = "triton"):
        import torch
        self.torch = torch
        self.kernels, self.cfgmod, _ = sgl
        self.H, self.I, self.E, self.top_k, self.dtype, self.path = hidden, inter, n_local, top_k, dtype, path
        self._steps: dict[int, StaticStep] = {}
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.w13, self.w2, self.s13, self.s2 = [], [], [], []
        for _ in range(COPIES):
            if dtype == "int4":
                self.w13.append(torch.randint(0, 256, (n_local, 2 * inter, hidden // 2), dtype=torch.uint8,
                                              device="cuda", generator=gen))
                self.w2.append(torch.randint(0, 256, (n_local, hidden, inter // 2), dtype=torch.uint8,
                                             device="cuda", generator=gen))
                self.s13.append(torch.rand(n_local, 2 * inter, hidden // 32, device="cuda", generator=gen)
                                .to(torch.bfloat16) * 0.01)
                self.s2.append(torch.rand(n_local, hidden, inter // 32, device="cuda", generator=gen)
                               .to(torch.bfloat16) * 0.01)
                continue
            w13 = torch.randn(n_local, 2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            w2 = torch.randn(n_local, hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16)
            if dtype == "fp8":
                self.w13.append(w13.to(torch.float8_e4m3fn))
                self.w2.append(w2.to(torch.float8_e4m3fn))
                self.s13.append(torch.full((n_local, 2 * inter // 128, hidden // 128), 0.01, device="cuda"))
                self.s2.append(torch.full((n_local, hidden // 128, -(-inter // 128)), 0.01, device="cuda"))
                del w13, w2
            else:
                self.w13.append(w13)
                self.w2.append(w2)
                self.s13.append(None)
                self.s2.append(None)

    def tuned_configs(self) -> dict | None:
        """SGLang's tuned configs for this rank's (E, N, device, dtype), None where it ships none."""
        dtype = {"bf16": None, "fp8": "fp8_w8a8", "int4": "int4_w4a16"}[self.dtype]
        block = {"bf16": None, "fp8": [128, 128], "int4": [0, 32]}[self.dtype]
        return self.cfgmod.get_moe_configs(self.E, self.I, dtype, block[0] if block else 0,
                                           block[1] if block else 0, per_channel_quant=False, down_moe=False)

    def config(self, m: int) -> dict:
        """SGLang's choice for M rows: its tuned file for (E, N, device, dtype) if any, else its default."""
        dtype = {"bf16": None, "fp8": "fp8_w8a8", "int4": "int4_w4a16"}[self.dtype]
        block = {"bf16": None, "fp8": [128, 128], "int4": [0, 32]}[self.dtype]
        configs = self.tuned_configs()
        if configs:
            return dict(configs[min(configs, key=lambda x: abs(x - m))])
        return dict(self.cfgmod.get_default_config(m, self.E, self.I, self.H, 1, dtype, False, block))

    def _quant(self, x):
        """Per-token-group (128) fp8 activation quant, as SGLang's block-fp8 path does before each GEMM."""
        torch = self.torch
        n, k = x.shape
        g = x.float().view(n, k // 128, 128)
        scale = (g.abs().amax(-1).clamp(min=1e-4) / 448.0)
        return (g / scale[..., None]).to(torch.float8_e4m3fn).view(n, k), scale

    def work(self, counts: list[int], config_m: int | None = None):
        """A closure that runs this rank's step (counts[s] tokens to local slot s) on every weight copy.

        config_m: the step's tokens T: the M SGLang's config lookup sees, and T * top_k pairs in the
        layout (the rank's own and, as -1, the rest). Default: the rank's pairs.
        """
        torch = self.torch
        import triton.language as tl
        n = max(1, sum(counts))
        if self.path == "torch":
            xs = [torch.randn(n, self.H, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            rows = [(s, int(np.sum(counts[:s])), c) for s, c in enumerate(counts) if c]

            def run_torch():
                for i in range(COPIES):
                    out = torch.empty_like(xs[i])
                    for s, r0, c in rows:
                        h = xs[i][r0:r0 + c] @ self.w13[i][s].t()
                        h = torch.nn.functional.silu(h[:, :self.I]) * h[:, self.I:]
                        out[r0:r0 + c] = h @ self.w2[i][s].t()
            return run_torch

        config_m = config_m or n
        cfg = self.config(config_m)
        ids = rank_pairs(counts, max(n, config_m * self.top_k))   # one row per pair: the kernel runs top-k 1
        pairs = ids.shape[0]
        sorted_ids, expert_ids, padded = align_layout(ids, self.E, cfg["BLOCK_SIZE_M"])
        xs = [torch.randn(pairs, self.H, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        sorted_ids = torch.from_numpy(sorted_ids).cuda()
        expert_ids = torch.from_numpy(expert_ids).cuda()
        post = torch.tensor([padded], dtype=torch.int32, device="cuda")
        topk_ids = torch.from_numpy(ids.astype(np.int32)).cuda()
        topk_w = torch.rand(pairs, 1, device="cuda")
        c1 = torch.empty(pairs, 2 * self.I, device="cuda", dtype=torch.bfloat16)
        c2 = torch.empty(pairs, self.H, device="cuda", dtype=torch.bfloat16)
        q = dict(use_fp8_w8a8=self.dtype == "fp8", use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=self.dtype == "int4", per_channel_quant=False,
                 block_shape={"bf16": None, "fp8": [128, 128], "int4": [0, 32]}[self.dtype])
        k = self.kernels

        def gemm(a, a_scale, w, w_scale, c, routed):
            k.invoke_fused_moe_kernel(a, w, None, c, a_scale, w_scale, None, topk_w, topk_ids, sorted_ids,
                                      expert_ids, post, routed, 1, cfg, tl.bfloat16, **q)

        def run():
            for i in range(COPIES):
                a, a_s = self._quant(xs[i]) if self.dtype == "fp8" else (xs[i], None)
                gemm(a, a_s, self.w13[i], self.s13[i], c1, False)
                h = torch.nn.functional.silu(c1[:, :self.I]) * c1[:, self.I:]
                h, h_s = self._quant(h) if self.dtype == "fp8" else (h, None)
                gemm(h, h_s, self.w2[i], self.s2[i], c2, True)
        run.last = (xs[-1], topk_w, c2)  # inputs and output of the last copy, for check()
        run.step_pairs = pairs
        return run

    def step(self, step_tokens: int) -> "StaticStep":
        """The rank's launches for steps of ``step_tokens`` tokens, captured once (``StaticStep``)."""
        if step_tokens not in self._steps:
            self._steps[step_tokens] = StaticStep(self, step_tokens)
        return self._steps[step_tokens]

    def check(self, counts: list[int]) -> float:
        """Relative error of one run against an fp32 torch reference (bf16 and fp8 weights); the rows of
        other ranks' pairs must come out zero."""
        torch = self.torch
        run = self.work(counts)
        x, w, out = run.last
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        scale = 0.01 if self.dtype == "fp8" else 1.0
        w13, w2 = self.w13[-1].float() * scale, self.w2[-1].float() * scale
        ref = torch.zeros(out.shape, device="cuda")
        r0 = 0
        for s, c in enumerate(counts):
            if c:
                h = x[r0:r0 + c].float() @ w13[s].t()
                h = torch.nn.functional.silu(h[:, :self.I]) * h[:, self.I:]
                ref[r0:r0 + c] = (h @ w2[s].t()) * w[r0:r0 + c]
                r0 += c
        return float((out.float() - ref).norm() / ref.norm())


def copies_for(distinct: int, expert_bytes: int) -> int:
    """Weight copies a replay cycles through so that its reads are at least ``L2_FLUSH_BYTES``: a rank
    reading less than that would find the previous replay's weights in L2."""
    return int(min(COPIES, max(MIN_COPIES, -(-L2_FLUSH_BYTES // max(1, distinct * expert_bytes)))))


class StaticStep:
    """One rank's launches for every workload of one step size, captured in CUDA graphs once.

    SGLang's sorted-token buffer, and so the kernels' grids, depend only on the step's pairs
    (``step_tokens`` x top-k), the rank's slots and BLOCK_SIZE_M, never on which slots get the pairs
    (``moeplace.cost.derive.sglang_sorted_rows``). So a workload is timed by writing its layout
    (sorted ids, expert ids, padded total) into the captured graph's buffers and replaying it: no
    capture per workload. A graph per weight-copy count (``copies_for``).
    """

    def __init__(self, rank: "RankMoe", step_tokens: int):
        import torch
        import triton.language as tl
        if rank.path != "triton" or rank.dtype != "bf16":
            raise ValueError("StaticStep times SGLang's bf16 Triton path")
        self.rank, self.torch, self.step_tokens = rank, torch, step_tokens
        self.cfg = rank.config(step_tokens)
        self.pairs = step_tokens * rank.top_k
        bm = self.cfg["BLOCK_SIZE_M"]
        size = sglang_sorted_rows(self.pairs, rank.E, bm)
        dev = dict(device="cuda")
        self.sorted_ids = torch.full((size,), self.pairs, dtype=torch.int32, **dev)
        self.expert_ids = torch.full((-(-size // bm),), -1, dtype=torch.int32, **dev)
        self.post = torch.zeros(1, dtype=torch.int32, **dev)
        self.topk_ids = torch.full((self.pairs, 1), -1, dtype=torch.int32, **dev)
        self.topk_w = torch.rand(self.pairs, 1, **dev)
        self.xs = [torch.randn(self.pairs, rank.H, dtype=torch.bfloat16, **dev) for _ in range(COPIES)]
        self.c1 = torch.empty(self.pairs, 2 * rank.I, dtype=torch.bfloat16, **dev)
        self.c2 = torch.empty(self.pairs, rank.H, dtype=torch.bfloat16, **dev)
        self.tl = tl
        self.graphs: dict[int, object] = {}
        self.expert_bytes = 3 * rank.H * rank.I * 2

    def _run(self, copies: int) -> None:
        torch, r = self.torch, self.rank
        q = dict(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                 per_channel_quant=False, block_shape=None)
        for i in range(copies):
            for a, w, c, routed in ((self.xs[i], r.w13[i], self.c1, False), (None, r.w2[i], self.c2, True)):
                if a is None:
                    a = torch.nn.functional.silu(self.c1[:, :r.I]) * self.c1[:, r.I:]
                r.kernels.invoke_fused_moe_kernel(a, w, None, c, None, None, None, self.topk_w, self.topk_ids,
                                                  self.sorted_ids, self.expert_ids, self.post, routed, 1, self.cfg,
                                                  self.tl.bfloat16, **q)

    def _graph(self, copies: int):
        torch = self.torch
        if copies not in self.graphs:
            self._run(copies)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._run(copies)
            self.graphs[copies] = g
        return self.graphs[copies]

    def load(self, counts: list[int]) -> int:
        """Write the layout of ``counts`` (tokens per local slot) into the buffers; returns the copies to run."""
        torch = self.torch
        ids = rank_pairs(counts, self.pairs)
        sorted_ids, expert_ids, padded = align_layout(ids, self.rank.E, self.cfg["BLOCK_SIZE_M"])
        self.sorted_ids.copy_(torch.from_numpy(sorted_ids))
        self.expert_ids.copy_(torch.from_numpy(expert_ids))
        self.post.fill_(padded)
        self.topk_ids.copy_(torch.from_numpy(ids.astype(np.int32)))
        return copies_for(sum(1 for c in counts if c), self.expert_bytes)

    def time_us(self, counts: list[int], reps: int) -> float:
        """Median µs of this rank's step with ``counts`` (graph replays, per weight copy)."""
        from cuda_timing import replay_us  # scripts/ is on sys.path

        copies = self.load(counts)
        g = self._graph(copies)
        g.replay()
        return replay_us(g, reps) / copies


def graph_time_us(fn, reps: int) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph, divided by COPIES."""
    import cuda_timing  # scripts/ is on sys.path

    return cuda_timing.graph_time_us(fn, reps, warmup_replays=2) / COPIES


def even_counts(distinct: int, tokens: int) -> list[int]:
    """``tokens`` spread as evenly as possible over ``distinct`` slots."""
    if distinct == 0:
        return []
    return [tokens // distinct + (i < tokens % distinct) for i in range(distinct)]


def sweep_grid(name: str) -> list[tuple[int, int]]:
    """(distinct experts, tokens) points; tokens counts (token, expert) pairs on the rank."""
    if name == "kimi-tp":
        ds, ns = [1, 8, 16, 32, 48, 64, 72, 96, 128, 192, 256, 384], [8, 16, 32, 72, 128, 256, 512, 1024, 2048]
    elif name == "gptoss-tp":
        ds, ns = [1, 2, 4, 8, 12, 16, 20, 24, 32], [4, 9, 16, 36, 72, 144, 288]
    elif name == "gptoss-ep":
        ds, ns = [1, 2, 3, 4], [1, 2, 4, 9, 16, 24, 36, 64]
    elif name == "torch":
        ds, ns = [1, 4, 8, 16, 32, 48], [9, 64, 256]
    else:
        ds, ns = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48], [1, 2, 4, 9, 16, 32, 64, 128, 256]
    points = [(d, n) for d in ds for n in ns if d <= n]
    return points if name in ("kimi-tp", "gptoss-tp", "torch") else [(0, 0)] + points


# SGLang's default bf16 config switches from 16-row to 64-row blocks once a step's tokens exceed the rank's
# local experts (``get_default_config``: M > E). One sweep per (expert slice, config) that the EP x TP
# layouts (EP8, EP4xTP2, EP2xTP4, TP8 on 8 GPUs) meet at 9-576 tokens and no file above covers: label ->
# (hidden, intermediate of the slice, local slots, top-k, EP groups, step tokens). Each runs every point at one
# step size (the smallest batch of its config), so its c is that step's; the cost model moves it to other
# steps and slot counts by the launch grid (``moeplace.cost.derive.measured_line``).
CONFIG_SWEEPS = {
    "kimi-i2048-bm16": (7168, 2048, 60, 8, 8, 36),      # EP8 with 96 spare slots at 36 tokens (36 <= 60)
    "kimi-i2048-bm64": (7168, 2048, 48, 8, 8, 72),
    "kimi-i1024-bm16": (7168, 1024, 96, 8, 4, 9),
    "kimi-i1024-bm64": (7168, 1024, 96, 8, 4, 144),
    "kimi-i512-bm16": (7168, 512, 192, 8, 2, 9),
    "kimi-i512-bm64": (7168, 512, 192, 8, 2, 288),
    "kimi-i256-bm16": (7168, 256, 384, 8, 1, 9),        # TP8 from a verify step to 384 tokens
    "kimi-i256-bm64": (7168, 256, 384, 8, 1, 576),
    "gptoss-i2880-bm64": (2880, 2880, 5, 4, 8, 9),      # EP8 with 8 spare slots
    "gptoss-i1440-bm64": (2880, 1440, 8, 4, 4, 9),
    "gptoss-i1440-bm16": (2880, 1440, 10, 4, 4, 9),     # 8 spare slots: 10 a group, 9 tokens <= 10
    "gptoss-i720-bm16": (2880, 720, 16, 4, 2, 9),
    "gptoss-i720-bm64": (2880, 720, 16, 4, 2, 36),
    "gptoss-i360-bm64": (2880, 360, 32, 4, 1, 36),
}


def config_sweep_points(slots: int, step_pairs: int, groups: int) -> list[tuple[int, int]]:
    """(distinct, pairs on the rank) of a config sweep: up to 8 expert counts to the rank's slots, and pair
    counts around the mean share of the step's pairs (``step_pairs / groups``) up to twice it."""
    mean = step_pairs / groups
    ds = sorted({max(1, round(x)) for x in np.linspace(1, min(slots, step_pairs), 8)})
    ns = sorted({max(1, min(step_pairs, round(mean * f))) for f in (0.25, 0.5, 1.0, 1.5, 2.0)})
    return [(d, max(d, n)) for d in ds for n in ns if n >= d or n == ns[-1]]


ROW_BLOCK_STEP_TOKENS = 576   # the largest batch the layout replay evaluates


def row_block_counts(slots: int, step_pairs: int, block_m: int, inter: int, config: dict) -> list[list[int]]:
    """Workloads where some experts run several row blocks: ``hot`` experts of (k - 1) * BM + 1 or k * BM
    pairs (k = 2, 3) beside experts of one block (a quarter block each), and the same experts without them
    (hot = 0), at three expert counts from where they fill the GPU to the rank's slots. What a row block
    beyond an expert's first costs, apart from its pairs, is the fit's ``r``."""
    base = max(1, block_m // 4)
    ds = sorted({min(slots, filling_experts(inter, config)), (filling_experts(inter, config) + slots) // 2, slots})
    out = []
    for d in ds:
        for hot in (0, 1, 2, 4):
            for k in ((2, 3) if hot else (1,)):
                for c in (((k - 1) * block_m + 1, k * block_m) if hot else (base,)):
                    counts = [c] * min(hot, d) + [base] * (d - min(hot, d))
                    if sum(counts) <= step_pairs:
                        out.append(counts)
    return out


def measure_config_sweep(sgl, label: str, reps: int) -> dict:
    """One ``CONFIG_SWEEPS`` entry: every point at its step size, through ``StaticStep``: even spreads of pairs
    over experts (``config_sweep_points``), then uneven ones with experts of several row blocks."""
    hidden, inter, slots, top_k, groups, tokens = CONFIG_SWEEPS[label]
    rank = RankMoe(sgl, hidden, inter, slots, top_k)
    step = rank.step(tokens)
    bm = step.cfg["BLOCK_SIZE_M"]
    # The uneven workloads run at the largest step of the same config (room for several blocks an expert):
    # 576 tokens for 64-row blocks, as many tokens as slots for 16-row ones (SGLang's M <= E).
    big = rank.step(ROW_BLOCK_STEP_TOKENS if bm == 64 else slots)
    assert big.cfg == step.cfg, (big.cfg, step.cfg)
    work = [(step, even_counts(d, n)) for d, n in dict.fromkeys(config_sweep_points(slots, tokens * top_k, groups))]
    work += [(big, c) for c in row_block_counts(slots, big.pairs, bm, inter, step.cfg)]
    rows = []
    for at, counts in work:
        # every slot of a workload has pairs: its experts' first blocks, then the blocks past them
        rows.append({"distinct": len(counts), "tokens": sum(counts),
                     "row_blocks": len(counts) + int(extra_row_blocks(counts, bm)),
                     "us": at.time_us(counts, reps), "config_m": at.step_tokens, "step_pairs": at.pairs,
                     "config": at.cfg})
    shape = dict(hidden=hidden, inter=inter, n_local=slots, top_k=top_k)
    return {"shape": shape, "dtype": "bf16", "path": "triton", "points": rows, "step_tokens": tokens,
            "tuned_file": bool(rank.tuned_configs())}


SWEEPS = [  # (label, shape, dtype, path, grid), most needed first
    ("kimi-ep-bf16", "kimi-ep", "bf16", "triton", "kimi-ep"),
    ("kimi-tp-bf16", "kimi-tp", "bf16", "triton", "kimi-tp"),
    ("gptoss-ep-bf16", "gptoss-ep", "bf16", "triton", "gptoss-ep"),
    ("gptoss-tp-bf16", "gptoss-tp", "bf16", "triton", "gptoss-tp"),
    ("kimi-ep-fp8", "kimi-ep", "fp8", "triton", "kimi-ep"),
    ("kimi-ep-bf16-torch", "kimi-ep", "bf16", "torch", "torch"),
    ("kimi-ep-int4", "kimi-ep", "int4", "triton", "kimi-ep"),
]


def measure(args) -> None:
    import torch
    import triton
    sgl = load_sglang_moe(args.sglang_wheel)
    # Two ceilings measured in the same run, to read the fitted a against.
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_us = graph_time_us(lambda: [dst.copy_(src) for _ in range(COPIES)], 10)
    del src, dst
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "sglang": sgl[2], "date": datetime.date.today().isoformat(), "copies": COPIES,
              "copy_gbps": 2 * n / copy_us / 1e3, "sweeps": {}}
    print(f"{result['gpu']} sglang {sgl[2]} triton {triton.__version__}: copy {result['copy_gbps']:.0f} GB/s",
          flush=True)
    # Correctness first (and PDL launches inside CUDA graphs: if they fail, SGLang's non-PDL launch).
    for dtype in ("bf16", "fp8"):
        try:
            err = RankMoe(sgl, **SHAPES["gptoss-ep" if dtype == "bf16" else "kimi-ep"], dtype=dtype).check([3, 0, 5, 1])
            graph_time_us(RankMoe(sgl, **SHAPES["gptoss-ep"]).work([2, 1]), 3)
        except Exception as e:
            print(f"check {dtype} failed ({type(e).__name__}: {str(e)[:200]}); retrying without PDL", flush=True)
            sgl[0].is_arch_support_pdl = lambda: False
            result["pdl"] = False
            err = RankMoe(sgl, **SHAPES["gptoss-ep"], dtype="bf16").check([3, 0, 5, 1]) if dtype == "bf16" else None
        result[f"check_rel_err_{dtype}"] = err
        print(f"check {dtype}: rel err vs fp32 reference {err}", flush=True)
        torch.cuda.empty_cache()
    only = set(args.only.split(",")) if args.only else None
    deadline = time.time() + args.budget_s
    def due(label: str) -> bool:
        """Whether sweep ``label`` runs: asked for (--only) and within the time budget (else one line)."""
        if only and label not in only:
            return False
        if time.time() > deadline:
            print(f"{label}: skipped (time budget)", flush=True)
            return False
        return True

    for label in CONFIG_SWEEPS:
        if not due(label):
            continue
        t0 = time.time()
        result["sweeps"][label] = sweep = measure_config_sweep(sgl, label, args.reps)
        gc.collect()         # a RankMoe and its StaticSteps refer to each other
        torch.cuda.empty_cache()
        print(f"{label}: {len(sweep['points'])} points in {time.time() - t0:.1f} s, "
              f"config {sweep['points'][0]['config']}, tuned file: {sweep['tuned_file']}; " + " ".join(
                  f"{r['distinct']}/{r['tokens']}:{r['us']:.0f}" for r in sweep["points"][::5]), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    for label, shape, dtype, path, grid in SWEEPS:
        if not due(label):
            continue
        t0 = time.time()
        try:
            rank = RankMoe(sgl, **SHAPES[shape], dtype=dtype, path=path)
            rows = []
            for d, tokens in sweep_grid(grid):
                counts = even_counts(d, tokens)
                config_m = max(1, round(tokens * STEP_TOKENS_PER_PAIR[shape]))
                work = rank.work(counts, config_m)
                us = graph_time_us(work, args.reps)
                rows.append({"distinct": d, "tokens": tokens, "us": us, "config_m": config_m,
                             "step_pairs": getattr(work, "step_pairs", None),
                             "config": rank.config(config_m) if path == "triton" else None})
            result["sweeps"][label] = {"shape": SHAPES[shape], "dtype": dtype, "path": path, "points": rows}
            print(f"{label}: {len(rows)} points in {time.time() - t0:.0f} s; "
                  + " ".join(f"{r['distinct']}/{r['tokens']}:{r['us']:.0f}" for r in rows[::6]), flush=True)
        except Exception as e:  # one failing sweep (e.g. int4) must not lose the others
            result["sweeps"][label] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            rank = None
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------
# Fitting (CPU side).

def fit_linear(points: list[dict], max_tokens: int | None = None) -> dict:
    """Least squares ``us = a * distinct + b * tokens + c`` over points (tokens <= max_tokens if given).

    Points with no expert are left out: an idle rank is never a step's slowest. Returns a, b, c, and
    the mean / max relative error of the fit on the points used.
    """
    pts = [p for p in points if p["distinct"] > 0 and (max_tokens is None or p["tokens"] <= max_tokens)]
    X = np.array([[p["distinct"], p["tokens"], 1.0] for p in pts])
    y = np.array([p["us"] for p in pts])
    # Relative least squares: every point counts by its relative error, so small steps are fit too.
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    rel = np.abs(X @ coef - y) / y
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "points": len(pts),
            "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def fit_with_row_blocks(points: list[dict], step_tokens: int) -> dict:
    """Relative least squares ``us = a * distinct + r * (row_blocks - distinct) + b * tokens + c_step`` over
    config-sweep points, with one c for each step size the points ran at (the launch grid differs), every
    term non-negative; returns a, r, b, the c of ``step_tokens``' points and the mean / max relative error."""
    from scipy.optimize import nnls
    steps = sorted({p["config_m"] for p in points})
    X = np.array([[p["distinct"], p["row_blocks"] - p["distinct"], p["tokens"]]
                  + [float(p["config_m"] == t) for t in steps] for p in points])
    y = np.array([p["us"] for p in points])
    w = 1.0 / y
    coef = nnls(X * w[:, None], y * w)[0]
    rel = np.abs(X @ coef - y) / y
    return {"a": float(coef[0]), "r": float(coef[1]), "b": float(coef[2]), "c": float(coef[3 + steps.index(step_tokens)]),
            "c_at_steps": {str(t): round(float(coef[3 + i]), 2) for i, t in enumerate(steps)},
            "points": len(points), "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def linear_range(points: list[dict], tol: float = 0.10) -> int | None:
    """The largest token bound up to which one linear fit stays within ``tol`` mean relative error."""
    best = None
    for bound in sorted({p["tokens"] for p in points if p["tokens"] >= 4}):
        if fit_linear(points, bound)["mean_rel_err"] <= tol:
            best = bound
    return best


H200_SMS = 132


def filling_experts(inter: int, config: dict) -> int:
    """Experts whose gate/up programs (one row block each: 2 x inter / BLOCK_SIZE_N) fill the GPU's SMs twice.
    Below that the kernel is latency-bound and sublinear in experts (BENCHMARKS.md#measured-lines: 1, 2, 4 experts cost
    66, 79, 106 µs in the 16-row config), a regime the slowest GPU of a layer at these batches is not in."""
    return -(-2 * H200_SMS // -(-2 * inter // config["BLOCK_SIZE_N"]))


def fit(args) -> None:
    raw = json.loads(Path(args.calib).read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"kimi-ep-bf16": "cost_h200_bf16.json", "kimi-ep-fp8": "cost_h200_fp8.json",
             "kimi-ep-int4": "cost_h200_int4.json", "kimi-tp-bf16": "cost_h200_bf16_tp8.json",
             "gptoss-ep-bf16": "cost_h200_bf16_gptoss.json", "gptoss-tp-bf16": "cost_h200_bf16_gptoss_tp8.json",
             "kimi-ep-bf16-torch": None}
    for label, sweep in raw["sweeps"].items():
        if "error" in sweep:
            print(f"{label}: no data ({sweep['error'][:120]})")
            continue
        pts = sweep["points"]
        full = fit_linear(pts)
        bound = linear_range(pts)
        # The file is for verify steps (T = VERIFY_TOKENS): fit the points that ran the kernel config
        # SGLang picks at that T. Other configs (M > local experts) are a different line (see fit notes).
        tokens = sweep.get("step_tokens", VERIFY_TOKENS)     # a config sweep ran every point at one step size
        verify_cfg = min(pts, key=lambda p: abs(p.get("config_m", p["tokens"]) - tokens))["config"]
        same = [p for p in pts if p["config"] == verify_cfg]
        blocks = label in CONFIG_SWEEPS and all("row_blocks" in p for p in pts)
        if label in CONFIG_SWEEPS:   # a layer's slowest GPU runs many experts: fit where they fill the GPU
            same = [p for p in same if p["distinct"] >= filling_experts(sweep["shape"]["inter"], verify_cfg)] or same
        low = fit_with_row_blocks(same, tokens) if blocks else fit_linear(same)
        print(f"{label}: all points a={full['a']:.2f} b={full['b']:.3f} c={full['c']:.1f} "
              f"(mean err {full['mean_rel_err']:.1%}, max {full['max_rel_err']:.1%}); "
              f"verify config: a={low['a']:.2f} r={low.get('r', 0):.2f} b={low['b']:.3f} c={low['c']:.1f} (mean err {low['mean_rel_err']:.1%}); "
              f"linear within 10% up to {bound} tokens")
        name = files.get(label) or (f"cost_h200_bf16_{label.replace('-', '_')}.json"
                                    if label in CONFIG_SWEEPS else None)
        if not name:
            continue
        s = sweep["shape"]
        doc = {
            "a_us_per_expert": round(low["a"], 3), "b_us_per_token": round(low["b"], 4), "c_us": round(low["c"], 2),
            **({"r_us_per_block": round(low["r"], 3), "block_m": verify_cfg["BLOCK_SIZE_M"]} if blocks else {}),
            "provenance": {
                "gpu": raw["gpu"], "date": raw["date"], "dtype": sweep["dtype"],
                "kernel": (f"sglang {raw['sglang']} fused_moe_kernel via invoke_fused_moe_kernel (Triton "
                           f"{raw['triton']}), SGLang's config lookup; gate/up GEMM + SiLU-and-mul + down GEMM"),
                "shape": {"hidden": s["hidden"], "expert_intermediate": s["inter"], "local_slots": s["n_local"]},
                # sweeps that know their top-k ran SGLang's buffer (moeplace.cost.derive.Measured)
                **({"align_layout": "sglang", "top_k": s["top_k"]} if "top_k" in s else {}),
                "fit": (f"relative least squares over the {low['points']} sweep points that ran SGLang's "
                        f"kernel config for a {tokens}-token step ({verify_cfg})"
                        + (f" with at least {filling_experts(s['inter'], verify_cfg)} experts (they fill the GPU)"
                           if label in CONFIG_SWEEPS else "")
                        + (f"; r from the points with experts of several row blocks, run at a "
                           f"{max(p['config_m'] for p in same)}-token step (its own c)" if blocks else "")),
                "step_tokens": tokens,
                # the fixed cost measured at each step size the points ran at (moeplace.cost.derive.measured_line)
                **({"c_us_at_step_tokens": low["c_at_steps"]} if blocks else {}),
                "kernel_config": [verify_cfg[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")],
                **({"tuned_file": sweep["tuned_file"]} if "tuned_file" in sweep else {}),
                "fit_mean_rel_err": round(low["mean_rel_err"], 4), "fit_max_rel_err": round(low["max_rel_err"], 4),
                "linear_up_to_tokens": bound,
                "all_points_fit": {k: round(full[k], 4) for k in ("a", "b", "c", "mean_rel_err", "max_rel_err")},
                "copy_gbps": round(raw["copy_gbps"]),
                "source": "scripts/calibrate_cost.py measure (CUDA-graph replay medians)",
            },
        }
        (out_dir / name).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"  wrote {out_dir / name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--sglang-wheel", default=".whl/sglang-*.whl")
    m.add_argument("--out", required=True)
    m.add_argument("--reps", type=int, default=15)
    m.add_argument("--only", default="", help="comma list of sweep labels")
    m.add_argument("--budget-s", type=float, default=180, help="start no new sweep after this many seconds")
    f = sub.add_parser("fit")
    f.add_argument("calib")
    f.add_argument("--out-dir", default="moeplace/cost/measured")
    args = p.parse_args()
    {"measure": measure, "fit": fit}[args.cmd](args)


if __name__ == "__main__":
    main()
