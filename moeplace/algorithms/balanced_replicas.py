"""Where spare slots go when SGLang dispatches by moeplace's balanced rule (``moeplace.dispatch.balanced``).

Dimension letters: S steps, E logical experts, R ranks, X subsets of ranks (2^R).

Under balanced dispatch a step's optimum is Hall's ``max over X of ceil(f[X] / |X|)`` (``hall``), f[X]
the step's active experts whose replicas all lie in the rank set X. A spare slot gives expert e a
replica on rank r: f[X] drops by one for the sets X that held all of e's replicas but not r. The step's
optimum drops (by one) exactly when every *tight* set (one that reaches the maximum) loses one expert
and was only one expert over M - 1 ("fragile"); that is, when e is active, e's replicas lie in the
intersection of the tight sets, and r lies outside their union. So the gain of every (expert, rank)
pair over all steps is one matrix product, exact. Per layer:

1. start from the first copies (``stepaware``'s: one copy of each expert, replicas where the experts do not
   split over the ranks), each rank with as many free slots;
2. the steps to fit: a sample of the fitted steps, and, for a share of the objective chosen by
   cross-validation on the fitted steps (``choose_smoothing``), smoothed steps without co-activation
   (``smoothed_steps``), so that a short capture's one-off co-activations do not decide the last
   replicas;
3. add replicas by exact gain in E[optimum] on those steps, in rounds: one replica a round where spare
   slots are few (several chosen against the same state can chase the same steps), up to BATCH_MAX
   where they are many; among equal gains prefer the pair that takes an expert out of every tight set
   of more steps that are not fragile (progress toward a later gain), then the busiest expert per
   replica, then the lower expert id and rank (deterministic); with R >= E spare slots every expert
   first reaches the naive layout's 1 + R // E replicas (``spare_floor``): which experts are hot may
   change after the capture, how many replicas every expert gets in the naive layout does not;
4. exchange the replica sets of two experts while that lowers E[optimum] exactly (``replica_exchange``),
   within the problem's work budget: the first copies were placed before the replicas were known.

The fast rule reached the optimum on every step measured (BENCHMARKS.md#with-spare-slots-across-datasets), so this is what SGLang gets.
Rank sets are enumerated, so this search is for R <= MAX_SEARCH_RANKS (one node of 8 GPUs is 256 sets);
wider layouts place their spare slots by ``wide_spares`` on WIDE_SEARCH_STEPS sampled steps, then spread
co-active slots apart on every fitted step (``coactive_spread``, kept by ``spread_if_better``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from moeplace.algorithms.baselines import first_copies
from moeplace.algorithms.replica_exchange import exchange_masks
from moeplace.algorithms import coactive_spread, wide_spares
from moeplace.algorithms.smoothed_steps import with_smoothed_steps
from moeplace.dispatch.balanced import mask_bits, pack_bits, replica_layout, step_expert_active, step_expert_counts
from moeplace.dispatch.exact import by_size, step_optimum, subset_counts, subset_sizes
from moeplace.dispatch.flow import HALL_MAX_RANKS, optimum
from moeplace.errors import MoeplaceError
from moeplace.parallel import PARALLEL_CELLS, layer_workers, map_layers
from moeplace.trace.steps import RoutingSteps, _ranges

from moeplace.algorithms import DEFAULT_EFFORT

if TYPE_CHECKING:
    from moeplace.algorithms import PlacementProblem

MAX_SEARCH_RANKS = HALL_MAX_RANKS   # the search enumerates Hall's rank sets, as the exact optimum does
SEARCH_CELLS = 1_200_000  # steps sampled for the search: at most this many step x (rank sets + experts)
MODEL_SEARCH_CELLS = 29_000_000   # and over all layers at most this many, so optimize stays seconds on a deep
                                  # model: 24 layers of up to 32 experts at 8 ranks (GPT-OSS-20B) keep their whole
                                  # sample, 60 of 384 experts (Kimi K2) see 755 steps a layer
MIN_ROUNDS, BATCH_MAX = 12, 16  # replicas go in at least MIN_ROUNDS rounds of at most BATCH_MAX
PROGRESS_WEIGHT = 1e-3    # weight of "out of every tight set of a step that is not fragile" against a step gained
SMOOTHING_SHARES = (0.0, 1 / 3, 2 / 3)   # shares of the objective given to smoothed steps, chosen by CV
CV_LAYERS = 2             # layers the cross-validation of the smoothing fits
WIDE_SEARCH_STEPS = 300   # steps a wide layout's spare search (``wide_spares``) fits, a layer (on 250 instead of 500: 0.1-0.5%
                          # worse held out, about 1.5 CPU s less on Kimi K2 at 64 ranks: BENCHMARKS.md#wide-expert-parallelism)
CHECK_STEPS = 500         # fitted steps that decide whether a wide layout keeps its spread slots (``spread_if_better``)
EXCHANGE_CELLS = 1e8      # each layer's exchange search work at the default effort (replica_exchange), so a
                          # layer gets the same search whatever the model's depth


def _tight(f: np.ndarray, sizes: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fragile [S] bool, inter [S], union [S]) of each step's tight rank sets (those at the optimum M).

    X is tight when f[X] > (M - 1)|X|; fragile: no tight set is more than one expert over (M - 1)|X|
    (then one fewer expert in each lowers the optimum). M comes from the largest f of each set size.
    """
    return _tight_by_size(f.take(by_size(ranks)[0] + 1, axis=1), ranks)


def _tight_by_size(g: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_tight`` of ``g [S, X-1]``: f without the empty set, its columns in ``hall.by_size`` order."""
    order, starts = by_size(ranks)
    top = np.maximum.reduceat(g, starts, axis=1)                           # [S, R] largest f per set size
    k = np.arange(1, ranks + 1, dtype=np.float32)
    opt = np.ceil(top / k).max(axis=1)          # exact: a quotient of small integers is whole only if exact
    floor = (opt[:, None] - 1) * k                                         # [S, R] (M - 1)|X| per set size
    tight = g > np.repeat(floor, np.diff(starts, append=g.shape[1]), axis=1)   # whole numbers: >= floor + 1
    fragile = ((top - floor).max(axis=1) <= 1) & (opt > 0)                 # no set 2 over (M - 1)|X|
    # per rank, how many tight sets hold it: in all of them (inter), in one at least (union)
    holding = tight.astype(np.float32) @ _holds(ranks)                     # [S, R + 1]; last: tight sets
    bit = np.int16(1) << np.arange(ranks, dtype=np.int16)
    inter = ((holding[:, :-1] == holding[:, -1:]) * bit).sum(axis=1, dtype=np.int16)
    union = ((holding[:, :-1] > 0) * bit).sum(axis=1, dtype=np.int16)
    return fragile, inter, union


@lru_cache(maxsize=None)
def _outside(ranks: int) -> np.ndarray:
    """[X, R] bool: rank r lies outside rank set X."""
    return ~mask_bits(np.arange(1 << ranks), ranks)


@lru_cache(maxsize=None)
def _holds(ranks: int) -> np.ndarray:
    """[X-1, R + 1] float32, in ``hall.by_size`` order: whether each non-empty rank set holds each rank,
    then a column of ones (float32 counts of at most 2^R sets are exact)."""
    ids = np.arange(1, 1 << ranks)[by_size(ranks)[0]]
    return np.hstack([(ids[:, None] >> np.arange(ranks)) & 1, np.ones((ids.size, 1))]).astype(np.float32)


def _pair_scores(steps: np.ndarray, experts: np.ndarray, masks: np.ndarray, fragile: np.ndarray, inter: np.ndarray,
                 union: np.ndarray, weight: np.ndarray, ranks: int, num_experts: int, progress: float) -> np.ndarray:
    """[E, R] score of active (step, expert) pairs (steps, experts: [N]; fragile, inter, union, weight: [S],
    per step). A pair whose expert has every replica inside all tight sets of its step gains the step's
    weight for each rank outside them all when the step is fragile, and ``progress`` of it (one step
    nearer to a later gain) when it is not."""
    keep = np.flatnonzero((masks[experts] & ~inter[steps]) == 0)
    s, e = steps[keep], experts[keep]
    w = np.where(fragile[s], 1.0, progress) * weight[s]
    outside = _outside(ranks).T[:, union[s]]                              # [R, pairs kept]
    scores = np.empty((num_experts, ranks))
    for r in range(ranks):   # one sum per rank, each in pair order
        scores[:, r] = np.bincount(e, weights=np.where(outside[r], w, 0.0), minlength=num_experts)
    return scores


def replica_gains(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """[E, R] exactly how many of the steps ``active [S, E]`` lower their optimum by one if expert e gets
    a replica on rank r (zero where e already has one there)."""
    f = subset_counts(active, masks, ranks)
    fragile, inter, union = _tight(f, subset_sizes(ranks), ranks)
    s, e = np.nonzero(active)
    gains = _pair_scores(s, e, masks, fragile, inter, union, np.ones(active.shape[0]), ranks, active.shape[1], 0.0)
    return np.where(mask_bits(masks, ranks), 0.0, gains)


def spare_rounds_batch(spare: int) -> int:
    """Replicas added per round: one at a time for few spare slots, up to BATCH_MAX for many."""
    return int(min(max(spare // MIN_ROUNDS, 1), BATCH_MAX))


def add_replicas(active: np.ndarray, masks: np.ndarray, ranks: int, room: int | np.ndarray,
                 expert_weight: np.ndarray, step_weight: np.ndarray | None = None,
                 max_copies: np.ndarray | None = None, min_copies: np.ndarray | None = None) -> np.ndarray:
    """New replica masks [E] after adding ``room`` replicas to every rank (one count, or [R] per rank).

    active: [S, E] bool, the steps to fit; masks: [E] replica ranks before (bit sets);
    expert_weight: [E] breaks ties toward the busiest expert per replica; step_weight: [S] what each
    step counts for (default 1); max_copies: [E] most replicas each expert may end with (default: no
    limit), passed over only where no expert under its limit has a rank with room left; min_copies: [E]
    replicas each expert gets before any expert gets more (default: none), by gain among those under it.
    """
    if ranks > MAX_SEARCH_RANKS:
        raise MoeplaceError(f"balanced replica placement enumerates rank sets: at most {MAX_SEARCH_RANKS} "
                            f"ranks, got {ranks}")
    masks = masks.astype(np.int16)
    S, E = active.shape
    step_weight = np.ones(S) if step_weight is None else np.asarray(step_weight, np.float64)
    # f without the empty set, its columns grouped by set size (``_tight_by_size``); ids: each column's set
    ids = np.arange(1, 1 << ranks, dtype=np.int16)[by_size(ranks)[0]]
    rank_bits = (np.int16(1) << np.arange(ranks, dtype=np.int16)).astype(np.int16)
    # take, not [:, ids]: a C-ordered result, whose rows the rounds below gather and reduce (2-3x faster)
    f = subset_counts(active, masks, ranks).take(ids, axis=1).astype(np.float32)   # float: updated by products, exact
    fragile, inter, union = _tight_by_size(f, ranks)
    # The score only involves active (step, expert) pairs: keep them as lists, grouped by step.
    pair_step, pair_expert = np.nonzero(active)
    first_pair = np.searchsorted(pair_step, np.arange(S + 1))

    def contribution(pairs: np.ndarray) -> np.ndarray:
        return _pair_scores(pair_step[pairs], pair_expert[pairs], masks, fragile, inter, union, step_weight, ranks, E,
                            PROGRESS_WEIGHT)

    score = contribution(np.arange(pair_step.size))
    # Where gains tie (none left on the fitted steps, say), the busiest expert per replica goes first, so
    # replicas spread over experts rather than pile onto the busiest one.
    tie_unit = 1e-6 * float(step_weight.min(initial=1.0)) / max(float(expert_weight.max(initial=0)), 1e-12)
    copies = mask_bits(masks, ranks).sum(axis=1)
    room = np.broadcast_to(np.asarray(room, np.int64), (ranks,)).copy()
    batch = spare_rounds_batch(int(room.sum()))
    is_chosen = np.zeros(E, bool)
    while room.sum():
        allowed = ((masks[:, None] & rank_bits) == 0) & (room > 0)[None, :]
        if max_copies is not None and (allowed & (copies < max_copies)[:, None]).any():
            allowed &= (copies < max_copies)[:, None]   # unless no expert under its limit fits the room left
        if min_copies is not None and (allowed & (copies < min_copies)[:, None]).any():
            allowed &= (copies < min_copies)[:, None]   # experts under their floor first, while one fits
        if not allowed.any():
            raise MoeplaceError("no expert can take another replica: spare slots exceed what ranks can hold")
        tie = tie_unit * expert_weight / copies
        total = np.where(allowed, score + tie[:, None], -np.inf)
        # A round adds the best pairs of distinct experts at once (their gains were computed against
        # the same state), then updates the steps they touch.
        chosen = wide_spares.best_pairs(total, room, batch)
        experts = np.array([e for e, _ in chosen])
        hit = np.flatnonzero(active[:, experts].any(axis=1))
        # f[X] drops by one for the sets holding all of e's replicas but not r
        drop = np.array([((ids & masks[e]) == masks[e]) & ((ids & rank_bits[r]) == 0) for e, r in chosen])
        if len(chosen) == 1:   # every step hit activates the one expert: its row drops as a whole, no product
            f_hit = f[hit] - drop[0].astype(np.float32)
        else:
            f_hit = f[hit] - active[np.ix_(hit, experts)].astype(np.float32) @ drop.astype(np.float32)
        f[hit] = f_hit         # the other steps activate none of the experts: they keep their f
        new_fragile, new_inter, new_union = _tight_by_size(f_hit, ranks)
        # A pair's score changes where its step's tight sets changed, or where its expert is a chosen
        # one (its mask changed); every pair of a chosen expert lies in ``hit``.
        changed = (new_fragile != fragile[hit]) | (new_inter != inter[hit]) | (new_union != union[hit])
        lengths = first_pair[hit + 1] - first_pair[hit]
        pairs = _ranges(first_pair[hit], lengths)
        is_chosen[experts] = True
        pairs = pairs[np.repeat(changed, lengths) | is_chosen[pair_expert[pairs]]]
        is_chosen[experts] = False
        score -= contribution(pairs)              # with the old masks, then with the new ones
        for e, r in chosen:
            masks[e] |= rank_bits[r]
            copies[e] += 1
            room[r] -= 1
        fragile[hit], inter[hit], union[hit] = new_fragile, new_inter, new_union
        score += contribution(pairs)
    if min_copies is not None:
        masks = lift_to_floor(masks, ranks, min_copies)
    return masks.astype(np.int64)


def lift_to_floor(masks: np.ndarray, ranks: int, min_copies: np.ndarray) -> np.ndarray:
    """Masks [E] with every expert holding ``min_copies [E]`` replicas at least, each rank as many as before.

    The greedy fill can leave an expert under its floor when the last rank with room already holds it;
    then a replica of an expert above its floor (the one with most copies, lowest id) on a rank the
    expert lacks (the lowest) moves to it. One exists while the floor fits: the donor holds more ranks.
    """
    masks = masks.copy()
    copies = mask_bits(masks, ranks).sum(axis=1)
    for e in np.flatnonzero(copies < min_copies):
        while copies[e] < min_copies[e]:
            spare = copies - min_copies
            donor = int(np.argmax(spare))
            if spare[donor] <= 0:
                return masks
            rank = int(np.flatnonzero(mask_bits(masks[donor:donor + 1] & ~masks[e], ranks)[0])[0])
            masks[donor] &= ~(1 << rank)
            masks[e] |= 1 << rank
            copies[donor] -= 1
            copies[e] += 1
    return masks


@dataclass(frozen=True)
class SpareSearch:
    """What the spare-slot search of every layer sees.

    steps: the fitted steps it fits (all, or a sample of ``sample_size``); smoothing: the share of its
    objective given to smoothed steps (``smoothed_steps``), chosen by cross-validation; seed: for them.
    """

    steps: RoutingSteps
    smoothing: float
    seed: int


def sample_size(problem: PlacementProblem) -> int:
    """Steps the search fits at most, a layer: SEARCH_CELLS / (rank sets + experts), and no more than
    MODEL_SEARCH_CELLS over all layers (the search's time grows with steps x cells x layers); on more
    than MAX_SEARCH_RANKS ranks, WIDE_SEARCH_STEPS."""
    if problem.ranks > MAX_SEARCH_RANKS:
        return WIDE_SEARCH_STEPS
    cells = (1 << problem.ranks) + problem.model.num_experts
    return max(min(SEARCH_CELLS // cells, MODEL_SEARCH_CELLS // (cells * problem.model.num_moe_layers)), 1)


def search_steps(problem: PlacementProblem, rng: np.random.Generator) -> SpareSearch:
    """The fitted steps the search sees (all, or ``sample_size`` of them at random) and its smoothing."""
    sample = sample_size(problem)
    steps = problem.steps
    if steps.num_steps > sample:
        steps = steps.take(np.sort(rng.choice(steps.num_steps, sample, replace=False)))
    smoothing = 0.0 if problem.ranks > MAX_SEARCH_RANKS else choose_smoothing(problem, int(rng.integers(2**31)))
    return SpareSearch(steps, smoothing, int(rng.integers(2**31)))


def choose_smoothing(problem: PlacementProblem, seed: int) -> float:
    """The share of smoothed steps (one of SMOOTHING_SHARES) whose spare slots do best on steps the fit
    did not see: two-fold cross-validation on the first and second half of the fitted steps (time order,
    so that the folds differ as tomorrow's traffic differs from today's), on CV_LAYERS layers, first
    copies by DeepSeek EPLB and replicas by ``add_replicas`` (no exchanges). Ties: the smaller share."""
    S, L = problem.steps.num_steps, problem.model.num_moe_layers
    R, E = problem.ranks, problem.model.num_experts
    if S < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    sizes = subset_sizes(R)
    halves = (problem.steps.slice(0, S // 2), problem.steps.slice(S // 2, S))
    sample = max(sample_size(problem) // 2, 1)
    fits = []   # (share index, steps, step weights, first copies, expert weight, test steps), drawn in order
    for layer in np.unique(np.linspace(0, L - 1, min(CV_LAYERS, L)).round().astype(int)):
        counts = [step_expert_counts(half, int(layer)) for half in halves]
        for fit, test in ((0, 1), (1, 0)):
            weight = counts[fit].sum(axis=0)
            base = first_copies(weight[None].astype(np.float64), problem.first_slots, R)[0]
            active = counts[fit] > 0
            if active.shape[0] > sample:
                active = active[np.sort(rng.choice(active.shape[0], sample, replace=False))]
            for i, share in enumerate(SMOOTHING_SHARES):
                steps, step_weight = with_smoothed_steps(active, share, sample // 2, rng)
                fits.append((i, steps, step_weight, base, weight, counts[test] > 0))

    def held_out_optimum(job: int) -> float:
        _, steps, step_weight, base, weight, test = fits[job]
        masks, room = first_copies_and_room(base, E, R, problem.num_physical // R)
        masks = add_replicas(steps, masks, R, room, weight, step_weight)
        return float(step_optimum(subset_counts(test, masks, R), sizes).mean())

    loss = np.zeros(len(SMOOTHING_SHARES))
    workers = layer_workers(PARALLEL_CELLS)   # a job is a replica search (~0.1 s at Kimi K2's size): worth a pool
    for job, value in sorted(map_layers(held_out_optimum, len(fits), workers)):   # summed in job order
        loss[fits[job][0]] += value
    return float(SMOOTHING_SHARES[int(np.argmin(loss))])


def place(problem: PlacementProblem, layer: int, base: np.ndarray, search: SpareSearch) -> np.ndarray:
    """phy2log [P] of one layer: ``base [F]``'s first copies (``first_copies_and_room``) plus the problem's
    spare slots, placed for balanced dispatch on ``search`` (``search_steps``): replicas by exact gain,
    then exchanges of two experts' replica sets by exact gain, on the sampled and smoothed steps."""
    R, E = problem.ranks, problem.model.num_experts
    counts = step_expert_counts(search.steps, layer)
    masks, room = first_copies_and_room(base, E, R, problem.num_physical // R)
    if R > MAX_SEARCH_RANKS:
        masks = wide_spares.add_replicas(counts > 0, masks, R, room, counts.sum(axis=0))
        masks = spread_if_better(step_expert_active(problem.steps, layer), masks, R)
        return masks_to_phy2log(masks, R, problem.num_physical // R)
    rng = np.random.default_rng([search.seed, layer])
    steps, weight = with_smoothed_steps(counts > 0, search.smoothing, sample_size(problem) // 2, rng)
    masks = add_replicas(steps, masks, R, room, counts.sum(axis=0), weight,
                         min_copies=spare_floor(E, problem.redundant))
    masks = exchange_masks(steps, weight, masks, R, EXCHANGE_CELLS * problem.effort / DEFAULT_EFFORT)
    return masks_to_phy2log(masks, R, problem.num_physical // R)


def spread_if_better(active: np.ndarray, masks: np.ndarray, ranks: int) -> np.ndarray:
    """``coactive_spread.spread_slots`` of a wide layout's replica sets ``masks`` on the fitted steps ``active [S, E]``
    (bool), kept where it lowers the exact E[optimum] on CHECK_STEPS of them, evenly spaced: where nearly every
    step is at its bound already (Kimi-K2-shaped on 320 ranks) the pair count has nothing left to fix and can
    cost a little held out (BENCHMARKS.md#wide-expert-parallelism)."""
    spread = coactive_spread.spread_slots(active, masks, ranks)
    check = active[np.unique(np.linspace(0, active.shape[0] - 1, min(CHECK_STEPS, active.shape[0])).astype(np.int64))]
    before, after = (float(optimum(check, m, ranks).mean()) if check.size else 0.0 for m in (masks, spread))
    return spread if after < before else masks


def first_copies_and_room(base: np.ndarray, num_experts: int, ranks: int,
                          slots_per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(masks, room [R]): one copy of each expert of ``base [F]`` (where its first slot is), as
    ``ReplicaLayout.masks`` holds them, and each rank's free slots up to ``slots_per_rank``.

    Where the experts do not split over the ranks, the first copies replicate some to fill every rank
    (``first_copy_slots``); those replicas are dropped here, so that the spare search places them with
    the spare slots, for balanced dispatch (placed for SGLang's dynamic rule they go to cold experts).
    """
    rank_of = np.arange(base.size) // (base.size // ranks)
    home = np.full(num_experts, ranks)
    np.minimum.at(home, base, rank_of)
    on = np.zeros((num_experts, ranks), bool)
    on[np.arange(num_experts), home] = True
    return pack_bits(on), slots_per_rank - on.sum(axis=0)


def spare_floor(experts: int, redundant: int) -> np.ndarray:
    """[E] replicas every expert holds at least with ``redundant`` spare slots: 1 + redundant // E, what the
    naive layout gives every expert whichever is hot (one each below E spare slots: no constraint)."""
    return np.full(experts, 1 + redundant // experts)


def masks_to_phy2log(masks: np.ndarray, ranks: int, slots_per_rank: int) -> np.ndarray:
    """phy2log [P]: each rank's experts in id order, from replica masks [E] (each rank holding exactly
    ``slots_per_rank`` experts)."""
    on = mask_bits(masks, ranks)                                        # [E, R]
    if np.any(on.sum(axis=0) != slots_per_rank):
        raise MoeplaceError("replica masks do not fill every rank's slots exactly")
    _, expert = np.nonzero(on.T)                                        # rank-major, experts ascending
    return expert
