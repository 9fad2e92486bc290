"""``moeplace optimize`` and ``compare`` as functions: split a trace, place, evaluate held-out steps."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.fit import fit as fit_placement
from moeplace.algorithms.robust import DESCRIPTION, Choice
from moeplace.algorithms.stepaware import search_moot
from moeplace.analysis.metrics import max_distinct_means
from moeplace.analysis.report import Evaluation, evaluate, steps_phrase
from moeplace.cost.model import CostModel
from moeplace.dispatch.by_cost import PLACED_AS
from moeplace.dispatch.flow import HALL_MAX_RANKS
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement
from moeplace.parallel import layer_workers
from moeplace.trace.load import Trace
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.synthetic import steps_from_counts

BASELINES = ("contiguous", "deepseek")
SPARE_BASELINE = "naive-spares"   # also a row under balanced dispatch with spare slots (the naive layout, algorithms.baselines.naive_spares)
SGLANG_RULES = ("dynamic", "static")   # SGLang's own dispatch among replicas; balanced is moeplace's
TODAY = "deepseek, no spares, dynamic"   # the reference row when spares are asked for (SGLang without moeplace)
# The fitted column: E[max distinct] on at most this many of the fitted steps, evenly spaced. It is there
# to warn when held-out steps differ by a few percent; on Kimi-K2-sized routing 500 steps give every row
# within 0.15% of 1,000 (which was within 0.1% of 2,000; the mean is over every layer) at half the cost.
FITTED_SAMPLE_STEPS = 500
AGGREGATE_SAMPLE_STEPS = 4000
# Steps optimize uses unless told otherwise, evenly spaced over the trace. On SYNTHETIC Kimi-K2-shaped
# routing, placements fitted on 5,000 to 200,000 steps are within 0.1% of each other on steps no fit saw,
# and 200,000 take 6-7x the CPU time and 8x the memory of 20,000 (BENCHMARKS.md#how-many-steps-to-fit, bench_sampling.py).
DEFAULT_SAMPLE_STEPS = 20_000
# Balanced dispatch: every row of the table runs the rule step by step, so the table is on at most this many
# held-out steps, evenly spaced. On Kimi-K2-shaped steps (BENCHMARKS.md#optimizer-and-cli-speed) E[max distinct]
# at 8 ranks on 2,000 of 6,000 was within 0.05% of all of them for every row; beyond HALL_MAX_RANKS (the
# rule's augmenting paths grow with the square of the ranks) on 1,000 within 0.5%.
BALANCED_EVAL_STEPS = 2000
WIDE_EVAL_STEPS = 1000
# Under SGLang's rules a row's table costs held-out steps x ranks per layer; above this many cells it is on
# WIDE_EVAL_CELLS / ranks of them (at least WIDE_EVAL_STEPS), evenly spaced: Kimi-K2-shaped on 20,000
# steps, from 64 ranks on. The rows share their steps, so their differences stay paired.
WIDE_EVAL_CELLS = 250_000
# Warn that the fitted steps are too narrow for the spare slots when at least this share of the experts (mean
# over layers) is never active in them: an even spread would give them that share of the spare slots, which then
# rest on nothing seen. Below it the idle experts are rare ones a longer capture finds (the shipped sample's fitted
# steps leave 2 of 768 layer-experts idle, both active in its later steps), not traffic the capture missed.
NARROW_SHARE = 0.1


def today_name(dispatch: str) -> str:
    """The reference row's name: DeepSeek EPLB without spare slots under SGLang's own rule."""
    return f"deepseek, no spares, {today_rule(dispatch)}"


def today_rule(dispatch: str) -> str:
    """SGLang's rule for the a2a that ``dispatch`` models (balanced runs where SGLang's is dynamic)."""
    return dispatch if dispatch in SGLANG_RULES else "dynamic"


@dataclass
class OptimizeResult:
    placement: Placement
    evaluations: list[Evaluation]   # baselines and the chosen algorithm, on the held-out steps
    fit_steps: int
    eval_steps: int
    note: str
    baseline: str = "deepseek"      # the row the table compares against
    fitted: list[float] = field(default_factory=list)   # each row's E[max distinct] on fitted steps (holdout > 0)
    fitted_steps: int = 0                                # how many fitted steps that column is on
    warnings: list[str] = field(default_factory=list)    # the fitted steps may not carry the spare slots asked for


def evenly_spaced(steps: RoutingSteps, count: int) -> RoutingSteps:
    """At most ``count`` of ``steps``, evenly spaced from the first to the last."""
    if steps.num_steps <= count:
        return steps
    return steps.take(np.unique(np.linspace(0, steps.num_steps - 1, count).astype(np.int64)))


def split_steps(steps: RoutingSteps, holdout: float) -> tuple[RoutingSteps, RoutingSteps]:
    """(fit, held-out): the first ``1 - holdout`` of the steps and the rest, in time order, because a
    placement made from yesterday's traffic is used on tomorrow's. holdout 0: both are all steps."""
    if holdout == 0:
        return steps, steps
    cut = holdout_cut(steps.num_steps, holdout)
    return steps.slice(0, cut), steps.slice(cut, steps.num_steps)   # views: the trace is held once


def holdout_cut(num_steps: int, holdout: float) -> int:
    """How many of ``num_steps`` steps come before the held-out ones; MoeplaceError where that leaves
    no step on one side."""
    if not 0 <= holdout < 1:
        raise MoeplaceError(f"--holdout must be in [0, 1), got {holdout}")
    cut = int(round(num_steps * (1 - holdout)))
    if holdout and (cut < 1 or cut >= num_steps):
        raise MoeplaceError(f"{num_steps} steps are too few to hold out {holdout:.0%} of them; lower --holdout")
    return cut


def routes_tokens(steps: RoutingSteps) -> bool:
    """Whether any step routes a token to an expert (an id other than -1, or a positive count)."""
    # a maximum, not a mask: the ids of 20,000 Kimi-K2-shaped steps are 60 million
    return bool((steps.topk_ids.size and steps.topk_ids.max() >= 0) or (steps.counts.size and steps.counts.max() > 0))


def optimize(trace: Trace, ranks: int, algorithm: str, mode: str = "all", nodes: int = 1, redundant: int = 0,
             dispatch: str = "dynamic", cost_model: CostModel | None = None, holdout: float = 0.3,
             seed: int = 0, max_steps: int | None = None, effort: float | None = None,
             balance_floor: float | None = None, progress: Callable[[int], None] = lambda n: None,
             reference_cost_model: CostModel | None = None,
             choice_progress: Callable[[int, int], None] = lambda done, total: None) -> OptimizeResult:
    """Fit ``algorithm`` on the first part of the trace; evaluate it and the baselines on the rest.

    With spare slots the table starts with what SGLang runs without moeplace (``today_name``:
    DeepSeek EPLB without spare slots, under SGLang's own rule), costed with ``reference_cost_model``
    (its ranks hold fewer slots); it is then the baseline. With a holdout, ``fitted`` has every row
    on up to FITTED_SAMPLE_STEPS of the fitted steps, for the table's fitted column.

    max_steps: use at most this many steps of ``mode``, evenly spaced over the trace (None:
    DEFAULT_SAMPLE_STEPS); memory holds only those steps, never the whole trace. progress: layers placed;
    choice_progress: (jobs done, jobs) of the spare-slot layout's choice (``robust.choose``), where it runs.
    """
    cost_model = cost_model or CostModel()
    model = trace.model
    limit = max_steps or DEFAULT_SAMPLE_STEPS
    steps, total = trace.load_counted(mode, limit)
    if total == 0:
        raise trace.no_steps_error(mode)
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
    for part, which in ((fit, "fitted"), (held_out, "held-out" if holdout else "fitted")):
        if not routes_tokens(part):   # found before the search, not after it
            raise MoeplaceError(f"the {which} steps route no token to any expert (every expert id is -1, none): "
                                "nothing to place or measure")
    placed_as = PLACED_AS.get(dispatch, dispatch)
    balanced_cap = WIDE_EVAL_STEPS if ranks > HALL_MAX_RANKS else BALANCED_EVAL_STEPS
    if placed_as == "balanced" and held_out.num_steps > balanced_cap:
        notes.append(f"balanced dispatch on {ranks} ranks: the table is on {balanced_cap:,} of the "
                     f"{held_out.num_steps:,} {'held-out' if holdout else ''} steps, evenly spaced")
        held_out = evenly_spaced(held_out, balanced_cap)
    elif placed_as != "balanced" and held_out.num_steps * ranks > WIDE_EVAL_CELLS:
        count = max(WIDE_EVAL_CELLS // ranks, WIDE_EVAL_STEPS)
        if held_out.num_steps > count:
            notes.append(f"{ranks} ranks: the table is on {count:,} of the {held_out.num_steps:,} "
                         f"{'held-out ' if holdout else ''}steps, evenly spaced")
            held_out = evenly_spaced(held_out, count)

    def problem(steps_: RoutingSteps, report: Callable[[int], None]) -> PlacementProblem:
        p = PlacementProblem(model, steps_, ranks, nodes=nodes, redundant=redundant,
                             dispatch=placed_as,
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
    baselines = BASELINES + ((SPARE_BASELINE,) if placed_as == "balanced" and redundant else ())
    maps = {name: solve(name, problem(fit, lambda n: None)) for name in baselines if name != algorithm}
    spares_chosen, capture_warnings = None, []
    fitted_problem = problem(fit, progress)
    fitted_map = fit_placement(fitted_problem, algorithm, choice_progress)   # balanced spares: the best out of fold
    maps[algorithm], spares_chosen = fitted_map.phy2log, fitted_map.choice
    if spares_chosen is not None:
        notes.append(spares_chosen.line)
        note = "; ".join(notes)
        capture_warnings = spare_warnings(fit, redundant, spares_chosen)
    placements = {name: Placement(model, ranks, phy2log, nodes=nodes, algorithm=name, trace=str(trace.path))
                  for name, phy2log in maps.items()}
    baseline = "deepseek"
    rules = {name: dispatch for name in placements}
    costs = {name: cost_model for name in placements}
    if redundant and model.num_experts % ranks == 0:   # else SGLang cannot run the experts without spares
        baseline = today_name(dispatch)
        today = replace(problem(fit, lambda n: None), redundant=0, dispatch=today_rule(dispatch))
        placements = {baseline: Placement(model, ranks, solve("deepseek", today), nodes=nodes,
                                          algorithm="deepseek", trace=str(trace.path)), **placements}
        rules[baseline], costs[baseline] = today_rule(dispatch), reference_cost_model or cost_model

    # every placement is measured on every layer: the work is theirs together
    workers = layer_workers(held_out.num_steps * (model.num_experts + redundant) * model.num_moe_layers
                            * len(placements))

    evals = evaluate(placements, [held_out], costs, rules, workers)   # each row under its own rule and cost model
    fitted_sample = evenly_spaced(fit, FITTED_SAMPLE_STEPS)
    fitted = (max_distinct_means(fitted_sample, list(placements.values()), [rules[n] for n in placements],
                                 [costs[n] for n in placements], workers) if holdout else [])
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
    if spares_chosen is not None:
        chosen.metrics["spare_layout"] = spares_chosen.to_json()
    return OptimizeResult(chosen, evals, fit.num_steps, held_out.num_steps, note, baseline, fitted,
                          fitted_sample.num_steps if holdout else 0, capture_warnings)


def spare_warnings(fit: RoutingSteps, redundant: int, choice: Choice) -> list[str]:
    """Lines that say the fitted steps are too short or too narrow for ``redundant`` spare slots: at least
    NARROW_SHARE of the experts never active in them (that share of the slots rests on nothing seen), or a fitted
    search that lost out of fold."""
    lines = []
    counts = fit.expert_token_counts()                                   # [L, E]
    unseen = float((counts == 0).sum(axis=1).mean())
    if unseen >= NARROW_SHARE * counts.shape[1]:
        lines.append(f"{unseen / counts.shape[1]:.0%} of the experts ({unseen:.1f} of {counts.shape[1]} a layer, on "
                     f"average) are never active in the {fit.num_steps:,} fitted steps, so where that share of the "
                     f"{redundant} spare slots should go rests on nothing seen: if your traffic routes to them, "
                     f"capture more, or more varied, traffic and run optimize again")
    if choice.losses["fitted"] > choice.losses[choice.name]:
        lines.append(f"stepaware's search, fitted on part of the fitted steps, did worse on the rest than "
                     f"{DESCRIPTION[choice.name]} (E[max distinct] {choice.losses['fitted']:.3f} against "
                     f"{choice.losses[choice.name]:.3f}), so that was written: the trace ({fit.num_steps:,} fitted "
                     f"steps) is too short or too uneven to fit {redundant} spare slots to it; capture more traffic "
                     f"for a placement fitted to it")
    return lines
