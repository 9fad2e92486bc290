"""DeepSeek EPLB in numpy, output-identical to SGLang 0.5.23's `eplb_algorithms.deepseek`.

The algorithm (deepseek-ai/EPLB) places `P` physical expert slots on `G` GPUs in three phases:
replicate the hottest experts until every slot is used, pack the replicas onto GPUs so that GPU
loads are even, and, in hierarchical mode, first pack whole expert groups onto nodes so that
replicas of a group stay inside one node. SGLang runs it with torch on the CPU; this module
reproduces it, tie-breaking included, without torch.

Dimension letters:
    L  MoE layers
    E  logical experts                    P  physical expert slots (replicas), P >= E
    N  nodes                              G  GPUs (ranks), a multiple of N
    X  rows of a batched sub-problem      n  items per row (groups, experts or replicas)
    C  the largest replica count of any expert (width of `log2phy`)

Where torch's result depends on more than the arithmetic:
- `torch.sort` on CPU without `stable=True` is libstdc++'s `std::sort` (introsort), whose order of
  equal keys is unspecified by torch but deterministic. `_sort_descending_like_torch` replays that
  algorithm step by step, so tied loads (zeros, equal integer counts, the equal shares of one
  expert's replicas) land in the same order as SGLang's.
- `torch.max(dim).indices` returns the first maximum, as `np.argmax` does.
- SGLang sums a group's float32 loads with torch's SIMD reduction, whose rounding depends on the
  CPU's vector width. We sum in float64 and round once. The sums are equal whenever they are
  exact in float32 (integer loads below 2**24 per group); otherwise the placement can differ
  only where two group sums tie to within one float32 ulp. The sums matter only in hierarchical
  mode with `num_groups > num_nodes`; the global policy is exact for any float32 loads.
"""

from __future__ import annotations

import numpy as np

from moeplace.errors import MoeplaceError

__all__ = [
    "balanced_packing",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
]

# libstdc++'s `_S_threshold`: introsort leaves ranges this short to the final insertion sort.
_INSERTION_SORT_THRESHOLD = 16


def rebalance_experts(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int | None,
    num_nodes: int,
    num_gpus: int,
    hierarchical: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place `num_replicas` physical expert slots on `num_gpus` GPUs, balancing load.

    Args:
        weight: [L, E] load (tokens routed) of each logical expert; finite and non-negative.
        num_replicas: P, physical expert slots in all; a multiple of `num_gpus`, at least E.
        num_groups: expert groups (DeepSeek's `n_group`); used only when `hierarchical`.
        num_nodes: N, nodes; `num_gpus` must be a multiple of it.
        num_gpus: G, GPUs (EP ranks); slot `p` lives on GPU `p // (P // G)`.
        hierarchical: pack expert groups onto nodes first, then replicate inside each node.

    Returns:
        phy2log: [L, P] int64, the logical expert held by each physical slot.
        log2phy: [L, E, C] int64, the slots holding each logical expert, padded with -1.
        logcnt: [L, E] int64, the number of slots holding each logical expert.

    Raises:
        MoeplaceError: malformed `weight` or an impossible slot/GPU/node/group layout.
    """
    weight32 = _check_inputs(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical)
    if hierarchical:
        assert num_groups is not None
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight32, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        # The global policy is the hierarchical one with a single group on a single node.
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight32, num_replicas, 1, 1, num_gpus
        )
    return phy2log, _logical_to_physical(phy2log, phyrank, logcnt), logcnt


def _check_inputs(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int | None,
    num_nodes: int,
    num_gpus: int,
    hierarchical: bool,
) -> np.ndarray:
    """Validate the problem and return `weight` as a [L, E] float32 array (SGLang's precision)."""
    weight = np.asarray(weight)
    if weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise MoeplaceError(f"expert weight must be a non-empty [layers, experts] array, got shape {weight.shape}")
    if weight.dtype.kind not in "iuf":
        raise MoeplaceError(f"expert weight must be integer or float, got dtype {weight.dtype}")
    weight32 = weight.astype(np.float32)
    if not np.isfinite(weight32).all():
        raise MoeplaceError("expert weight has NaN or infinite entries (or values beyond float32 range)")
    if (weight32 < 0).any():
        raise MoeplaceError("expert weight has negative entries; loads are token counts")

    num_experts = weight.shape[1]
    counts = {"num_replicas": num_replicas, "num_nodes": num_nodes, "num_gpus": num_gpus}
    if hierarchical:
        counts["num_groups"] = num_groups
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise MoeplaceError(f"{name} must be a positive integer, got {value!r}")

    if num_replicas < num_experts:
        raise MoeplaceError(
            f"num_replicas ({num_replicas}) is smaller than the number of experts ({num_experts}): "
            "every expert needs at least one slot"
        )
    if num_replicas % num_gpus:
        raise MoeplaceError(f"num_replicas ({num_replicas}) is not divisible by num_gpus ({num_gpus})")
    if num_gpus % num_nodes:
        raise MoeplaceError(f"num_gpus ({num_gpus}) is not divisible by num_nodes ({num_nodes})")
    if hierarchical:
        if num_experts % num_groups:
            raise MoeplaceError(
                f"the number of experts ({num_experts}) is not divisible by num_groups ({num_groups})"
            )
        if num_groups % num_nodes:
            raise MoeplaceError(
                f"num_groups ({num_groups}) is not divisible by num_nodes ({num_nodes}), "
                "so groups cannot be spread evenly over nodes; use the non-hierarchical policy"
            )
    return weight32


def rebalance_experts_hierarchical(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three phases: groups to nodes, replicas within nodes, replicas to GPUs.

    Experts are renumbered twice on the way. "mlog" (node-major logical) numbers experts so that
    node `k` owns the contiguous block `[k * E/N, (k+1) * E/N)`; "pphy" numbers the slots of a
    node so that GPU `g` owns the block `[g * P/G, (g+1) * P/G)`. Each phase then works on
    contiguous blocks, and one gather maps the result back to logical ids.

    Args:
        weight: [L, E] float32 loads. Input is assumed valid (see `_check_inputs`).

    Returns:
        phy2log: [L, P] logical expert of each slot.
        phyrank: [L, P] which replica of its expert each slot is (0 for the first).
        logcnt: [L, E] replicas per logical expert.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    # Phase 1: pack groups onto nodes, balancing each node's total load.
    tokens_per_group = _group_sums(weight, num_groups)  # [L, num_groups]
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    first_mlog_of_group = (group_pack * groups_per_node + group_rank) * group_size  # [L, num_groups]
    log2mlog = (first_mlog_of_group[:, :, None] + np.arange(group_size)).reshape(num_layers, num_experts)
    mlog2log = _inverse_permutation(log2mlog)

    # Phase 2: replicate within each node; every node gets P/N slots for its E/N experts.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, experts_per_node)  # [L*N, E/N]
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_replicas // num_nodes)

    # Phase 3: pack each node's replicas onto its GPUs; a replica carries an equal share of its expert's load.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    gpu_in_node, rank_on_gpu = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = gpu_in_node * slots_per_gpu + rank_on_gpu
    pphy2phy = _inverse_permutation(phy2pphy)  # [L*N, P/N]

    # Back to whole-layer numbering: node-local mlog ids become global mlog ids, then logical ids.
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(num_layers, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * experts_per_node)[None, :, None]).reshape(num_layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    phyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, axis=1)
    return phy2log, phyrank, logcnt


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedily add replicas to the expert whose per-replica load is highest.

    Each of the `num_phy - n` extra slots goes to the expert with the largest `load / replicas`
    (the first such expert on ties, as `torch.max(dim).indices` does), which minimises the
    largest per-replica load.

    Args:
        weight: [X, n] float32 loads of the n logical experts of each row.
        num_phy: slots per row, at least n.

    Returns:
        phy2log: [X, num_phy] expert of each slot; slots `0..n-1` hold experts `0..n-1`.
        phyrank: [X, num_phy] replica number of each slot within its expert.
        logcnt: [X, n] replicas per expert.
    """
    num_rows, num_log = weight.shape
    rows = np.arange(num_rows)
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (num_rows, 1))
    phyrank = np.zeros((num_rows, num_phy), dtype=np.int64)
    logcnt = np.ones((num_rows, num_log), dtype=np.int64)
    for slot in range(num_log, num_phy):
        # float32 / float32, as torch divides a float32 tensor by an int64 one.
        hottest = np.argmax(weight / logcnt.astype(np.float32), axis=1)
        phy2log[:, slot] = hottest
        phyrank[:, slot] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, phyrank, logcnt


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Split each row's n items into `num_packs` packs of exactly n / num_packs items.

    Greedy longest-processing-time: items in descending weight order each go to the lightest
    pack that still has room (the lowest-numbered one on ties, as Python's `min` picks). The
    rows are independent, so all rows take their k-th item at once.

    Args:
        weight: [X, n] float32 item weights; n is a multiple of `num_packs`.
        num_packs: M, packs per row.

    Returns:
        pack_index: [X, n] pack of each item.
        rank_in_pack: [X, n] position of each item within its pack, in placement order.
    """
    num_rows, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        # SGLang short-cuts this case to the identity rather than running the greedy, whose
        # order would differ; keep the shortcut to keep the output.
        pack_index = np.tile(np.arange(num_items, dtype=np.int64), (num_rows, 1))
        return pack_index, np.zeros((num_rows, num_items), dtype=np.int64)

    order = _sort_descending_like_torch(weight)
    rows = np.arange(num_rows)
    # SGLang accumulates pack loads as Python floats: float64 sums of the float32 item weights.
    pack_load = np.zeros((num_rows, num_packs), dtype=np.float64)
    pack_size = np.zeros((num_rows, num_packs), dtype=np.int64)
    pack_index = np.full((num_rows, num_items), -1, dtype=np.int64)
    rank_in_pack = np.full((num_rows, num_items), -1, dtype=np.int64)
    for step in range(num_items):
        item = order[:, step]
        open_load = np.where(pack_size < items_per_pack, pack_load, np.inf)
        pack = np.argmin(open_load, axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_size[rows, pack]
        pack_load[rows, pack] += weight[rows, item].astype(np.float64)
        pack_size[rows, pack] += 1
    return pack_index, rank_in_pack


def _group_sums(weight: np.ndarray, num_groups: int) -> np.ndarray:
    """[L, E] float32 -> [L, num_groups] float32 total load of each group of consecutive experts.

    Summed in float64 and rounded once: exact whenever torch's float32 sum is, and independent
    of the machine (see the module docstring).
    """
    num_layers, num_experts = weight.shape
    grouped = weight.reshape(num_layers, num_groups, num_experts // num_groups)
    return grouped.sum(axis=-1, dtype=np.float64).astype(np.float32)


def _inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """[X, n] row-wise permutations -> [X, n] their inverses (`inv[x, perm[x, i]] = i`)."""
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inverse


def _logical_to_physical(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """[L, P] slot maps and [L, E] counts -> [L, E, C] slots of each expert by replica number, -1 padded."""
    num_layers, num_slots = phy2log.shape
    num_experts = logcnt.shape[1]
    width = int(logcnt.max())
    log2phy = np.full((num_layers, num_experts * width), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * width + phyrank, np.broadcast_to(np.arange(num_slots), phy2log.shape), axis=1
    )
    return log2phy.reshape(num_layers, num_experts, width)


# --- torch.sort(descending=True) on CPU, tie order included ------------------------------------


def _sort_descending_like_torch(weight: np.ndarray) -> np.ndarray:
    """[X, n] float32 -> [X, n] indices of each row in the order torch's CPU sort returns.

    Torch's default (unstable) CPU sort is `std::sort(..., greater)` from libstdc++. When a row has
    no ties every correct sort agrees, and for n <= 16 libstdc++ only runs its (stable) insertion
    sort, so numpy's stable argsort serves both; other rows replay the introsort.
    """
    order = np.argsort(-weight, axis=1, kind="stable")
    num_items = weight.shape[1]
    if num_items <= _INSERTION_SORT_THRESHOLD:
        return order
    sorted_values = np.take_along_axis(weight, order, axis=1)
    has_ties = (sorted_values[:, 1:] == sorted_values[:, :-1]).any(axis=1)
    for row in np.flatnonzero(has_ties):
        order[row] = _libstdcxx_sort_descending(weight[row].tolist())
    return order


def _libstdcxx_sort_descending(keys: list[float]) -> list[int]:
    """Indices of `keys` in the order `std::sort(first, last, std::greater)` leaves them.

    A transcription of libstdc++'s `__sort`: introsort with median-of-three pivots down to
    ranges of 16, heapsort past a depth of 2*floor(log2 n), then one insertion-sort pass.
    """
    items = list(range(len(keys)))
    if len(items) > 1:
        _introsort_loop(items, keys, 0, len(items), 2 * (len(items).bit_length() - 1))
        _insertion_sort(items, keys, 0, len(items))
    return items


def _introsort_loop(items: list[int], keys: list[float], first: int, last: int, depth_limit: int) -> None:
    while last - first > _INSERTION_SORT_THRESHOLD:
        if depth_limit == 0:
            _heap_sort(items, keys, first, last)
            return
        depth_limit -= 1
        cut = _partition_around_median(items, keys, first, last)
        _introsort_loop(items, keys, cut, last, depth_limit)
        last = cut


def _partition_around_median(items: list[int], keys: list[float], first: int, last: int) -> int:
    """libstdc++'s `__unguarded_partition_pivot`: pivot = median of (first+1, mid, last-1), moved to first."""
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    ka, kb, kc = keys[items[a]], keys[items[b]], keys[items[c]]
    # `comp(x, y)` is `x > y` for a descending sort.
    if ka > kb:
        median = b if kb > kc else (c if ka > kc else a)
    else:
        median = a if ka > kc else (c if kb > kc else b)
    items[first], items[median] = items[median], items[first]

    pivot = keys[items[first]]
    low, high = first + 1, last
    while True:
        while keys[items[low]] > pivot:
            low += 1
        high -= 1
        while pivot > keys[items[high]]:
            high -= 1
        if low >= high:
            return low
        items[low], items[high] = items[high], items[low]
        low += 1


def _insertion_sort(items: list[int], keys: list[float], first: int, last: int) -> None:
    """Stable insertion sort; the same moves as libstdc++'s guarded-then-unguarded final pass."""
    for i in range(first + 1, last):
        item = items[i]
        key = keys[item]
        j = i
        while j > first and key > keys[items[j - 1]]:
            items[j] = items[j - 1]
            j -= 1
        items[j] = item


def _heap_sort(items: list[int], keys: list[float], first: int, last: int) -> None:
    """libstdc++'s `__partial_sort(first, last, last)`: `__make_heap` then `__sort_heap`."""
    length = last - first
    for parent in range((length - 2) // 2, -1, -1):
        _adjust_heap(items, keys, first, parent, length, items[first + parent])
    for end in range(length - 1, 0, -1):
        # `__pop_heap`: the heap top moves to the end, the displaced item sifts down from the top.
        displaced = items[first + end]
        items[first + end] = items[first]
        _adjust_heap(items, keys, first, 0, end, displaced)


def _adjust_heap(items: list[int], keys: list[float], base: int, hole: int, length: int, item: int) -> None:
    """libstdc++'s `__adjust_heap`: sift the hole to a leaf along larger children, then push `item` up."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if keys[items[base + child]] > keys[items[base + child - 1]]:
            child -= 1
        items[base + hole] = items[base + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        items[base + hole] = items[base + child - 1]
        hole = child - 1
    # `__push_heap`
    key = keys[item]
    parent = (hole - 1) // 2
    while hole > top and keys[items[base + parent]] > key:
        items[base + hole] = items[base + parent]
        hole = parent
        parent = (hole - 1) // 2
    items[base + hole] = item
