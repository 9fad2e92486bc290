"""Spare slots that hold when the traffic changes: the candidate layout that does best on steps its fit did not see.

Dimension letters: S steps, E experts, R ranks, L MoE layers.

A spare-slot search fitted on one capture trusts that capture's hot and co-active experts; when the
prompts change, experts that were cold turn hot and may have no second replica. So under balanced
dispatch with spare slots the layout is chosen, among a few candidates, by its exact E[optimum] on
steps its fit did not see (``choose``):

* ``fitted``: ``stepaware``'s search as it is: its own first copies (fitted to the steps under dynamic
  dispatch, where ``stepaware.eplb_first_copies`` says not DeepSeek EPLB's), replicas by exact gain,
  exchanges of two experts' replica sets by exact gain;
* ``replicas``: DeepSeek EPLB's first copies, replicas by exact gain on the fitted steps, no exchanges;
* ``prior 1/3``, ``prior 2/3``: as ``replicas``, the gains on the fitted steps blended with steps whose
  experts are drawn uniformly (a uniform prior over which experts a step activates; sizes as fitted);
* ``even``: the naive layout's replica counts (every expert replicated as evenly as R allows, the hottest
  first) on DeepSeek EPLB's first copies, each replica on the rank the fitted gains choose, so co-active
  experts can spread;
* ``naive``: the naive layout itself (``baselines.naive_spares``).

Each candidate is scored out of fold as it is written: first copies and exchanges fitted to a short
capture can cost more on other prompts than the replicas gain (GPT-OSS fitted on 1k tokens of SORRY-Bench,
R = 8: ``fitted`` 2.570 on GPQA, ``replicas`` 2.539, the naive layout 2.562), so they are a candidate of
their own, not a step every candidate takes.

Every candidate but ``naive`` keeps the naive layout's floor: with R >= E spare slots each expert holds
1 + R // E replicas at least (``balanced_replicas.spare_floor``), and only the surplus and the ranks go by
gain. The floor does not depend on which experts the capture found hot: a layout that leaves a cold
expert of the capture with one replica fewer bets that it stays cold, and on traffic where it turned hot
that bet cost up to 5% against the naive layout (BENCHMARKS.md, spare slots when the traffic changes).

Folds: the trace's steps carry no request id, so the folds are FOLDS contiguous blocks of steps (a
block holds other requests than the rest, mostly, since a request's steps are close in time; steps of
one request never sit in a fit and its test at random). Each fold fits every candidate on the other
blocks (``fitted`` with no smoothed steps) and scores it on the block by the per-step optimum
(``dispatch.flow.optimum``), on evenly spaced layers: as many as CV_CELLS of fitting work allows
(``cv_layers``), CV_LAYERS at least. A short capture is cheap to fit, so it is scored on more layers:
there a candidate's out-of-fold figure on few layers is mostly noise (its held-out blocks hold a few
dozen steps, and a blend's uniform steps are one random draw), and the noisiest candidate wins by luck
(GPT-OSS fitted on 1k tokens of MMLU-Pro, R = 8: on 3 layers ``prior 1/3`` 2.425 out of fold against
``fitted`` 2.445, on SORRY-Bench 2.384 against 2.310). Above MAX_SEARCH_RANKS (wide EP) the blends'
searches, which enumerate rank sets, are out of reach: ``fitted`` (DeepSeek EPLB's first copies,
``wide_spares`` on as many steps as its real fit, then ``coactive_spread`` on the fold's fitted steps) and
``naive`` compete on CV_LAYERS layers, each block scored on WIDE_TEST_STEPS of its steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from moeplace.algorithms import PlacementProblem, balanced_replicas
from moeplace.algorithms.balanced_replicas import (MAX_SEARCH_RANKS, add_replicas, first_copies_and_room,
                                                   masks_to_phy2log, sample_size, spare_floor)
from moeplace.algorithms.baselines import first_copies, hot_expert_spares, naive_spares
from moeplace.algorithms.smoothed_steps import weighted_union
from moeplace.algorithms.stepaware import (BALANCED_BASE_EFFORT, eplb_first_copies, place_layer, search_moot,
                                           search_rows, stepaware)
from moeplace.dispatch.balanced import replica_layout, step_expert_counts
from moeplace.dispatch.flow import optimum
from moeplace.parallel import PARALLEL_CELLS, layer_workers, map_layers

FOLDS = 3          # contiguous blocks of steps, each held out once
CV_LAYERS = 3      # layers the choice fits at least, evenly spaced
CV_CELLS = 15_000_000   # the choice's fitting work over its layers (``cv_layers``): steps fitted x (rank sets +
                        # experts), every fold and candidate; Kimi K2's shape (377 steps a fold, 640 cells) needs
                        # 13e6 for CV_LAYERS layers, GPT-OSS-20B fitted on 1k tokens (75 steps, 288 cells) 2.1e6 a layer
WIDE_TEST_STEPS = 500   # above MAX_SEARCH_RANKS: a held-out block is scored on this many of its steps, evenly spaced


@dataclass(frozen=True)
class Candidate:
    """One way to fill the spare slots. prior: share of uniform steps in the objective; even: the naive
    layout's replica counts, ranks by gain; naive: the naive layout; search: ``stepaware`` as it is."""

    name: str
    prior: float = 0.0
    even: bool = False
    naive: bool = False
    search: bool = False


# Most robust first: on an exact tie of the out-of-fold loss the one that trusts the capture least wins.
CANDIDATES = (Candidate("naive", naive=True), Candidate("even", even=True), Candidate("prior 2/3", 2 / 3),
              Candidate("prior 1/3", 1 / 3), Candidate("replicas"), Candidate("fitted", search=True))
WIDE_CANDIDATES = ("naive", "fitted")   # above MAX_SEARCH_RANKS (the blends' searches enumerate rank sets)
WHY = {"fitted": "the capture's hot and co-active experts recur in steps the fit did not see",
       "replicas": "the capture's hot and co-active experts recur, but first copies and exchanges fitted to it "
                   "did not carry over to steps the fit did not see",
       "prior 1/3": "the capture's co-activation recurs only in part on steps the fit did not see",
       "prior 2/3": "the capture's hot experts recur little on steps the fit did not see",
       "even": "which experts are hot changes between parts of the capture; where co-active ones sit does not",
       "naive": "the capture's statistics did not carry over to steps the fit did not see"}

# Each candidate in plain words, for the note that names the one written.
DESCRIPTION = {"fitted": "stepaware's search",
               "replicas": "DeepSeek EPLB's layout plus replicas by their gain on the fitted steps",
               "prior 1/3": "DeepSeek EPLB's layout plus replicas by their gain on the fitted steps blended one third "
                            "with random steps",
               "prior 2/3": "DeepSeek EPLB's layout plus replicas by their gain on the fitted steps blended two thirds "
                            "with random steps",
               "even": "the naive layout's replica counts with each replica on the rank where it gains most",
               "naive": "the naive layout (DeepSeek EPLB plus a replica of each of the hottest experts)"}


@dataclass(frozen=True)
class Choice:
    """The chosen candidate and each candidate's mean E[optimum] on held-out blocks (``losses``), over
    ``folds`` blocks and ``layers`` layers."""

    name: str
    losses: dict[str, float]
    folds: int
    layers: int

    @property
    def line(self) -> str:
        """One line: which layout, how it was chosen, its out-of-fold figure against the fitted search and the
        naive layout, and what that says of the capture."""
        if not self.layers:
            return f"spare slots: {DESCRIPTION[self.name]} (too few fitted steps to try other ways to place them)"
        lo = self.losses
        others = [f"{lo[name]:.3f} for {what}" for name, what in (("fitted", DESCRIPTION["fitted"]),
                                                                    ("naive", "the naive layout")) if name != self.name]
        return (f"spare slots: {DESCRIPTION[self.name]}, the best of {len(lo)} ways tried on the fitted steps (each "
                f"fitted on part of them and scored on the rest, {self.folds} blocks in turn, {self.layers} layers: "
                f"E[max distinct] {lo[self.name]:.3f} against {' and '.join(others)}), so {WHY[self.name]}")

    def to_json(self) -> dict:
        return {"name": self.name, "folds": self.folds, "layers": self.layers, "out_of_fold": dict(self.losses)}


def uniform_steps(active: np.ndarray, num_steps: int, rng: np.random.Generator) -> np.ndarray:
    """[num_steps, E] bool steps of the sizes of ``active [S, E]``'s steps, each one's experts uniform."""
    S, E = active.shape
    sizes = active.sum(axis=1)[rng.integers(S, size=num_steps)]
    keys = rng.random((num_steps, E))
    nth = np.sort(keys, axis=1)[np.arange(num_steps), np.minimum(E - sizes, E - 1)]
    return (keys >= nth[:, None]) & (sizes[:, None] > 0)


def with_prior(active: np.ndarray, share: float, num_prior: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S + n, E], weight [S + n]): ``active`` and n uniform steps making up ``share`` of the weight."""
    if share <= 0 or active.shape[0] == 0:
        return active, np.ones(active.shape[0])
    return weighted_union(active, uniform_steps(active, max(num_prior, 1), rng), share)


def even_copies(weight: np.ndarray, redundant: int) -> np.ndarray:
    """[E] replicas per expert in the naive layout: 1 + redundant // E each, one more for the
    redundant % E hottest (``weight [E]`` tokens; ties: lower id)."""
    E = weight.shape[0]
    copies = np.full(E, 1 + redundant // E)
    copies[np.lexsort((np.arange(E), -weight))[:redundant % E]] += 1
    return copies


def layer_masks(candidate: Candidate, active: np.ndarray, weight: np.ndarray, base: np.ndarray, ranks: int,
                redundant: int, num_prior: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(masks [E], steps, step weight) of one layer: ``base [F]`` first copies (``first_copy_slots``) plus the
    rest of ``redundant`` spare slots filled as ``candidate`` does, fitted on ``active [S, E]`` (``weight [E]``:
    fitted tokens)."""
    E = weight.shape[0]
    if candidate.naive:
        return replica_layout(hot_expert_spares(base, weight, ranks, E + redundant - base.size), E, ranks).masks, \
            active, np.ones(active.shape[0])
    first, room = first_copies_and_room(base, E, ranks, (E + redundant) // ranks)
    steps, step_weight = with_prior(active, candidate.prior, num_prior, rng)
    cap = even_copies(weight, redundant) if candidate.even else None
    masks = add_replicas(steps, first, ranks, room, weight, step_weight, cap, spare_floor(E, redundant))
    return masks, steps, step_weight


def fold_blocks(num_steps: int, folds: int) -> list[np.ndarray]:
    """Step indices of ``folds`` contiguous blocks (fewer where there are fewer steps)."""
    return [b for b in np.array_split(np.arange(num_steps), min(folds, num_steps)) if b.size]


def cv_layers(problem: PlacementProblem, blocks: list[np.ndarray], candidates: tuple[Candidate, ...],
              sample: int) -> int:
    """Layers the choice scores: as many as CV_CELLS of fitting work allows, CV_LAYERS at least, all at most.
    A layer's work: each fold (``blocks``, the held-out step indices; the rest is fitted) fits each candidate but
    ``naive`` on up to ``sample`` of its steps (the blends on ``sample // 2`` uniform steps more), each step
    costing its rank sets and experts (``sample_size``'s cells)."""
    S, L = sum(block.size for block in blocks), problem.model.num_moe_layers
    cells = (1 << problem.ranks) + problem.model.num_experts
    fitted = sum(min(S - block.size, sample) for block in blocks)
    per_layer = cells * sum(fitted + (len(blocks) * (sample // 2) if c.prior else 0)
                            for c in candidates if not c.naive)
    return int(min(L, max(CV_LAYERS, CV_CELLS // max(per_layer, 1))))


def choose(problem: PlacementProblem, seed: int,
           progress: Callable[[int, int], None] = lambda done, total: None) -> Choice:
    """The candidate with the lowest E[optimum] over held-out blocks (``fold_blocks``) and ``cv_layers`` layers.
    Above MAX_SEARCH_RANKS only WIDE_CANDIDATES compete on CV_LAYERS layers, each block scored on
    WIDE_TEST_STEPS of its steps. progress: (jobs done, jobs) at the start and as each (layer, block) ends."""
    S, L = problem.steps.num_steps, problem.model.num_moe_layers
    R, E = problem.ranks, problem.model.num_experts
    wide = R > MAX_SEARCH_RANKS
    candidates = tuple(c for c in CANDIDATES if not wide or c.name in WIDE_CANDIDATES)
    blocks = fold_blocks(S, FOLDS)
    if len(blocks) < 2:
        return Choice("fitted", {c.name: 0.0 for c in candidates}, len(blocks), 0)
    sample = sample_size(problem) if wide else max(sample_size(problem) // 2, 1)   # wide: as ``wide_spares`` fits
    count = CV_LAYERS if wide else cv_layers(problem, blocks, candidates, sample)
    layers = np.unique(np.linspace(0, L - 1, min(count, L)).round().astype(int))
    jobs = [(int(layer), k) for layer in layers for k in range(len(blocks))]
    seeds = np.random.default_rng(seed).integers(2**31, size=len(jobs))

    def held_out(job: int) -> np.ndarray:
        layer, k = jobs[job]
        rng = np.random.default_rng(seeds[job])
        # the layer's counts of every step once; a fold's rows are indexed from them (a copy of the fold's
        # steps would copy every layer's routing)
        every = step_expert_counts(problem.steps, layer)
        fit_rows = np.concatenate([b for i, b in enumerate(blocks) if i != k])
        counts = every[fit_rows]
        block = blocks[k]
        if wide and block.size > WIDE_TEST_STEPS:
            block = block[np.unique(np.linspace(0, block.size - 1, WIDE_TEST_STEPS).astype(np.int64))]
        test = (every[block] > 0).astype(np.float32)   # 0/1 once: each candidate's score reads it (``subset_counts``)
        weight = counts.sum(axis=0)
        base = first_copies(weight[None].astype(np.float64), problem.first_slots, R)[0]
        rows = np.arange(counts.shape[0])
        if rows.size > sample:
            rows = np.sort(rng.choice(rows.size, sample, replace=False))
        active = counts[rows] > 0
        out = np.zeros(len(candidates))
        for i, candidate in enumerate(candidates):
            if candidate.search:
                masks = replica_layout(search_layer(problem, layer, base, fit_rows, rows, rng), E, R).masks
            else:
                masks = layer_masks(candidate, active, weight, base, R, problem.redundant, sample // 2, rng)[0]
            out[i] = optimum(test, masks, R).mean()
        return out

    progress(0, len(jobs))
    done = []
    for job, value in map_layers(held_out, len(jobs), layer_workers(PARALLEL_CELLS)):
        done.append((job, value))
        progress(len(done), len(jobs))
    loss = np.zeros(len(candidates))
    for _, value in sorted(done, key=lambda x: x[0]):   # summed in job order, whichever worker ended first
        loss += value
    loss /= len(jobs)
    best = int(np.argmin(loss))   # the first of equals: the most robust
    return Choice(candidates[best].name, {c.name: float(v) for c, v in zip(candidates, loss)}, len(blocks),
                  len(layers))


def search_layer(problem: PlacementProblem, layer: int, reference: np.ndarray, fit_rows: np.ndarray,
                 rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """phy2log [P] of one layer as ``stepaware`` places it under balanced dispatch with spare slots, fitted
    on ``fit_rows`` of the problem's steps (its first copies, replicas by gain on ``fit_rows[rows]``,
    exchanges), without smoothed steps. reference: [F] DeepSeek EPLB's first copies of the layer."""
    E, L = problem.model.num_experts, problem.model.num_moe_layers
    steps = problem.steps.one_layer(layer)    # the fold's steps of this layer alone: no copy of every layer
    one = replace(problem, model=steps.model, steps=steps.take(fit_rows), progress=lambda n: None)
    first = reference
    if not eplb_first_copies(problem):   # first copies searched, as stepaware's
        base = replace(one, redundant=problem.first_slots - E, dispatch="dynamic",
                       effort=problem.effort * BALANCED_BASE_EFFORT)
        search = None if search_moot(base) else search_rows(base.steps.num_steps, base.num_physical, rng, base.ranks)
        first = place_layer(base, 0, reference, search, base.effort / L)
    spares = balanced_replicas.SpareSearch(one.steps.take(rows), 0.0, int(rng.integers(2**31)))
    return balanced_replicas.place(one, 0, first, spares)


def robust_spares(problem: PlacementProblem,
                  choice_progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[np.ndarray, Choice]:
    """(phy2log [L, P], the choice): spare slots for balanced dispatch by the candidate ``choose`` picks (its
    progress: ``choice_progress``), then fitted on all of ``problem.steps`` as it was scored."""
    rng = np.random.default_rng([problem.seed, 36])
    choice = choose(problem, int(rng.integers(2**31)), choice_progress)
    candidate = next(c for c in CANDIDATES if c.name == choice.name)
    if candidate.search:
        return stepaware(problem), choice
    if candidate.naive:
        return naive_spares(problem), choice
    L, R, E = problem.model.num_moe_layers, problem.ranks, problem.model.num_experts
    weight = problem.steps.expert_token_counts()
    base = first_copies(weight, problem.first_slots, R)     # as scored out of fold
    sample = sample_size(problem)
    rows = problem.steps.take(np.sort(rng.choice(problem.steps.num_steps, sample, replace=False))) \
        if problem.steps.num_steps > sample else problem.steps
    seeds = rng.integers(2**31, size=L)

    def place(layer: int) -> np.ndarray:
        counts = step_expert_counts(rows, layer)
        layer_rng = np.random.default_rng(seeds[layer])
        masks = layer_masks(candidate, counts > 0, weight[layer], base[layer], R, problem.redundant, sample // 2,
                            layer_rng)[0]
        return masks_to_phy2log(masks, R, problem.num_physical // R)

    out = np.zeros((L, problem.num_physical), np.int64)
    # each layer is a replica search (~0.03 s at Kimi K2's size, seeded per layer): worth a pool, as the choice's
    for layer, phy2log in map_layers(place, L, layer_workers(PARALLEL_CELLS)):
        out[layer] = phy2log
        problem.progress(1)
    return out, choice
