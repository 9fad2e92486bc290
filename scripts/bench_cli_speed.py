"""How long the CLI takes end to end: wall time, CPU time and peak memory of each command, each beside the
same command from a baseline tree (the code before a change), run alternately in this one process.

Question: How long does each command take end to end, and did a change make it slower?
Baseline: the same command from a baseline tree (the code before a change), run alternately in this one process.
Output: a table on stdout; --json FILE writes every run; --work DIR keeps the traces.

    python scripts/bench_cli_speed.py [--work DIR] [--baseline-tree DIR] [--repeat 2] [--baseline-timeout 300]
                                      [--cases kimi,kimi-balanced,...] [--json out.json]

Cases: the README's main command (the shipped GPT-OSS-20B sample, verify steps, plots); on the same sample
``optimize --dispatch balanced --replica-memory 3`` (a help example: the spare-slot search) and ``advise --ranks 8
--mode verify`` (its quality column: the layout it picks and that layout's MoE ms per step at the trace's batch);
``trace synth
--shape kimi-k2 --steps 20000`` and ``optimize`` on that trace with its defaults
(``--ranks 8``; the README's "at most 10 s" is this one), with ``--redundant 96 --dispatch balanced`` and
with ``--max-steps 10000``; stepaware alone on the same steps (the search, in a fresh process, for the
end-to-end / search ratio); where the default run's time goes (``kimi-phases``: counting, reading, the
cost model, the baselines, the search, the evaluation, each timed in one process with BLAS on one
thread for both trees); and the shapes where every placement scores the same or the search used to
slow down with less data: the shipped GPT-OSS-20B sample at ``--ranks 16`` and ``32``, each also with
``--max-steps 300``, and SYNTHETIC Mixtral-8x7B-shaped routing at ``--ranks 8`` (one expert per rank) and
``4``, and some of these on fewer steps (``--max-steps``: the time must not grow as the steps shrink).
Both trees read the same trace files (made once by this tree, reused from ``--work``), use the
same seed, and report E[max distinct] on the same held-out steps (``optimize --json``), so a speed-up
that changed a placement shows there.

Each command runs as ``python -c "from moeplace.cli import main; main()" ...`` with PYTHONPATH set to the
tree. CPU seconds are user + system of the command and every process it waited for (its forked
workers); "first s" is when its first line on stderr (a progress line, mostly) came, from its start;
"peak MB" is the largest single process's peak RSS, and "tree MB" the peak of the summed RSS
of the command and its workers, sampled every 50 ms (psutil; pages the workers share with the parent
count twice there). The machine's load average is printed beside each run: on a shared machine CPU
seconds are the steadier figure. A baseline run that passes ``--baseline-timeout`` is stopped and
shown as "> N s".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "gptoss20b-sample.mptrace"
CLI = "from moeplace.cli import main; main()"
SEARCH_ALONE = r"""
import sys, time
from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.optimize import split_steps
from moeplace.trace.load import open_trace
trace = open_trace(sys.argv[1])
fit, _ = split_steps(trace.load("all", 20000), 0.3)
start = time.perf_counter()
solve("stepaware", PlacementProblem(trace.model, fit, 8))
print(f"search {time.perf_counter() - start:.2f} s")
"""
PHASES = r"""
import resource, sys, time
from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.optimize import split_steps
from moeplace.analysis.report import evaluate
from moeplace.commands.costing import resolve_costing
from moeplace.files.placement import Placement
from moeplace.trace.load import open_trace
def cpu():
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
clock, used, out = time.perf_counter(), cpu(), []
def phase(name):
    global clock, used
    out.append(f"{name} {time.perf_counter() - clock:.2f}/{cpu() - used:.2f}")
    clock, used = time.perf_counter(), cpu()
trace = open_trace(sys.argv[1])
total = trace.count("all"); phase("count")
steps = trace.load("all", 20000, total=total); phase("read")
fit, held = split_steps(steps, 0.3)
costing = resolve_costing(trace.model, None, None)
cost = costing.ep(trace.model.num_experts // 8); phase("cost-model")
maps = {name: solve(name, PlacementProblem(trace.model, fit, 8, cost_model=cost)) for name in ("contiguous", "deepseek")}
phase("baselines")
maps["stepaware"] = solve("stepaware", PlacementProblem(trace.model, fit, 8, cost_model=cost)); phase("search")
try:      # the current tree spreads the evaluation's layers over the CPUs, as optimize does
    from moeplace.parallel import layer_workers
    spread = {"workers": layer_workers(held.num_steps * trace.model.num_experts * trace.model.num_moe_layers)}
except ImportError:
    spread = {}
evaluate({n: Placement(trace.model, 8, m) for n, m in maps.items()}, [held], cost, **spread); phase("evaluation")
print("phases (wall/CPU s): " + ", ".join(out))
"""

# name: (trace, arguments after the trace); "synth-*" make their trace instead.
CASES: dict[str, tuple[str, list[str]]] = {
    "synth-kimi": ("", ["trace", "synth", "--shape", "kimi-k2", "--steps", "20000"]),
    "kimi": ("kimi", ["--ranks", "8"]),
    "kimi-balanced": ("kimi", ["--ranks", "8", "--redundant", "96", "--dispatch", "balanced"]),
    "kimi-10k": ("kimi", ["--ranks", "8", "--max-steps", "10000"]),
    "kimi-search-alone": ("kimi", []),
    "kimi-phases": ("kimi", []),
    "sample-readme": ("sample", ["--ranks", "8", "--mode", "verify"]),   # + --sglang-out and --plot-dir
    "sample-balanced": ("sample", ["--ranks", "8", "--mode", "verify", "--dispatch", "balanced", "--replica-memory", "3"]),
    "sample-advise": ("sample", ["--ranks", "8", "--mode", "verify"]),   # advise, not optimize
    "sample-r16": ("sample", ["--ranks", "16"]),
    "sample-r16-300": ("sample", ["--ranks", "16", "--max-steps", "300"]),
    "sample-r32": ("sample", ["--ranks", "32"]),
    "sample-r32-300": ("sample", ["--ranks", "32", "--max-steps", "300"]),
    "mixtral-r8": ("mixtral", ["--ranks", "8"]),
    "mixtral-r4": ("mixtral", ["--ranks", "4"]),
    # less data must never take longer: the same shapes on fewer steps
    "sample-r16-1000": ("sample", ["--ranks", "16", "--max-steps", "1000"]),
    "mixtral-r4-300": ("mixtral", ["--ranks", "4", "--max-steps", "300"]),
    "mixtral-r4-2000": ("mixtral", ["--ranks", "4", "--max-steps", "2000"]),
    "kimi-r32-300": ("kimi", ["--ranks", "32", "--max-steps", "300"]),
    "kimi-r32-1000": ("kimi", ["--ranks", "32", "--max-steps", "1000"]),
    "kimi-r32-3000": ("kimi", ["--ranks", "32", "--max-steps", "3000"]),
}


@dataclass
class Run:
    case: str
    tree: str
    wall_s: float
    cpu_s: float
    peak_mb: float
    tree_mb: float | None
    load_before: float
    load_after: float
    exit_code: int | None            # None: stopped at the timeout
    first_line_s: float | None = None   # when the first stderr line came (None: none came)
    rows: list[dict] = field(default_factory=list)   # optimize --json rows (held-out steps)
    note: str = ""


def tree_rss_sampler(pid: int, stop: threading.Event, peak: list[float]) -> None:
    """Keep peak[0] at the largest summed RSS (MB) of ``pid`` and its descendants seen so far."""
    try:
        import psutil
    except ImportError:
        peak[0] = float("nan")
        return
    try:
        root = psutil.Process(pid)
        while not stop.is_set():
            procs = [root] + root.children(recursive=True)
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total / 2**20)
            stop.wait(0.05)
    except psutil.Error:
        pass


def first_line(stream, start: float, when: list[float | None]) -> None:
    """Set when[0] to the seconds from ``start`` to the first line of ``stream``, then drain it."""
    for _ in stream:
        if when[0] is None:
            when[0] = time.perf_counter() - start


def run(command: list[str], tree: Path, cwd: Path, timeout: float | None) -> tuple[float, float, float, float,
                                                                                   int | None, str, float | None]:
    """(wall s, CPU s, peak MB, tree MB, exit code or None if stopped, stdout, s to the first stderr line) of one
    command."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)   # each tree's CLI its own default
    if command[2] in (SEARCH_ALONE, PHASES):
        env["OPENBLAS_NUM_THREADS"] = "1"   # as the current CLI runs: not two BLAS threads fighting over a core
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    when: list[float | None] = [None]
    reader = threading.Thread(target=first_line, args=(proc.stderr, start, when), daemon=True)
    reader.start()
    stop, peak = threading.Event(), [0.0]
    sampler = threading.Thread(target=tree_rss_sampler, args=(proc.pid, stop, peak), daemon=True)
    sampler.start()
    stopped = []
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, lambda: (stopped.append(True), os.killpg(proc.pid, signal.SIGKILL)))
        timer.start()
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if timer is not None:
        timer.cancel()
    stop.set()
    sampler.join()
    reader.join()
    code = None if stopped else proc.returncode
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, peak[0], code, out, when[0]


def command_for(case: str, traces: dict[str, Path], work: Path, tag: str) -> list[str]:
    trace, args = CASES[case]
    if case.startswith("synth-"):
        return [sys.executable, "-c", CLI, *args, "-o", str(work / f"{tag}-{case}.mptrace")]
    if case in ("kimi-search-alone", "kimi-phases"):
        return [sys.executable, "-c", SEARCH_ALONE if case == "kimi-search-alone" else PHASES, str(traces[trace])]
    if case == "sample-readme":   # the README's main command, plots and all
        args = [*args, "--sglang-out", str(work / f"{tag}-init.json"), "--plot-dir", str(work / f"{tag}-plots")]
    if case == "sample-advise":
        return [sys.executable, "-c", CLI, "advise", str(traces[trace]), *args, "--json"]
    return [sys.executable, "-c", CLI, "optimize", str(traces[trace]), *args, "-o", str(work / f"{tag}-{case}.json"),
            "--json"]


def make_traces(work: Path) -> dict[str, Path]:
    """The traces the cases read, made by this tree once and reused from ``work``."""
    traces = {"sample": SAMPLE, "kimi": work / "kimi-k2-20000.mptrace", "mixtral": work / "mixtral-8x7b-20000.mptrace"}
    for name, shape in (("kimi", "kimi-k2"), ("mixtral", "mixtral-8x7b")):
        if not traces[name].exists():
            subprocess.run([sys.executable, "-c", CLI, "trace", "synth", "--shape", shape, "--steps", "20000",
                            "-o", str(traces[name])], env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return traces


def measure(case: str, tree: Path, tag: str, traces: dict[str, Path], work: Path, timeout: float | None) -> Run:
    load_before = os.getloadavg()[0]
    wall, cpu, peak, tree_mb, code, out, first = run(command_for(case, traces, work, tag), tree, work, timeout)
    result = Run(case, tag, wall, cpu, peak, tree_mb, load_before, os.getloadavg()[0], code, first)
    if code == 0 and out.lstrip().startswith("{"):
        data = json.loads(out)
        if "layouts" in data:   # advise: the layout it picks, at the trace's batch
            pick = next(r for r in data["layouts"] if r["name"] == data["fastest_layout_at_trace"])
            result.note = f"pick {pick['name']}, {pick['at_trace_us'] / 1e3:.3f} ms"
        else:
            result.rows, result.note = data["rows"], data.get("note", "")
    elif code == 0:
        result.note = out.strip().splitlines()[-1] if out.strip() else ""
    return result


def best(runs: list[Run]) -> Run:
    """The run with the least CPU time (its wall time, memory and rows come with it)."""
    done = [r for r in runs if r.exit_code == 0]
    return min(done, key=lambda r: r.cpu_s) if done else runs[0]


def quality(r: Run) -> str:
    rows = {row["placement"]: row for row in r.rows}
    if "stepaware" not in rows:
        return ""
    parts = [f"stepaware {rows['stepaware']['e_max_distinct']:.4f}"]
    if "deepseek" in rows:
        parts.append(f"deepseek {rows['deepseek']['e_max_distinct']:.4f}")
    return ", ".join(parts)


def show(r: Run) -> str:
    if r.exit_code is None:
        return f"{r.case:<18} {r.tree:<9} > {r.wall_s:6.0f} s (stopped)                  load {r.load_before:4.1f}"
    tree_mb = "" if r.tree_mb is None or r.tree_mb != r.tree_mb else f"{r.tree_mb:7.0f}"
    first = "" if r.first_line_s is None else f"{r.first_line_s:7.2f}"
    status = "" if r.exit_code == 0 else f" exit {r.exit_code}"
    return (f"{r.case:<18} {r.tree:<9} {r.wall_s:7.2f} {r.cpu_s:7.2f} {first:>7} {r.peak_mb:7.0f} {tree_mb:>7}  "
            f"load {r.load_before:4.1f}-{r.load_after:4.1f}{status}  {quality(r) or r.note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("bench-cli-speed"), help="Folder for traces and outputs.")
    ap.add_argument("--baseline-tree", type=Path, help="A checkout of the code to compare with (its repository root).")
    ap.add_argument("--repeat", type=int, default=2, help="Runs of each command per tree; the least CPU time is shown.")
    ap.add_argument("--baseline-timeout", type=float, default=300.0, help="Stop a baseline run after this many s.")
    ap.add_argument("--cases", default=",".join(CASES), help=f"Comma-separated, from: {', '.join(CASES)}.")
    ap.add_argument("--json", type=Path, help="Also write every run here.")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases: {', '.join(unknown)}")
    args.work.mkdir(parents=True, exist_ok=True)
    traces = make_traces(args.work.resolve())
    trees = [("current", REPO)] + ([("baseline", args.baseline_tree.resolve())] if args.baseline_tree else [])
    print(f"machine: {os.cpu_count()} CPUs; repeat {args.repeat}; least-CPU run of each shown")
    print(f"{'case':<18} {'tree':<9} {'wall s':>7} {'CPU s':>7} {'first s':>7} {'peak MB':>7} {'tree MB':>7}  load       "
          "E[max distinct], held out")
    runs: list[Run] = []
    summary = []
    for case in cases:
        per_tree: dict[str, list[Run]] = {tag: [] for tag, _ in trees}
        for _ in range(args.repeat):
            for tag, tree in trees:   # alternate, so that both see the same load
                timeout = args.baseline_timeout if tag == "baseline" else None
                if per_tree[tag] and per_tree[tag][-1].exit_code is None:
                    continue          # stopped once: do not wait for it again
                per_tree[tag].append(measure(case, tree, tag, traces, args.work.resolve(), timeout))
                runs.append(per_tree[tag][-1])
        shown = {tag: best(rs) for tag, rs in per_tree.items()}
        for r in shown.values():
            print(show(r), flush=True)
        if "baseline" in shown:
            cur, base = shown["current"], shown["baseline"]
            if base.exit_code is None:
                line = f"{case}: current {cur.wall_s:.2f} s wall against a baseline stopped at {base.wall_s:.0f} s"
            else:
                line = (f"{case}: baseline / current = {base.wall_s / cur.wall_s:.2f}x wall, "
                        f"{base.cpu_s / cur.cpu_s:.2f}x CPU, {base.peak_mb / cur.peak_mb:.2f}x peak memory")
            print("  " + line, flush=True)
            summary.append(line)
    if "kimi" in cases and "kimi-search-alone" in cases:
        for tag, _ in trees:
            end_to_end = best([r for r in runs if r.case == "kimi" and r.tree == tag])
            alone = best([r for r in runs if r.case == "kimi-search-alone" and r.tree == tag])
            if end_to_end.exit_code != 0 or alone.exit_code != 0:
                continue
            search_s = float(alone.note.split()[1])
            line = (f"{tag}: optimize end to end {end_to_end.wall_s:.2f} s wall = {end_to_end.wall_s / search_s:.2f}x "
                    f"stepaware's search alone on the same steps ({search_s:.2f} s)")
            print(line)
            summary.append(line)
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
