"""Step-aware placement: minimise the expected per-step maximum rank load, not the average.

Dimension letters: S steps, P physical slots ("items": one per replica), R ranks, E experts.

At low batch a rank's MoE time is set by how many distinct experts it reads in a step, and the step
waits for its slowest rank, so the objective per layer is ``mean_s max_r D[s, r]`` where ``D[s, r]``
counts the slots on rank r that step s activates. Experts that fire together must be spread apart
(anti-affinity). Phases, per layer:

1. replicate: give spare slots to the experts whose extra replica adds the fewest reads (under
   the dynamic rule a replica only sees the token rows sent to it; two replicas hit in one step
   are two reads), or under the static rule to the coldest experts.
2. place greedily: slots by decreasing tokens, each to the rank where it raises the per-step
   maximum least (the share of its steps in which that rank is already a maximum), among the ranks
   light enough to keep token balancedness.
3. improve by swaps: the exact change of the objective for every pair swap at once, in matrix form,
   best swap first, until none helps or the work budget ends. A small quadratic term breaks ties
   on the plateaus of the max, and a floor on token balancedness keeps prefill from regressing.

The objective counts distinct experts; the cost model's token term (b, under 2% of a in the
calibrated files) enters only through that balance floor and the tie-breaks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moeplace.algorithms import PlacementProblem, balanced_replicas
from moeplace.algorithms.baselines import separate_replicas
from moeplace.algorithms.deepseek import rebalance_experts
from moeplace.dispatch.loads import balancedness, static_dispatch_table
from moeplace.parallel import PARALLEL_CELLS, layer_workers, map_layers
from moeplace.trace.steps import RoutingSteps

TIE_BREAK = 2**-10          # weight of sum_r D^2 against the max: only decides between equal maxima; a power of
                            # two keeps the float32 terms exact, so rank_deltas sums what swap_deltas does bit for
                            # bit (with 1e-3 the two orders of summing differed: tests/test_algorithms.py). A
                            # problem may weigh it more (``PlacementProblem.pair_weight``: the online decision)
MIN_GAIN = TIE_BREAK / 2    # a real change of the objective is a whole number plus TIE_BREAK times one
SWAP_GAIN = 1e-4            # a swap's float32 delta must be below -SWAP_GAIN to be tried
MAX_REPAIRS = 64            # swaps allowed to lift token balancedness to the floor
STATIC_REPAIRS = 32         # and in the static rule's second search, from SGLang's table of the first
PAIR_CELLS = 10_000         # one rank pair's numpy calls in swap_deltas (~10 us), in effort cells (~1 ns)
SEARCH_CELLS = 500_000      # the swap search sees at most this many step x slot cells (all steps place)
BALANCED_BASE_EFFORT = 0.05  # share of the work budget for the first copies under balanced dispatch
BALANCED_BASE_MAX_EXPERTS = 128   # above, the first copies under balanced dispatch are DeepSeek EPLB's
# Wide EP (many ranks, few slots each): above this many step x slot x rank cells a layer's greedy packing
# and its swap search see a sample of the steps (``search_rows``, ``is_wide``), and the swap search runs only the rounds
# the work budget pays for, none if one costs more (a round's [S, R, R] table grows with the square of
# the ranks). Kimi-K2-sized layers on 14,000 steps pass it from 16 ranks on (at 16 and 32 ranks under balanced
# dispatch this halved optimize's time for 0.2-0.4% more E[max distinct]: BENCHMARKS.md#wide-expert-parallelism).
WIDE_CELLS = 50_000_000
WIDE_SEARCH_CELLS = 24_000_000   # a wide layer's sampled steps x slots x ranks
DEAR_ROUND_CELLS = 100_000_000   # a swap round dearer than this runs only within the budget (~0.3 s at 128 ranks)


def stepaware(problem: PlacementProblem) -> np.ndarray:
    """phy2log [L, P] minimising E_s[max_r distinct experts] layer by layer.

    Under ``balanced`` dispatch with spare slots, each layer gets its first copies first (one copy of every
    expert, and where the experts do not split over the ranks the replicas that make them: ``first_slots``),
    then ``balanced_replicas`` fills the spare slots. With replicas the first copies matter less, so they
    get a share ``BALANCED_BASE_EFFORT`` of the work budget, and where ``eplb_first_copies`` says so they
    are DeepSeek EPLB's (hierarchical over nodes): on Kimi-K2-shaped routing with E/4 spare slots the two
    end within 0.1% of each other, on GPT-OSS with E/4 stepaware's are 2% better
    (BENCHMARKS.md#with-spare-slots-across-datasets).
    """
    L = problem.model.num_moe_layers
    rng = np.random.default_rng(problem.seed)
    base = problem
    if problem.dispatch == "balanced" and problem.redundant:
        base = replace(problem, redundant=problem.first_slots - problem.model.num_experts, dispatch="dynamic",
                       effort=problem.effort * BALANCED_BASE_EFFORT)
    weight = problem.steps.expert_token_counts()
    ref, _, _ = rebalance_experts(weight, base.num_physical, 1, 1, problem.ranks, False)
    base_is_ref = base is not problem and eplb_first_copies(problem)
    if base_is_ref and problem.nodes > 1 and problem.model.num_experts % problem.nodes == 0:
        # over nodes the first copies are DeepSeek EPLB's hierarchical ones (experts to nodes, then to GPUs)
        ref, _, _ = rebalance_experts(weight, base.num_physical, problem.nodes, problem.nodes, problem.ranks, True)
    if base_is_ref and base.redundant:   # the first copies replicate experts: never twice on a rank
        ref = np.stack([separate_replicas(row, problem.ranks, w) for row, w in zip(ref, weight)])
    search = balanced_replicas.search_steps(problem, rng) if base is not problem else None
    # Each layer's sample of steps for the swap search, drawn in layer order: the same placement
    # whichever worker places which layer.
    no_search = base_is_ref or search_moot(base)
    rows = [None if no_search else search_rows(problem.steps.num_steps, base.num_physical, rng, base.ranks)
            for _ in range(L)]

    def place(layer: int) -> np.ndarray:
        phy2log = ref[layer] if base_is_ref else place_layer(base, layer, ref[layer], rows[layer], base.effort / L)
        return balanced_replicas.place(problem, layer, phy2log, search) if base is not problem else phy2log

    out = np.zeros((L, problem.num_physical), np.int64)
    # a layer with spare slots is a replica search (0.2 s at GPT-OSS-20B's size on 2,000 steps): worth a pool, as
    # in ``robust``; without, the swap search is worth one on a large trace only
    cells = PARALLEL_CELLS if search is not None else problem.steps.num_steps * problem.num_physical * L
    for layer, phy2log in map_layers(place, L, layer_workers(cells)):
        out[layer] = phy2log
        problem.progress(1)
    return out


def eplb_first_copies(problem: PlacementProblem) -> bool:
    """Whether balanced dispatch's first copies (with spare slots) are DeepSeek EPLB's rather than searched: above
    BALANCED_BASE_MAX_EXPERTS, where a swap round costs O(E^2), and above ``balanced_replicas.MAX_SEARCH_RANKS``,
    where the spread of co-active slots after the spare search (``coactive_spread``) moves them anyway (searched
    first copies end no better there: BENCHMARKS.md#wide-expert-parallelism)."""
    return (problem.model.num_experts > BALANCED_BASE_MAX_EXPERTS
            or problem.ranks > balanced_replicas.MAX_SEARCH_RANKS)


def search_rows(num_steps: int, P: int, rng: np.random.Generator, ranks: int = 1) -> np.ndarray:
    """[S'] the steps a layer's swap search sees: all, or SEARCH_CELLS / P of them at random, in order;
    where the layer is wide (``is_wide``), at most WIDE_SEARCH_CELLS / (P * ranks) of them."""
    size = max(SEARCH_CELLS // P, 1)
    if is_wide(num_steps, P, ranks):
        size = max(min(size, WIDE_SEARCH_CELLS // (P * ranks)), 64)
    if num_steps <= size:
        return np.arange(num_steps)
    return np.sort(rng.choice(num_steps, size, replace=False))


def is_wide(num_steps: int, P: int, ranks: int) -> bool:
    """Whether a layer of ``num_steps`` steps, P slots and ``ranks`` ranks is placed on sampled steps
    (WIDE_CELLS)."""
    return num_steps * P * ranks > WIDE_CELLS


def place_layer(problem: PlacementProblem, layer: int, reference: np.ndarray, rows: np.ndarray | None,
                effort: float) -> np.ndarray:
    """phy2log [P] for one layer. reference: [P] DeepSeek EPLB's map, for the token-balance floor;
    rows: the steps the swap search sees (``search_rows``; None where ``search_moot``)."""
    R, E, P = problem.ranks, problem.model.num_experts, problem.num_physical
    replicas = replica_counts(problem.steps, layer, E, problem.redundant, R, problem.dispatch)
    item_expert = np.repeat(np.arange(E), replicas)
    if search_moot(problem):
        return item_expert   # slot p holds item p: replicas of an expert on increasing ranks
    # a wide layer packs and searches on its sampled steps only: the other steps' activity is never read
    wide = is_wide(problem.steps.num_steps, P, R)
    active, item_tokens = item_activity(problem.steps, layer, replicas, problem.dispatch,
                                        rows=rows if wide else None)
    floor = token_floor(problem.balance_floor, reference, item_expert, item_tokens, R)
    search = active if wide else active[rows]
    nodes = problem.nodes
    pairs = pair_weight(problem)
    if nodes == 1:
        refine = problem.dispatch == "static" and replicas.max() > 1
        rank = partition(active, search, item_tokens, item_expert, R, floor, effort / 2 if refine else effort, wide,
                         pairs)
        if refine:
            # Under the static rule the replica that serves a step is the one nearest its source
            # rank, so a slot's steps depend on where the replicas sit: re-derive them from the
            # placement found (SGLang's own table) and search again from there, once and with at most
            # STATIC_REPAIRS repairs (twice, with 64: within 0.2% held out at up to 2.6x the time,
            # BENCHMARKS.md#optimizer-and-cli-speed).
            rounds = max(1, int(effort / 2 / round_cost(rows.size, P, R)))
            order = np.lexsort((item_expert, rank))
            static_item = order[static_dispatch_table(item_expert[order], E, R, 1)]
            search, item_tokens = item_activity(problem.steps, layer, replicas, "static", static_item, rows)
            rank, _ = swap_search(search, item_tokens, item_expert, rank, R, floor, rounds, STATIC_REPAIRS,
                                  pairs=pairs)
    else:
        # Hierarchical: slots to nodes first (a node may hold up to ranks-per-node replicas of an
        # expert, one per rank), then each node's slots to its ranks. Replicas sharing a key go to
        # different nodes; groups of ``nodes`` replicas make at most ranks-per-node groups (an
        # expert has at most R replicas), so no node gets more replicas than it has ranks.
        per_node = R // nodes
        replica_index = np.arange(P) - np.searchsorted(item_expert, item_expert)
        node_key = item_expert * P + replica_index // nodes
        node = partition(active, search, item_tokens, node_key, nodes, floor, effort / 2, wide, pairs)
        rank = np.zeros(P, np.int64)
        for n in range(nodes):
            mine = np.flatnonzero(node == n)
            rank[mine] = n * per_node + partition(active[:, mine], search[:, mine], item_tokens[mine],
                                                  item_expert[mine], per_node, floor,
                                                  effort / (2 * nodes), wide, pairs)
    # Slots on each rank in expert order; the rank's slot range is [r*spr, (r+1)*spr).
    order = np.lexsort((item_expert, rank))
    return item_expert[order]


def pair_weight(problem: PlacementProblem) -> float:
    """The weight of sum_r D^2 in ``problem``'s objective: its ``pair_weight``, else TIE_BREAK."""
    return TIE_BREAK if problem.pair_weight is None else problem.pair_weight


def search_moot(problem: PlacementProblem) -> str | None:
    """Why no placement of the slots on the ranks scores better than another, or None.

    Then ``place_layer`` skips the greedy packing and the swap search: at one slot per rank a swap
    only renames two ranks. Under ``static`` dispatch a rank's replicas decide which source ranks it
    serves, so there it still matters; under balanced dispatch with spare slots their own search
    (``balanced_replicas``) runs whatever this says.
    """
    R, P = problem.ranks, problem.num_physical
    if problem.dispatch == "balanced" and problem.redundant:
        return None
    if R == 1:
        return "one rank holds every expert"
    if P == R and not (problem.dispatch == "static" and problem.redundant):
        return "one expert slot per rank: every assignment of slots to ranks scores the same"
    return None


def partition(active: np.ndarray, search: np.ndarray, item_tokens: np.ndarray, item_expert: np.ndarray,
              R: int, floor: float, effort: float, wide: bool | None = None,
              pairs: float = TIE_BREAK) -> np.ndarray:
    """[P] rank of each item: greedy packing, then swap search on ``search`` (a subset of steps).
    wide: pack and score on ``search`` too, and run only the swap rounds the budget pays for (default:
    ``is_wide`` of these steps, slots and ranks); pairs: the weight of sum_r D^2 (``pair_weight``).

    Starts from the token order, then, if the work budget ``effort`` allows, from the presence order:
    the search ends in different local optima; the better one on all steps is kept. Work is counted
    in step x slot x rank cells, not seconds, so a seed gives the same placement on any machine.
    """
    S, P = active.shape
    wide = is_wide(S, P, R) if wide is None else wide
    fit = search if wide else active      # a wide layer packs and scores on the sampled steps too
    start_cost = fit.shape[0] * P * R
    per_round = round_cost(search.shape[0], P, R)
    presence = fit.sum(axis=0)
    orders = [None, np.argsort(-(presence + 1e-9 * item_tokens), kind="stable")]
    best, best_value = None, np.inf
    for order in orders:
        if best is not None and effort < start_cost + 2 * per_round:
            break
        effort -= start_cost
        start = order_replicas(greedy_place(fit, item_tokens, item_expert, R, P // R, floor, order, pairs),
                               item_expert)
        rounds = int(effort // per_round)
        # one round at least, unless the layer is wide or a round alone is dear (many ranks)
        dear = wide or per_round > DEAR_ROUND_CELLS
        rank, used = swap_search(search, item_tokens, item_expert, start, R, floor,
                                 rounds if dear else max(1, rounds), min(rounds, MAX_REPAIRS) if dear else MAX_REPAIRS,
                                 pairs=pairs)
        effort -= used * per_round
        value = _objective(_loads(fit, rank, R), pairs)
        if value < best_value:
            best, best_value = rank, value
    return best


def round_cost(S: int, P: int, R: int) -> int:
    """Work of one swap round on S steps, in the cells ``effort`` counts: the products over steps,
    the [P, P] deltas, and ``swap_deltas``' loop over rank pairs, whose numpy calls cost about
    PAIR_CELLS cells each (at 16 to 64 ranks on few steps they outweigh the arithmetic, and a
    budget that left them out let a smaller sample take longer)."""
    return S * P * R + 50 * P * P + PAIR_CELLS * (R * (R - 1) // 2)


def order_replicas(rank: np.ndarray, item_expert: np.ndarray) -> np.ndarray:
    """Give an expert's replica items increasing ranks: [P] -> [P].

    Item k of an expert stands for the token rows ``r % n == k``; SGLang's dynamic rule sends those
    rows to the k-th replica by physical id, which is the k-th by rank. Keeping ranks increasing
    along each expert's items makes the search's columns the rows each replica really gets.
    item_expert must be non-decreasing (items grouped by expert).
    """
    return rank[np.lexsort((rank, item_expert))]


def token_floor(balance_floor: float, reference: np.ndarray, item_expert: np.ndarray, item_tokens: np.ndarray,
                ranks: int) -> float:
    """The token balancedness a layer's search keeps: ``balance_floor`` times that of ``reference [P]`` (DeepSeek
    EPLB's map of the steps), its experts' tokens (``item_tokens [P]`` of the items ``item_expert [P]``) split
    evenly over their replicas; at most 1."""
    spr = reference.shape[0] // ranks
    rank_tokens = np.bincount(_ranks_of(reference, spr), weights=_expert_tokens_on(reference, item_expert, item_tokens),
                              minlength=ranks)
    return min(balance_floor * float(balancedness(rank_tokens[None])[0]), 1.0)


def _ranks_of(phy2log: np.ndarray, spr: int) -> np.ndarray:
    return np.arange(phy2log.shape[0]) // spr


def _expert_tokens_on(phy2log: np.ndarray, item_expert: np.ndarray, item_tokens: np.ndarray) -> np.ndarray:
    """Tokens of each slot of ``phy2log`` if an expert's tokens split evenly over its replicas."""
    per_expert = np.bincount(item_expert, weights=item_tokens, minlength=phy2log.max() + 1)
    copies = np.bincount(phy2log, minlength=per_expert.shape[0])
    return per_expert[phy2log] / np.maximum(copies[phy2log], 1)


def replica_counts(steps: RoutingSteps, layer: int, num_experts: int, redundant: int, ranks: int,
                   dispatch: str = "dynamic") -> np.ndarray:
    """[E] replicas per expert.

    At low batch a replica costs as well as helps: a step whose tokens for an expert fall on two
    replicas reads that expert's weights twice. Spare slots go, one at a time, to the expert whose
    second replica adds the fewest reads over the steps (ties: the hotter expert), and an expert
    with n replicas is charged n times that, so slots spread before they pile up.

    Under the ``static`` rule a step sends all its tokens for an expert to the replica nearest its
    source rank: a replica adds no read but pulls the step's load onto that rank, which is what
    per-step balance must avoid, so spare slots go to the experts present in the fewest steps.
    """
    counts = np.ones(num_experts, np.int64)
    if redundant == 0:
        return counts
    if dispatch == "dynamic" and not steps.count_steps.size:   # token rows only: read off the pairs at once
        single_reads, extra_reads = dynamic_reads(steps, layer, num_experts)
    else:
        single_reads = item_activity(steps, layer, counts, dispatch)[0].sum(axis=0)
    if dispatch == "static":
        extra_reads = single_reads
    elif steps.count_steps.size:
        paired, _ = item_activity(steps, layer, np.full(num_experts, 2), dispatch)
        extra_reads = paired.reshape(paired.shape[0], num_experts, 2).sum(axis=(0, 2)) - single_reads
    for _ in range(redundant):
        score = np.where(counts < ranks, extra_reads * counts - 1e-9 * single_reads, np.inf)
        counts[int(np.argmin(score))] += 1
    return counts


def dynamic_reads(steps: RoutingSteps, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps reading each expert [E], reads a second replica adds [E]) under the dynamic rule (row r to
    replica r % 2), from the token-row pairs alone: what ``item_activity`` gives with 1 and 2 replicas."""
    step_of_row, row_in_step, ids = steps.layer(layer)
    S, E = steps.num_steps, num_experts
    hit = np.zeros((2, S, E), bool)                         # [row parity, step, expert]
    valid = ids >= 0
    parity = np.broadcast_to((row_in_step & 1)[:, None], ids.shape)
    hit[parity[valid], np.broadcast_to(step_of_row[:, None], ids.shape)[valid], ids[valid]] = True
    both = hit.sum(axis=1)                                   # [2, E]
    single = (hit[0] | hit[1]).sum(axis=0)
    return single.astype(np.float32), (both.sum(axis=0) - single).astype(np.float32)


def item_activity(steps: RoutingSteps, layer: int, replicas: np.ndarray, dispatch: str,
                  static_item: np.ndarray | None = None,
                  rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Which slots each step reads and the tokens each slot gets: (active [S, P] f32, item_tokens [P]).
    rows: only these steps' rows of ``active`` ([len(rows), P]; item_tokens still over every step).

    Items are replicas in expert order. ``dynamic``: token row r goes to replica ``r % n``;
    ``static``: the step's source rank s sends expert e to item ``static_item[s % R, e]`` when a
    placement is known (SGLang's table), else to replica ``s % n`` (an even split).
    """
    S = steps.num_steps
    P = int(replicas.sum())
    first = np.concatenate([[0], np.cumsum(replicas)[:-1]])
    item_tokens = np.zeros(P)
    step, row, e = steps.layer_pairs(layer)
    if e.size:
        if replicas.max() == 1:
            item = e                  # one replica each: an expert's item is itself, whatever the rule
        else:
            pick = row if dispatch == "dynamic" else steps.ranks[step].astype(np.int64)
            item = (static_item[pick % static_item.shape[0], e] if dispatch == "static" and static_item is not None
                    else first[e] + pick % replicas[e])
        item_tokens += np.bincount(item, minlength=P)
    if rows is not None and not steps.count_steps.size:   # only the rows asked for: a wide layer's sample
        index = np.full(S, -1, np.int64)
        index[rows] = np.arange(len(rows))
        active = np.zeros(len(rows) * P, np.float32)
        if e.size:
            at = index[step]
            keep = at >= 0
            active[at[keep] * P + item[keep]] = 1
        return active.reshape(len(rows), P), item_tokens
    active = np.zeros(S * P, np.float32)
    if e.size:
        active[step * P + item] = 1
    active = active.reshape(S, P)
    if steps.count_steps.size and dispatch == "static" and static_item is not None:
        c = steps.counts[:, layer, :]
        src = steps.ranks[steps.count_steps].astype(np.int64) % static_item.shape[0]
        target = static_item[src]                                          # [S_c, E] item per expert
        np.maximum.at(active, (steps.count_steps[:, None], target), (c > 0).astype(np.float32))
        item_tokens += np.bincount(target.ravel(), weights=c.ravel(), minlength=P)
    elif steps.count_steps.size:
        c = steps.counts[:, layer, :]
        for j in range(int(replicas.max())):
            has = replicas > j
            share = np.floor(c[:, has] / replicas[has]) + (j < np.mod(c[:, has], replicas[has]))
            active[steps.count_steps[:, None], first[has] + j] += share > 0
            item_tokens[first[has] + j] += share.sum(axis=0)
    active = np.minimum(active, 1, out=active)
    return (active if rows is None else active[rows]), item_tokens


def greedy_place(active: np.ndarray, item_tokens: np.ndarray, item_expert: np.ndarray, R: int, spr: int,
                 balance_floor: float = 0.0, order: np.ndarray | None = None, pairs: float = TIE_BREAK) -> np.ndarray:
    """[P] rank of each item: heaviest first, each to the rank where it raises the step maxima least.

    Like DeepSeek's balanced packing, items come in decreasing token order (unless ``order`` says
    otherwise) and only ranks whose
    load is near the lightest open rank's may take the next one; "near" is the slack that token
    balancedness >= balance_floor allows, so a loose floor leaves anti-affinity free to choose.
    """
    S, P = active.shape
    by_item = _transpose_bool(active > 0)
    item_of, step_of = np.nonzero(by_item)                 # every item's steps at once, item-major
    item_steps = np.split(step_of, np.searchsorted(item_of, np.arange(1, P)))
    D = np.zeros((R, S), np.int16)      # rank-major: reductions over ranks run along long rows
    top = np.zeros(S, np.int16)         # [S] max_r D, kept up to date rather than reduced per item
    fill = np.zeros(R, np.int64)
    load = np.zeros(R)
    rank = np.full(P, -1, np.int64)
    holds = np.zeros((R, int(item_expert.max()) + 1), bool)
    slack = (1.0 / balance_floor - 1.0) * item_tokens.sum() / R if balance_floor > 0 else np.inf
    if order is None:
        order = np.argsort(-(item_tokens + 1e-9 * active.sum(axis=0)), kind="stable")
    for i in order:
        steps = item_steps[i]
        Di = D[:, steps]
        score = ((Di == top[steps]).sum(axis=1)
                 + pairs * (2 * Di.sum(axis=1, dtype=np.int64) + steps.size))
        open_ = (fill < spr) & ~holds[:, item_expert[i]]
        if not open_.any():
            # Every rank with a free slot already holds this expert: move some other item k from a
            # rank without it into the free slot, and take k's place.
            r = _make_room(rank, item_expert, holds, fill, spr, i)
            k = int(np.flatnonzero((rank == r) & ~holds[int(np.argmax(fill < spr)), item_expert])[0])
            free = int(np.argmax(fill < spr))
            steps_k = item_steps[k]
            D[r, steps_k] -= 1
            D[free, steps_k] += 1
            top[steps_k] = D[:, steps_k].max(axis=0)
            rank[k], fill[free], fill[r] = free, fill[free] + 1, fill[r] - 1
            load[r] -= item_tokens[k]
            load[free] += item_tokens[k]
            holds[r, item_expert[k]], holds[free, item_expert[k]] = False, True
            open_[:] = False
            open_[r] = True
        score[~open_ | (load > load[open_].min() + slack)] = np.inf
        r = int(np.argmin(score))
        rank[i], fill[r], load[r] = r, fill[r] + 1, load[r] + item_tokens[i]
        holds[r, item_expert[i]] = True
        grown = D[r, steps] + 1
        D[r, steps] = grown
        top[steps] = np.maximum(top[steps], grown)
    return rank


def _transpose_bool(x: np.ndarray) -> np.ndarray:
    """[S, P] -> contiguous [P, S], a block of rows at a time: numpy's transposed copy of the whole
    reads across every row per output row, 3x slower at Kimi-K2's 14,000 x 384."""
    out = np.empty(x.shape[::-1], x.dtype)
    for start in range(0, x.shape[0], 256):
        out[:, start:start + 256] = x[start:start + 256].T
    return out


def _make_room(rank: np.ndarray, item_expert: np.ndarray, holds: np.ndarray, fill: np.ndarray, spr: int,
               i: int) -> int:
    """A rank that does not hold item i's expert and has an item that can move to a free slot."""
    free = int(np.argmax(fill < spr))
    for r in np.flatnonzero(~holds[:, item_expert[i]]):
        if np.any((rank == r) & ~holds[free, item_expert]):
            return int(r)
    raise AssertionError("no rank can make room: replicas exceed ranks")  # replica_counts caps at R


def swap_search(active: np.ndarray, item_tokens: np.ndarray, item_expert: np.ndarray, rank: np.ndarray,
                R: int, balance_floor: float, max_rounds: int,
                max_repairs: int = MAX_REPAIRS, min_swap: float = SWAP_GAIN,
                pairs: float = TIE_BREAK) -> tuple[np.ndarray, int]:
    """Best-improvement pair swaps on the exact objective sum_s max_r D + pairs * sum D^2, each lowering it by
    more than ``min_swap`` (a search that pays for what it moves asks more of a swap: ``refine``).

    While token balancedness is under ``balance_floor`` (greedy packing can leave it there), each
    round instead makes the cheapest swap that unloads the heaviest rank, at most ``max_repairs`` times.
    Returns (rank, rounds used).
    """
    rank = rank.copy()
    X = active
    D = _loads(X, rank, R)
    rounds_done = repairs = 0
    while repairs < max_repairs:
        load = np.bincount(rank, weights=item_tokens, minlength=R)
        if balancedness(load[None])[0] < balance_floor:
            heavy = int(np.argmax(load))
            items, delta = rank_deltas(X, D, rank, item_expert, R, heavy, pairs)
            out = item_tokens[items, None]
            new_heavy = load[heavy] - out + item_tokens[None, :]
            new_other = load[rank][None, :] + out - item_tokens[None, :]
            cost = np.where((new_heavy < load[heavy]) & (new_other < load[heavy]), delta, np.inf)
            k = int(np.argmin(cost))
            if not np.isfinite(cost.flat[k]):
                return rank, rounds_done
            i, j = divmod(k, X.shape[1])
            _swap(D, X, rank, int(items[i]), j)
            repairs += 1
            continue
        if rounds_done >= max_rounds:
            return rank, rounds_done
        rounds_done += 1
        if not _improve(X, D, rank, item_expert, item_tokens, load, R, balance_floor, min_swap, pairs):
            return rank, rounds_done
    return rank, rounds_done


def _loads(X: np.ndarray, rank: np.ndarray, R: int) -> np.ndarray:
    """[S, R] active slots per rank per step."""
    return X @ np.eye(R, dtype=np.float32)[rank]


def swap_deltas(X: np.ndarray, D: np.ndarray, rank: np.ndarray, item_expert: np.ndarray, R: int,
                pairs: float = TIE_BREAK) -> np.ndarray:
    """[P, P] exact change of sum_s max_r D + pairs * sum D^2 if items i and j swap ranks.

    X: [S, P] activity, D: [S, R] loads. inf where a swap is not allowed (``_blocked``).
    """
    S, P = X.shape
    h = move_changes(D, pairs=pairs)
    XH = X.T @ h.reshape(S, R * R)                     # [P, R*R]: sum_s x_si h(s, a, b)
    # Items grouped by rank, so that each rank pair's block of deltas is a slice (then put back in order).
    by_rank = np.argsort(rank, kind="stable")
    start = np.searchsorted(rank[by_rank], np.arange(R + 1))
    Xr = [X[:, by_rank[start[r]:start[r + 1]]] for r in range(R)]
    XHr = XH[by_rank]
    both = h + h.transpose(0, 2, 1)                    # [S, R, R] h_ab + h_ba
    grouped = np.full((P, P), np.inf, np.float32)
    for a in range(R):
        for b in range(a + 1, R):
            I, J = slice(start[a], start[a + 1]), slice(start[b], start[b + 1])
            cross = (Xr[a] * both[:, a, b, None]).T @ Xr[b]   # sum_s x_si x_sj (h_ab + h_ba), symmetric in a, b
            block = XHr[I, a * R + b][:, None] + XHr[J, b * R + a][None, :] - cross
            grouped[I, J] = block
            grouped[J, I] = block.T
    back = np.argsort(by_rank)
    delta = grouped[back][:, back]
    delta[_blocked(rank, item_expert, R, np.arange(P))] = np.inf
    return delta


def rank_deltas(X: np.ndarray, D: np.ndarray, rank: np.ndarray, item_expert: np.ndarray, R: int,
                heavy: int, pairs: float = TIE_BREAK) -> tuple[np.ndarray, np.ndarray]:
    """(items [n], delta [n, P]): ``swap_deltas``' rows of the n items on rank ``heavy`` only, what a repair
    step reads, from 2R columns of ``move_changes`` instead of R^2 (at 64 ranks a sixth of the time)."""
    items = np.flatnonzero(rank == heavy)
    others = np.arange(R)
    h = move_changes(D, np.r_[np.full(R, heavy), others], np.r_[others, np.full(R, heavy)], pairs)   # [S, 2R]
    off, on = h[:, :R], h[:, R:]                       # h(s, heavy, b), h(s, b, heavy)
    Xi = X[:, items]
    delta = (Xi.T @ off)[:, rank] + (X * on[:, rank]).sum(axis=0)[None, :] - Xi.T @ (X * (off + on)[:, rank])
    delta[_blocked(rank, item_expert, R, items)] = np.inf
    return items, delta


def _blocked(rank: np.ndarray, item_expert: np.ndarray, R: int, rows: np.ndarray) -> np.ndarray:
    """[n, P] which swaps of the items ``rows`` with every item are not allowed: the same rank, a rank that
    would hold two replicas of one expert, or an expert's replicas no longer on increasing ranks."""
    holds = np.zeros((R, int(item_expert.max()) + 1), bool)
    holds[rank, item_expert] = True
    blocked = holds[rank[None, :], item_expert[rows, None]]          # i's expert already on j's rank
    blocked |= holds[rank[rows, None], item_expert[None, :]]         # j's expert already on i's rank
    # Replicas keep increasing ranks along their items (see order_replicas): item i may only move
    # to a rank strictly between its expert's neighbouring replicas.
    same_prev = np.r_[False, item_expert[1:] == item_expert[:-1]]
    same_next = np.r_[item_expert[:-1] == item_expert[1:], False]
    lo = np.where(same_prev, np.r_[-1, rank[:-1]], -1)
    hi = np.where(same_next, np.r_[rank[1:], R], R)
    i_fits = (lo[rows, None] < rank[None, :]) & (rank[None, :] < hi[rows, None])     # i onto j's rank
    j_fits = (lo[None, :] < rank[rows, None]) & (rank[rows, None] < hi[None, :])     # j onto i's rank
    return blocked | ~(i_fits & j_fits)


def move_changes(D: np.ndarray, a: np.ndarray | None = None, b: np.ndarray | None = None,
                 pairs: float = TIE_BREAK) -> np.ndarray:
    """h [S, *shape]: change of step s's objective when rank a loses one active slot and rank b gains one
    (0 where a == b), for the rank pairs ``a``, ``b`` broadcast to ``shape`` (default: every pair, [S, R, R]).
    D: [S, R] loads.

    The largest load outside ranks a and b is the first of each step's three largest that sits on
    neither, so every pair is done at once rather than in a loop over R^2 pairs (which at 16 or 32
    ranks cost more than the arithmetic).
    """
    S, R = D.shape
    if (a is None or b is None) and R >= 3:
        return _every_move_change(D, pairs)
    if a is None or b is None:
        a, b = np.arange(R)[:, None], np.arange(R)[None, :]
    a, b = np.broadcast_arrays(np.asarray(a, np.int64), np.asarray(b, np.int64))
    shape, a, b = a.shape, a.ravel(), b.ravel()
    padded = np.pad(D, ((0, 0), (0, max(0, 3 - R))))       # zero loads: no rank outside a, b adds none
    top = np.argsort(-padded, axis=1, kind="stable")[:, :3]                # [S, 3]
    value = np.take_along_axis(padded, top, axis=1)
    others = value[:, 2, None]
    for k in (1, 0):
        outside = (top[:, k, None] != a) & (top[:, k, None] != b)
        others = np.where(outside, value[:, k, None], others)               # [S, pairs]
    new_max = np.maximum(others, np.maximum(D[:, a] - 1, D[:, b] + 1))
    h = new_max - D.max(axis=1)[:, None] + pairs * 2 * (D[:, b] - D[:, a] + 1)
    h[:, a == b] = 0
    return h.reshape((S,) + shape).astype(np.float32, copy=False)


def _every_move_change(D: np.ndarray, pairs: float = TIE_BREAK) -> np.ndarray:
    """``move_changes(D)`` for every rank pair (R >= 3), the same numbers at half the time: the largest load outside
    a and b is the step's largest, except on the row and the column of its rank (the second largest) and at the
    two pairs of its two largest ranks (the third), written in place of a search per pair; a and b broadcast."""
    S, R = D.shape
    top = np.argsort(-D, axis=1, kind="stable")[:, :3]                    # [S, 3]
    value = np.take_along_axis(D, top, axis=1)
    steps = np.arange(S)
    others = np.repeat(value[:, 0], R * R).reshape(S, R, R)
    others[steps, top[:, 0], :] = value[:, 1, None]
    others[steps, :, top[:, 0]] = value[:, 1, None]
    others[steps, top[:, 0], top[:, 1]] = value[:, 2]
    others[steps, top[:, 1], top[:, 0]] = value[:, 2]
    lose, gain = D[:, :, None], D[:, None, :]
    new_max = np.maximum(others, np.maximum(lose - 1, gain + 1))
    h = new_max - D.max(axis=1)[:, None, None] + pairs * 2 * (gain - lose + 1)
    ranks = np.arange(R)
    h[:, ranks, ranks] = 0
    return h.astype(np.float32, copy=False)


def _improve(X: np.ndarray, D: np.ndarray, rank: np.ndarray, item_expert: np.ndarray,
             item_tokens: np.ndarray, load: np.ndarray, R: int, balance_floor: float,
             min_swap: float = SWAP_GAIN, pairs: float = TIE_BREAK) -> bool:
    """One round: apply the best improving swaps on disjoint rank pairs (their effects barely
    interact), keeping the token-balance floor; a batch that turns out worse is cut back to its
    best swap. Returns False when no swap improves the exact objective.

    The deltas are float32 sums over steps, and where every placement scores the same (one slot per
    rank) their rounding alone looks like a gain: so the objective is recomputed after the swaps, and
    a round that did not lower it by MIN_GAIN is undone and ends the search."""
    P = X.shape[1]
    flat = swap_deltas(X, D, rank, item_expert, R, pairs).ravel()
    top = np.argpartition(flat, min(255, flat.size - 1))[:256]
    top = top[np.argsort(flat[top], kind="stable")]
    chosen, used = [], set()
    for k in top:
        if not flat[k] < -min_swap or len(chosen) >= R // 2:
            break
        i, j = divmod(int(k), P)
        a, b = int(rank[i]), int(rank[j])
        if a in used or b in used:
            continue
        new_load = load.copy()
        new_load[a] += item_tokens[j] - item_tokens[i]
        new_load[b] += item_tokens[i] - item_tokens[j]
        if balancedness(new_load[None])[0] < balance_floor:
            continue
        chosen.append((i, j))
        used.update((a, b))
        load = new_load
    if not chosen:
        return False
    before = _objective(D, pairs)
    for i, j in chosen:
        _swap(D, X, rank, i, j)
    if len(chosen) > 1 and _objective(D, pairs) > before + flat[chosen[0][0] * P + chosen[0][1]] / 2:
        for i, j in reversed(chosen[1:]):
            _swap(D, X, rank, i, j)
        chosen = chosen[:1]
    if _objective(D, pairs) > before - MIN_GAIN:
        for i, j in reversed(chosen):
            _swap(D, X, rank, i, j)
        return False
    return True


def _swap(D: np.ndarray, X: np.ndarray, rank: np.ndarray, i: int, j: int) -> None:
    """Exchange the ranks of items i and j, updating the step loads D [S, R] in place."""
    a, b = rank[i], rank[j]
    D[:, a] += X[:, j] - X[:, i]
    D[:, b] += X[:, i] - X[:, j]
    rank[i], rank[j] = b, a


def _objective(D: np.ndarray, pairs: float = TIE_BREAK) -> float:
    return float(D.max(axis=1).sum(dtype=np.float64) + pairs * (D.astype(np.float64) ** 2).sum())
