"""Replay routing steps on the GPU under each placement: measured MoE ms per step vs the cost model.

Per step and MoE layer, each of the 8 EP ranks runs its own expert subset with the token counts
SGLang's dispatch would give it (``moeplace.advise.slot_token_counts``); the layer takes as long as
its slowest rank, and the step is the sum over layers. TP-MoE (every rank holds 1/8 of every expert)
is replayed the same way: one rank runs every activated expert at 1/8 width.

A rank's work is timed by the fused-MoE path of ``calibrate_cost.py`` (SGLang's Triton kernel). Its
time depends only on the multiset of per-slot token counts (all experts have the same shape), so each
distinct rank workload is timed once and reused wherever it recurs.

    python scripts/replay_placement.py prepare --out out/replay          # here: placements, work lists
    python3 scripts/replay_placement.py measure --work out/replay --out $OUT/replay_times.json  # GPU
    python scripts/replay_placement.py report --work out/replay --times replay_times.json   # here
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# The GPT-OSS-20B routing sits beside the checkout (as for bench_placement.py); --gptoss for elsewhere.
GPTOSS = ROOT.parent / "shared/traces-real/gptoss20b-fingerprint/gptoss20b_routing_topk_ids.npz"
RANKS = 8
ALGORITHMS = ("contiguous", "deepseek", "stepaware")
# trace -> EP shape, TP shape (calibrate_cost.SHAPES), redundant slots, steps to fit, steps to replay
TRACES = {
    "gptoss": dict(ep="gptoss-ep", tp="gptoss-tp", redundant=8, fit_steps=3000, test_steps=64),
    "kimi": dict(ep="kimi-ep", tp="kimi-tp", redundant=32, fit_steps=320, test_steps=32, layer_scale=5),
}
COST_FILES = {"gptoss-ep": "cost_h200_bf16_gptoss.json", "gptoss-tp": "cost_h200_bf16_gptoss_tp8.json",
              "kimi-ep": "cost_h200_bf16.json", "kimi-tp": "cost_h200_bf16_tp8.json"}


def load_trace(name: str, gptoss_path: str):
    """(train steps, test steps, label) of one trace; test steps come after the training ones."""
    from moeplace.model import ModelSpec
    from moeplace.trace.load import open_trace
    from moeplace.trace.synthetic import synthetic_steps
    cfg = TRACES[name]
    if name == "gptoss":
        steps = open_trace(gptoss_path, window=9).load("all")
        cut = int(steps.num_steps * 0.8)
        train = steps.take(np.linspace(0, cut - 1, cfg["fit_steps"]).astype(np.int64))
        test = steps.take(np.linspace(cut, steps.num_steps - 1, cfg["test_steps"]).astype(np.int64))
        return train, test, "GPT-OSS-20B real trace (verify windows of 9 tokens)"
    # 12 of Kimi K2's 60 MoE layers (the synthetic layers are drawn alike); report scales to 60.
    model = ModelSpec("SYNTHETIC kimi-k2-shaped, 12 of 60 MoE layers", 13, tuple(range(1, 13)), 384, 8)
    _, steps = synthetic_steps(cfg["fit_steps"] + cfg["test_steps"], tokens_per_step=9, model=model)
    n = cfg["fit_steps"]
    return (steps.take(np.arange(n)), steps.take(np.arange(n, steps.num_steps)),
            "SYNTHETIC Kimi-K2-shaped trace (9 tokens per step; 12 layers replayed, scaled to 60)")


def prepare(args) -> None:
    """Placements and per-(step, layer, rank) work keys for every trace; unique keys per GPU job."""
    sys.path.insert(0, str(Path(__file__).parent))
    from calibrate_cost import SHAPES
    from moeplace.advise import rank_work, slot_token_counts, work_key
    from moeplace.algorithms import PlacementProblem, solve

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, dict] = {}   # job name -> {"shape", "n_local", "keys": [counts...]}
    key_ids: dict[str, dict] = {}

    def key_id(job: str, shape: str, n_local: int, key: tuple[int, ...]) -> int:
        if job not in jobs:
            jobs[job] = {"shape": shape, "n_local": n_local, "keys": []}
            key_ids[job] = {}
        ids = key_ids[job]
        if key not in ids:
            ids[key] = len(ids)
            jobs[job]["keys"].append(list(key))
        return ids[key]

    meta = {}
    for name, cfg in TRACES.items():
        if args.only and name not in args.only.split(","):
            continue
        train, test, label = load_trace(name, args.gptoss)
        L, E = test.model.num_moe_layers, test.model.num_experts
        arrays = {}
        placements = {}
        for red in (0, cfg["redundant"]):
            for alg in ALGORITHMS:
                t0 = time.time()
                p = solve(alg, PlacementProblem(train.model, train, RANKS, redundant=red, effort=args.effort))
                tag = f"{alg}+r{red}" if red else alg
                placements[tag] = p
                arrays[f"phy2log/{tag}"] = p
                print(f"{name} {tag}: placed in {time.time() - t0:.1f} s", flush=True)
        for tag, phy2log in placements.items():
            P = phy2log.shape[1]
            job = f"{cfg['ep']}-{P // RANKS}"
            idx = np.zeros((test.num_steps, L, RANKS), np.int32)
            for layer in range(L):
                work = rank_work(slot_token_counts(test, layer, phy2log[layer], RANKS), RANKS)
                for s in range(test.num_steps):
                    for r in range(RANKS):
                        idx[s, layer, r] = key_id(job, cfg["ep"], P // RANKS, work_key(work[s, r]))
            arrays[f"idx/{tag}"] = idx
            arrays[f"job/{tag}"] = np.array(job)
        # TP-MoE: one rank runs every activated expert (1/R wide) on all pairs of the step.
        job = f"{cfg['tp']}-{E}"
        idx = np.zeros((test.num_steps, L), np.int32)
        for layer in range(L):
            step_of_row, _, ids = test.layer(layer)
            valid = ids >= 0
            step_k = np.broadcast_to(step_of_row[:, None], ids.shape)[valid]
            counts = np.bincount(step_k * E + ids[valid], minlength=test.num_steps * E).reshape(-1, E)
            for s in range(test.num_steps):
                idx[s, layer] = key_id(job, cfg["tp"], SHAPES[cfg["tp"]]["n_local"], work_key(counts[s]))
        arrays["idx/tp"] = idx
        arrays["job/tp"] = np.array(job)
        np.savez_compressed(out / f"{name}.npz", **arrays)
        # The test steps themselves, so report predicts from exactly what was replayed.
        np.savez_compressed(out / f"{name}_test.npz", topk_ids=test.topk_ids, token_offsets=test.token_offsets,
                            model=json.dumps(test.model.to_json()))
        meta[name] = {"label": label, "train_steps": train.num_steps, "test_steps": test.num_steps,
                      "layers": L, "experts": E, "redundant": cfg["redundant"], "effort": args.effort}
    (out / "work.json").write_text(json.dumps({"jobs": jobs, "traces": meta}))
    for job, j in jobs.items():
        print(f"job {job}: {len(j['keys'])} distinct rank workloads", flush=True)


def measure(args) -> None:
    """GPU: time every distinct rank workload of every job (fused-MoE path, bf16)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from calibrate_cost import SHAPES, RankMoe, graph_time_us, load_sglang_moe
    sgl = load_sglang_moe(args.sglang_wheel)
    jobs = {}
    for d in args.work.split(","):
        jobs.update(json.loads((Path(d) / "work.json").read_text())["jobs"])
    result = {"gpu": torch.cuda.get_device_name(), "sglang": sgl[2], "jobs": {}}
    deadline = time.time() + args.budget_s
    for job, j in jobs.items():
        t0 = time.time()
        shape = dict(SHAPES[j["shape"]], n_local=j["n_local"])
        rank = RankMoe(sgl, **shape, dtype="bf16")
        times = []
        for key in j["keys"]:
            if time.time() > deadline:
                break
            times.append(graph_time_us(rank.work(key, args.step_tokens), args.reps))
        result["jobs"][job] = {"us": times, "complete": len(times) == len(j["keys"])}
        print(f"{job}: {len(times)}/{len(j['keys'])} workloads in {time.time() - t0:.0f} s", flush=True)
        rank = None
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result))


def report(args) -> None:
    """Measured vs predicted ms per step for every placement and TP-MoE; a markdown table."""
    from moeplace.advise import ep_layer_cost, tp_layer_cost
    from moeplace.costmodel import CostModel, load_cost_model
    from moeplace.model import ModelSpec
    from moeplace.trace.steps import RoutingSteps

    times = json.loads(Path(args.times).read_text())
    data = Path(args.cost_dir)
    lines = []
    summary = {}
    for work_dir in map(Path, args.work.split(",")):
      work = json.loads((work_dir / "work.json").read_text())
      for name, meta in work["traces"].items():
        arrays = np.load(work_dir / f"{name}.npz")
        t = np.load(work_dir / f"{name}_test.npz")
        model = ModelSpec.from_json(json.loads(str(t["model"])))
        test = RoutingSteps.from_topk(model, t["topk_ids"], np.diff(t["token_offsets"]), 5)
        cfg = TRACES[name]
        ep_cost = load_cost_model(data / COST_FILES[cfg["ep"]])
        tp_cost = load_cost_model(data / COST_FILES[cfg["tp"]])
        lines += [f"**{meta['label']}**: {meta['test_steps']} held-out steps x {meta['layers']} MoE layers "
                  f"replayed, placements fit on {meta['train_steps']} earlier steps; 8 EP ranks, bf16.", "",
                  "| placement | mode | measured ms/step | predicted ms/step | error | mean abs step error "
                  "| predicted, uncalibrated default |",
                  "|---|---|---|---|---|---|---|"]
        rows = {}
        tags = [k.split("/", 1)[1] for k in arrays.files if k.startswith("idx/")]
        for tag in tags:
            us = np.array(times["jobs"][str(arrays[f"job/{tag}"])]["us"])
            idx = arrays[f"idx/{tag}"]
            if idx.max() >= us.size:
                print(f"{name} {tag}: not all workloads were timed; skipped")
                continue
            if tag == "tp":
                measured = us[idx].sum(axis=1)
                predicted = sum(tp_layer_cost(test, layer, tp_cost) for layer in range(model.num_moe_layers))
                default = None
                mode = "TP-MoE (1/8 of every expert)"
            else:
                measured = us[idx].max(axis=2).sum(axis=1)
                phy2log = arrays[f"phy2log/{tag}"]
                predicted = sum(ep_layer_cost(test, layer, phy2log[layer], RANKS, ep_cost)
                                for layer in range(model.num_moe_layers))
                default = sum(ep_layer_cost(test, layer, phy2log[layer], RANKS, CostModel())
                              for layer in range(model.num_moe_layers))
                red = phy2log.shape[1] - model.num_experts
                mode = f"EP, {red} redundant" if red else "EP"
            scale = cfg.get("layer_scale", 1)   # replayed layers -> the model's MoE layers
            measured, predicted = measured * scale, predicted * scale
            default = None if default is None else default * scale
            m, p = measured.mean() / 1e3, predicted.mean() / 1e3
            step_err = float(np.mean(np.abs(predicted - measured) / measured))
            rows[tag] = {"mode": mode, "measured_ms": m, "predicted_ms": p, "error": p / m - 1,
                         "step_abs_error": step_err,
                         "default_ms": None if default is None else default.mean() / 1e3}
            d = "n/a" if default is None else f"{default.mean() / 1e3:.2f}"
            lines.append(f"| {tag.split('+')[0]} | {mode} | {m:.2f} | {p:.2f} | {p / m - 1:+.1%} | "
                         f"{step_err:.1%} | {d} |")
        ep_rows = [r for k, r in rows.items() if k != "tp"]
        if ep_rows:
            mean_abs = np.mean([abs(r["error"]) for r in ep_rows])
            lines += ["", f"Mean |error| over EP rows: {mean_abs:.1%}."]
        for red_tag in ("", f"+r{meta['redundant']}"):
            sa, ds = rows.get("stepaware" + red_tag), rows.get("deepseek" + red_tag)
            if sa and ds:
                lines.append(f"stepaware{red_tag} vs deepseek{red_tag}: {sa['measured_ms']:.2f} vs "
                             f"{ds['measured_ms']:.2f} ms/step measured ({sa['measured_ms'] / ds['measured_ms'] - 1:+.1%}).")
        lines.append("")
        summary[name] = rows
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--out", default="out/replay")
    a.add_argument("--gptoss", type=Path, default=GPTOSS, help=f"GPT-OSS-20B top-k ids .npz (default: {GPTOSS})")
    a.add_argument("--effort", type=float, default=2e8)
    a.add_argument("--only", default="")
    b = sub.add_parser("measure")
    b.add_argument("--work", default="out/replay")
    b.add_argument("--out", required=True)
    b.add_argument("--sglang-wheel", default=".whl/sglang-*.whl")
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--step-tokens", type=int, default=9,
                   help="tokens per replayed step: the M SGLang's kernel config lookup sees on every rank")
    b.add_argument("--budget-s", type=float, default=200)
    c = sub.add_parser("report")
    c.add_argument("--work", default="out/replay")
    c.add_argument("--times", required=True)
    c.add_argument("--cost-dir", default="moeplace/data")
    c.add_argument("--out", default="")
    args = p.parse_args()
    {"prepare": prepare, "measure": measure, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
