"""Replay routing steps on the GPU under each placement: measured MoE ms per step vs the cost model.

Question: What MoE time per verify step does each placement and dispatch rule measure on the GPU, against the cost
    model's prediction?
Baseline: DeepSeek EPLB (and SGLang's best rule with spare slots) replayed in the same process on the same steps.
Output: prepare --out DIR; measure --out FILE.json (timings); report --times FILE.json prints the tables.

Per step and MoE layer, each EP rank runs its own expert subset with the token counts SGLang's
dispatch would give it (``moeplace.analysis.advise.slot_token_counts``: the ``dynamic`` rule, or moeplace's
``balanced`` rule on the placements made for it); the layer takes as long as its slowest rank, and
the step is the sum over layers. TP-MoE (every rank holds 1/N of every expert) is replayed the same
way: one rank runs every activated expert at 1/N width.

A rank's work is timed by the fused-MoE path of ``calibrate_cost.py`` (SGLang's Triton kernel over
SGLang's block layout of all the step's pairs, other ranks' as -1, so the kernel's grid is SGLang's).
Its time depends only on the multiset of per-slot token counts (all experts have the same shape), so
each distinct rank workload is timed once and reused wherever it recurs.

Placements (``placement_specs``): contiguous, deepseek and stepaware without spare slots (dynamic
rule), deepseek with E/4 spare slots (dynamic), and balanced dispatch on stepaware's balanced
placement with E/4 and E/2 spare slots.

    python scripts/replay_placement.py prepare --out out/replay          # here: placements, work lists
    python3 scripts/replay_placement.py measure --work out/replay --out $OUT/replay_times.json  # GPU
    python scripts/replay_placement.py report --work out/replay --times replay_times.json   # here

``measure --jobs gptoss`` / ``--jobs kimi`` times one trace's workloads, so two GPUs can share the
work (``report --times a.json,b.json`` merges them).

Layouts by batch: ``prepare --batch-tokens 9,36,72,144,288,576`` replays batches of 1 to 64 requests verifying 9 tokens,
built from the held-out steps (each job times its batch's kernel config; ``--steps 9=24,576=8`` sets the steps
per size, ``--kimi-layers`` the synthetic layers); ``--cost-rule`` adds moeplace's rule by cost on the balanced
placement with E/4 spares (``cost+r..``); ``--layouts`` adds EP groups with MoE TP inside (``ep4xtp2``,
``ep2xtp4``, stepaware and DeepSeek EPLB without spares, E/4 spares under the cost rule; TP-MoE is the ``tp``
row). Placements are fitted with advise's cost models. ``measure`` captures a job's launches once and writes
each workload into the graph's buffers (``calibrate_cost.StaticStep``), and skips ranks another rank of the
layer dominates (``dominated``; the first ``--check-steps`` of each size are timed in full to check that).
``report`` ends with the layout questions: the rule by cost against every other rule, and the layout ``advise``
would name (its cost models on the replayed steps and placements) against the fastest measured:

    python scripts/replay_placement.py prepare --out out/rp22 --batch-tokens 9,36,72,144,288,576 --cost-rule --layouts
    python3 scripts/replay_placement.py measure --work out/rp22 --out $OUT/replay22.json
    python scripts/replay_placement.py report --work out/rp22 --times replay22.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bench_inputs import GPTOSS, gptoss_steps, kimi_shaped   # scripts/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 8
ALGORITHMS = ("contiguous", "deepseek", "stepaware")
# trace -> expert shape (bf16), redundant slots of the dynamic-rule rows of check_derived_cost.py,
# steps to fit, steps to replay, replayed layers -> the model's MoE layers
TRACES = {
    "gptoss": dict(hidden=2880, inter=2880, redundant=8, fit_steps=3000, test_steps=64,
                   label="GPT-OSS-20B real routing"),
    "kimi": dict(hidden=7168, inter=2048, redundant=32, fit_steps=320, test_steps=32, layer_scale=5,
                 label="SYNTHETIC Kimi-K2-shaped routing"),
}


def placement_specs(num_experts: int) -> list[tuple[str, str, int, str]]:
    """(tag, algorithm, redundant slots, dispatch rule) of every EP placement replayed."""
    quarter, half = num_experts // 4, num_experts // 2
    return [(alg, alg, 0, "dynamic") for alg in ALGORITHMS] + [
        (f"deepseek+r{quarter}", "deepseek", quarter, "dynamic"),
        (f"balanced+r{quarter}", "stepaware", quarter, "balanced"),
        (f"balanced+r{half}", "stepaware", half, "balanced"),
    ]


def extra_specs(num_experts: int, ranks: int, cost_rule: bool, layouts: bool) -> list[tuple[str, str, int, str, int]]:
    """(tag, algorithm, spare slots, rule, EP groups) of the layout rows: the cost rule with E/4 spare slots
    (on the balanced placement), and EP groups with MoE TP inside, without spares (stepaware and DeepSeek EPLB,
    the two ``advise`` compares) and with E/4 spares under the cost rule."""
    quarter = num_experts // 4
    out = [(f"cost+r{quarter}", "stepaware", quarter, "cost", ranks)] if cost_rule else []
    for ep in ((ranks // 2, ranks // 4) if layouts else ()):
        if ep >= 2 and ranks % ep == 0 and num_experts % ep == 0:
            tag = f"ep{ep}xtp{ranks // ep}"
            out += [(tag, "stepaware", 0, "dynamic", ep), (f"deepseek-{tag}", "deepseek", 0, "dynamic", ep),
                    (f"{tag}+r{quarter}", "stepaware", quarter, "cost", ep)]
    return out


GPU: list[str] = []   # [``--gpu``] (report and prepare): whose shipped cost models predict, else the H200's


def rank_cost(hidden: int, inter: int, slots: int, top_k: int, moe_tp: int, step_tokens: int):
    """The cost model ``advise`` uses for one GPU holding ``slots`` experts, each 1/moe_tp of ``hidden x inter``
    (bf16), at steps of ``step_tokens`` tokens (``Costing.group``: SGLang's kernel config and grid for them), from
    the shipped models of ``--gpu`` where given (``moeplace.cost.gpus``)."""
    from moeplace.commands.costing import Costing
    from moeplace.cost.gpus import resolve_gpu
    from moeplace.model.expert_shape import ExpertShape
    shape = ExpertShape(hidden, inter, "bf16", "replay")
    return Costing(shape, top_k, gpu=resolve_gpu(GPU[0] if GPU else None)).group(slots, moe_tp, step_tokens)


def layout_members(tags: list[str], num_experts: int, ranks: int, groups: dict[str, int]) -> dict[str, list[str]]:
    """advise's layout name (``moeplace.analysis.layouts.Layout.name``) -> the replayed rows it is costed with: without
    spare slots DeepSeek EPLB and stepaware under SGLang's dynamic rule, with E/4 spares the cost rule on
    stepaware's placement for it, TP-MoE the ``tp`` row."""
    from moeplace.analysis.layouts import Layout
    quarter = num_experts // 4
    out: dict[str, list[str]] = {}
    for tag in tags:
        ep = 1 if tag == "tp" else groups.get(tag, ranks)
        base = tag.split("+")[0].removeprefix("deepseek-")
        if tag == "tp" or base in ("deepseek", "stepaware", f"ep{ep}xtp{ranks // ep}") and "+" not in tag:
            out.setdefault(Layout(ranks, ep).name, []).append(tag)
        elif tag in (f"cost+r{quarter}", f"ep{ep}xtp{ranks // ep}+r{quarter}"):
            out.setdefault(Layout(ranks, ep, quarter).name, []).append(tag)
    return out


def ep_shape(hidden: int, inter: int, slots_per_rank: int, top_k: int) -> dict:
    """One EP rank's shape for ``calibrate_cost.RankMoe``: whole experts, ``slots_per_rank`` of them."""
    return dict(hidden=hidden, inter=inter, n_local=slots_per_rank, top_k=top_k)


def tp_shape(hidden: int, inter: int, ranks: int, num_experts: int, top_k: int) -> dict:
    """One TP-MoE rank's shape: 1/ranks of every expert's intermediate dimension."""
    return dict(hidden=hidden, inter=-(-inter // ranks), n_local=num_experts, top_k=top_k)


def stale_jobs(jobs: dict) -> list[str]:
    """Jobs of a work.json prepared before the replay built SGLang's layout (their shapes lack top_k)."""
    return [job for job, j in jobs.items() if "top_k" not in j["shape"]]


def load_trace(name: str, gptoss_path: str, test_steps: int | None = None, kimi_layers: int = 12):
    """(train steps, test steps, label) of one trace; test steps come after the training ones.
    kimi_layers: the synthetic Kimi-shaped layers drawn (of 60; the report scales to 60)."""
    cfg = TRACES[name]
    n_test = test_steps or cfg["test_steps"]
    if name == "gptoss":
        steps = gptoss_steps(gptoss_path, "all")
        cut = int(steps.num_steps * 0.8)
        train = steps.take(np.linspace(0, cut - 1, cfg["fit_steps"]).astype(np.int64))
        test = steps.take(np.linspace(cut, steps.num_steps - 1, n_test).astype(np.int64))
        return train, test, "GPT-OSS-20B real trace (verify windows of 9 tokens)"
    steps = kimi_shaped(kimi_layers, cfg["fit_steps"] + n_test)     # the report scales to 60 layers
    n = cfg["fit_steps"]
    return (steps.take(np.arange(n)), steps.take(np.arange(n, steps.num_steps)),
            f"SYNTHETIC Kimi-K2-shaped trace (9 tokens per step; {kimi_layers} layers replayed, scaled to 60)")


def fit_placements(train, ranks: int, effort: float, log=print, only: list[str] | None = None,
                   extra: list[tuple[str, str, int, str, int]] = (),
                   cost: "Callable[[int, int], object] | None" = None) -> dict[str, tuple[np.ndarray, str]]:
    """tag -> (phy2log [L, P], dispatch rule) for the specs of ``placement_specs`` (those in ``only``), then
    ``extra`` (``extra_specs``: placed for their EP groups; the cost rule's spares as balanced dispatch's).
    cost(groups, slots per group): the cost model each placement is fitted with, as ``advise`` fits its
    layouts (default: the library's)."""
    from moeplace.algorithms import PlacementProblem, solve
    from moeplace.dispatch.by_cost import PLACED_AS
    out = {}
    for tag, alg, red, dispatch, groups in [(*spec, ranks) for spec in placement_specs(train.model.num_experts)] \
            + list(extra):
        if only is not None and tag not in only:
            continue
        t0 = time.time()
        model = cost(groups, (train.model.num_experts + red) // groups) if cost else None
        problem = PlacementProblem(train.model, train, groups, redundant=red, dispatch=PLACED_AS.get(dispatch, dispatch),
                                   effort=effort, **({"cost_model": model} if model else {}))
        out[tag] = (solve(alg, problem), dispatch)
        log(f"{tag}: placed for {groups} ranks in {time.time() - t0:.1f} s")
    return out


class WorkIndex:
    """Distinct rank workloads per GPU job (one rank shape): ``key_id`` numbers each new multiset."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}   # job name -> {"shape": RankMoe kwargs, "keys": [counts...]}
        self._ids: dict[str, dict] = {}

    def key_id(self, job: str, shape: dict, key: tuple[int, ...], step_tokens: int | None = None) -> int:
        if job not in self.jobs:
            self.jobs[job] = {"shape": shape, "keys": []}
            if step_tokens is not None:
                self.jobs[job]["step_tokens"] = step_tokens
            self._ids[job] = {}
        ids = self._ids[job]
        if key not in ids:
            ids[key] = len(ids)
            self.jobs[job]["keys"].append(list(key))
        return ids[key]


def dominated(keys: list[tuple[int, ...]]) -> np.ndarray:
    """[R] whether each rank's work (a ``work_key``: per-slot token counts) is dominated by another rank's:
    that one runs at least as many experts, at least as many pairs, and at least as many row blocks of them in
    both of SGLang's bf16 configs (16 and 64 rows), so under the fused kernel it takes at least as long (the
    reads, the pairs and the blocks computed only add time), and the layer's slowest rank is among the
    others. Of equal loads the first is kept. The report checks the rule on steps timed in full
    (``--check-steps``). (The 2026-12-01 replay compared 16-row blocks only: a rank with more 64-row blocks
    was sometimes skipped, 0.4% of a layer's time on average, BENCHMARKS.md#the-replay-on-the-gpu.)"""
    load = np.array([[len(k), sum(k), sum(-(-c // 16) for c in k), sum(-(-c // 64) for c in k)]
                     for k in keys]).reshape(len(keys), 4)
    out = np.zeros(len(keys), bool)
    for i in range(len(keys)):
        for j in range(len(keys)):
            if i != j and not out[j] and (load[j] >= load[i]).all() and ((load[j] > load[i]).any() or j < i):
                out[i] = True
                break
    return out


def index_workloads(index: WorkIndex, name: str, test, placements: dict, ranks: int, hidden: int,
                    inter: int, step_tokens: int = 9, groups: dict[str, int] | None = None,
                    prune_from: int | None = None, cost_models: dict | None = None) -> dict[str, np.ndarray]:
    """idx/<tag> [S, L, R] (EP) and idx/tp [S, L] workload ids, job/<tag> the job each lives in.

    Ids are given step by step (all placements of step 0 first), so a time cut while measuring drops
    the last steps of every placement alike. step_tokens: the steps' tokens (a job per batch size other
    than 9); groups: tag -> EP groups for the EP x TP rows (default ``ranks``), each GPU of a group timed
    with 1/(ranks / groups) of every expert. prune_from: from this step on, a rank whose work another rank
    of the layer dominates (``dominated``) is not timed (id -1); the steps before it time every rank, so
    the report can check the rule. cost_models: tag -> the cost model the ``cost`` rule balances.
    """
    from moeplace.analysis.advise import rank_work, slot_token_counts, work_key
    L, E, K = test.model.num_moe_layers, test.model.num_experts, test.model.top_k
    batch = "" if step_tokens == 9 else f"-b{step_tokens}"
    work, jobs, shapes = {}, {}, {}
    for tag, (phy2log, dispatch) in placements.items():
        ep = (groups or {}).get(tag, ranks)
        moe_tp, spr = ranks // ep, phy2log.shape[1] // ep
        jobs[tag] = f"{name}{batch}-ep-{spr}" + (f"-tp{moe_tp}" if moe_tp > 1 else "")
        shapes[tag] = ep_shape(hidden, -(-inter // moe_tp), spr, K)
        cost = (cost_models or {}).get(tag) or rank_cost(hidden, inter, spr, K, moe_tp, step_tokens) \
            if dispatch == "cost" else None
        work[tag] = np.stack([rank_work(slot_token_counts(test, layer, phy2log[layer], ep, dispatch, cost), ep)
                              for layer in range(L)], axis=1)             # [S, L, groups, spr]
    # TP-MoE: one rank runs every activated expert (1/R wide) on all pairs of the step.
    jobs["tp"], shapes["tp"] = f"{name}{batch}-tp{ranks}-{E}", tp_shape(hidden, inter, ranks, E, K)
    tp_counts = np.zeros((test.num_steps, L, 1, E), np.int64)
    for layer in range(L):
        step_of_row, _, ids = test.layer(layer)
        valid = ids >= 0
        step_k = np.broadcast_to(step_of_row[:, None], ids.shape)[valid]
        tp_counts[:, layer, 0] = np.bincount(step_k * E + ids[valid], minlength=test.num_steps * E).reshape(-1, E)
    work["tp"] = tp_counts
    idx = {tag: np.zeros(w.shape[:3], np.int32) for tag, w in work.items()}
    for s in range(test.num_steps):
        for tag, w in work.items():
            for layer in range(L):
                keys = [work_key(w[s, layer, r]) for r in range(w.shape[2])]
                skip = dominated(keys) if prune_from is not None and s >= prune_from else np.zeros(len(keys), bool)
                for r, key in enumerate(keys):
                    idx[tag][s, layer, r] = -1 if skip[r] else index.key_id(
                        jobs[tag], shapes[tag], key, None if step_tokens == 9 else step_tokens)
    arrays = {}
    for tag in work:
        arrays[f"idx/{tag}"] = idx[tag][:, :, 0] if tag == "tp" else idx[tag]
        arrays[f"job/{tag}"] = np.array(jobs[tag])
    return arrays


def job_deadlines(sizes: list[int], start: float, budget_s: float) -> list[float]:
    """When each of several jobs run one after another must stop: the budget shared by their sizes."""
    cum = np.cumsum(sizes) / max(1, sum(sizes))
    return [start + budget_s * float(c) for c in cum]


JOB_FLOOR_S = 10.0   # a job may always take this long (within the budget): its kernel config's first compile


def share_deadline(now: float, end: float, size: float, rest: float) -> float:
    """When a job must stop: its share (``size`` of the ``rest`` still to run, itself included) of the time
    left to ``end``, and never less than ``JOB_FLOOR_S`` while the budget lasts. Time one job saves or overruns
    (a kernel's compile) passes to the ones after it, and a small job whose kernel compiles first (the very
    first job) is not starved by that compile."""
    left = max(0.0, end - now)
    return now + max(left * size / max(rest, 1e-9), min(JOB_FLOOR_S, left))


def timed_steps(us_len: int, idx: np.ndarray) -> int:
    """How many leading steps of idx [S, ...] have every workload among the first ``us_len`` timed."""
    done = (idx.reshape(idx.shape[0], -1) < us_len).all(axis=1)     # -1: not timed (dominated), never missing
    return int(np.argmin(done)) if not done.all() else idx.shape[0]


def batch_steps(spec: str, tokens: list[int], default: int) -> dict[int, int]:
    """Replayed steps per batch size from ``"9=32,576=6"`` (sizes not named: ``default``)."""
    given = dict(tuple(map(int, part.split("="))) for part in spec.split(",") if part)
    return {t: given.get(t, default) for t in tokens}


def prepare(args) -> None:
    """Placements and per-(step, layer, rank) work keys for every trace; unique keys per GPU job."""
    from moeplace.dispatch.evaluation import verify_batches
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = WorkIndex()
    meta = {}
    sizes = list(map(int, args.batch_tokens.split(",")))
    for name in TRACES:
        if args.only and name not in args.only.split(","):
            continue
        cfg = TRACES[name]
        counts = batch_steps(args.steps, sizes, cfg["test_steps"])
        train, pool, label = load_trace(name, args.gptoss, max(args.pool, *counts.values()), args.kimi_layers)
        extra = extra_specs(pool.model.num_experts, args.ranks, args.cost_rule, args.layouts)
        groups = {tag: g for tag, *_, g in extra}
        tags = [t for t, *_ in placement_specs(pool.model.num_experts)] + [t for t, *_ in extra]
        only = [t for t in tags if t not in args.skip.split(",")]

        def fit_cost(g: int, slots: int, name=name):
            """advise's cost model for a group's GPU at the trace's batch (9 tokens)."""
            return rank_cost(TRACES[name]["hidden"], TRACES[name]["inter"], slots, pool.model.top_k, args.ranks // g, 9)
        placements = fit_placements(train, args.ranks, args.effort, lambda m: print(f"{name} {m}", flush=True),
                                    only=only, extra=extra, cost=fit_cost)
        for tokens in sizes:
            key = name if tokens == 9 else f"{name}-b{tokens}"
            n = counts[tokens]
            steps = (pool.take(np.arange(n)) if tokens == 9 else
                     verify_batches(pool, tokens, n, seed=tokens).steps)
            arrays = {f"phy2log/{tag}": p for tag, (p, _) in placements.items()}
            arrays.update(index_workloads(index, name, steps, placements, args.ranks, cfg["hidden"], cfg["inter"],
                                          tokens, groups, prune_from=args.check_steps))
            np.savez_compressed(out / f"{key}.npz", **arrays)
            # The test steps themselves, so report predicts from exactly what was replayed.
            np.savez_compressed(out / f"{key}_test.npz", topk_ids=steps.topk_ids, token_offsets=steps.token_offsets,
                                model=json.dumps(steps.model.to_json()))
            meta[key] = {"label": label + ("" if tokens == 9 else f", batches of {tokens} tokens"), "trace": name,
                         "batch_tokens": tokens, "train_steps": train.num_steps, "test_steps": steps.num_steps,
                         "layers": steps.model.num_moe_layers, "experts": steps.model.num_experts,
                         "ranks": args.ranks, "effort": args.effort, "groups": groups,
                         "layer_scale": (60 / steps.model.num_moe_layers if name == "kimi" else 1),
                         "check_steps": args.check_steps,
                         "dispatch": {tag: d for tag, (_, d) in placements.items()}}
    for j in index.jobs.values():
        j["est_s"] = job_estimate_s(j["shape"], j["keys"], j.get("step_tokens", 9), args.reps)
    (out / "work.json").write_text(json.dumps({"jobs": index.jobs, "traces": meta}))
    for job, j in index.jobs.items():
        print(f"job {job}: {len(j['keys'])} distinct rank workloads, about {j['est_s']:.1f} s", flush=True)
    print(f"{sum(len(j['keys']) for j in index.jobs.values())} workloads in {len(index.jobs)} jobs, about "
          f"{sum(j['est_s'] for j in index.jobs.values()):.0f} s of GPU time at --reps {args.reps}", flush=True)


# Per workload beyond its replays: writing its layout into the graph's buffers, and the host's timing loop.
OVERHEAD_S = 1.5e-3


def job_estimate_s(shape: dict, keys: list, step_tokens: int, reps: int) -> float:
    """Seconds ``measure`` will take for a job: each workload's predicted time (the cost model), on the weight
    copies it cycles through, for ``reps`` + 1 replays, plus ``OVERHEAD_S``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from calibrate_cost import copies_for
    moe_tp = 1
    model = rank_cost(shape["hidden"], shape["inter"], shape["n_local"], shape["top_k"], moe_tp, step_tokens)
    expert_bytes = 6 * shape["hidden"] * shape["inter"]
    return sum(float(model.cost(np.array(len(k)), np.array(sum(k)))) * 1e-6 * copies_for(len(k), expert_bytes)
               * (reps + 1) + OVERHEAD_S for k in keys)


def time_workloads(sgl, shape: dict, keys: list, step_tokens: int, reps: int, deadline: float,
                   cross_check: int = 0) -> tuple[list[float], list[list[float]], dict]:
    """µs of each workload (per-slot token counts) of one rank shape, until ``deadline`` (time.time()); for
    the first ``cross_check`` workloads [captured once (``StaticStep``), captured per workload (``work``)]; and
    the kernel config SGLang's lookup gave the job, with whether a tuned file was found."""
    import torch
    from calibrate_cost import RankMoe, graph_time_us
    rank = RankMoe(sgl, **shape, dtype="bf16")
    step = rank.step(step_tokens)
    times = []
    for key in keys:
        if time.time() > deadline:
            break
        times.append(step.time_us(key, reps))
    checks = [[step.time_us(key, reps), graph_time_us(rank.work(key, step_tokens), reps)]
              for key in keys[:cross_check]]
    used = {"config": step.cfg, "tuned_file": bool(rank.tuned_configs())}   # what SGLang's lookup gave
    del rank, step
    gc.collect()             # a RankMoe and its StaticSteps refer to each other
    torch.cuda.empty_cache()
    return times, checks, used


def measure(args) -> None:
    """GPU: time every distinct rank workload of every job (fused-MoE path, bf16)."""
    sys.path.insert(0, str(Path(__file__).parent))
    jobs = {}
    for d in args.work.split(","):
        jobs.update(json.loads((Path(d) / "work.json").read_text())["jobs"])
    wanted = [j for j in jobs if not args.jobs or j.split("-")[0] in args.jobs.split(",")]
    if stale_jobs({j: jobs[j] for j in wanted}):
        print(f"replay_placement: {args.work} was prepared before the replay built SGLang's layout (no top_k); "
              "run prepare again", file=sys.stderr)
        sys.exit(2)
    import torch
    from calibrate_cost import load_sglang_moe
    sgl = load_sglang_moe(args.sglang_wheel)
    result = {"gpu": torch.cuda.get_device_name(), "sglang": sgl[2], "jobs": {}}
    start = time.time()
    sizes = [jobs[j].get("est_s", len(jobs[j]["keys"])) for j in wanted]
    for i, job in enumerate(wanted):
        t0 = time.time()
        end = share_deadline(t0, start + args.budget_s, sizes[i], sum(sizes[i:]))
        keys = jobs[job]["keys"]
        times, checks, used = time_workloads(sgl, jobs[job]["shape"], keys,
                                             jobs[job].get("step_tokens", args.step_tokens), args.reps, end,
                                             args.cross_check)
        result["jobs"][job] = {"us": times, "complete": len(times) == len(keys), "cross_check": checks, **used}
        print(f"{job}: {len(times)}/{len(keys)} workloads in {time.time() - t0:.1f} s, BLOCK_SIZE_M "
              f"{used['config']['BLOCK_SIZE_M']}, tuned file {used['tuned_file']}, cross-check "
              + " ".join(f"{a:.0f}/{b:.0f}" for a, b in checks), flush=True)
        Path(args.out).write_text(json.dumps(result))
    print(f"all jobs: {sum(len(j['us']) for j in result['jobs'].values())} workloads in {time.time() - start:.0f} s")


def replayed_ms(us: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """[S] µs per step from workload times: EP idx [S, L, R] (slowest rank per layer) or TP idx [S, L]."""
    times = np.where(idx >= 0, np.append(us, np.nan)[idx], -np.inf)   # -1: a dominated rank, never the slowest
    per_layer = times.max(axis=2) if idx.ndim == 3 else times
    return per_layer.sum(axis=1)


def predicted_us(name: str, test, tag: str, phy2log: np.ndarray | None, ranks: int, dispatch: str,
                 layers: range | None = None, hidden: int | None = None, inter: int | None = None,
                 step_tokens: int = 9, groups: int | None = None) -> np.ndarray:
    """[S] µs per step the derived cost model predicts (what the commands use) over ``layers``.

    hidden, inter: the expert shape (default: the trace's, from TRACES); step_tokens: the steps' tokens;
    groups: EP groups of an EP x TP row (default ``ranks``).
    """
    from moeplace.analysis.advise import ep_layer_cost, tp_layer_cost
    hidden, inter = hidden or TRACES[name]["hidden"], inter or TRACES[name]["inter"]
    E, K = test.model.num_experts, test.model.top_k
    layers = layers if layers is not None else range(test.model.num_moe_layers)
    if tag == "tp":
        cost = rank_cost(hidden, inter, E, K, ranks, step_tokens)
        return sum(tp_layer_cost(test, layer, cost) for layer in layers)
    ep = groups or ranks
    cost = rank_cost(hidden, inter, phy2log.shape[1] // ep, K, ranks // ep, step_tokens)
    return sum(ep_layer_cost(test, layer, phy2log[layer], ep, cost, dispatch) for layer in layers)


def load_test(work_dir: Path, name: str):
    """The replayed test steps of one trace, as ``prepare`` saved them."""
    from moeplace.model.spec import ModelSpec
    from moeplace.trace.steps import RoutingSteps
    t = np.load(work_dir / f"{name}_test.npz")
    model = ModelSpec.from_json(json.loads(str(t["model"])))
    return RoutingSteps.from_topk(model, t["topk_ids"], np.diff(t["token_offsets"]), 5)


def placement_label(tag: str, dispatch: str, ranks: int, groups: int | None = None) -> str:
    if tag == "tp":
        return f"TP-MoE (1/{ranks} of every expert)"
    red = tag.split("+r")[1] if "+r" in tag else ""
    split = "EP" if not groups or groups == ranks else f"EP{groups} x MoE TP {ranks // groups}"
    return f"{split}, {red} redundant, {dispatch}" if red else split


def write_report(lines: list[str], summary: dict, out: str) -> None:
    """Print the markdown report; with ``out``, write it there and the figures beside it as JSON."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".json").write_text(json.dumps(summary, indent=1))


def report(args) -> None:
    """Measured vs predicted ms per step for every placement and TP-MoE; a markdown table."""
    jobs = {}
    for path in args.times.split(","):
        jobs.update(json.loads(Path(path).read_text())["jobs"])
    lines = []
    summary = {}
    by_trace: dict[str, dict] = {}
    misses: list[float | None] = []
    for work_dir in map(Path, args.work.split(",")):
        work = json.loads((work_dir / "work.json").read_text())
        for name, meta in work["traces"].items():
            arrays = np.load(work_dir / f"{name}.npz")
            test = load_test(work_dir, name)
            ranks = meta.get("ranks", RANKS)
            trace, tokens, groups = meta.get("trace", name), meta.get("batch_tokens", 9), meta.get("groups", {})
            tags = [k.split("/", 1)[1] for k in arrays.files if k.startswith("idx/")]
            done = {t: timed_steps(len(jobs.get(str(arrays[f"job/{t}"]), {"us": []})["us"]), arrays[f"idx/{t}"])
                    for t in tags}
            S = min([n for n in done.values() if n] or [0])   # steps timed in every row that has any
            test = test.take(np.arange(S))
            lines += [f"**{meta['label']}**: {S} of {meta['test_steps']} held-out steps x {meta['layers']} MoE "
                      f"layers replayed, placements fit on {meta['train_steps']} earlier steps; {ranks} EP ranks, "
                      "bf16.", "", "| placement | mode | measured ms/step | predicted ms/step | error "
                      "| mean abs step error |", "|---|---|---|---|---|---|"]
            rows = {}
            for tag in tags:
                job = jobs.get(str(arrays[f"job/{tag}"]))
                idx = arrays[f"idx/{tag}"][:S]
                if not done[tag]:
                    print(f"{name} {tag}: no step fully timed; skipped")
                    continue
                dispatch = meta.get("dispatch", {}).get(tag, "dynamic")
                phy2log = None if tag == "tp" else arrays[f"phy2log/{tag}"]
                scale = meta.get("layer_scale", TRACES[trace].get("layer_scale", 1))   # replayed -> the model's layers
                measured = replayed_ms(np.array(job["us"]), idx) * scale
                predicted = predicted_us(trace, test, tag, phy2log, ranks, dispatch, step_tokens=tokens,
                                         groups=groups.get(tag)) * scale
                m, p = measured.mean() / 1e3, predicted.mean() / 1e3
                step_err = float(np.mean(np.abs(predicted - measured) / measured))
                mode = placement_label(tag, dispatch, ranks, groups.get(tag))
                rows[tag] = {"mode": mode, "measured_ms": m, "predicted_ms": p, "error": p / m - 1,
                             "step_abs_error": step_err}
                lines.append(f"| {tag.split('+')[0]} | {mode} | {m:.2f} | {p:.2f} | {p / m - 1:+.1%} | "
                             f"{step_err:.1%} |")
                if tag != "tp":
                    misses.append(dominance_miss(np.array(job["us"]), work["jobs"][str(arrays[f"job/{tag}"])]["keys"],
                                                 idx[:meta.get("check_steps", 0)]))
            ep_rows = [r for k, r in rows.items() if k != "tp"]
            if ep_rows:
                lines += ["", f"Mean |error| over EP rows: {np.mean([abs(r['error']) for r in ep_rows]):.1%}."]
            base = rows.get("deepseek")
            for tag, r in rows.items():
                if base and tag != "deepseek":
                    lines.append(f"{tag} vs deepseek: {r['measured_ms']:.2f} vs {base['measured_ms']:.2f} ms/step "
                                 f"measured ({r['measured_ms'] / base['measured_ms'] - 1:+.1%}).")
            lines.append("")
            summary[name] = rows
            cfg = TRACES[trace]
            by_trace.setdefault(trace, {})[tokens] = {
                "rows": rows, "steps": S,
                "members": layout_members(list(rows), meta["experts"], ranks, groups),
                "bound_ms": float(bound_us(test, rank_cost(cfg["hidden"], cfg["inter"], meta["experts"] // ranks,
                                                           test.model.top_k, 1, tokens), ranks).mean())
                * meta.get("layer_scale", 1) / 1e3}
    checked = np.concatenate([m for m in misses if m is not None] or [np.zeros(0)])
    if checked.size:
        lines += [f"Ranks skipped as dominated, checked on the {checked.size:,} (row, layer-step)s timed on every "
                  f"rank: the slowest measured rank was one the rule skips in {(checked > 0).mean():.0%} of them "
                  f"(near-equal ranks, and ranks with more 64-row blocks), costing the layer {checked.mean():.2%} "
                  f"of its time on average, {np.quantile(checked, 0.99):.1%} at the 99th percentile, {checked.max():.1%} at most.",
                  ""]
    for trace, batches in by_trace.items():
        lines += goal_lines(trace, batches)
        summary[f"{trace}/goals"] = {str(t): b for t, b in batches.items()}
    write_report(lines, summary, args.out)


def dominance_miss(us: np.ndarray, keys: list, idx: np.ndarray) -> np.ndarray | None:
    """On steps timed on every rank (idx [S, L, R], none -1): [S * L] how much longer each layer's slowest
    rank is than the slowest of the ranks ``dominated`` keeps (0 where the rule kept the slowest)."""
    if idx.size == 0 or (idx < 0).any():
        return None
    return np.array([us[ids].max() / us[ids[~dominated([tuple(keys[i]) for i in ids])]].max() - 1
                     for ids in idx.reshape(-1, idx.shape[-1])])


def bound_us(steps, cost, ranks: int) -> np.ndarray:
    """[S] the mean-rank bound under ``cost``: every activated expert read once, its pairs' row blocks run once
    (splitting an expert over replicas saves at most a block per extra read, and r < a) and every pair run
    once, spread evenly over the ranks (no rule and no placement does better under that model)."""
    from moeplace.dispatch.balanced import step_expert_counts
    from moeplace.dispatch.loads import layer_distinct_total
    out = np.zeros(steps.num_steps)
    for layer in range(steps.model.num_moe_layers):
        step_of_row, _, ids = steps.layer(layer)
        pairs = np.bincount(step_of_row, weights=(ids >= 0).sum(axis=1), minlength=steps.num_steps)
        extra = cost.extra_blocks(step_expert_counts(steps, layer))
        out += cost.cost(layer_distinct_total(steps, layer), pairs, extra) / ranks + cost.c_us * (1 - 1 / ranks)
    return out


SGLANG_ROWS = ("contiguous", "deepseek", "stepaware")     # SGLang's dynamic rule, no spare slots


def goal_lines(trace: str, batches: dict) -> list[str]:
    """The layout questions on one trace, from the replay's measured ms per step: the rule by cost against every
    other rule, and ``advise``'s layout (its cost model on the replayed steps and placements) against the
    fastest layout measured."""
    sizes = sorted(batches)
    lines = [f"**{TRACES[trace]['label']}: rules (measured MoE ms per step)**", "",
             "| tokens/step | steps | SGLang's best (no spares) | deepseek + E/4, dynamic | balanced + E/4 | "
             "**cost + E/4** | cost vs SGLang's best | cost vs best other rule | bound (predicted) vs SGLang's best "
             "(predicted) |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for t in sizes:
        rows, quarter = batches[t]["rows"], None
        spare = {k: v for k, v in rows.items() if "+r" in k and k.split("+r")[0] in ("deepseek", "balanced", "cost")}
        if not spare or not any(k in rows for k in SGLANG_ROWS):
            lines.append(f"| {t} | {batches[t]['steps']} | not timed | | | | | | |")
            continue
        quarter = next(iter(spare)).split("+r")[1]
        sgl = min((k for k in SGLANG_ROWS if k in rows), key=lambda k: rows[k]["measured_ms"])
        cost = rows.get(f"cost+r{quarter}")
        others = [k for k in [*SGLANG_ROWS, f"deepseek+r{quarter}", f"balanced+r{quarter}"] if k in rows]
        best_other = min(others, key=lambda k: rows[k]["measured_ms"])
        sgl_pred = min(rows[k]["predicted_ms"] for k in SGLANG_ROWS if k in rows)

        def ms(k):
            return f"{rows[k]['measured_ms']:.2f}" if k in rows else "-"
        lines.append(f"| {t} | {batches[t]['steps']} | {rows[sgl]['measured_ms']:.2f} ({sgl}) | "
                     f"{ms(f'deepseek+r{quarter}')} | {ms(f'balanced+r{quarter}')} | **{ms(f'cost+r{quarter}')}** | "
                     + (f"{cost['measured_ms'] / rows[sgl]['measured_ms'] - 1:+.1%} | "
                        f"{cost['measured_ms'] / rows[best_other]['measured_ms'] - 1:+.1%} ({best_other}) | "
                        if cost else "- | - | ")
                     + f"{batches[t]['bound_ms'] / sgl_pred - 1:+.1%} |")
    lines += ["", f"**{TRACES[trace]['label']}: layouts, advise's choice against the fastest measured**", "",
              "| tokens/step | " + " | ".join(sorted({n for b in batches.values() for n in b["members"]},
                                                   key=layout_order)) + " | advise's choice (predicted ms) | "
              "fastest measured | advise's choice measured vs fastest |"]
    names = sorted({n for b in batches.values() for n in b["members"]}, key=layout_order)
    lines.append("|---:|" + "---:|" * len(names) + "---|---|---:|")
    for t in sizes:
        rows, members = batches[t]["rows"], batches[t]["members"]
        measured = {n: min(rows[k]["measured_ms"] for k in members[n]) for n in members}
        # advise costs a layout by the better of its placements, predicted; the member it would pick:
        picked = {n: min(members[n], key=lambda k: rows[k]["predicted_ms"]) for n in members}
        choice = min(members, key=lambda n: rows[picked[n]]["predicted_ms"])
        best = min(measured, key=measured.get)
        chosen_ms = rows[picked[choice]]["measured_ms"]
        batches[t]["advise"] = {"choice": choice, "fastest": best, "choice_measured_ms": chosen_ms,
                                "fastest_ms": measured[best], "ratio": chosen_ms / measured[best] - 1}
        lines.append(f"| {t} | " + " | ".join(f"{measured[n]:.2f}" if n in measured else "-" for n in names)
                     + f" | {choice} ({rows[picked[choice]]['predicted_ms']:.2f}) | {best} | "
                     f"{chosen_ms / measured[best] - 1:+.1%} |")
    return lines + [""]


def layout_order(name: str) -> tuple[int, int]:
    """EP R first, TP-MoE last (``moeplace.analysis.layouts.candidate_layouts``' order), each without spares first."""
    base = name.split("+")[0]
    ep = 1 if base.startswith("TP") else int(base[2:].split("x")[0])
    return (-ep, "+" in name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--out", default="out/replay")
    a.add_argument("--gptoss", type=Path, default=GPTOSS, help=f"GPT-OSS-20B top-k ids .npz (default: {GPTOSS})")
    a.add_argument("--effort", type=float, default=2e8)
    a.add_argument("--ranks", type=int, default=RANKS, help="EP ranks the placements are made for")
    a.add_argument("--only", default="")
    a.add_argument("--batch-tokens", default="9", help="tokens per replayed step, a comma list ("
                   "9,36,72,144,288,576; batches of 9-token requests built from the held-out steps)")
    a.add_argument("--cost-rule", action="store_true", help="add the cost rule's row (E/4 spare slots)")
    a.add_argument("--layouts", action="store_true", help="add EP groups with MoE TP inside (EP R/2, EP R/4)")
    a.add_argument("--steps", default="", help="replayed steps per batch size, e.g. 9=32,576=6 (default: the "
                   "trace's held-out step count for every size)")
    a.add_argument("--pool", type=int, default=0, help="held-out steps the batches are drawn from (default: the "
                   "most steps any batch size replays)")
    a.add_argument("--kimi-layers", type=int, default=12, help="synthetic Kimi-shaped layers replayed (of 60)")
    a.add_argument("--check-steps", type=int, default=2, help="leading steps of each batch size timed on every "
                   "rank; later steps skip ranks another rank dominates (the report checks the rule on these)")
    a.add_argument("--skip", default="", help="comma list of placement tags not to replay")
    a.add_argument("--reps", type=int, default=5, help="measure's --reps, for the time estimate")
    b = sub.add_parser("measure")
    b.add_argument("--work", default="out/replay")
    b.add_argument("--out", required=True)
    b.add_argument("--jobs", default="", help="comma list of traces whose jobs to time (default: all)")
    b.add_argument("--sglang-wheel", default=".whl/sglang-*.whl")
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--step-tokens", type=int, default=9,
                   help="tokens per replayed step: the M SGLang's kernel config lookup sees on every rank")
    b.add_argument("--budget-s", type=float, default=200)
    b.add_argument("--cross-check", type=int, default=0, help="per job, time this many workloads both ways "
                   "(captured once and written into the graph's buffers; captured per workload)")
    c = sub.add_parser("report")
    c.add_argument("--work", default="out/replay")
    c.add_argument("--times", required=True, help="measure's JSON; a comma list is merged")
    c.add_argument("--out", default="")
    for parser in (a, c):
        parser.add_argument("--gpu", default="", help="the GPU whose shipped cost models predict (report) and fit "
                            "the placements (prepare), e.g. H100 (default: the H200's)")
    args = p.parse_args()
    if args.cmd != "measure" and args.gpu:
        GPU[:] = [args.gpu]
    {"prepare": prepare, "measure": measure, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
