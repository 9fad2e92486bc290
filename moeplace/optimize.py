"""``moeplace optimize`` and ``compare`` as functions: split a trace, place, evaluate held-out steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.stepaware import search_moot
from moeplace.costmodel import CostModel
from moeplace.errors import MoeplaceError
from moeplace.parallel import layer_workers
from moeplace.placement import Placement
from moeplace.report import Evaluation, evaluate, steps_phrase
from moeplace.trace.load import Trace
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.synthetic import steps_from_counts

BASELINES = ("contiguous", "deepseek")
TODAY = "deepseek, no spares, dynamic"   # the reference row under balanced dispatch (SGLang without moeplace)
AGGREGATE_SAMPLE_STEPS = 4000
# Steps optimize uses unless told otherwise, evenly spaced over the trace. On SYNTHETIC Kimi-K2-shaped
# routing, placements fitted on 5,000 to 200,000 steps are within 0.1% of each other on steps no fit saw,
# and 200,000 take 6-7x the CPU time and 8x the memory of 20,000 (BENCHMARKS.md, bench_sampling.py).
DEFAULT_SAMPLE_STEPS = 20_000


@dataclass
class OptimizeResult:
    placement: Placement
    evaluations: list[Evaluation]   # baselines and the chosen algorithm, on the held-out steps
    fit_steps: int
    eval_steps: int
    note: str


def split_steps(steps: RoutingSteps, holdout: float) -> tuple[RoutingSteps, RoutingSteps]:
    """(fit, held-out): the first ``1 - holdout`` of the steps and the rest, in time order, because a
    placement made from yesterday's traffic is used on tomorrow's. holdout 0: both are all steps."""
    if not 0 <= holdout < 1:
        raise MoeplaceError(f"--holdout must be in [0, 1), got {holdout}")
    S = steps.num_steps
    cut = int(round(S * (1 - holdout)))
    if holdout == 0:
        return steps, steps
    if cut < 1 or cut >= S:
        raise MoeplaceError(f"{S} steps are too few to hold out {holdout:.0%} of them; lower --holdout")
    return steps.slice(0, cut), steps.slice(cut, S)


def optimize(trace: Trace, ranks: int, algorithm: str, mode: str = "all", nodes: int = 1, redundant: int = 0,
             dispatch: str = "dynamic", cost_model: CostModel | None = None, holdout: float = 0.3,
             seed: int = 0, max_steps: int | None = None, effort: float | None = None,
             balance_floor: float | None = None, progress: Callable[[int], None] = lambda n: None,
             reference_cost_model: CostModel | None = None) -> OptimizeResult:
    """Fit ``algorithm`` on the first part of the trace; evaluate it and the baselines on the rest.

    Under ``balanced`` dispatch with spare slots the table also has what SGLang runs without
    moeplace (``TODAY``: DeepSeek EPLB without spare slots, SGLang's dynamic rule), costed with
    ``reference_cost_model`` (its ranks hold fewer slots).

    max_steps: use at most this many steps of ``mode``, evenly spaced over the trace (None:
    DEFAULT_SAMPLE_STEPS); memory holds only those steps, never the whole trace.
    """
    cost_model = cost_model or CostModel()
    model = trace.model
    limit = max_steps or DEFAULT_SAMPLE_STEPS
    total = trace.count(mode)
    if total == 0:
        raise trace.no_steps_error(mode)
    steps = trace.load(mode, limit, total=total)
    notes = []
    if steps.num_steps < total:
        notes.append(f"used {steps.num_steps:,} of the trace's {steps_phrase(total, mode)}, evenly spaced "
                     f"(--max-steps to change; default {DEFAULT_SAMPLE_STEPS:,})")
    if trace.header.aggregate_only:
        counts = steps.expert_token_counts()
        steps = steps_from_counts(model, counts, AGGREGATE_SAMPLE_STEPS, seed=seed)
        notes.append(f"aggregate-only trace: {AGGREGATE_SAMPLE_STEPS} steps were sampled from its counts with "
                     f"independent tokens (no co-activation); metrics are for those sampled steps")
    fit, held_out = split_steps(steps, holdout)

    def problem(steps_: RoutingSteps, report: Callable[[int], None]) -> PlacementProblem:
        p = PlacementProblem(model, steps_, ranks, nodes=nodes, redundant=redundant, dispatch=dispatch,
                             cost_model=cost_model, seed=seed, progress=report)
        if effort is not None:
            p.effort = effort
        if balance_floor is not None:
            p.balance_floor = balance_floor
        return p

    problem(fit, progress).check()
    moot = search_moot(problem(fit, progress)) if algorithm == "stepaware" else None
    if moot:
        notes.append(f"{moot}, so stepaware skipped its search")
    note = "; ".join(notes)
    maps = {name: solve(name, problem(fit, lambda n: None)) for name in BASELINES if name != algorithm}
    maps[algorithm] = solve(algorithm, problem(fit, progress))
    placements = {name: Placement(model, ranks, phy2log, nodes=nodes, algorithm=name, trace=str(trace.path))
                  for name, phy2log in maps.items()}
    workers = layer_workers(held_out.num_steps * (model.num_experts + redundant) * model.num_moe_layers)
    evals = evaluate(placements, [held_out], cost_model, dispatch, workers)
    if dispatch == "balanced" and redundant:
        today = replace(problem(fit, lambda n: None), redundant=0, dispatch="dynamic")
        placements[TODAY] = Placement(model, ranks, solve("deepseek", today), nodes=nodes, algorithm="deepseek",
                                      trace=str(trace.path))
        evals = evaluate({TODAY: placements[TODAY]}, [held_out], reference_cost_model or cost_model,
                         "dynamic", workers) + evals
    chosen = placements[algorithm]
    by_name = {e.name: e for e in evals}
    chosen.metrics = {
        "evaluated_on": "held-out steps" if holdout else "fitted steps", "holdout": holdout, "mode": mode,
        "dispatch": dispatch, "seed": seed, "fit_steps": fit.num_steps, "eval_steps": held_out.num_steps,
        "cost_model": cost_model.to_json(),
        **{f"{name}.{k}": by_name[name].summary[k] for name in placements
           for k in ("e_max_distinct", "optimum", "lower_bound", "token_balancedness", "moe_us_per_step")},
    }
    if note:
        chosen.metrics["note"] = note
    return OptimizeResult(chosen, evals, fit.num_steps, held_out.num_steps, note)
