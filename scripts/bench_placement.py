"""Placement quality and speed: stepaware against DeepSeek EPLB and SGLang's contiguous layout.

Question: How far below DeepSeek EPLB does stepaware bring E[max distinct] on held-out steps, and how fast is it?
Baseline: DeepSeek EPLB and SGLang's contiguous layout fitted on the same steps (and SGLang's own rebalance_experts
    for the runtime).
Output: tables on stdout; --json FILE writes all figures.

    python scripts/bench_placement.py [--gptoss PATH] [--json OUT]

1. Real GPT-OSS-20B routing (../shared/traces-real), 9-token windows as verify steps, 8 ranks,
   fit on the first 70% of steps, measured on the last 30%: E[max distinct experts per rank],
   token balancedness, with 0 and 8 redundant slots. Goals: E[max] >= 12% below DeepSeek EPLB,
   balancedness >= 0.98x DeepSeek's.
2. Other shapes (SYNTHETIC, 128 experts top-8 and 64 experts top-6), to show it is not tuned to
   one trace.
3. Runtime on a Kimi-K2-shaped problem (60 MoE layers, 384 experts, 8 ranks, 10,000 steps), beside
   SGLang's own deepseek rebalance_experts on the same input when SGLang is installed.
4. Determinism: the same seed twice gives the same placement.
5. An in-sample ceiling: stepaware fitted on the held-out steps themselves (not a valid result).
6. The --balance-floor trade-off on each trace: E[max distinct] against held-out token balancedness.
Every figure is measured in this process; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.optimize import split_steps
from moeplace.analysis.report import comparison_rows, evaluate, format_table
from moeplace.cost.model import CostModel
from moeplace.files.placement import Placement, check_placement
from moeplace.model.spec import ModelSpec
from moeplace.trace.load import open_trace
from moeplace.trace.synthetic import KIMI_K2, synthetic_steps

from bench_inputs import GPTOSS

ALGOS = ("contiguous", "deepseek", "stepaware")


def compare(model: ModelSpec, steps, ranks: int, redundant: int, label: str) -> list[dict]:
    fit, held = split_steps(steps, 0.3)
    placements, seconds = {}, {}
    for name in ALGOS:
        t0 = time.perf_counter()
        phy2log = solve(name, PlacementProblem(model, fit, ranks, redundant=redundant))
        seconds[name] = time.perf_counter() - t0
        placements[name] = Placement(model, ranks, phy2log, algorithm=name)
        check_placement(placements[name])
    rows = comparison_rows(evaluate(placements, [held], CostModel()), "deepseek")
    print(f"\n{label}: fit {fit.num_steps} steps, held-out {held.num_steps}, {ranks} ranks, {redundant} redundant")
    print(format_table(rows, "deepseek"))
    for r in rows:
        r.update(case=label, redundant=redundant, fit_seconds=seconds[r["placement"]])
    return rows


def floor_tradeoff(model: ModelSpec, steps, label: str, floors=(0.98, 0.9, 0.0)) -> list[dict]:
    """stepaware at several balance floors, fitted and measured as in ``compare`` (no redundancy)."""
    fit, held = split_steps(steps, 0.3)
    placements = {"deepseek": Placement(model, 8, solve("deepseek", PlacementProblem(model, fit, 8)))}
    for floor in floors:
        placements[f"stepaware floor {floor:g}"] = Placement(
            model, 8, solve("stepaware", PlacementProblem(model, fit, 8, balance_floor=floor)))
    rows = comparison_rows(evaluate(placements, [held], CostModel()), "deepseek")
    print(f"\n{label}: --balance-floor trade-off (held-out)")
    ds = next(r for r in rows if r["placement"] == "deepseek")
    for r in rows:
        r.update(case=label, balance_vs_deepseek=r["token_balancedness"] / ds["token_balancedness"])
        print(f"  {r['placement']:22s} E[max] {r['e_max_distinct']:.3f} "
              f"({100 * (r['e_max_distinct'] / ds['e_max_distinct'] - 1):+.1f}%)  token balancedness "
              f"{r['token_balancedness']:.3f} ({r['balance_vs_deepseek']:.3f}x DeepSeek's)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gptoss", type=Path, default=GPTOSS)
    ap.add_argument("--kimi-steps", type=int, default=10_000)
    ap.add_argument("--json", type=Path, help="also write all figures here")
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores")
    out: dict = {"rows": []}

    trace = open_trace(args.gptoss, window=9)
    steps = trace.load("verify")
    for redundant in (0, 8):
        out["rows"] += compare(trace.model, steps, 8, redundant, "gpt-oss-20b real, verify windows of 9")
    # In-sample ceiling: stepaware fitted on the held-out steps themselves. Not a valid result (it
    # sees the test), but it bounds what this search can reach with any static placement there.
    _, held = split_steps(steps, 0.3)
    oracle = Placement(trace.model, 8, solve("stepaware", PlacementProblem(trace.model, held, 8)))
    oracle_e_max = evaluate({"oracle": oracle}, [held], CostModel())[0].summary["e_max_distinct"]
    print(f"\nin-sample ceiling (stepaware fitted on the held-out steps themselves): E[max distinct] {oracle_e_max:.3f}")
    by = {(r["redundant"], r["placement"]): r for r in out["rows"]}
    ds, sa, sa8 = by[(0, "deepseek")], by[(0, "stepaware")], by[(8, "stepaware")]
    goals = {
        "e_max_vs_deepseek_pct": 100 * (sa["e_max_distinct"] / ds["e_max_distinct"] - 1),
        "e_max_goal_met (<= -12%)": sa["e_max_distinct"] <= 0.88 * ds["e_max_distinct"],
        "balancedness_ratio_vs_deepseek": sa["token_balancedness"] / ds["token_balancedness"],
        "balancedness_goal_met (>= 0.98)": sa["token_balancedness"] >= 0.98 * ds["token_balancedness"],
        "redundant8_vs_redundant0_pct": 100 * (sa8["e_max_distinct"] / sa["e_max_distinct"] - 1),
        "in_sample_ceiling_vs_deepseek_pct": 100 * (oracle_e_max / ds["e_max_distinct"] - 1),
    }

    out["floor_rows"] = floor_tradeoff(trace.model, steps, "gpt-oss-20b real")
    for E, K in ((128, 8), (64, 6)):
        model = ModelSpec(f"SYNTHETIC {E}x top-{K}", 24, tuple(range(24)), E, K)
        _, syn = synthetic_steps(3000, 9, model, seed=E)
        out["rows"] += compare(model, syn, 8, 0, f"SYNTHETIC {E} experts top-{K}")
        out["floor_rows"] += floor_tradeoff(model, syn, f"SYNTHETIC {E} experts top-{K}")

    _, kimi = synthetic_steps(args.kimi_steps, 9, KIMI_K2, seed=1)
    problem = PlacementProblem(KIMI_K2, kimi, 8)
    t0 = time.perf_counter()
    first = solve("stepaware", problem)
    stepaware_s = time.perf_counter() - t0
    again = solve("stepaware", PlacementProblem(KIMI_K2, kimi, 8))
    t0 = time.perf_counter()
    solve("deepseek", problem)
    ours_deepseek_s = time.perf_counter() - t0
    sglang_s = None
    try:
        import torch
        from sglang.srt.eplb.eplb_algorithms.deepseek import rebalance_experts

        weight = torch.tensor(kimi.expert_token_counts())
        t0 = time.perf_counter()
        rebalance_experts(weight, 384, 1, 1, 8, False)
        sglang_s = time.perf_counter() - t0
    except ImportError:
        pass
    goals.update({
        "kimi_stepaware_seconds": stepaware_s, "kimi_goal_met (<= 10 s)": stepaware_s <= 10,
        "kimi_moeplace_deepseek_seconds": ours_deepseek_s, "kimi_sglang_deepseek_seconds": sglang_s,
        "deterministic_same_seed": bool(np.array_equal(first, again)),
    })
    print(f"\nKimi-K2-shaped (60 MoE layers, 384 experts, 8 ranks, {args.kimi_steps} steps): stepaware "
          f"{stepaware_s:.2f} s; moeplace deepseek {ours_deepseek_s:.2f} s; SGLang deepseek "
          + (f"{sglang_s:.2f} s" if sglang_s is not None else "not installed"))
    print("\ngoals:")
    for k, v in goals.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    out["goals"] = goals
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
