#!/usr/bin/env python
"""Balanced-dispatch kernel: µs per MoE layer per step under CUDA-graph replay, against SGLang's rule.

Question: How many µs does the dispatch kernel add per MoE layer and step inside SGLang's router?
Baseline: SGLang's own replica dispatch on the same layout and ids, in the same CUDA graph set-up and process.
Output: --out FILE.md (default bench_dispatch.md), a markdown table, with a .json beside it.

The layout is made by moeplace itself: one Kimi-K2-shaped layer (SYNTHETIC routing: 384 experts,
top-8) placed by ``stepaware`` for balanced dispatch on 8 ranks with 96 spare slots, fitted on
``--fit-steps`` synthetic verify steps. The ids come from held-out synthetic steps of the same routing
(9 tokens each; a batch of T tokens is T/9 steps, as T/9 requests verifying 9 drafts).

For each batch size, one CUDA graph holds ``--calls`` dispatches, each over a different batch with its
own input and output buffers; µs per call = median replay time / calls. Rows:

  moeplace cuda     ``moeplace_kernels.balanced_dispatch``, the CUDA kernel (int32 ids, as SGLang's)
  moeplace cost     ``moeplace_kernels.balanced_dispatch.cost_dispatch``, the rule by cost in the same CUDA
                    kernel (``--cost-q``: pairs per expert read; 281 is the derived H200 Kimi-K2 model's q
                    from 72 tokens per step, BENCHMARKS.md#the-rule-by-cost)
  moeplace triton   the same rule in Triton (the fallback)
  sglang dynamic    SGLang 0.5.23's ``_topk_ids_logical_to_physical_dynamic`` with ``rank_invariant``
                    (what ``--moe-a2a-backend none`` runs), loaded from the wheel
  copy (floor)      one copy kernel per call: the cost of any one-kernel step in a graph

With ``--phases``, builds of the CUDA kernel that stop after each of its phases show where the time
goes, in SM cycles measured inside the kernel and in µs per call (for the rule by cost too, with
``cost`` in ``--kernels``); the SM clock (NVML) during the replays is printed too. ``--variant LABEL=SPEC`` (repeatable) adds a row for another build of the CUDA
kernel: SPEC holds nvcc flags (``-DBD_THREADS=256``) and/or another source of the same C entry point
(a ``.cu`` path, e.g. an earlier version from git), each checked like the others; with ``cost`` in
``--kernels``, a row of its rule by cost too.

Every moeplace output is compared with ``moeplace.dispatch.balanced.fast_rule`` (the cost rows with
``moeplace.dispatch.by_cost.cost_rule``, split experts' entries in ``pair_slots``' order; ids that differ: a
column; 0 is right). A variant that fails is reported in its row and the others still run. Also reported:
augmenting paths per batch (mean, max, share at the cap of 16) and the mean over batches of the
largest number of distinct experts a rank reads, under each rule, beside the exact per-step optimum.

    python3 scripts/bench_dispatch.py --sglang-wheel '.whl/sglang-*.whl' --out bench_dispatch.md --phases
    git show df717cf:kernels/balanced_dispatch.cu > build/previous.cu   # the one-warp kernel
    python3 scripts/bench_dispatch.py --kernels cuda --variant previous=build/previous.cu --variant '256 threads=-DBD_THREADS=256'
    python3 scripts/bench_dispatch.py --kernels cuda,cost --tokens 9,36,72,144,288,576 --out cost.md

``--exact-only N`` (no GPU needed) instead scores the rule by cost on the first N batches of each size
against the exact optimum (``moeplace.dispatch.by_cost.exact_split``, HiGHS: its proven lower bound), in units
of (token, expert) pairs: the busiest rank's ``q * distinct + tokens``, without the launch term c (so the
gap is no smaller than with it). The batches are the ones the timing run uses (same seeds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeplace.dispatch.balanced import MAX_AUGMENT, ReplicaLayout, fast_rule, replica_layout  # noqa: E402
from moeplace.dispatch.by_cost import RuleWeights, cost_rule  # noqa: E402
from moeplace.files.atomic import atomic_write_text  # noqa: E402

TOKENS_PER_STEP = 9


@dataclass
class Batches:
    """``calls`` batches of ``tokens`` token rows: ids [calls, T, K] and their expected picks."""

    tokens: int
    ids: np.ndarray
    expected: np.ndarray     # [calls, T, K] physical slots by the fast rule
    augments: np.ndarray     # [calls] augmenting paths the rule used
    optimum: np.ndarray      # [calls] exact per-step optimum of the largest distinct experts on a rank
    counts: np.ndarray       # [calls, E] tokens per expert
    cost_expected: np.ndarray | None = None   # [calls, T, K] slots by the rule by cost (with --cost-q)
    cost_rounds: np.ndarray | None = None     # [calls] its moves


def one_layer_model(args):
    from moeplace.model.spec import ModelSpec

    return ModelSpec("SYNTHETIC kimi-k2-shaped, one layer", 1, (0,), args.experts, args.topk)


def make_layout(args) -> tuple[np.ndarray, ReplicaLayout]:
    """(phy2log [P], its ReplicaLayout): stepaware for balanced dispatch on one synthetic layer."""
    from moeplace.algorithms import PlacementProblem, solve
    from moeplace.trace.synthetic import synthetic_steps

    model = one_layer_model(args)
    _, fit = synthetic_steps(args.fit_steps, TOKENS_PER_STEP, model, seed=args.seed)
    problem = PlacementProblem(model, fit, args.ranks, redundant=args.redundant, dispatch="balanced",
                               effort=args.effort)
    phy2log = solve("stepaware", problem)[0]
    return phy2log, replica_layout(phy2log, args.experts, args.ranks)


def make_batches(args, layout: ReplicaLayout, tokens: int) -> Batches:
    """Held-out synthetic steps grouped into ``args.calls`` batches of ``tokens`` rows."""
    from moeplace.dispatch.exact import step_optimum, subset_counts, subset_sizes
    from moeplace.trace.synthetic import synthetic_steps

    model = one_layer_model(args)
    per_batch = tokens // TOKENS_PER_STEP
    _, held = synthetic_steps(args.calls * per_batch, TOKENS_PER_STEP, model, seed=args.seed + 1)
    ids = held.layer(0)[2].astype(np.int64).reshape(args.calls, tokens, args.topk)
    E, R = args.experts, args.ranks
    counts = np.stack([np.bincount(b.ravel(), minlength=E) for b in ids])
    rule = fast_rule(counts, layout.masks, R, MAX_AUGMENT)
    expected = layout.slots[ids, rule.pick[np.arange(args.calls)[:, None, None], ids]]
    optimum = step_optimum(subset_counts(counts > 0, layout.masks, R), subset_sizes(R))
    batches = Batches(tokens, ids, expected, rule.augments, optimum, counts)
    if args.cost_q:
        batches.cost_expected, batches.cost_rounds = cost_slots(ids, counts, layout, args.cost_q)
    return batches


def parse_weights(text: str) -> RuleWeights:
    """``READ,PAIR,BLOCK,BLOCK_M`` as RuleWeights (argparse: a bad value is one line)."""
    try:
        read, pair, block, block_m = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected four integers READ,PAIR,BLOCK,BLOCK_M, got {text!r}") from None
    return RuleWeights(read, pair, block, block_m)


def weights_label(w: RuleWeights) -> str:
    return f"q {w.read}" if (w.pair, w.block) == (1, 0) else f"weights {w.read}/{w.pair}/{w.block}/{w.block_m}"


def cost_slots(ids: np.ndarray, counts: np.ndarray, layout: ReplicaLayout,
               q: RuleWeights) -> tuple[np.ndarray, np.ndarray]:
    """([calls, T, K] slots, [calls] moves) by the rule by cost: a split expert's entries take its ranks in
    increasing rank order, in entry order (``moeplace.dispatch.by_cost.pair_slots``)."""
    chosen = cost_rule(counts, layout.masks, layout.ranks, q)
    ends = np.cumsum(chosen.full_alloc(counts), axis=2)                   # [calls, E, R]
    out = np.empty_like(ids)
    for c, batch in enumerate(ids):
        flat = batch.ravel()
        order = np.argsort(flat, kind="stable")
        grouped = flat[order]
        position = np.empty(flat.size, np.int64)
        position[order] = np.arange(flat.size) - np.searchsorted(grouped, grouped, side="left")
        rank = (position[:, None] >= ends[c, flat]).sum(axis=1)
        out[c] = layout.slots[flat, rank].reshape(batch.shape)
    return out, chosen.rounds


def exactness(args, layout: ReplicaLayout) -> list[dict]:
    """The rule by cost against ``exact_split``'s proven bound on the first ``args.exact_only`` batches of each size."""
    from moeplace.dispatch.by_cost import allocation_cost, exact_split

    q, R = args.cost_q, args.ranks
    out = []
    for tokens in args.tokens:
        batches = make_batches(args, layout, tokens)
        n = min(args.exact_only, args.calls)
        alloc = cost_rule(batches.counts[:n], layout.masks, R, q).full_alloc(batches.counts[:n])
        gaps, optimal = [], 0
        for c in range(n):
            mine = float(allocation_cost(alloc[c], q.read, q.pair, q.block, q.block_m).max())
            exact = exact_split(batches.counts[c], layout.masks, R, q.read, q.pair, args.exact_time, q.block, q.block_m)
            gaps.append(mine / exact.bound - 1 if exact.bound > 0 else 0.0)
            optimal += exact.optimal
        row = dict(tokens=tokens, steps=n, proven_optimal=optimal, gap_mean=float(np.mean(gaps)),
                   gap_max=float(np.max(gaps)), moves_mean=float(batches.cost_rounds.mean()),
                   moves_max=int(batches.cost_rounds.max()))
        out.append(row)
        print(f"{tokens:3d} tokens: rule by cost vs exact bound, mean {100 * row['gap_mean']:.2f}%, max "
              f"{100 * row['gap_max']:.2f}% ({optimal}/{n} proven optimal); moves per batch mean "
              f"{row['moves_mean']:.2f}, max {row['moves_max']}", flush=True)
    return out


def load_sglang_dispatch(wheel: str | None):
    """(SGLang's expert_location_dispatch module, sglang version), from the wheel."""
    from sglang_wheel import register_packages, stub, unpack

    root, version = unpack(wheel)
    register_packages(root, ["sglang", "sglang.srt", "sglang.srt.eplb"])
    stub("sglang.srt.eplb.expert_location", get_global_expert_location_metadata=lambda: None)
    stub("sglang.srt.runtime_context", get_exec=lambda: None)
    return importlib.import_module("sglang.srt.eplb.expert_location_dispatch"), version


def sglang_dispatch_info(module, phy2log: np.ndarray, experts: int, device):
    """SGLang's ExpertLocationDispatchInfo for one layer, its replica lists as SGLang builds them
    (physical ids ascending, padded with -1) without an a2a backend (``rank_invariant``)."""
    import torch

    lists = [np.flatnonzero(phy2log == e) for e in range(experts)]
    width = max(len(x) for x in lists)
    table = np.full((experts, width), -1, np.int64)
    for e, x in enumerate(lists):
        table[e, :len(x)] = x
    return module.ExpertLocationDispatchInfo(
        ep_dispatch_algorithm="dynamic", partial_logical_to_rank_dispatch_physical_map=None,
        partial_logical_to_all_physical_map=torch.from_numpy(table).to(device),
        partial_logical_to_all_physical_map_num_valid=torch.tensor([len(x) for x in lists], device=device),
        num_physical_experts=int(phy2log.shape[0]), rank_invariant=True)


def max_distinct(slots: np.ndarray, ranks: int, physical: int) -> np.ndarray:
    """[calls] largest number of distinct physical slots a rank reads, per batch. slots: [calls, T, K]."""
    per_rank = physical // ranks
    out = np.zeros(slots.shape[0], np.int64)
    for c, batch in enumerate(slots):
        used = np.unique(batch[batch >= 0])
        out[c] = np.bincount(used // per_rank, minlength=ranks).max()
    return out


PHASES = ((-1, "launch only"), (1, "1 loads (ids, masks, row count)"), (2, "2 tokens per expert"),
          (3, "3 list of the multi-replica experts"), (4, "4 greedy"), (5, "5 augmenting paths"),
          (6, "5b moves (rule by cost)"), (0, "6 slots (whole kernel)"))


def parse_variant(text: str) -> tuple[str, str | None, list[str]]:
    """(label, source or None, nvcc flags) of ``--variant LABEL=SPEC``."""
    label, sep, spec = text.partition("=")
    if not sep or not label.strip() or not spec.split():
        raise argparse.ArgumentTypeError(f"--variant takes LABEL=SPEC (nvcc flags and/or a .cu path), got {text!r}")
    sources = [t for t in spec.split() if t.endswith(".cu")]
    if len(sources) > 1:
        raise argparse.ArgumentTypeError(f"--variant {label}: one .cu source at most, got {', '.join(sources)}")
    if sources and not Path(sources[0]).is_file():
        raise argparse.ArgumentTypeError(f"--variant {label}: no such file {sources[0]}")
    return label.strip(), (sources[0] if sources else None), [t for t in spec.split() if not t.endswith(".cu")]


def build_libraries(capability: tuple[int, int], builds: dict) -> dict:
    """{key: library} for ``builds`` {key: (source or None for the shipped one, nvcc flags)}: benchmark
    builds of the CUDA kernel (e.g. ``BD_STOP_AFTER``, ``BD_CLOCK`` in balanced_dispatch.cu), compiled
    side by side with nvcc."""
    import subprocess
    import tempfile

    from moeplace_kernels import balanced_dispatch_cuda as bdc

    nvcc = bdc.find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc")
    folder = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    jobs = {}
    for n, (key, (source, flags)) in enumerate(builds.items()):
        path = folder / f"build{n}.so"
        cmd = [nvcc, *bdc.NVCC_FLAGS, *bdc.arch_flags(capability), "-shared", "-Xcompiler", "-fPIC", *flags,
               "-o", str(path), str(source or bdc.SOURCE)]
        jobs[key] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), path)
    libraries = {}
    for key, (proc, path) in jobs.items():
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"nvcc failed for {key}: {err.strip().splitlines()[:1]}")
        libraries[key] = bdc.DispatchLibrary(str(path))
    return libraries


def sm_clock_mhz(fn, replays: int = 400) -> float | None:
    """The SM clock (NVML) while a graph of ``fn`` replays back to back, or None without NVML."""
    import torch

    try:
        torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 (pynvml missing or unsupported)
        return None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(replays):
        graph.replay()
    time.sleep(0.03)
    mhz = torch.cuda.clock_rate()
    torch.cuda.synchronize()
    return float(mhz)


def measure(args) -> tuple[list[dict], dict]:
    import torch

    from cuda_timing import graph_time_us
    from moeplace_kernels.balanced_dispatch import (balanced_dispatch, cost_dispatch, dispatch_tables, launch_cuda,
                                                    prepare)

    device = torch.device("cuda")
    t0 = time.time()
    phy2log, layout = make_layout(args)
    print(f"layout: stepaware, balanced dispatch, {args.ranks} ranks, {args.redundant} spare slots "
          f"({time.time() - t0:.1f} s)", flush=True)
    masks, slots = dispatch_tables(layout, device)
    backends = []
    for b in (b for b in ("cuda", "triton") if b in args.kernels or (b == "cuda" and "cost" in args.kernels)):
        try:
            print(f"prepare {b}: {prepare(device, b)}", flush=True)
            backends.append(b)
        except Exception as exc:  # noqa: BLE001 (a build or compile error: reported, the rest still runs)
            print(f"moeplace {b}: unavailable ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})",
                  flush=True)
    sgl, version, info = None, "(not loaded)", None
    if args.sglang_wheel != "none":
        sgl, version = load_sglang_dispatch(args.sglang_wheel)
        info = sglang_dispatch_info(sgl, phy2log, args.experts, device)
    physical = int(phy2log.shape[0])
    rows, meta = [], dict(sglang=version, torch=torch.__version__, device=torch.cuda.get_device_name(),
                          calls=args.calls, reps=args.reps, phases=[], sm_clock_mhz={})
    builds = {("variant", label): (source, flags) for label, source, flags in args.variant}
    if args.phases:
        builds.update({("phase", stop): (None, [f"-DBD_STOP_AFTER={stop}", "-DBD_CLOCK=1"]) for stop, _ in PHASES})
    libraries = {}
    if builds:
        t0 = time.time()
        try:
            libraries = build_libraries(torch.cuda.get_device_capability(device), builds)
            print(f"{len(builds)} benchmark builds ({time.time() - t0:.1f} s)", flush=True)
        except (OSError, RuntimeError) as exc:
            print(f"no benchmark builds: {str(exc).splitlines()[0]}", flush=True)
    for tokens in args.tokens:
        batches = make_batches(args, layout, tokens)
        ids = [torch.from_numpy(b).to(device=device, dtype=torch.int32) for b in batches.ids]
        num_rows = torch.tensor(tokens, dtype=torch.int32, device=device)
        outs = [torch.empty_like(x) for x in ids]

        def moeplace(backend):
            def run():
                for x, o in zip(ids, outs):
                    balanced_dispatch(x, masks, slots, num_rows, o, backend=backend)
            return run

        def cost(backend):
            def run():
                for x, o in zip(ids, outs):
                    cost_dispatch(x, masks, slots, args.cost_q, num_rows, o, backend=backend)
            return run

        def build(library, q=None):
            def run():
                for x, o in zip(ids, outs):
                    launch_cuda(library, x, masks, slots, num_rows, o, MAX_AUGMENT, q)
            return run

        def dynamic():
            for c, x in enumerate(ids):
                outs[c] = sgl._topk_ids_logical_to_physical_dynamic(x, info)

        def copy():
            for x, o in zip(ids, outs):
                o.copy_(x)

        variants = [(f"moeplace {b}", moeplace(b)) for b in backends if b in args.kernels]
        if "cost" in args.kernels and "cuda" in backends:
            variants.append((f"moeplace cost ({weights_label(args.cost_q)})", cost("cuda")))
        variants += [(f"moeplace cuda [{key[1]}]", build(lib)) for key, lib in libraries.items() if key[0] == "variant"]
        if "cost" in args.kernels:
            variants += [(f"moeplace cost ({weights_label(args.cost_q)}) [{key[1]}]", build(lib, args.cost_q))
                         for key, lib in libraries.items() if key[0] == "variant"]
        variants += [(f"sglang {version} dynamic", dynamic)] if sgl is not None else []
        variants += [("copy (floor)", copy)]
        common = dict(tokens=tokens, entries=tokens * args.topk,
                      augments_mean=float(batches.augments.mean()), augments_max=int(batches.augments.max()),
                      at_cap=float((batches.augments >= MAX_AUGMENT).mean()),
                      optimum=float(batches.optimum.mean()))
        for name, fn in variants:
            row = dict(common, kernel=name, us=None, max_distinct=None, wrong=None)
            rows.append(row)
            try:   # one failing variant must not cost the others' figures in one run
                fn()
                torch.cuda.synchronize()
                got = np.stack([o.cpu().numpy() for o in outs])
                if name.startswith("moeplace cost"):
                    row["wrong"] = int((got != batches.cost_expected).sum())
                    row["moves_mean"] = float(batches.cost_rounds.mean())
                    row["moves_max"] = int(batches.cost_rounds.max())
                elif name.startswith("moeplace"):
                    row["wrong"] = int((got != batches.expected).sum())
                if "floor" not in name:
                    row["max_distinct"] = float(max_distinct(got, args.ranks, physical).mean())
                row["us"] = graph_time_us(fn, reps=args.reps) / args.calls
            except Exception as exc:  # noqa: BLE001 (reported in the table)
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            print(f"{tokens:3d} tokens  {name:24s} " + (f"{row['us']:7.2f} µs" if row["us"] is not None
                                                        else row["error"]), flush=True)
        if "cuda" in backends:
            meta["sm_clock_mhz"][tokens] = sm_clock_mhz(moeplace("cuda"))
        rules = [("balanced", None)] + ([("cost", args.cost_q)] if "cost" in args.kernels else [])
        for (rule, q), (stop, label) in ((r, ph) for r in rules for ph in PHASES if ("phase", 0) in libraries):
            if q is None and stop == 6:   # the balanced rule has no moves
                continue
            run_phase = build(libraries["phase", stop], q)
            run_phase()
            torch.cuda.synchronize()
            cycles = float(np.median([o[0, 0].item() for o in outs]))
            us = graph_time_us(run_phase, reps=args.reps) / args.calls
            meta["phases"].append(dict(tokens=tokens, rule=rule, phase=label, cycles=cycles, us=us))
            print(f"{tokens:3d} tokens  {rule:8s} until {label:24s} {cycles:8.0f} cycles {us:7.2f} µs/call",
                  flush=True)
    return rows, meta


def table(rows: list[dict], meta: dict, args) -> str:
    base = {r["tokens"]: r["us"] for r in rows if "dynamic" in r["kernel"]}
    lines = [f"Device: {meta['device']}, torch {meta['torch']}, SGLang {meta['sglang']} (wheel). "
             f"{args.experts} experts, top-{args.topk}, {args.ranks} ranks, {args.redundant} spare slots; "
             f"{meta['calls']} calls per graph, median of {meta['reps']} replays.", "",
             "| tokens | ids | kernel | µs / call | vs sglang dynamic | ids unlike the rule | E[max distinct] "
             "| exact optimum | augmenting paths mean / max / at cap |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        us = r.get("error") or f"{r['us']:.2f}"
        ratio = f"{r['us'] / base[r['tokens']]:.2f}x" if r["us"] and base.get(r["tokens"]) else ""
        wrong = "" if r["wrong"] is None else str(r["wrong"])
        if "moves_mean" in r:
            wrong += f" (moves mean {r['moves_mean']:.2f}, max {r['moves_max']})"
        distinct = "" if r["max_distinct"] is None else f"{r['max_distinct']:.2f}"
        lines.append(f"| {r['tokens']} | {r['entries']} | {r['kernel']} | {us} | {ratio} | {wrong} | {distinct} | "
                     f"{r['optimum']:.2f} | {r['augments_mean']:.2f} / {r['augments_max']} / "
                     f"{100 * r['at_cap']:.0f}% |")
    clocks = ", ".join(f"{t} tokens {c:.0f} MHz" for t, c in meta["sm_clock_mhz"].items() if c)
    if clocks:
        lines += ["", f"SM clock (NVML) while the CUDA kernel's graph replays: {clocks}."]
    if meta["phases"]:
        lines += ["", "Where the CUDA kernel's time goes: builds that stop after each phase; SM cycles from the "
                  "kernel's first instruction (median over the calls) and µs per call under graph replay.", "",
                  "| tokens | rule | until the end of | cycles | µs / call |", "| ---: | --- | --- | ---: | ---: |"]
        lines += [f"| {p['tokens']} | {p['rule']} | {p['phase']} | {p['cycles']:.0f} | {p['us']:.2f} |"
                  for p in meta["phases"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-wheel", default=".whl/sglang-*.whl",
                    help="the sglang wheel (a glob is fine); none: no SGLang row")
    ap.add_argument("--out", default="bench_dispatch.md", help="markdown table (a .json beside it)")
    ap.add_argument("--tokens", default="9,36,72", help="token rows per batch, multiples of 9")
    ap.add_argument("--kernels", default="cuda,triton", help="moeplace kernels to time: cuda, cost, triton")
    ap.add_argument("--cost-q", type=int, default=281,
                    help="the rule by cost's pairs per expert read (its rows, and --exact-only)")
    ap.add_argument("--cost-weights", type=parse_weights, metavar="READ,PAIR,BLOCK,BLOCK_M",
                    help="the rule by cost's weights with the row-block term instead of --cost-q, e.g. "
                         "3096,1,1724,64 (moeplace.dispatch.by_cost.rule_weights of the derived Kimi-shaped model)")
    ap.add_argument("--exact-only", type=int, default=0, metavar="N",
                    help="no timing: the rule by cost against the exact optimum on N batches of each size (CPU)")
    ap.add_argument("--exact-time", type=float, default=10.0, help="seconds the MILP may take per batch")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--redundant", type=int, default=96, help="spare slots over all ranks")
    ap.add_argument("--fit-steps", type=int, default=4000, help="synthetic steps the layout is fitted on")
    ap.add_argument("--effort", type=float, default=4e7, help="stepaware's work budget for the one layer")
    ap.add_argument("--calls", type=int, default=100, help="dispatches (different batches) per graph")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", action="store_true",
                    help="also time builds of the CUDA kernel that stop after each phase (needs nvcc)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="LABEL=SPEC",
                    help="also time another build of the CUDA kernel: nvcc flags and/or a .cu source of the "
                         "same entry point, e.g. '256 threads=-DBD_THREADS=256' (repeatable; needs nvcc)")
    args = ap.parse_args()
    args.cost_q = args.cost_weights or RuleWeights(args.cost_q)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 or t % TOKENS_PER_STEP for t in args.tokens):
        ap.error(f"--tokens must be positive multiples of {TOKENS_PER_STEP}")
    if args.exact_only:
        _, layout = make_layout(args)
        rows = exactness(args, layout)
        atomic_write_text(args.out, json.dumps(dict(weights=asdict(args.cost_q), rows=rows), indent=1))
        return
    rows, meta = measure(args)
    text = table(rows, meta, args)
    atomic_write_text(args.out, text)
    atomic_write_text(Path(args.out).with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(text)


if __name__ == "__main__":
    main()
