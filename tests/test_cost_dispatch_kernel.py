"""The rule-by-cost kernels against ``moeplace.dispatch.by_cost.cost_rule_step`` and ``pair_slots``, bit for bit.

The oracle: ``cost_rule_step`` on the valid rows' counts gives each expert's tokens per rank; a valid entry
of expert e takes the rank where its position among e's valid entries (entry order) falls in the cumulative
allocation (``pair_slots``' order), padding rows the lowest replica rank, unknown ids -1. One test checks the
oracle against ``pair_slots`` itself on a placement.

GPU tests (``@pytest.mark.gpu``, skipped without CUDA): both kernels over random layouts, 1 to 32 ranks,
K 1/4/8, up to 576 rows of top-8 (4,608 ids), q from 1 (many moves, up to 32 rounds) to above the step's
pairs (the balanced rule), int64 ids, padding rows, in place, and a CUDA graph replayed with new ids. On the
CPU: the Triton kernel in Triton's interpreter on parametrised and hypothesis cases, and the input checks.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from moeplace.dispatch.balanced import replica_layout  # noqa: E402
from moeplace.dispatch.by_cost import MAX_ROUNDS, RuleWeights, cost_rule_step, pair_slots  # noqa: E402
from moeplace_kernels.balanced_dispatch import TRITON_COST_EXPERTS, cost_dispatch, dispatch_tables  # noqa: E402

from test_balanced_dispatch_kernel import _layout, random_masks, run_in_triton_interpreter, slots_of  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
BACKENDS = ("cuda", "triton")


# ----------------------------------------------------------------------------- cases and the oracle

def expected_cost(ids: np.ndarray, masks: np.ndarray, slots: np.ndarray, num_rows: int, q: int | RuleWeights,
                  max_augment: int | None = 16, max_rounds: int = MAX_ROUNDS) -> np.ndarray:
    """[N, K] slots by ``cost_rule_step`` on the valid rows, a split expert's entries in ``pair_slots``' order."""
    experts, ranks = slots.shape
    known = (ids >= 0) & (ids < experts)
    live = ids[:num_rows][known[:num_rows]]
    alloc = cost_rule_step(np.bincount(live, minlength=experts), masks, ranks, q, max_rounds, max_augment)
    ends = np.cumsum(alloc, axis=1)
    lowest = np.array([(int(m) & -int(m)).bit_length() - 1 for m in masks])
    seen = np.zeros(experts, np.int64)
    out = np.full(ids.shape, -1, np.int64)
    for (row, j), e in np.ndenumerate(ids):
        if not known[row, j]:
            continue
        if row < num_rows:
            out[row, j] = slots[e, int((seen[e] >= ends[e]).sum())]
            seen[e] += 1
        else:
            out[row, j] = slots[e, lowest[e]]
    return out


def skewed_ids(rng: np.random.Generator, rows: int, k: int, experts: int) -> np.ndarray:
    """[N, K] distinct experts per row, drawn with Zipf-like weights (hot experts: moves pay); 3% -1, and
    one id out of range when N*K > 4."""
    weights = 1.0 / np.arange(1, experts + 1) ** 0.8
    weights = rng.permutation(weights / weights.sum())
    k_eff = min(k, experts)
    ids = np.stack([rng.choice(experts, k_eff, replace=False, p=weights) for _ in range(rows)])
    if k_eff < k:
        ids = np.concatenate([ids, np.full((rows, k - k_eff), -1)], axis=1)
    ids = np.where(rng.random(ids.shape) < 0.03, -1, ids)
    if ids.size > 4:
        ids.flat[rng.integers(ids.size)] = experts + 5
    return ids


def make_case(seed: int, experts: int, ranks: int, rows: int, k: int, style: str, q: int | RuleWeights) -> dict:
    """A random layout and skewed ids; q: the rule's weights (an int: reads and pairs only)."""
    rng = np.random.default_rng(seed)
    masks = random_masks(rng, experts, ranks, style)
    return dict(masks=masks, slots=slots_of(rng, masks, ranks), ids=skewed_ids(rng, rows, k, experts),
                num_rows=int(rng.integers(0, rows + 1)) if seed % 3 == 1 else rows, q=q)


def run_case(case: dict, device: str, backend: str, dtype=torch.int32, max_augment: int | None = 16,
             max_rounds: int = MAX_ROUNDS, in_place: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(kernel output, expected) for one case."""
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), device)
    ids = torch.from_numpy(case["ids"]).to(device=device, dtype=dtype)
    nr = torch.tensor(case["num_rows"], dtype=torch.int64, device=device)
    out = cost_dispatch(ids, masks, slots, case["q"], nr, out=ids if in_place else None, max_augment=max_augment,
                        max_rounds=max_rounds, backend=backend)
    assert out.dtype == dtype and out.shape == ids.shape
    return out.cpu().numpy(), expected_cost(case["ids"], case["masks"], case["slots"], case["num_rows"],
                                            case["q"], max_augment, max_rounds)


def moves_made(case: dict, max_rounds: int = MAX_ROUNDS) -> int:
    """Experts whose tokens the rule split or moved off the balanced pick (the case exercises the moves)."""
    experts, ranks = case["slots"].shape
    ids = case["ids"][:case["num_rows"]]
    counts = np.bincount(ids[(ids >= 0) & (ids < experts)], minlength=experts)
    moved = cost_rule_step(counts, case["masks"], ranks, case["q"], max_rounds)
    base = cost_rule_step(counts, case["masks"], ranks, None)
    return int((moved != base).any(axis=1).sum())


# ----------------------------------------------------------------------------- CPU: the oracle itself

def test_oracle_is_pair_slots_on_a_placement():
    """``expected_cost`` gives ``pair_slots``' slots on a placement (8 ranks, 96 spare slots, hot experts)."""
    from moeplace.cost.model import CostModel
    from moeplace.model.spec import ModelSpec
    from moeplace.trace.steps import RoutingSteps

    rng = np.random.default_rng(3)
    E, R, spare = 384, 8, 12
    own = np.array_split(rng.permutation(E), R)
    phy2log = np.concatenate([np.concatenate([o, rng.choice(np.setdiff1d(np.arange(E), o), spare, replace=False)])
                              for o in own])
    layout = replica_layout(phy2log, E, R)
    ids = skewed_ids(rng, 144, 8, E)
    ids[ids >= E] = -1                      # a trace holds no out-of-range id
    model = ModelSpec("one layer", 1, (0,), E, 8)
    steps = RoutingSteps.from_topk(model, ids[:, None, :].astype(np.int16), [144], 0)
    q = 40
    _, slot = pair_slots(steps, 0, phy2log, R, CostModel(float(q), 1.0, 0.0))
    want = expected_cost(ids, layout.masks, layout.slots, 144, q)
    np.testing.assert_array_equal(slot, want[ids >= 0])
    assert moves_made(dict(ids=ids, masks=layout.masks, slots=layout.slots, num_rows=144, q=q)) > 0


# ----------------------------------------------------------------------------- GPU: against the oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 16, 32])
@pytest.mark.parametrize("rows, k", [(1, 8), (9, 8), (72, 8), (144, 4), (576, 8)])
@pytest.mark.parametrize("q", [1, 20, 281, 100000])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_kernel_matches_cost_rule_step(backend, ranks, rows, k, q):
    if backend == "triton" and rows * k > 1200 and ranks not in (8, 32):
        pytest.skip("the Triton fallback at 4,608 ids: two rank counts are enough")
    for i, style in enumerate(("two", "any", "few")):
        case = make_case(7000 * ranks + 10 * rows + k + i + q, 384, ranks, rows, k, style, min(q, 65536))
        got, want = run_case(case, "cuda", backend)
        np.testing.assert_array_equal(got, want, err_msg=f"{style} layout, {case['num_rows']} valid rows")


ROW_BLOCK_WEIGHTS = {   # read / pair / block / block_m: the derived H200 Kimi-shaped models, and small ones
    "kimi-72": RuleWeights(3096, 1, 1724, 64), "kimi-36": RuleWeights(4096, 0, 2510, 16),
    "small": RuleWeights(20, 1, 12, 4), "blocks-only": RuleWeights(30, 0, 25, 2)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 8, 32])
@pytest.mark.parametrize("rows, k", [(9, 8), (36, 8), (144, 4), (576, 8)])
@pytest.mark.parametrize("weights", list(ROW_BLOCK_WEIGHTS))
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_kernel_with_row_blocks_matches_cost_rule_step(backend, ranks, rows, k, weights):
    if backend == "triton" and rows * k > 1200 and ranks != 8:
        pytest.skip("the Triton fallback at 4,608 ids: one rank count is enough")
    for i, style in enumerate(("two", "any", "few")):
        case = make_case(900 * ranks + 10 * rows + k + i, 384, ranks, rows, k, style, ROW_BLOCK_WEIGHTS[weights])
        got, want = run_case(case, "cuda", backend)
        np.testing.assert_array_equal(got, want, err_msg=f"{style} layout, {case['num_rows']} valid rows")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_many_moves_int64_in_place_and_sizes(backend):
    """32 rounds at q = 1, no rounds, no augment cap, int64 ids, in place, E = 4096, 8,192 ids."""
    cases = [(make_case(1, 384, 8, 576, 8, "two", 1), dict(max_rounds=32)),
             (make_case(2, 384, 8, 576, 8, "any", 5), dict(max_rounds=0)),
             (make_case(3, 384, 32, 288, 8, "two", 3), dict(max_augment=None, dtype=torch.int64)),
             (make_case(4, 64, 8, 72, 8, "any", 2), dict(in_place=True)),
             (make_case(5, 4096, 32, 512, 8, "few", 7), dict(dtype=torch.int64)),
             (make_case(6, 384, 8, 1024, 8, "two", 50), {}),
             (make_case(7, 16, 4, 576, 8, "any", 1), dict(max_rounds=32)),   # every expert hot
             (make_case(8, 16, 4, 576, 8, "any", RuleWeights(4, 0, 3, 8)), dict(max_rounds=32))]
    for case, options in cases:
        if backend == "triton" and case["slots"].shape[0] > TRITON_COST_EXPERTS:
            continue   # refused: test_triton_rule_by_cost_refuses_more_experts_than_it_compiles_for
        got, want = run_case(case, "cuda", backend, **options)
        np.testing.assert_array_equal(got, want, err_msg=str(options))
        assert moves_made(case, options.get("max_rounds", MAX_ROUNDS)) > 0 or options.get("max_rounds") == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_graph_replay_with_new_inputs(backend):
    """Captured once, replayed with new ids and row counts in the same buffers: no sync, no allocation."""
    rows, k, q = 144, 8, 30
    case = make_case(21, 384, 8, rows, k, "two", q)
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), "cuda")
    ids = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
    num_rows = torch.tensor(rows, dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)
    cost_dispatch(ids, masks, slots, q, num_rows, out, backend=backend)   # build / compile
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        cost_dispatch(ids, masks, slots, q, num_rows, out, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cost_dispatch(ids, masks, slots, q, num_rows, out, backend=backend)
    for seed in range(5):
        rng = np.random.default_rng(100 + seed)
        new_ids = skewed_ids(rng, rows, k, 384)
        valid = int(rng.integers(rows // 2, rows + 1))
        ids.copy_(torch.from_numpy(new_ids))
        num_rows.fill_(valid)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(),
                                      expected_cost(new_ids, case["masks"], case["slots"], valid, q))


# ----------------------------------------------------------------------------- CPU: input checks

@pytest.mark.parametrize("change, text", [
    (dict(weights=0), "q must be an int from 1 to 65536, got 0"),
    (dict(weights=2.0), "q must be an int"),
    (dict(weights=True), "q must be an int"),
    (dict(max_rounds=33), "max_rounds must be an int from 0 to 32, got 33"),
    (dict(max_rounds=-1), "max_rounds must be an int from 0 to 32"),
    (dict(weights=RuleWeights(5, 2 ** 17)), "pair must be an int from 0 to 65536"),
    (dict(weights=RuleWeights(5, 1, 3, 0)), "block_m must be a power of two from 1 to 8192 where block > 0, got 0"),
    (dict(weights=RuleWeights(5, 1, 3, 24)), "block_m must be a power of two"),
    (dict(topk_ids=torch.zeros(1025, 8, dtype=torch.int32)), "at most 8192 ids"),
])
def test_bad_input_is_one_clear_line(change, text):
    good = dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32), masks=torch.ones(8, dtype=torch.int32),
                slots=torch.zeros(8, 3, dtype=torch.int32), weights=5)
    with pytest.raises(ValueError, match=text) as info:
        cost_dispatch(**{**good, **change})
    assert "\n" not in str(info.value)


def test_triton_rule_by_cost_refuses_more_experts_than_it_compiles_for(monkeypatch):
    """Past 1,023 experts the fallback's rule by cost would compile for many minutes at server start: refused
    in one line (the balanced rule there, and the CUDA kernel, take 4,096)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # CPU tensors reach the backend choice; nothing is launched
    ids, masks, slots = (torch.zeros(4, 2, dtype=torch.int32), torch.ones(1024, dtype=torch.int32),
                         torch.zeros(1024, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="Triton fallback's rule by cost takes at most 1023 experts") as info:
        cost_dispatch(ids, masks, slots, RuleWeights(5, 1), backend="triton")
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- CPU: Triton interpreter

_INTERP_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from hypothesis import given, settings, strategies as st, HealthCheck
    from moeplace.dispatch.by_cost import RuleWeights
    from test_cost_dispatch_kernel import make_case, run_case, moves_made
    moved = 0
    for seed, (E, R, N, K, style, q, dtype, rounds) in enumerate([
            (40, 1, 9, 4, "any", 1, torch.int32, 16), (40, 3, 36, 8, "two", 2, torch.int64, 16),
            (64, 8, 72, 8, "two", 4, torch.int32, 32), (64, 8, 64, 4, "few", 3, torch.int32, 1),
            (96, 32, 72, 8, "two", 1, torch.int32, 16), (96, 8, 36, 8, "any", 1000, torch.int64, 16),
            (16, 4, 144, 8, "any", 1, torch.int32, 32),
            (64, 8, 72, 8, "two", RuleWeights(40, 0, 30, 4), torch.int32, 16),
            (40, 3, 36, 8, "any", RuleWeights(6, 1, 4, 2), torch.int64, 16),
            (16, 4, 144, 8, "any", RuleWeights(9, 1, 5, 8), torch.int32, 32)]):
        case = make_case(seed, E, R, N, K, style, q)
        got, want = run_case(case, "cpu", "triton", dtype, 16, rounds)
        assert np.array_equal(got, want), (seed, got, want)
        moved += moves_made(case, rounds)
    assert moved > 10, moved

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 10**6), experts=st.integers(2, 48), ranks=st.integers(1, 8),
           rows=st.integers(1, 40), k=st.integers(1, 8), q=st.integers(1, 40),
           style=st.sampled_from(["two", "any", "few"]), rounds=st.integers(0, 32),
           blocks=st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(1, 40), st.sampled_from([1, 2, 4, 8]))))
    def agrees(seed, experts, ranks, rows, k, q, style, rounds, blocks):
        weights = q if blocks is None else RuleWeights(q, *blocks)
        got, want = run_case(make_case(seed, experts, ranks, rows, k, style, weights), "cpu", "triton",
                             torch.int32, 16, rounds)
        assert np.array_equal(got, want)

    agrees()
    print("ok")
""")


def test_triton_kernel_in_interpreter():
    """The Triton kernel itself, in Triton's CPU interpreter, against cost_rule_step (fixed and hypothesis cases)."""
    run_in_triton_interpreter(_INTERP_SCRIPT, timeout=900)
