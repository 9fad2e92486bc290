"""Wide expert parallelism: how long does optimize take, and how good are its placements, from 8 to 320 ranks?

Question: At 8 to 320 EP ranks (flat, and over nodes of 8 GPUs), how long does `moeplace optimize` take end to
end through the CLI, and how does its placement's E[max distinct experts on a rank per step] on held-out steps
compare with SGLang's own EPLB algorithms run on the same input?
Baseline: SGLang's `deepseek` and `deepseek_hierarchical` (sglang.srt.eplb.eplb_algorithms, nodes of 8 GPUs,
one expert group per node), fitted on the same steps with the same slots; the naive spare layout (DeepSeek EPLB
plus a replica of the hottest experts, moeplace.algorithms.baselines.naive_spares); and the per-step bound
(ceil(distinct experts / ranks)). Every row is scored on the same held-out steps (the last 30%) under the same
dispatch rule, moeplace's balanced one (where the experts do not split over the ranks, the first copies replicate
the hottest until they do: moeplace.algorithms.first_copy_slots).
Over nodes, each row's cross-node token traffic on the same held-out steps (moeplace.dispatch.traffic): the share
of (token, expert) sends received on another node than the step's source rank under that rule, and under SGLang's
static rule (DeepEP: a source rank keeps its own node's replica where one is), the SYNTHETIC steps spread over the
ranks round robin.
Output: a table on stdout; --json FILE writes the figures; --work DIR keeps the traces and placements.

    python scripts/bench_wide_ep.py [--shapes kimi-k2,deepseek-v3] [--widths 8,16,32,64,128,144,256,320]
                                    [--steps 20000] [--work DIR] [--json out.json]

Spare slots: about E/4, the nearest count that makes the slots split evenly over the ranks (at least one
per rank where the experts alone do not). For each shape the SYNTHETIC trace is made once
(`moeplace trace synth --shape S --steps N`); for each width `moeplace optimize` runs in a fresh process,
flat and with --nodes R/8 (R >= 16), and its wall and CPU seconds are recorded; its placements, SGLang's and
the naive layout are then scored in this process. On a shared machine CPU seconds are the steadier measure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8
HOLDOUT = 0.3


def spare_slots(experts: int, ranks: int) -> int:
    """About experts / 4 spare slots, so that experts + spares split evenly over the ranks (> 0)."""
    first = (-experts) % ranks
    spares = first + ranks * max(0, round((experts / 4 - first) / ranks))
    return spares or ranks


def run_cli(args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of one moeplace command in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moeplace", *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"moeplace {' '.join(args)} failed:\n{done.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def sglang_placement(weight: np.ndarray, slots: int, ranks: int, nodes: int, hierarchical: bool) -> np.ndarray:
    """phy2log [L, P] from SGLang's own EPLB entry point (torch, CPU), on the fitted steps' token counts."""
    import torch
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm, rebalance_experts

    algorithm = EplbAlgorithm.deepseek_hierarchical if hierarchical else EplbAlgorithm.deepseek
    phy2log, _, _ = rebalance_experts(tokens_per_expert=torch.from_numpy(weight).double()[None], num_physical_experts=slots,
                                      num_local_physical_experts=slots // ranks, num_groups=nodes, num_nodes=nodes,
                                      algorithm=algorithm)
    return phy2log.numpy()


def score(steps_file: Path, placements: dict[str, Path | np.ndarray], ranks: int, nodes: int, dispatch: str) -> dict:
    """E[max distinct] and E[per-step optimum] on the held-out steps of each placement, and the bound; over
    nodes, the share of sends that cross nodes under ``dispatch`` and under SGLang's static rule."""
    from moeplace.analysis.optimize import split_steps
    from moeplace.analysis.report import evaluate
    from moeplace.cost.model import CostModel
    from moeplace.dispatch.balanced import step_expert_counts
    from moeplace.dispatch.traffic import source_ranks, static_cross_sends
    from moeplace.files.placement import Placement, load_placement
    from moeplace.trace.load import open_trace

    trace = open_trace(steps_file)
    fit, held = split_steps(trace.load("all", None), HOLDOUT)
    loaded = {}
    for name, p in placements.items():
        if isinstance(p, Path):
            loaded[name] = load_placement(p, model=trace.model, ranks=ranks)
        else:
            loaded[name] = Placement(trace.model, ranks, p, nodes=nodes, algorithm=name)
    evals = evaluate(loaded, [held], CostModel(), dispatch, workers=1)
    out = {e.name: {"e_max_distinct": e.summary["e_max_distinct"], "optimum": e.summary["optimum"]} for e in evals}
    if nodes > 1:
        source = source_ranks(held.ranks, ranks)[0]
        static = {name: [0, 0] for name in loaded}
        for layer in range(trace.model.num_moe_layers):
            sends = step_expert_counts(held, layer)
            for name, p in loaded.items():
                cross, total = static_cross_sends(sends, p.phy2log[layer], ranks, nodes, source)
                static[name][0] += cross
                static[name][1] += total
        for e in evals:
            out[e.name].update(cross_node_share=e.summary["cross_node_share"],
                               cross_node_sends_per_layer=e.summary["cross_node_sends_per_layer"],
                               static_cross_node_share=static[e.name][0] / static[e.name][1])
    out["bound"] = evals[0].summary["lower_bound"]
    out["held_out_steps"] = held.num_steps
    return out


def bench_width(trace: Path, shape_experts: int, ranks: int, work: Path) -> list[dict]:
    from moeplace.algorithms import PlacementProblem, solve
    from moeplace.analysis.optimize import split_steps
    from moeplace.trace.load import open_trace

    spares = spare_slots(shape_experts, ranks)
    dispatch = "balanced"
    rows = []
    for nodes in ([1] if ranks < 16 else [1, ranks // GPUS_PER_NODE]):
        out = work / f"{trace.stem}-{ranks}-{nodes}.json"
        args = ["optimize", str(trace), "--ranks", str(ranks), "--redundant", str(spares), "--dispatch", dispatch,
                "--nodes", str(nodes), "-o", str(out)]
        wall, cpu, _ = run_cli(args)
        tr = open_trace(trace)
        fit, _ = split_steps(tr.load("all", None), HOLDOUT)
        weight = fit.expert_token_counts()
        slots = shape_experts + spares
        start = time.perf_counter()
        flat = sglang_placement(weight, slots, ranks, 1, False)
        sglang_s = time.perf_counter() - start
        placements = {"moeplace": out, "sglang deepseek": flat}
        if nodes > 1 and shape_experts % nodes == 0:   # SGLang's hierarchy needs the groups (one a node) to split
            placements["sglang deepseek_hierarchical"] = sglang_placement(weight, slots, ranks, nodes, True)
        problem = PlacementProblem(tr.model, fit, ranks, nodes=nodes, redundant=spares, dispatch=dispatch)
        placements["naive spares"] = solve("naive-spares", problem)
        scores = score(trace, placements, ranks, nodes, dispatch)
        rows.append({"trace": trace.stem, "ranks": ranks, "nodes": nodes, "spares": spares, "dispatch": dispatch,
                     "optimize_wall_s": wall, "optimize_cpu_s": cpu, "sglang_deepseek_s": sglang_s, **scores})
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    names = [k for k in r if isinstance(r[k], dict)]
    quality = "  ".join(f"{k} {r[k]['e_max_distinct']:.3f}" + (
        f" (cross-node {100 * r[k]['cross_node_share']:.1f}%, static {100 * r[k]['static_cross_node_share']:.1f}%)"
        if "cross_node_share" in r[k] else "") for k in names)
    return (f"{r['trace']:<14} R={r['ranks']:<4} nodes={r['nodes']:<3} spares={r['spares']:<4} {r['dispatch']:<9} "
            f"optimize {r['optimize_wall_s']:6.1f} s wall {r['optimize_cpu_s']:6.1f} s CPU | {quality}  "
            f"bound {r['bound']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="kimi-k2,deepseek-v3")
    parser.add_argument("--widths", default="8,16,32,64,128,144,256,320")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--work", type=Path, default=Path("bench-wide-ep"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from moeplace.trace.load import open_trace

    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        trace = args.work / f"{shape}-{args.steps}.mptrace"
        if not trace.exists():
            run_cli(["trace", "synth", "--shape", shape, "--steps", str(args.steps), "-o", str(trace)])
        experts = open_trace(trace).model.num_experts
        for ranks in (int(w) for w in args.widths.split(",")):
            rows += bench_width(trace, experts, ranks, args.work)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
