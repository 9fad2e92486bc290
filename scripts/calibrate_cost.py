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
import importlib
import json
import sys
import time
import types
from pathlib import Path


# moeplace from this checkout, also on a GPU machine where it is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeplace.cost.derive import LARGE_M, sglang_default_config  # noqa: E402
from moeplace.cost.sweeps import H200_SMS, Sweep, even_counts, fit_linear, linear_range, sweep_line  # noqa: E402
from moeplace.sglang import fused_moe_timing  # noqa: E402
from moeplace.sglang.fused_moe_timing import (COPIES, RankMoe, StaticStep, align_layout, copies_for,  # noqa: E402,F401
                                              measure_sweep, rank_pairs)

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
    says how the rest is kept out. Where no wheel matches ``wheel`` and SGLang is installed, the installed one
    (``moeplace.sglang.fused_moe_timing.load_fused_moe``).
    """
    import glob
    import importlib.util

    import torch

    from sglang_wheel import register_packages, stub, unpack
    if not glob.glob(wheel or "") and importlib.util.find_spec("sglang") is not None:
        return fused_moe_timing.load_fused_moe()

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

def graph_time_us(fn, reps: int) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph, divided by COPIES."""
    return fused_moe_timing.graph_time_us(fn, reps, warmup_replays=2) / COPIES


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


ROW_BLOCK_STEP_TOKENS = 576   # the largest batch the layout replay evaluates


def measure_config_sweep(sgl, label: str, reps: int) -> dict:
    """One ``CONFIG_SWEEPS`` entry, timed as ``moeplace calibrate`` times a sweep (``measure_sweep``): even spreads
    of pairs over experts at its step, then uneven ones with experts of several row blocks at the largest step of
    the same config (576 tokens for 64-row blocks, as many tokens as slots for 16-row ones: SGLang's M <= E)."""
    import torch
    hidden, inter, slots, top_k, groups, tokens = CONFIG_SWEEPS[label]
    big = ROW_BLOCK_STEP_TOKENS if sglang_default_config(tokens, slots, "bf16") == LARGE_M else slots
    sweep = Sweep(label, hidden, inter, slots, top_k, groups, tokens, big)
    points = measure_sweep(sgl, sweep, reps, torch.cuda.get_device_properties(0).multi_processor_count)
    shape = dict(hidden=hidden, inter=inter, n_local=slots, top_k=top_k)
    return {"shape": shape, "dtype": "bf16", "path": "triton", "points": points, "step_tokens": tokens}


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
        print(f"{label}: {len(sweep['points'])} points in {time.time() - t0:.1f} s, "
              f"config {sweep['points'][0]['config']}; " + " ".join(
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


def fit(args) -> None:
    """Each sweep's line: a config sweep's as ``moeplace calibrate`` fits it (``moeplace.cost.sweeps.sweep_line``), a
    verify-step sweep's a plain line over the points that ran SGLang's config for a verify step."""
    raw = json.loads(Path(args.calib).read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"kimi-ep-bf16": "cost_h200_bf16.json", "kimi-ep-fp8": "cost_h200_fp8.json",
             "kimi-ep-int4": "cost_h200_int4.json", "kimi-tp-bf16": "cost_h200_bf16_tp8.json",
             "gptoss-ep-bf16": "cost_h200_bf16_gptoss.json", "gptoss-tp-bf16": "cost_h200_bf16_gptoss_tp8.json",
             "kimi-ep-bf16-torch": None}
    kernel = (f"sglang {raw['sglang']} fused_moe_kernel via invoke_fused_moe_kernel (Triton {raw['triton']}), "
              f"SGLang's config lookup; gate/up GEMM + SiLU-and-mul + down GEMM")
    for label, sweep in raw["sweeps"].items():
        if "error" in sweep:
            print(f"{label}: no data ({sweep['error'][:120]})")
            continue
        pts, s = sweep["points"], sweep["shape"]
        full = fit_linear(pts)
        bound = linear_range(pts)
        extra = {"linear_up_to_tokens": bound,
                 "all_points_fit": {k: round(full[k], 4) for k in ("a", "b", "c", "mean_rel_err", "max_rel_err")},
                 "copy_gbps": round(raw["copy_gbps"]),
                 "source": "scripts/calibrate_cost.py measure (CUDA-graph replay medians)",
                 **({"tuned_file": sweep["tuned_file"]} if "tuned_file" in sweep else {})}
        if label in CONFIG_SWEEPS:
            doc = sweep_line(s, pts, sweep["step_tokens"], raw["gpu"], H200_SMS,
                             {"date": raw["date"], "kernel": kernel})
            doc["provenance"].update(extra)
            name = f"cost_h200_bf16_{label.replace('-', '_')}.json"
        else:
            # The file is for verify steps (T = VERIFY_TOKENS): fit the points that ran the kernel config SGLang
            # picks at that T. Other configs (M > local experts) are a different line (see fit notes).
            verify_cfg = min(pts, key=lambda p: abs(p.get("config_m", p["tokens"]) - VERIFY_TOKENS))["config"]
            low = fit_linear([p for p in pts if p["config"] == verify_cfg])
            doc = {
                "a_us_per_expert": round(low["a"], 3), "b_us_per_token": round(low["b"], 4), "c_us": round(low["c"], 2),
                "provenance": {
                    "gpu": raw["gpu"], "date": raw["date"], "dtype": sweep["dtype"], "kernel": kernel,
                    "shape": {"hidden": s["hidden"], "expert_intermediate": s["inter"], "local_slots": s["n_local"]},
                    # sweeps that know their top-k ran SGLang's buffer (moeplace.cost.derive.Measured)
                    **({"align_layout": "sglang", "top_k": s["top_k"]} if "top_k" in s else {}),
                    "fit": (f"relative least squares over the {low['points']} sweep points that ran SGLang's "
                            f"kernel config for a {VERIFY_TOKENS}-token step ({verify_cfg})"),
                    "step_tokens": VERIFY_TOKENS,
                    "kernel_config": [verify_cfg[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")],
                    "fit_mean_rel_err": round(low["mean_rel_err"], 4), "fit_max_rel_err": round(low["max_rel_err"], 4),
                    **extra,
                },
            }
            name = files.get(label)
        prov = doc["provenance"]
        print(f"{label}: all points a={full['a']:.2f} b={full['b']:.3f} c={full['c']:.1f} "
              f"(mean err {full['mean_rel_err']:.1%}, max {full['max_rel_err']:.1%}); "
              f"fitted: a={doc['a_us_per_expert']:.2f} r={doc.get('r_us_per_block', 0):.2f} "
              f"b={doc['b_us_per_token']:.3f} c={doc['c_us']:.1f} (mean err {prov['fit_mean_rel_err']:.1%}); "
              f"linear within 10% up to {bound} tokens")
        if name:
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
