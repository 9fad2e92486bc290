"""One GPU's fused-MoE work timed the way SGLang 0.5.23 runs it (GPU side of ``moeplace calibrate``).

A GPU's work in one step is a list of per-slot token counts ("counts": tokens sent to each local expert it must
run). It runs as SGLang's Triton MoE path runs it with ``--moe-a2a-backend none``: every (token, k) pair of the
step goes into ``moe_align_block_size``'s layout (the pairs of other GPUs' experts as -1, whose blocks the kernel
fills with zeros; SGLang's buffer size, so the kernel's grid is SGLang's), ``invoke_fused_moe_kernel`` (gate/up
GEMM), SiLU-and-mul, ``invoke_fused_moe_kernel`` (down GEMM, routed weight applied), with SGLang's own config
lookup (its tuned file for the shape and device, else its default). The kernel code is SGLang's, imported from
the installed package (``load_fused_moe``); scripts that run without SGLang installed pass the same modules from
its wheel.

Times are CUDA-graph replays (median of ``reps``); each graph runs the work on enough disjoint weight copies
(``copies_for``) that no expert is read twice from L2 within one replay, and the time is divided by the copies.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import numpy as np

from moeplace.cost.derive import sglang_sorted_rows
from moeplace.model.expert_shape import WEIGHT_BYTES

COPIES = 4
L2_FLUSH_BYTES = 2 * 60 << 20   # twice an H200's L2: reads of at least this leave no weight cached for the next replay
MIN_COPIES = 2                  # a graph's launch (a few µs) is then shared by two copies of the work
QUANT = {"bf16": (None, None), "fp8": ("fp8_w8a8", [128, 128]), "int4": ("int4_w4a16", [0, 32])}


def load_fused_moe(device: str = "cuda") -> tuple[Any, Any, str]:
    """(SGLang's fused_moe_triton_kernels module, its fused_moe_triton_config module, SGLang's version), from the
    installed package, with SGLang's runtime context published (``publish_server_defaults``)."""
    import importlib

    import sglang
    kernels = importlib.import_module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
    config = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    publish_server_defaults(device)
    return kernels, config, sglang.__version__


def publish_server_defaults(device: str = "cuda") -> None:
    """SGLang's config lookup reads its runtime context (the deterministic-inference flag), which a server
    publishes at start. Outside a server it is published here as a server with default flags publishes it
    (SGLang's own ``ServerArgs``, for a tiny model folder: only the flags are read), unless one is published."""
    import json
    import tempfile
    from pathlib import Path

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    if runtime_context.get_context().is_config_namespace_published("exec"):
        return
    with tempfile.TemporaryDirectory(prefix="moeplace-calibrate-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
        runtime_context.publish(ServerArgs(model_path=folder, skip_tokenizer_init=True, device=device),
                                role="scheduler")


def capture(fn: Callable[[], Any], calls: int = 1):
    """A CUDA graph of ``calls`` calls of ``fn``, run once before so that compilation stays outside."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


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


def graph_time_us(fn: Callable[[], Any], reps: int = 50, warmup_replays: int = 1) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph (compile and warm-up outside)."""
    import torch

    g = capture(fn)
    for _ in range(warmup_replays):
        g.replay()
    torch.cuda.synchronize()
    return replay_us(g, reps)


def align_layout(ids: np.ndarray, num_local: int, block_m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """SGLang 0.5.23's ``moe_align_block_size`` of one GPU: (sorted_ids, expert_ids, padded total).

    ids: [T, K] local slots, -1 for pairs of other GPUs. Pairs are grouped by bucket ``id + 1`` (bucket 0: the -1
    pairs, whose blocks the kernel fills with zeros), each bucket padded to whole blocks of ``block_m``; a pad holds
    the sentinel ``T*K``. The buffer has SGLang's size (``moeplace.cost.derive.sglang_sorted_rows``); the kernel's
    grid covers all of it (blocks past the padded total exit at once, their expert ids are -1).
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
    """[step_pairs, 1] local slot of each pair of the step: slot s for the next counts[s] pairs, then -1 for the
    pairs that go to other GPUs."""
    own = np.repeat(np.arange(len(counts)), counts)
    if own.size > step_pairs:
        raise ValueError(f"{own.size} pairs on the rank but only {step_pairs} in the step")
    return np.concatenate([own, np.full(step_pairs - own.size, -1)])[:, None]


def copies_for(distinct: int, expert_bytes: float) -> int:
    """Weight copies a replay cycles through so that its reads are at least ``L2_FLUSH_BYTES``: a GPU reading less
    than that would find the previous replay's weights in L2."""
    return int(min(COPIES, max(MIN_COPIES, -(-L2_FLUSH_BYTES // max(1, int(distinct * expert_bytes))))))


class RankMoe:
    """Weights of ``COPIES`` GPUs of one shape and format; ``work(counts)`` returns a launch closure.

    sgl: ``load_fused_moe()``'s (kernels, config module, version). top_k: the model's experts per token (a step of
    T tokens has T * top_k pairs in SGLang's layout). dtype: "bf16" | "fp8" (block [128, 128] weights,
    per-token-group activations, as Kimi K2 ships) | "int4" (weight-only, group 32, as Kimi K2 Thinking ships).
    path: "triton" (SGLang's kernel) | "torch" (plain per-expert matmuls, a ceiling to read the kernel against).
    device: where the weights live ("cuda"; Triton's CPU interpreter takes "cpu" with float16 activations).
    """

    def __init__(self, sgl, hidden: int, inter: int, n_local: int, top_k: int, dtype: str = "bf16",
                 path: str = "triton", device: str = "cuda", act_dtype=None):
        import torch
        self.torch = torch
        self.kernels, self.cfgmod, _ = sgl
        self.H, self.I, self.E, self.top_k, self.dtype, self.path = hidden, inter, n_local, top_k, dtype, path
        self.device = device
        self.act_dtype = act_dtype or torch.bfloat16
        self._steps: dict[int, StaticStep] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        dev = dict(device=device, generator=gen)
        self.w13, self.w2, self.s13, self.s2 = [], [], [], []
        for _ in range(COPIES):
            if dtype == "int4":
                self.w13.append(torch.randint(0, 256, (n_local, 2 * inter, hidden // 2), dtype=torch.uint8, **dev))
                self.w2.append(torch.randint(0, 256, (n_local, hidden, inter // 2), dtype=torch.uint8, **dev))
                self.s13.append(torch.rand(n_local, 2 * inter, hidden // 32, **dev).to(torch.bfloat16) * 0.01)
                self.s2.append(torch.rand(n_local, hidden, inter // 32, **dev).to(torch.bfloat16) * 0.01)
                continue
            w13 = torch.randn(n_local, 2 * inter, hidden, dtype=self.act_dtype, **dev)
            w2 = torch.randn(n_local, hidden, inter, dtype=self.act_dtype, **dev)
            if dtype == "fp8":
                self.w13.append(w13.to(torch.float8_e4m3fn))
                self.w2.append(w2.to(torch.float8_e4m3fn))
                self.s13.append(torch.full((n_local, 2 * inter // 128, hidden // 128), 0.01, device=device))
                self.s2.append(torch.full((n_local, hidden // 128, -(-inter // 128)), 0.01, device=device))
                del w13, w2
            else:
                self.w13.append(w13)
                self.w2.append(w2)
                self.s13.append(None)
                self.s2.append(None)

    @property
    def expert_bytes(self) -> float:
        """Bytes one expert's weights (gate/up and down, scales included) take in this format."""
        return 3 * self.H * self.I * WEIGHT_BYTES[self.dtype]

    def tuned_configs(self) -> dict | None:
        """SGLang's tuned configs for this GPU's (E, N, device, format), None where it ships none."""
        dtype, block = QUANT[self.dtype]
        return self.cfgmod.get_moe_configs(self.E, self.I, dtype, block[0] if block else 0,
                                           block[1] if block else 0, per_channel_quant=False, down_moe=False)

    def config(self, m: int) -> dict:
        """SGLang's choice for M rows: its tuned file for (E, N, device, format) if any, else its default."""
        dtype, block = QUANT[self.dtype]
        configs = self.tuned_configs()
        if configs:
            return dict(configs[min(configs, key=lambda x: abs(x - m))])
        return dict(self.cfgmod.get_default_config(m, self.E, self.I, self.H, 1, dtype, False, block))

    def quant(self, x):
        """Per-token-group (128) fp8 activation quant, as SGLang's block-fp8 path does before each GEMM."""
        torch = self.torch
        n, k = x.shape
        g = x.float().view(n, k // 128, 128)
        scale = (g.abs().amax(-1).clamp(min=1e-4) / 448.0)
        return (g / scale[..., None]).to(torch.float8_e4m3fn).view(n, k), scale

    def gemms(self, x, c1, c2, topk_w, topk_ids, sorted_ids, expert_ids, post, cfg: dict, copy: int) -> None:
        """Gate/up GEMM, SiLU-and-mul, down GEMM with the routed weight: one copy's launches, as SGLang runs them."""
        import triton.language as tl
        torch = self.torch
        dtype, block = QUANT[self.dtype]
        q = dict(use_fp8_w8a8=self.dtype == "fp8", use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=self.dtype == "int4", per_channel_quant=False, block_shape=block)
        compute = tl.float16 if self.act_dtype == torch.float16 else tl.bfloat16
        a, a_s = self.quant(x) if self.dtype == "fp8" else (x, None)
        for w, s, c, routed in ((self.w13[copy], self.s13[copy], c1, False), (self.w2[copy], self.s2[copy], c2, True)):
            if routed:
                h = torch.nn.functional.silu(c1[:, :self.I]) * c1[:, self.I:]
                a, a_s = self.quant(h) if self.dtype == "fp8" else (h, None)
            self.kernels.invoke_fused_moe_kernel(a, w, None, c, a_s, s, None, topk_w, topk_ids, sorted_ids,
                                                 expert_ids, post, routed, 1, cfg, compute, **q)

    def work(self, counts: list[int], config_m: int | None = None):
        """A closure that runs this GPU's step (counts[s] tokens to local slot s) on every weight copy.

        config_m: the step's tokens T: the M SGLang's config lookup sees, and T * top_k pairs in the layout (the
        GPU's own and, as -1, the rest). Default: the GPU's pairs.
        """
        torch = self.torch
        n = max(1, sum(counts))
        dev = dict(device=self.device)
        if self.path == "torch":
            xs = [torch.randn(n, self.H, dtype=self.act_dtype, **dev) for _ in range(COPIES)]
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
        xs = [torch.randn(pairs, self.H, dtype=self.act_dtype, **dev) for _ in range(COPIES)]
        layout = (torch.from_numpy(sorted_ids).to(self.device), torch.from_numpy(expert_ids).to(self.device),
                  torch.tensor([padded], dtype=torch.int32, **dev))
        topk_ids = torch.from_numpy(ids.astype(np.int32)).to(self.device)
        topk_w = torch.rand(pairs, 1, **dev)
        c1 = torch.empty(pairs, 2 * self.I, dtype=self.act_dtype, **dev)
        c2 = torch.empty(pairs, self.H, dtype=self.act_dtype, **dev)

        def run():
            for i in range(COPIES):
                self.gemms(xs[i], c1, c2, topk_w, topk_ids, *layout, cfg, i)
        run.last = (xs[-1], topk_w, c2)  # inputs and output of the last copy, for check()
        run.step_pairs = pairs
        return run

    def step(self, step_tokens: int) -> "StaticStep":
        """The GPU's launches for steps of ``step_tokens`` tokens, captured once (``StaticStep``)."""
        if step_tokens not in self._steps:
            self._steps[step_tokens] = StaticStep(self, step_tokens)
        return self._steps[step_tokens]

    def check(self, counts: list[int]) -> float:
        """Relative error of one run against an fp32 torch reference (bf16 and fp8 weights); the rows of other
        GPUs' pairs must come out zero."""
        torch = self.torch
        run = self.work(counts)
        x, w, out = run.last
        out.fill_(float("nan"))
        run()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return reference_error(x, w, out, self.w13[-1], self.w2[-1], counts, 0.01 if self.dtype == "fp8" else 1.0)


def reference_error(x, topk_w, out, w13, w2, counts: list[int], scale: float = 1.0) -> float:
    """Relative error of ``out`` against an fp32 reference of the same pairs (slot s: the next counts[s] rows of
    ``x``), where every row past the GPU's own pairs must be zero."""
    import torch
    inter = w2.shape[-1]
    w13, w2 = w13.float() * scale, w2.float() * scale
    ref = torch.zeros(out.shape, device=out.device)
    r0 = 0
    for s, c in enumerate(counts):
        if c:
            h = x[r0:r0 + c].float() @ w13[s].t()
            h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            ref[r0:r0 + c] = (h @ w2[s].t()) * topk_w[r0:r0 + c]
            r0 += c
    return float((out.float() - ref).norm() / ref.norm())


class StaticStep:
    """One GPU's launches for every workload of one step size, captured in CUDA graphs once.

    SGLang's sorted-token buffer, and so the kernels' grids, depend only on the step's pairs (``step_tokens`` x
    top-k), the GPU's slots and BLOCK_SIZE_M, never on which slots get the pairs
    (``moeplace.cost.derive.sglang_sorted_rows``). So a workload is timed by writing its layout (sorted ids, expert
    ids, padded total) into the captured graph's buffers and replaying it: no capture per workload. A graph per
    weight-copy count (``copies_for``).
    """

    def __init__(self, rank: RankMoe, step_tokens: int):
        import torch
        if rank.path != "triton" or rank.dtype != "bf16":
            raise ValueError("StaticStep times SGLang's bf16 Triton path")
        self.rank, self.torch, self.step_tokens = rank, torch, step_tokens
        self.cfg = rank.config(step_tokens)
        self.pairs = step_tokens * rank.top_k
        bm = self.cfg["BLOCK_SIZE_M"]
        size = sglang_sorted_rows(self.pairs, rank.E, bm)
        dev = dict(device=rank.device)
        self.sorted_ids = torch.full((size,), self.pairs, dtype=torch.int32, **dev)
        self.expert_ids = torch.full((-(-size // bm),), -1, dtype=torch.int32, **dev)
        self.post = torch.zeros(1, dtype=torch.int32, **dev)
        self.topk_ids = torch.full((self.pairs, 1), -1, dtype=torch.int32, **dev)
        self.topk_w = torch.rand(self.pairs, 1, **dev)
        self.xs = [torch.randn(self.pairs, rank.H, dtype=rank.act_dtype, **dev) for _ in range(COPIES)]
        self.c1 = torch.empty(self.pairs, 2 * rank.I, dtype=rank.act_dtype, **dev)
        self.c2 = torch.empty(self.pairs, rank.H, dtype=rank.act_dtype, **dev)
        self.graphs: dict[int, Any] = {}

    def run(self, copies: int) -> None:
        """The launches of ``copies`` weight copies with the buffers as loaded."""
        for i in range(copies):
            self.rank.gemms(self.xs[i], self.c1, self.c2, self.topk_w, self.topk_ids, self.sorted_ids,
                            self.expert_ids, self.post, self.cfg, i)

    def load(self, counts: list[int]) -> int:
        """Write the layout of ``counts`` (tokens per local slot) into the buffers; returns the copies to run."""
        torch = self.torch
        ids = rank_pairs(counts, self.pairs)
        sorted_ids, expert_ids, padded = align_layout(ids, self.rank.E, self.cfg["BLOCK_SIZE_M"])
        self.sorted_ids.copy_(torch.from_numpy(sorted_ids))
        self.expert_ids.copy_(torch.from_numpy(expert_ids))
        self.post.fill_(padded)
        self.topk_ids.copy_(torch.from_numpy(ids.astype(np.int32)))
        return copies_for(sum(1 for c in counts if c), self.rank.expert_bytes)

    def time_us(self, counts: list[int], reps: int) -> float:
        """Median µs of this GPU's step with ``counts`` (graph replays, per weight copy)."""
        copies = self.load(counts)
        if copies not in self.graphs:
            self.graphs[copies] = capture(lambda: self.run(copies))
        g = self.graphs[copies]
        g.replay()
        return replay_us(g, reps) / copies


def measure_sweep(sgl, sweep, reps: int, sms: int) -> list[dict[str, Any]]:
    """Every point of ``sweep`` (``moeplace.cost.sweeps.Sweep``) timed on this GPU: its even points at its step,
    its uneven ones at its big step, each point as ``moeplace.cost.sweeps.point`` keeps it."""
    import gc

    import torch

    from moeplace.cost.sweeps import point, workloads

    rank = RankMoe(sgl, sweep.hidden, sweep.inter, sweep.local_slots, sweep.top_k)
    try:
        first = rank.step(sweep.step_tokens).cfg
        out = []
        for tokens, counts in workloads(sweep, first["BLOCK_SIZE_M"], first["BLOCK_SIZE_N"], sms):
            at = rank.step(tokens)
            out.append(point(counts, at.time_us(counts, reps), tokens, sweep.top_k, at.cfg))
        return out
    finally:
        rank = None
        gc.collect()         # a RankMoe and its StaticSteps refer to each other
        torch.cuda.empty_cache()
