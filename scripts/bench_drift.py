"""Spare slots when the traffic changes: fitted on one kind of prompt, scored on another.

Question: Does moeplace's spare-slot placement under balanced dispatch (``algorithms.robust``: the candidate
    layout best out of fold) stay at or below the naive spare layout when the scored requests come from other
    prompts than the fitted ones?
Baseline: the naive spare layout (DeepSeek EPLB's layout of the fitted steps plus one replica of each of the R
    hottest experts, under balanced dispatch), DeepSeek EPLB without spares (SGLang today), the per-step bound;
    also moeplace's fitted search alone (``stepaware``), as it was before the out-of-fold choice.
Output: a table on stdout; --json FILE writes every figure.

    python scripts/bench_drift.py --gptoss PATH [--meta PATH] [--fit-tokens 1000,10000,all] [--same]
                                  [--no-gptoss] [--no-synthetic] [--quick] [--json OUT]

8 ranks, E[max distinct experts on the busiest rank] (the per-step optimum under balanced dispatch,
``dispatch.exact``), averaged over MoE layers, for R in {E/8, E/4, E/2, E}:

* GPT-OSS-20B real routing (9-token verify windows), the examples split by their ``dataset`` field (MMLU,
  MMLU-Pro, GPQA, SORRY-Bench): fitted on the first whole examples of one dataset up to about 1k and 10k
  tokens and on all of it, scored on the first whole examples of each other dataset up to 2,000 steps
  (18,000 tokens);
* SYNTHETIC routing (``trace.synthetic``) of 384/top-8, 128/top-8 and 64/top-6 shapes on 4 MoE layers,
  fitted on 2,000 steps and scored on 4,000 later steps whose expert ids were relabelled per layer: ``swap``
  (the E/16 hottest experts of the fit and the E/16 coldest swap hotness) and ``new group`` (the E/8
  coldest take the places of those ranked E/8 to E/4: a new hot group appears), and on them unchanged
  (``same``: the same-distribution goal of Kimi-K2-shaped routing);
* with --same, GPT-OSS fitted on a random half of the examples and scored on the other half (the
  same-distribution goals: E/4 at least 18.5% and E/2 at least 25% below DeepSeek EPLB, E within 1% of the bound).

R = E/8 is left out where it does not split over the 8 ranks (GPT-OSS: 4 spare slots).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.robust import robust_spares
from moeplace.dispatch.balanced import replica_layout, step_expert_counts
from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.synthetic import synthetic_steps

from bench_inputs import DATASETS, GPTOSS, VERIFY_TOKENS, example_steps, gptoss_steps, pct, relabel

RANKS = 8
FIT_TOKENS = (1_000, 10_000, None)    # None: the whole dataset
SCORED_STEPS = 2_000                  # each dataset is scored on its first whole examples up to this many steps
SHAPES = (("SYNTHETIC 384/top-8", 384, 8), ("SYNTHETIC 128/top-8", 128, 8), ("SYNTHETIC 64/top-6", 64, 6))


@dataclass
class Case:
    """Fitted steps and the step sets they are scored on (name -> steps)."""

    label: str
    fit: RoutingSteps
    scored: dict[str, RoutingSteps]


def actives(steps: RoutingSteps) -> list[np.ndarray]:
    return [step_expert_counts(steps, layer) > 0 for layer in range(steps.model.num_moe_layers)]


def e_opt(active: list[np.ndarray], phy2log: np.ndarray) -> float:
    """E[per-step optimum] over layers and steps (one replica each: E[max distinct] under any rule)."""
    E, sizes = active[0].shape[1], subset_sizes(RANKS)
    return float(np.mean([step_optimum(subset_counts(a, replica_layout(row, E, RANKS).masks, RANKS), sizes).mean()
                          for a, row in zip(active, phy2log)]))


def bound(active: list[np.ndarray]) -> float:
    return float(np.mean([np.ceil(a.sum(axis=1) / RANKS).mean() for a in active]))


def same_distribution_case(path: Path) -> Case:
    """The examples in two random halves (seeded, as ``bench_balanced``): fitted on one, scored on the other."""
    steps = gptoss_steps(path)
    examples = example_steps(path)
    order = np.random.default_rng(0).permutation(len(examples))
    fit, held = (steps.take(np.sort(np.concatenate([examples[x] for x in half])))
                 for half in (order[:len(examples) // 2], order[len(examples) // 2:]))
    return Case("gpt-oss random half", fit, {"other half": held})


def gptoss_cases(path: Path, meta: Path, quick: bool, fit_tokens: tuple = FIT_TOKENS,
                 fitted_on: tuple = ()) -> list[Case]:
    steps = gptoss_steps(path)
    examples = example_steps(path)
    kinds = [x["dataset"] for x in json.loads(meta.read_text())]
    rows = {name: [examples[i] for i, k in enumerate(kinds) if k in parts] for name, parts in DATASETS.items()}
    fitted_on = fitted_on or tuple(rows)
    whole = {name: steps.take(np.concatenate(ex)) for name, ex in rows.items()}
    scored = {name: steps.take(np.concatenate(first_examples(ex, SCORED_STEPS))) for name, ex in rows.items()}
    cases = []
    for name, ex in rows.items():
        if name not in fitted_on:
            continue
        for tokens in fit_tokens[:1] + fit_tokens[2:] if quick else fit_tokens:
            if tokens is None:
                fit = whole[name]
            else:
                fit = steps.take(np.concatenate(first_examples(ex, tokens // VERIFY_TOKENS)))
            label = f"gpt-oss {name} {fit.num_steps * VERIFY_TOKENS:,} tok"
            cases.append(Case(label, fit, {other: scored[other] for other in rows if other != name}))
    return cases


def first_examples(examples: list[np.ndarray], num_steps: int) -> list[np.ndarray]:
    """The first whole examples (step index arrays) until about ``num_steps`` steps."""
    count = int(np.searchsorted(np.cumsum([e.size for e in examples]), num_steps)) + 1
    return examples[:count]


def drift_perms(fit: RoutingSteps, kind: str) -> np.ndarray:
    """[L, E] relabelling per layer: ``swap`` or ``new group`` (module docstring), by the fit's token counts."""
    weight = fit.expert_token_counts()
    L, E = weight.shape
    perms = np.tile(np.arange(E), (L, 1))
    for layer in range(L):
        order = np.lexsort((np.arange(E), -weight[layer]))       # hottest first
        if kind == "swap":
            a, b = order[:E // 16], order[::-1][:E // 16]
        else:
            a, b = order[E // 8:E // 4], order[::-1][:E // 8]
        perms[layer, a], perms[layer, b] = b, a
    return perms


def synthetic_cases(quick: bool) -> list[Case]:
    cases = []
    for label, experts, top_k in SHAPES[1:] if quick else SHAPES:
        model = ModelSpec(label, 4, tuple(range(4)), experts, top_k)
        _, steps = synthetic_steps(6_000, VERIFY_TOKENS, model, seed=experts)
        fit, later = steps.take(np.arange(2_000)), steps.take(np.arange(2_000, 6_000))
        scored = {kind: relabel(later, drift_perms(fit, kind)) for kind in ("swap", "new group")}
        cases.append(Case(label, fit, {"same": later, **scored}))
    return cases


def spare_counts(experts: int) -> list[int]:
    return [r for r in (experts // 8, experts // 4, experts // 2, experts) if r % RANKS == 0]


def measure(case: Case) -> list[dict]:
    model = case.fit.model
    E = model.num_experts
    scored = {name: actives(s) for name, s in case.scored.items()}
    today = solve("deepseek", PlacementProblem(model, case.fit, RANKS))
    rows = []
    for R in spare_counts(E):
        t0 = time.perf_counter()
        ours, choice = robust_spares(PlacementProblem(model, case.fit, RANKS, redundant=R, dispatch="balanced"))
        seconds = time.perf_counter() - t0
        fitted = ours if choice.name == "fitted" else solve(
            "stepaware", PlacementProblem(model, case.fit, RANKS, redundant=R, dispatch="balanced"))
        naive = solve("naive-spares", PlacementProblem(model, case.fit, RANKS, redundant=R))
        for name, active in scored.items():
            r = dict(case=case.label, fit_steps=case.fit.num_steps, scored=name, steps=int(active[0].shape[0]),
                     R=R, E=E, chosen=choice.name, moeplace=e_opt(active, ours), fitted=e_opt(active, fitted),
                     naive=e_opt(active, naive), deepseek=e_opt(active, today), bound=bound(active),
                     out_of_fold=choice.losses, scored_layers=choice.layers, fit_seconds=seconds)
            rows.append(r)
            print(f"  {r['case']:32s} -> {name:12s} R {R:4d}: moeplace {r['moeplace']:.3f} [{choice.name}, "
                  f"{choice.layers} layers]  "
                  f"fitted {r['fitted']:.3f}  naive {r['naive']:.3f}  DeepSeek {r['deepseek']:.3f}  "
                  f"bound {r['bound']:.3f}  {seconds:.1f} s", flush=True)
    return rows


def print_grid(rows: list[dict]) -> None:
    print(f"\n{'fitted on':32s} {'scored on':12s} {'R':>4s} {'moeplace':>9s} {'chosen':>10s} {'fitted':>7s} "
          f"{'naive':>7s} {'DeepSeek':>8s} {'bound':>6s} {'vs naive':>8s} {'vs DS':>7s}")
    for r in rows:
        print(f"{r['case']:32s} {r['scored']:12s} {r['R']:4d} {r['moeplace']:9.3f} {r['chosen']:>10s} "
              f"{r['fitted']:7.3f} {r['naive']:7.3f} {r['deepseek']:8.3f} {r['bound']:6.3f} "
              f"{pct(r['moeplace'], r['naive']):>8s} {pct(r['moeplace'], r['deepseek']):>7s}")
    worse = [r for r in rows if r["moeplace"] > r["naive"] + 1e-9]
    fitted_worse = [r for r in rows if r["fitted"] > r["naive"] + 1e-9]
    print(f"\nrows: {len(rows)}; moeplace above the naive layout: {len(worse)} "
          f"(worst {max((r['moeplace'] / r['naive'] - 1 for r in rows), default=0):+.2%}); "
          f"the fitted search alone above it: {len(fitted_worse)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gptoss", type=Path, default=GPTOSS, help="per-token GPT-OSS-20B routing (.npz)")
    parser.add_argument("--meta", type=Path, default=None,
                        help="the examples' metadata (default: gptoss20b_examples_meta.json beside --gptoss)")
    parser.add_argument("--quick", action="store_true", help="fewer fit sizes and shapes")
    parser.add_argument("--no-synthetic", action="store_true")
    parser.add_argument("--no-gptoss", action="store_true")
    parser.add_argument("--fit-tokens", default="1000,10000,all",
                        help="GPT-OSS fit sizes in tokens, comma-separated ('all': the whole dataset)")
    parser.add_argument("--fit-on", default="", help="GPT-OSS datasets to fit on, comma-separated (default: all)")
    parser.add_argument("--same", action="store_true",
                        help="also GPT-OSS fitted on a random half of the examples, scored on the other half")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    meta = args.meta or args.gptoss.parent / "gptoss20b_examples_meta.json"
    fits = tuple(None if t == "all" else int(t) for t in args.fit_tokens.split(","))
    cases = [] if args.no_gptoss else gptoss_cases(args.gptoss, meta, args.quick, fits,
                                                            tuple(x for x in args.fit_on.split(",") if x))
    cases += [same_distribution_case(args.gptoss)] if args.same else []
    cases += [] if args.no_synthetic else synthetic_cases(args.quick)
    rows = []
    for case in cases:
        rows += measure(case)
    print_grid(rows)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "python": sys.version.split()[0],
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
