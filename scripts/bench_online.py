"""Online re-placement against the alternatives, on traffic that changes while the server runs.

Question: Kept fresh while serving, does moeplace's placement stay ahead of SGLang's own online rebalancer and of a
    placement made once at start, and how many expert weights does each move?
Baseline: ``sglang-eplb``: SGLang 0.5.23's rebalancer (``--enable-eplb``): every period DeepSeek EPLB on the window's
    token counts (its algorithm, moeplace's copy of it with replicas kept apart), applied unconditionally (its
    trigger at the default utilisation threshold of 1.0), SGLang's ``dynamic`` rule among replicas; ``start-only``:
    moeplace fitted on the first window and never changed.
Output: a table on stdout; --json FILE writes {"rows": [{"trace", "ranks", "redundant", "policy", "e_max_distinct",
    "moe_us_per_step", "moved_experts", "replacements"}], "goals": ...}.

    python scripts/bench_online.py [--gptoss PATH] [--quick] [--json OUT]
    python scripts/bench_online.py --only kimi:8:0 [--policies moeplace-online]   # one row, one policy

Traces (9-token verify steps, one request's window each), in time order:
* GPT-OSS-20B real routing, its datasets served one after another (MMLU, MMLU-Pro, GPQA, SORRY-Bench: the examples'
  ``dataset`` field), each example's steps together;
* SYNTHETIC Kimi-K2-shaped routing (``bench_inputs.kimi_shaped``, a share of its 60 MoE layers) in phases drawn
  with different seeds, so each phase has other hot experts and other co-active groups.

Every policy sees the same steps, window (the last WINDOW steps) and period (PERIOD steps; SGLang requires its
period to be at least its window). Scoring starts after the first window, where each policy places from it; then
every period each policy may re-place from the window just past, in force from the next step. ``moeplace-online``
runs ``analysis.replace.decide`` (what the server's worker runs) under moeplace's rule (balanced with spare slots),
``start-only`` and ``moeplace-online`` start from the same fit (``algorithms.fit``). Per row: E[max distinct] under
the policy's rule over every scored step (averaged over MoE layers), MoE µs per step from the cost model derived
for the model's experts, re-placements, and expert replicas moved (slots whose expert changed; SGLang's rebalancer
does not align its new map to the old one, moeplace's decision does, ``algorithms.moves``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy loads: the row jobs are the parallelism

import argparse
import json
import multiprocessing
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.fit import fit
from moeplace.algorithms.moves import moved_slots
from moeplace.analysis.metrics import LayerSums, accumulate, summarize
from moeplace.analysis.replace import ReplaceConfig, decide
from moeplace.commands.costing import resolve_costing
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps, concat_steps

from bench_inputs import DATASETS, GPTOSS, example_steps, gptoss_steps, kimi_shaped, relabel

WINDOW = 2000          # steps the policies fit on (SGLang's recorder buffer)
PERIOD = 2000          # steps between decisions (SGLang's --eplb-rebalance-num-iterations, at least the window)
KIMI_LAYERS = 4
DRIFT = 1 / 16         # share of the experts that trade names between Kimi-shaped phases
POLICIES = ("start-only", "sglang-eplb", "moeplace-online")
GOAL_TIE = 0.005       # moeplace-online at or below every other policy, within this share


@dataclass
class Trace:
    name: str
    steps: RoutingSteps
    ranks: tuple[int, ...]


def gptoss_trace(path: Path, per_dataset: int | None) -> Trace:
    """The datasets one after another (``DATASETS`` order), each example's steps in order; with ``per_dataset``,
    each dataset's first whole examples up to about that many steps."""
    steps = gptoss_steps(path)
    examples = example_steps(path)
    kinds = [x["dataset"] for x in json.loads((path.parent / "gptoss20b_examples_meta.json").read_text())]
    order = []
    for parts in DATASETS.values():
        mine = [examples[i] for i, k in enumerate(kinds) if k in parts]
        if per_dataset is not None:
            mine = mine[:int(np.searchsorted(np.cumsum([e.size for e in mine]), per_dataset)) + 1]
        order += mine
    steps = steps.take(np.concatenate(order))
    # named so that the cost model knows the experts (the .npz names none)
    return Trace("gpt-oss-20b datasets in turn", replace(steps, model=replace(steps.model, name="gpt-oss-20b")), (8,))


def kimi_trace(phases: int, phase_steps: int, seed: int = 0) -> Trace:
    """SYNTHETIC Kimi-K2-shaped steps whose hot experts move: from one phase to the next, in every layer, DRIFT of
    the experts of the hottest quarter (by the first phase's tokens, under the names they have then) trade names
    with as many of the coldest half, drawn at random."""
    steps = kimi_shaped(KIMI_LAYERS, phases * phase_steps, seed=seed)
    L, E = steps.model.num_moe_layers, steps.model.num_experts
    weight = steps.slice(0, phase_steps).expert_token_counts()
    rng = np.random.default_rng(seed)
    names = np.tile(np.arange(E), (L, 1))     # [L, E] the name each expert of the first phase has now
    parts = []
    for phase in range(phases):
        if phase:
            for layer in range(L):
                order = np.argsort(-weight[layer], kind="stable")
                hot = rng.choice(order[:E // 4], int(DRIFT * E), replace=False)
                cold = rng.choice(order[E // 2:], int(DRIFT * E), replace=False)
                names[layer, hot], names[layer, cold] = names[layer, cold], names[layer, hot].copy()
        parts.append(relabel(steps.slice(phase * phase_steps, (phase + 1) * phase_steps), names))
    return Trace("SYNTHETIC kimi-k2-shaped, hot experts moving", concat_steps(parts), (8, 64))


def spare_counts(experts: int, ranks: int) -> list[int]:
    """0 and about E/4 spare slots: the first multiple of the ranks from E/4 up."""
    quarter = experts // 4
    return [0, quarter + (-quarter) % ranks]


def run_policy(policy: str, steps: RoutingSteps, ranks: int, redundant: int, cost_model, replica_bytes: float,
               window: int, period: int) -> dict:
    """Score ``policy`` over ``steps`` (module docstring): E[max distinct], MoE µs, re-placements, moves."""
    model = steps.model
    rule = "dynamic" if policy == "sglang-eplb" or not redundant else "balanced"
    config = ReplaceConfig(replica_bytes=replica_bytes)

    def place(win: RoutingSteps) -> np.ndarray:
        problem = PlacementProblem(model, win, ranks, redundant=redundant, dispatch=rule, cost_model=cost_model,
                                   balance_floor=config.balance_floor)
        return solve("deepseek", problem) if policy == "sglang-eplb" else fit(problem).phy2log

    current = Placement(model, ranks, place(steps.slice(0, window)))
    sums = LayerSums(model.num_moe_layers, ranks)
    moved = replacements = 0
    seconds = []
    for start in range(window, steps.num_steps, period):
        stop = min(start + period, steps.num_steps)
        accumulate(sums, steps.slice(start, stop), current, cost_model, rule)
        if stop == steps.num_steps or policy == "start-only":
            continue
        win = steps.slice(stop - window, stop)
        t0 = time.perf_counter()
        if policy == "sglang-eplb":
            new = place(win)
        else:
            new = decide(win, current, rule, cost_model, config).target
        seconds.append(time.perf_counter() - t0)
        if new is not None and (new != current.phy2log).any():
            moved += int(moved_slots(current.phy2log, new).sum())
            replacements += 1
            current = Placement(model, ranks, new)
    s = summarize(sums)
    return {"policy": policy, "rule": rule, "e_max_distinct": s["e_max_distinct"],
            "token_balancedness": s["token_balancedness"],
            "moe_us_per_step": s["moe_us_per_step"], "moved_experts": moved, "replacements": replacements,
            "scored_steps": s["steps"], "decision_seconds": float(np.mean(seconds)) if seconds else 0.0}


TRACES: list[Trace | None] = []   # made once in main(), read by the forked row jobs


def run_row(job: tuple[int, int, int, str]) -> dict:
    """One row of the table: trace ``TRACES[t]`` on ``ranks`` with ``redundant`` spare slots under ``policy``."""
    t, ranks, redundant, policy = job
    trace = TRACES[t]
    model = trace.steps.model
    costing = resolve_costing(model, None, None)
    cost_model = costing.ep((model.num_experts + redundant) // ranks)
    return {"trace": trace.name, "ranks": ranks, "redundant": redundant,
            **run_policy(policy, trace.steps, ranks, redundant, cost_model, costing.shape.bytes, WINDOW, PERIOD)}


def by_row(rows: list[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    """{(trace, ranks, spare slots): {policy: row}}."""
    by = {}
    for r in rows:
        by.setdefault((r["trace"], r["ranks"], r["redundant"]), {})[r["policy"]] = r
    return by


def goals(rows: list[dict]) -> list[str]:
    """One line per goal broken (empty: every goal met)."""
    broken = []
    for (trace, ranks, redundant), p in by_row(rows).items():
        if len(p) < len(POLICIES):   # a row run with some policies only (--policies)
            continue
        ours, eplb = p["moeplace-online"], p["sglang-eplb"]
        where = f"{trace}, {ranks} ranks, {redundant} spare"
        for other in ("start-only", "sglang-eplb"):
            if ours["e_max_distinct"] > p[other]["e_max_distinct"] * (1 + GOAL_TIE):
                broken.append(f"{where}: above {other}")
        if ranks == 8:
            need = 0.15 if redundant else 0.05
            if ours["e_max_distinct"] > eplb["e_max_distinct"] * (1 - need):
                broken.append(f"{where}: not {need:.0%} below sglang-eplb")
        if eplb["moved_experts"] and ours["moved_experts"] > eplb["moved_experts"] / 2:
            broken.append(f"{where}: moves more than half of sglang-eplb's replicas")
    return broken


TRACE_KEYS = ("gptoss", "kimi")   # --only's names of the traces, in TRACES' order


def parse_only(text: str) -> tuple[str, int | None, int | None]:
    """``TRACE[:RANKS[:SPARES]]`` (``kimi:8:0``) -> (trace key, ranks or None, spare slots or None)."""
    parts = text.split(":")
    if parts[0] not in TRACE_KEYS or len(parts) > 3 or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected TRACE[:RANKS[:SPARES]], TRACE one of "
                                         f"{', '.join(TRACE_KEYS)}")
    numbers = [int(p) for p in parts[1:]] + [None] * (3 - len(parts))
    return parts[0], numbers[0], numbers[1]


def selected(only: list[tuple[str, int | None, int | None]], key: str, ranks: int, redundant: int) -> bool:
    """Whether the row (trace ``key``, ``ranks``, ``redundant``) is among ``only`` (every row if it is empty)."""
    return not only or any(k == key and r in (None, ranks) and s in (None, redundant) for k, r, s in only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gptoss", type=Path, default=GPTOSS, help="per-token GPT-OSS-20B routing (.npz)")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter run: 2,000 steps of each dataset, 3 Kimi-shaped phases of 3,000 steps")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="rows run at once, each in a process of its own (default: the usable CPUs)")
    parser.add_argument("--only", type=parse_only, action="append", default=[], metavar="TRACE[:RANKS[:SPARES]]",
                        help=f"run only these rows (repeatable; TRACE one of {', '.join(TRACE_KEYS)}), e.g. kimi:8:0")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="run only these policies (the goals are checked on rows that have all three)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global TRACES
    wanted = {key for key, _, _ in args.only} or set(TRACE_KEYS)
    # a trace no row asks for is not built (the GPT-OSS file need not be there for a Kimi-shaped row)
    TRACES = [gptoss_trace(args.gptoss, 2000 if args.quick else None) if "gptoss" in wanted else None,
              kimi_trace(3 if args.quick else 6, 3000 if args.quick else 4000) if "kimi" in wanted else None]
    jobs = [(t, ranks, redundant, policy) for t, trace in enumerate(TRACES) if trace is not None
            for ranks in trace.ranks for redundant in spare_counts(trace.steps.model.num_experts, ranks)
            if selected(args.only, TRACE_KEYS[t], ranks, redundant) for policy in args.policies]
    if not jobs:
        parser.error("--only selects no row (rows: " + ", ".join(
            f"{TRACE_KEYS[t]}:{r}:{s}" for t, trace in enumerate(TRACES) if trace is not None
            for r in trace.ranks for s in spare_counts(trace.steps.model.num_experts, r)) + ")")
    jobs.sort(key=lambda job: job[3] != "moeplace-online")   # the long ones first
    t0 = time.perf_counter()
    rows = []
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for row in pool.imap_unordered(run_row, jobs):
            rows.append(row)
            print(f"{row['trace']:36s} {row['ranks']:3d} ranks {row['redundant']:4d} spare  {row['policy']:16s} "
                  f"E[max distinct] {row['e_max_distinct']:.3f}  MoE {row['moe_us_per_step']:8.0f} µs/step  "
                  f"re-placed {row['replacements']:3d}x  moved {row['moved_experts']:7,d}  "
                  f"decision {row['decision_seconds']:.1f} s  ({time.perf_counter() - t0:.0f} s)", flush=True)
    order = {job: i for i, job in enumerate((TRACES[t].name, r, s, p) for t, r, s, p in sorted(jobs))}
    rows.sort(key=lambda r: order[(r["trace"], r["ranks"], r["redundant"], r["policy"])])
    for (trace, ranks, redundant), p in by_row(rows).items():
        if "moeplace-online" in p and "sglang-eplb" in p:
            ours, eplb = p["moeplace-online"], p["sglang-eplb"]
            print(f"{trace}, {ranks} ranks, {redundant} spare: moeplace-online "
                  f"{100 * (ours['e_max_distinct'] / eplb['e_max_distinct'] - 1):+.1f}% against sglang-eplb, "
                  f"moved {ours['moved_experts']:,} ({eplb['moved_experts']:,})")
    broken = goals(rows)
    print("\ngoals: " + ("every goal met" if not broken else "; ".join(broken)))
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "python": sys.version.split()[0],
                                         "window": WINDOW, "period": PERIOD, "rows": rows, "goals_broken": broken},
                                        indent=1))


if __name__ == "__main__":
    main()
