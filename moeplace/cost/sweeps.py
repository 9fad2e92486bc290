"""What ``moeplace calibrate`` times on a GPU, and the line it fits on the times (pure: no torch, no SGLang).

A *sweep* is one GPU shape of the layouts a model can run on ``--ranks`` GPUs (an expert slice ``hidden x inter``,
``local_slots`` of them a GPU) at one kernel config SGLang runs it with: its points are workloads (tokens on each
of ``distinct`` local experts), even spreads timed in steps of each batch size that runs the config (``steps``: the
fixed cost follows SGLang's launch grid, which bends where the step's pairs outnumber the GPU's slots, so it is
measured at each), then uneven ones with experts of several row blocks at the config's largest step (``big_step``).
The fit is ``moeplace.cost.model``'s line: ``a * distinct + r * extra row blocks + b * pairs + c``, one c per step
size (the launch grid differs), every term non-negative, relative least squares over the points whose experts fill the GPU (below that the kernel is
latency-bound and sublinear in experts, a regime a layer's slowest GPU is not in at these batches).

Legend: T step tokens, K top-k, E local slots (a GPU's experts), BM the kernel config's BLOCK_SIZE_M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from moeplace.cost.derive import LARGE_M, SMALL_M, sglang_default_config
from moeplace.cost.model import extra_row_blocks

VERIFY_TOKENS = 9      # a speculative verify step (1 + 8 drafts): the smallest step measured where it runs a config
H200_SMS = 132


@dataclass(frozen=True)
class Sweep:
    """One GPU shape at one kernel config: ``groups`` EP groups hold ``local_slots`` slots of ``hidden x inter``
    each (an expert, or 1/moe_tp of one), for steps of ``step_tokens`` and each of ``more_steps`` (even points) and
    ``big_step`` (uneven)."""

    label: str
    hidden: int
    inter: int
    local_slots: int
    top_k: int
    groups: int
    step_tokens: int
    big_step: int
    more_steps: tuple[int, ...] = ()

    @property
    def steps(self) -> tuple[int, ...]:
        return (self.step_tokens, *self.more_steps)


def plan_sweeps(hidden: int, slices: Iterable[tuple[int, int, int]], top_k: int,
                batches: Iterable[int]) -> list[Sweep]:
    """The sweeps that cover ``slices`` ((intermediate of the slice, local slots, EP groups), most wanted first)
    at every kernel config SGLang's default picks for ``batches``, the batch sizes a layout is costed at (16-row
    blocks while a step's tokens are at most the GPU's slots, 64-row ones above: ``sglang_default_config``). A config's even points run at each of its
    batches from a verify step up, its uneven ones at its largest batch; one sweep per (slice, slots, config)."""
    batches = sorted(set(batches))
    out: dict[tuple[int, int, tuple[int, int, int]], Sweep] = {}
    for inter, slots, groups in slices:
        for config in (SMALL_M, LARGE_M):
            runs = [t for t in batches if sglang_default_config(t, slots, "bf16") == config]
            if not runs or (inter, slots, config) in out:
                continue
            step = min((t for t in runs if t >= VERIFY_TOKENS), default=runs[-1])
            label = f"h{hidden}-i{inter}-e{slots}-bm{config[0]}"
            out[inter, slots, config] = Sweep(label, hidden, inter, slots, top_k, groups, step, runs[-1],
                                              tuple(t for t in runs if t > step))
    return list(out.values())


def even_counts(distinct: int, tokens: int) -> list[int]:
    """``tokens`` spread as evenly as possible over ``distinct`` slots."""
    if distinct == 0:
        return []
    return [tokens // distinct + (i < tokens % distinct) for i in range(distinct)]


def config_sweep_points(slots: int, step_pairs: int, groups: int) -> list[tuple[int, int]]:
    """(distinct, pairs on the GPU) of a sweep's even points: up to 8 expert counts to the GPU's slots, and pair
    counts around the mean share of the step's pairs (``step_pairs / groups``) up to twice it."""
    mean = step_pairs / groups
    ds = sorted({max(1, round(x)) for x in np.linspace(1, min(slots, step_pairs), 8)})
    ns = sorted({max(1, min(step_pairs, round(mean * f))) for f in (0.25, 0.5, 1.0, 1.5, 2.0)})
    return [(d, max(d, n)) for d in ds for n in ns if n >= d or n == ns[-1]]


def filling_experts(inter: int, block_n: int, sms: int = H200_SMS) -> int:
    """Experts whose gate/up programs (one row block each: 2 x inter / BLOCK_SIZE_N) fill the GPU's ``sms`` SMs
    twice. Below that the kernel is latency-bound and sublinear in experts (BENCHMARKS.md#measured-lines: 1, 2, 4
    experts cost 66, 79, 106 µs in the 16-row config), a regime the slowest GPU of a layer at these batches is not
    in."""
    return -(-2 * sms // -(-2 * inter // block_n))


def row_block_counts(slots: int, step_pairs: int, block_m: int, filling: int) -> list[list[int]]:
    """Workloads where some experts run several row blocks: ``hot`` experts of (k - 1) * BM + 1 or k * BM pairs
    (k = 2, 3) beside experts of one block (a quarter block each), and the same experts without them (hot = 0), at
    three expert counts from where they fill the GPU (``filling``) to the GPU's slots. What a row block beyond an
    expert's first costs, apart from its pairs, is the fit's ``r``."""
    base = max(1, block_m // 4)
    ds = sorted({min(slots, filling), (filling + slots) // 2, slots})
    out = []
    for d in ds:
        for hot in (0, 1, 2, 4):
            for k in ((2, 3) if hot else (1,)):
                for c in (((k - 1) * block_m + 1, k * block_m) if hot else (base,)):
                    counts = [c] * min(hot, d) + [base] * (d - min(hot, d))
                    if sum(counts) <= step_pairs:
                        out.append(counts)
    return out


def workloads(sweep: Sweep, block_m: int, block_n: int, sms: int) -> list[tuple[int, list[int]]]:
    """(step tokens, tokens on each local slot) of every point of ``sweep``: even spreads at each of its steps, then
    the uneven ones at its big step (room for several row blocks an expert)."""
    out = [(step, even_counts(d, n)) for step in sweep.steps
           for d, n in dict.fromkeys(config_sweep_points(sweep.local_slots, step * sweep.top_k, sweep.groups))]
    filling = filling_experts(sweep.inter, block_n, sms)
    out += [(sweep.big_step, c) for c in row_block_counts(sweep.local_slots, sweep.big_step * sweep.top_k,
                                                          block_m, filling)]
    return out


def point(counts: list[int], us: float, step_tokens: int, top_k: int, config: dict[str, int]) -> dict[str, Any]:
    """One timed workload as the fit and the raw file keep it."""
    bm = config["BLOCK_SIZE_M"]
    return {"distinct": len(counts), "tokens": sum(counts),
            "row_blocks": len(counts) + int(extra_row_blocks(counts, bm)),
            "us": us, "config_m": step_tokens, "step_pairs": step_tokens * top_k, "config": config}


def fit_linear(points: list[dict], max_tokens: int | None = None) -> dict:
    """Relative least squares ``us = a * distinct + b * tokens + c`` over points (tokens <= max_tokens if given).

    Points with no expert are left out: an idle rank is never a step's slowest. Returns a, b, c, and the mean /
    max relative error of the fit on the points used.
    """
    pts = [p for p in points if p["distinct"] > 0 and (max_tokens is None or p["tokens"] <= max_tokens)]
    X = np.array([[p["distinct"], p["tokens"], 1.0] for p in pts])
    y = np.array([p["us"] for p in pts])
    w = 1.0 / y        # every point counts by its relative error, so small steps are fit too
    coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    rel = np.abs(X @ coef - y) / y
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "points": len(pts),
            "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def linear_range(points: list[dict], tol: float = 0.10) -> int | None:
    """The largest token bound up to which one linear fit stays within ``tol`` mean relative error."""
    best = None
    for bound in sorted({p["tokens"] for p in points if p["tokens"] >= 4}):
        if fit_linear(points, bound)["mean_rel_err"] <= tol:
            best = bound
    return best


def fit_with_row_blocks(points: list[dict], step_tokens: int) -> dict:
    """Relative least squares ``us = a * distinct + r * (row_blocks - distinct) + b * tokens + c_step`` over sweep
    points, one c for each step size the points ran at, every term non-negative; returns a, r, b, the c of
    ``step_tokens``' points, every step's c and the mean / max relative error."""
    from scipy.optimize import nnls
    steps = sorted({p["config_m"] for p in points})
    X = np.array([[p["distinct"], p["row_blocks"] - p["distinct"], p["tokens"]]
                  + [float(p["config_m"] == t) for t in steps] for p in points])
    y = np.array([p["us"] for p in points])
    w = 1.0 / y
    coef = nnls(X * w[:, None], y * w)[0]
    rel = np.abs(X @ coef - y) / y
    return {"a": float(coef[0]), "r": float(coef[1]), "b": float(coef[2]),
            "c": float(coef[3 + steps.index(step_tokens)]),
            "c_at_steps": {str(t): round(float(coef[3 + i]), 2) for i, t in enumerate(steps)},
            "points": len(points), "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())}


def sweep_line(shape: dict[str, int], points: list[dict], step_tokens: int, gpu: str, sms: int,
               meta: dict[str, Any]) -> dict[str, Any]:
    """The cost-model line of one sweep (``CostModel.to_json`` with the provenance ``moeplace.cost.derive`` reads):
    fitted on the points of the config the sweep's step ran, with at least ``filling_experts`` experts.

    shape: hidden, inter, n_local, top_k. meta: what else the provenance names (date, SGLang's version, kernel)."""
    config = min(points, key=lambda p: abs(p["config_m"] - step_tokens))["config"]
    same = [p for p in points if p["config"] == config]
    enough = filling_experts(shape["inter"], config["BLOCK_SIZE_N"], sms)
    fitted = [p for p in same if p["distinct"] >= enough] or same
    low = fit_with_row_blocks(fitted, step_tokens)
    return {
        "a_us_per_expert": round(low["a"], 3), "b_us_per_token": round(low["b"], 4), "c_us": round(low["c"], 2),
        "r_us_per_block": round(low["r"], 3), "block_m": config["BLOCK_SIZE_M"],
        "provenance": {
            **meta, "gpu": gpu, "dtype": "bf16",
            "shape": {"hidden": shape["hidden"], "expert_intermediate": shape["inter"],
                      "local_slots": shape["n_local"]},
            "align_layout": "sglang", "top_k": shape["top_k"], "step_tokens": step_tokens,
            "c_us_at_step_tokens": low["c_at_steps"],
            "kernel_config": [config[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")],
            "fit": (f"relative least squares over the {low['points']} points that ran SGLang's kernel config "
                    f"{config} with at least {enough} experts (they fill the GPU); one c per step size"),
            "fit_mean_rel_err": round(low["mean_rel_err"], 4), "fit_max_rel_err": round(low["max_rel_err"], 4),
        },
    }
