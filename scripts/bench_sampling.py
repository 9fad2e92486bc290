"""How many steps does optimize need? Time, peak memory and placement quality against --max-steps.

Question: How many steps does optimize need: time, peak memory and placement quality against --max-steps?
Baseline: the largest --max-steps, and DeepSeek EPLB fitted beside each size, scored on the same unseen tail.
Output: a table on stdout; --json FILE writes the figures; --work DIR keeps the traces.

    python scripts/bench_sampling.py [--steps 200000] [--tail 20000] [--sizes 5000,10000,20000,50000,200000]
                                     [--work DIR] [--json out.json]

Makes one SYNTHETIC Kimi-K2-shaped trace of ``steps + tail`` verify steps (``moeplace trace synth``'s
generator), cut in two files: the first ``steps`` for optimize, the last ``tail`` never seen by any
fit. For each size, ``moeplace.analysis.optimize.optimize`` (stepaware, 8 ranks, defaults otherwise) runs in a
fresh process on the first file with ``max_steps=size``; its wall time and peak RSS are recorded,
and its placement and the DeepSeek EPLB baseline fitted beside it are then measured on the unseen
tail in this process. The largest size is the reference the others are compared to. CPU seconds
(user + system of the optimize process) are given beside wall time: on a shared machine they are the
steadier measure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moeplace.analysis.report import evaluate
from moeplace.cost.model import CostModel
from moeplace.files.placement import load_placement
from moeplace.trace.load import open_trace
from moeplace.trace.store import write_chunks
from moeplace.trace.synthetic import KIMI_K2, SyntheticRouting, synthetic_chunks

RUN = r"""
import json, resource, sys, time
from moeplace.analysis.optimize import optimize
from moeplace.files.placement import save_placement, Placement
from moeplace.trace.load import open_trace
trace, size, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
start = time.perf_counter()
result = optimize(open_trace(trace), 8, "stepaware", max_steps=size)
seconds = time.perf_counter() - start
save_placement(out, result.placement)
deepseek = next(e for e in result.evaluations if e.name == "deepseek").placement
save_placement(out.replace(".json", ".deepseek.json"), deepseek)
usage = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM: this process's own peak RSS (ru_maxrss keeps the peak of the parent it was forked from)
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": peak_kb / 1024,
                  "fit_steps": result.fit_steps, "note": result.note}))
"""


def make_traces(work: Path, steps: int, tail: int) -> tuple[Path, Path]:
    """(first ``steps`` steps, last ``tail`` steps) of one synthetic trace, as two files."""
    fit_path, tail_path = work / f"kimi-{steps}.mptrace", work / f"kimi-tail-{tail}.mptrace"
    if fit_path.exists() and tail_path.exists():
        return fit_path, tail_path
    routing = SyntheticRouting(KIMI_K2, seed=11)
    whole = work / "whole.mptrace"
    write_chunks(whole, routing.header(), synthetic_chunks(routing, steps + tail))

    def part(first: int, last: int):
        seen = 0
        for chunk in open_trace(whole).chunks():
            lo, hi = max(first - seen, 0), min(last - seen, chunk.num_steps)
            if lo < hi:
                yield chunk.take(np.arange(lo, hi))
            seen += chunk.num_steps

    write_chunks(fit_path, routing.header(), part(0, steps))
    write_chunks(tail_path, routing.header(), part(steps, steps + tail))
    whole.unlink()
    return fit_path, tail_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--tail", type=int, default=20_000)
    ap.add_argument("--sizes", default="5000,10000,20000,50000,200000")
    ap.add_argument("--work", type=Path, default=Path("out/bench_sampling"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fit_path, tail_path = make_traces(args.work, args.steps, args.tail)
    print(f"traces: {args.steps} + {args.tail} steps in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows = []
    for size in [int(x) for x in args.sizes.split(",")]:
        out = args.work / f"stepaware-{size}.json"
        proc = subprocess.run([sys.executable, "-c", RUN, str(fit_path), str(size), str(out)],
                              capture_output=True, text=True, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        placements = {"stepaware": load_placement(out), "deepseek": load_placement(out.with_suffix(".deepseek.json"))}
        evals = {e.name: e.summary for e in evaluate(placements, open_trace(tail_path).chunks(), CostModel())}
        rows.append({"max_steps": size, **run, "stepaware": evals["stepaware"]["e_max_distinct"],
                     "deepseek": evals["deepseek"]["e_max_distinct"], "lower_bound": evals["stepaware"]["lower_bound"]})
        print(f"max_steps {size}: {run['seconds']:.0f} s ({run['cpu_s']:.0f} s CPU), {run['peak_mb']:.0f} MB",
              file=sys.stderr)
    ref = rows[-1]
    print(f"SYNTHETIC Kimi-K2-shaped, 8 ranks; E[max distinct] on {args.tail} steps no fit saw "
          f"(lower bound {ref['lower_bound']:.3f})")
    print(f"{'max_steps':>9} {'fit on':>7} {'wall s':>7} {'CPU s':>6} {'x CPU':>6} {'peak MB':>8} {'x mem':>6} "
          f"{'stepaware':>9} {'vs ref':>7} {'deepseek':>9} {'stepaware vs deepseek':>22}")
    for r in rows:
        print(f"{r['max_steps']:9} {r['fit_steps']:7} {r['seconds']:7.0f} {r['cpu_s']:6.0f} {r['cpu_s'] / ref['cpu_s']:6.3f} "
              f"{r['peak_mb']:8.0f} {r['peak_mb'] / ref['peak_mb']:6.3f} {r['stepaware']:9.3f} "
              f"{100 * (r['stepaware'] / ref['stepaware'] - 1):+6.2f}% {r['deepseek']:9.3f} "
              f"{100 * (r['stepaware'] / r['deepseek'] - 1):+21.1f}%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
