"""Imbalance metrics: hand-computed cases, a per-token oracle of SGLang's dispatch rules, properties.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical slots, R ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.analysis.metrics import LayerSums, accumulate, gap_closed, summarize
from moeplace.cost.model import CostModel, load_cost_model
from moeplace.dispatch.loads import balancedness, layer_distinct_total, layer_rank_loads, static_dispatch_table
from moeplace.errors import FormatError, MoeplaceError
from moeplace.files.placement import Placement, placement_problems
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps, concat_steps

UNIT_COST = CostModel(a_us_per_expert=1.0, b_us_per_token=0.0, c_us=0.0)


# ----------------------------------------------------------------------------- helpers

def random_placement(rng: np.random.Generator, E: int, R: int, redundant: int, swaps: int = 30) -> np.ndarray:
    """A valid [P] layer map: SGLang's contiguous layout, experts relabelled, then random swaps
    between ranks that keep every rank free of duplicate replicas."""
    P = E + redundant
    spr = P // R
    phy2log = rng.permutation(E)[np.arange(P) % E]
    for _ in range(swaps):
        a, b = rng.integers(P, size=2)
        ra, rb = a // spr, b // spr
        if ra == rb:
            continue
        on_a, on_b = phy2log[ra * spr:(ra + 1) * spr], phy2log[rb * spr:(rb + 1) * spr]
        if phy2log[a] not in on_b and phy2log[b] not in on_a:
            phy2log[a], phy2log[b] = phy2log[b], phy2log[a]
    # Shuffle slots within each rank too: the order of slots decides replica order.
    phy2log = np.concatenate([rng.permutation(phy2log[r * spr:(r + 1) * spr]) for r in range(R)])
    model = ModelSpec.all_moe("m", 1, E, 1)
    assert placement_problems(Placement(model, R, phy2log[None])) == []
    return phy2log


def random_steps(rng: np.random.Generator, model: ModelSpec, n_steps: int, max_rows: int = 6,
                 count_share: float = 0.3, src_ranks: int = 4) -> RoutingSteps:
    """Token-row steps (distinct ids per row, some -1) mixed with integer count steps."""
    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    parts = []
    for _ in range(n_steps):
        rank = int(rng.integers(src_ranks))
        if rng.random() < count_share:
            counts = rng.integers(0, 6, (1, L, E)) * (rng.random((1, L, E)) < 0.5)
            parts.append(RoutingSteps.from_counts(model, counts.astype(float), M.EXTEND, ranks=rank))
        else:
            rows = int(rng.integers(0, max_rows + 1))
            ids = np.argsort(rng.random((rows, L, E)), axis=2)[:, :, :K]
            ids[rng.random(ids.shape) < 0.15] = -1
            parts.append(RoutingSteps.from_topk(model, ids, [rows], M.TARGET_VERIFY, rank))
    return concat_steps(parts)


def naive_loads(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, dispatch: str,
                static_table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loop of SGLang's rules. dynamic: the token in row r of its forward pass takes
    replica r % n of the expert's replicas sorted by physical id; static: the step's source rank
    sends expert e to static_table[rank, e]. A count step's c tokens are rows 0..c-1."""
    P = len(phy2log)
    spr = P // ranks
    replicas = {e: sorted(p for p in range(P) if phy2log[p] == e) for e in range(steps.model.num_experts)}
    S = steps.num_steps
    slots_hit = [[set() for _ in range(ranks)] for _ in range(S)]
    tokens = np.zeros((S, ranks), np.int64)

    def send(s: int, row: int, e: int) -> None:
        if dispatch == "dynamic":
            slot = replicas[e][row % len(replicas[e])]
        else:
            slot = int(static_table[int(steps.ranks[s]) % ranks][e])
        slots_hit[s][slot // spr].add(slot)
        tokens[s, slot // spr] += 1

    for s in range(S):
        for row, t in enumerate(range(steps.token_offsets[s], steps.token_offsets[s + 1])):
            for e in steps.topk_ids[t, layer]:
                if e >= 0:
                    send(s, row, int(e))
    for c, s in enumerate(steps.count_steps):
        for e in range(steps.model.num_experts):
            for row in range(int(steps.counts[c, layer, e])):
                send(int(s), row, e)
    distinct = np.array([[len(x) for x in per_step] for per_step in slots_hit], np.int64).reshape(S, ranks)
    return distinct, tokens


# ----------------------------------------------------------------------------- hand-computed cases

MODEL_4 = ModelSpec("four", 1, (0,), 4, 2)


def _hand_steps() -> RoutingSteps:
    ids = np.array([[[0, 1]], [[0, 2]],   # step 0: experts 0, 1, 2
                    [[2, 3]],             # step 1: experts 2, 3
                    [[1, -1]]])           # step 2: expert 1
    return RoutingSteps.from_topk(MODEL_4, ids, [2, 1, 1], M.TARGET_VERIFY)


def test_hand_case_contiguous_two_ranks():
    steps = _hand_steps()
    phy2log = np.arange(4)  # rank 0: experts 0, 1; rank 1: experts 2, 3
    for dispatch in ("dynamic", "static"):
        distinct, tokens = layer_rank_loads(steps, 0, phy2log, 2, dispatch)
        np.testing.assert_array_equal(distinct, [[2, 1], [0, 2], [1, 0]])
        np.testing.assert_array_equal(tokens, [[3, 1], [0, 2], [1, 0]])
    np.testing.assert_array_equal(layer_distinct_total(steps, 0), [3, 2, 1])

    sums = LayerSums(1, 2)
    placement = Placement(MODEL_4, 2, phy2log[None])
    accumulate(sums, steps, placement, UNIT_COST)
    s = summarize(sums)
    assert s["steps"] == 3
    assert s["e_max_distinct"] == pytest.approx(5 / 3)             # max(2,1), max(0,2), max(1,0)
    assert s["e_mean_distinct"] == pytest.approx(1.0)              # (1.5 + 1 + 0.5) / 3
    assert s["lower_bound"] == pytest.approx((2 + 1 + 1) / 3)      # ceil(3/2), ceil(2/2), ceil(1/2)
    assert s["token_balancedness"] == pytest.approx((3.5 + 1e-5) / (4 + 1e-5))  # tokens [4, 3]
    assert s["moe_us_per_step"] == pytest.approx(5 / 3)            # a = 1 µs per distinct expert
    assert s["moe_us_per_step_if_balanced"] == pytest.approx(1.0)
    np.testing.assert_array_equal(sums.rank_tokens, [[4, 3]])
    np.testing.assert_array_equal(sums.rank_distinct, [[3, 3]])
    np.testing.assert_array_equal(sums.step_max_hist[0, :3], [0, 1, 2])


def test_hand_case_with_replicas():
    # 6 slots on 2 ranks: rank 0 holds experts 0, 1, 2; rank 1 holds 3, 0, 1 (slots 3, 4, 5).
    phy2log = np.array([0, 1, 2, 3, 0, 1])
    ids = np.array([[[0, 1]], [[0, 3]]])  # one step, two rows
    steps = RoutingSteps.from_topk(MODEL_4, ids, [2], M.TARGET_VERIFY, ranks=0)
    # dynamic: row 0 takes replica 0 of each expert (slots 0, 1); row 1 replica 1 of expert 0 (slot 4)
    distinct, tokens = layer_rank_loads(steps, 0, phy2log, 2, "dynamic")
    np.testing.assert_array_equal(distinct, [[2, 2]])
    np.testing.assert_array_equal(tokens, [[2, 2]])
    # static from rank 0: expert 0 stays local (slot 0) for both rows
    distinct, tokens = layer_rank_loads(steps, 0, phy2log, 2, "static")
    np.testing.assert_array_equal(distinct, [[2, 1]])
    np.testing.assert_array_equal(tokens, [[3, 1]])
    # static from rank 1: experts 0 and 1 local on rank 1 (slots 4, 5), expert 3 at slot 3
    steps.ranks[:] = 1
    distinct, tokens = layer_rank_loads(steps, 0, phy2log, 2, "static")
    np.testing.assert_array_equal(distinct, [[0, 3]])
    np.testing.assert_array_equal(tokens, [[0, 4]])
    # A count step: 3 tokens of expert 0 split 2 / 1 over its replicas, 1 token of expert 2.
    counts = RoutingSteps.from_counts(MODEL_4, np.array([[[3.0, 0, 1, 0]]]), M.EXTEND)
    distinct, tokens = layer_rank_loads(counts, 0, phy2log, 2, "dynamic")
    np.testing.assert_array_equal(distinct, [[2, 1]])
    np.testing.assert_array_equal(tokens, [[3, 1]])


def test_balancedness_and_gap_closed():
    np.testing.assert_allclose(balancedness(np.array([[1.0, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]])),
                               [1.0, (1 + 1e-5) / (4 + 1e-5), 1.0])
    assert gap_closed(3.0, 5.0, 1.0) == pytest.approx(0.5)
    assert gap_closed(1.0, 5.0, 1.0) == pytest.approx(1.0)
    assert gap_closed(6.0, 5.0, 1.0) == pytest.approx(-0.25)
    assert gap_closed(2.0, 2.0, 2.0) == 0.0  # no gap to close


def test_unknown_dispatch_and_empty_summary():
    with pytest.raises(MoeplaceError, match="dispatch"):
        layer_rank_loads(_hand_steps(), 0, np.arange(4), 2, "random")
    with pytest.raises(MoeplaceError, match="no steps"):
        summarize(LayerSums(1, 2))


def test_summary_with_layers_and_percentiles():
    """Two layers: the summary averages layers; per-layer lists keep them apart."""
    model = ModelSpec("two", 3, (0, 2), 4, 1)
    ids = np.array([[[0], [0]], [[1], [0]], [[2], [0]], [[3], [0]]])  # layer 2 sends everything to expert 0
    steps = RoutingSteps.from_topk(model, ids, [4], M.TARGET_VERIFY)
    sums = LayerSums(2, 2)
    accumulate(sums, steps, Placement(model, 2, np.tile(np.arange(4), (2, 1))), UNIT_COST)
    s = summarize(sums)
    assert s["per_layer"]["e_max_distinct"] == [2.0, 1.0]
    assert s["per_layer"]["lower_bound"] == [2.0, 1.0]
    assert s["per_layer"]["token_balancedness"] == pytest.approx([1.0, (2 + 1e-5) / (4 + 1e-5)])
    assert s["balancedness_worst"] == pytest.approx((2 + 1e-5) / (4 + 1e-5))
    assert s["moe_us_per_step"] == pytest.approx(3.0)  # both layers add up


# ----------------------------------------------------------------------------- oracle

ORACLE_SHAPES = [
    # (E, K, R, redundant, layers, steps, seed)
    (4, 2, 2, 0, 1, 12, 0),
    (4, 2, 2, 2, 2, 12, 1),
    (8, 2, 4, 8, 2, 20, 2),
    (16, 4, 4, 4, 1, 25, 3),
    (32, 4, 8, 8, 2, 15, 4),
    (12, 3, 3, 6, 1, 30, 5),
    (9, 1, 3, 0, 1, 10, 6),
    (6, 6, 2, 6, 1, 10, 7),  # top_k = E; every expert twice
]


@pytest.mark.parametrize("E,K,R,redundant,layers,n_steps,seed", ORACLE_SHAPES)
@pytest.mark.parametrize("dispatch", ["dynamic", "static"])
def test_layer_rank_loads_matches_per_token_oracle(E, K, R, redundant, layers, n_steps, seed, dispatch):
    rng = np.random.default_rng(seed)
    model = ModelSpec.all_moe("m", layers, E, K)
    steps = random_steps(rng, model, n_steps, src_ranks=R + 1)  # rank ids beyond R wrap
    for layer in range(layers):
        phy2log = random_placement(rng, E, R, redundant)
        table = static_dispatch_table(phy2log, E, R, 1) if dispatch == "static" else None
        want = naive_loads(steps, layer, phy2log, R, dispatch, table)
        got = layer_rank_loads(steps, layer, phy2log, R, dispatch)
        np.testing.assert_array_equal(got[0], want[0], err_msg="distinct")
        np.testing.assert_array_equal(got[1], want[1], err_msg="tokens")


def naive_static_rule(phy2log: np.ndarray, E: int, ranks: int, nodes: int, rank: int, e: int) -> int | None:
    """SGLang 0.5.23's ``_find_nearest_expert``: a replica on the rank (lowest slot), else one on the
    rank's node if that narrows the choice, else None (a fair seeded choice among all replicas)."""
    P = len(phy2log)
    spr, rpn = P // ranks, ranks // nodes
    replicas = [p for p in range(P) if phy2log[p] == e]
    if len(replicas) == 1:
        return replicas[0]
    local = [p for p in replicas if p // spr == rank]
    if local:
        return local[0]
    same_node = [p for p in replicas if p // spr // rpn == rank // rpn]
    if 0 < len(same_node) < len(replicas):
        return same_node[0]
    return None


@pytest.mark.parametrize("E,R,nodes,redundant,seed", [(4, 4, 1, 4, 0), (8, 8, 2, 8, 1), (16, 8, 4, 8, 2),
                                                      (6, 6, 3, 6, 3), (32, 8, 1, 0, 4), (12, 6, 2, 6, 5)])
def test_static_table_follows_sglang_rule(E, R, nodes, redundant, seed):
    rng = np.random.default_rng(seed)
    phy2log = random_placement(rng, E, R, redundant, swaps=60)
    table = static_dispatch_table(phy2log, E, R, nodes, seed=seed)
    assert table.shape == (R, E)
    for e in range(E):
        replicas = np.flatnonzero(phy2log == e)
        fallback = []
        for r in range(R):
            assert phy2log[table[r, e]] == e
            want = naive_static_rule(phy2log, E, R, nodes, r, e)
            if want is None:
                fallback.append(int(table[r, e]))
            else:
                assert table[r, e] == want, (e, r)
        # SGLang's _fair_choices: the remaining ranks are spread evenly over all replicas.
        if fallback:
            per_replica = [fallback.count(int(p)) for p in replicas]
            assert max(per_replica) - min(per_replica) <= 1, (e, per_replica)


def test_static_table_spreads_remote_ranks():
    """4 ranks, expert 0 on ranks 0 and 1: ranks 2 and 3 must not both read the rank-0 copy."""
    phy2log = np.array([0, 1, 0, 2, 3, 1, 2, 3])  # 2 slots per rank
    table = static_dispatch_table(phy2log, 4, 4, 1)
    assert table[0, 0] == 0 and table[1, 0] == 2
    assert sorted(table[2:, 0].tolist()) == [0, 2]


@pytest.mark.parametrize("seed", range(4))
def test_count_steps_equal_token_rows_when_rows_are_prefix_closed(seed):
    """A count step is modelled as rows 0..c-1: token rows built that way give the same loads."""
    rng = np.random.default_rng(seed)
    E, R, redundant = 8, 4, 8
    model = ModelSpec.all_moe("m", 1, E, E)  # top_k = E so a row can hold every expert
    phy2log = random_placement(rng, E, R, redundant)
    for dispatch in ("dynamic", "static"):
        for _ in range(10):
            c = rng.integers(0, 4, E) * (rng.random(E) < 0.6)  # at most 3 tokens per expert
            rows = max(int(c.max()), 0)
            ids = np.full((rows, 1, E), -1)
            for r in range(rows):
                chosen = np.flatnonzero(c > r)
                ids[r, 0, :chosen.size] = rng.permutation(chosen)
            as_rows = RoutingSteps.from_topk(model, ids, [rows], M.TARGET_VERIFY, ranks=1)
            as_counts = RoutingSteps.from_counts(model, c[None, None].astype(float), M.TARGET_VERIFY, ranks=1)
            a = layer_rank_loads(as_rows, 0, phy2log, R, dispatch)
            b = layer_rank_loads(as_counts, 0, phy2log, R, dispatch)
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
            np.testing.assert_array_equal(layer_distinct_total(as_rows, 0), layer_distinct_total(as_counts, 0))


def test_count_steps_equal_token_rows_without_replicas():
    """With one slot per expert the row order cannot matter: any steps, given as counts, load the same."""
    rng = np.random.default_rng(9)
    model = ModelSpec.all_moe("m", 2, 16, 4)
    steps = random_steps(rng, model, 20, count_share=0.0)
    phy2log = random_placement(rng, 16, 4, 0)
    per_step = np.stack([steps.take([s]).expert_token_counts() for s in range(steps.num_steps)])
    as_counts = RoutingSteps.from_counts(model, per_step, M.TARGET_VERIFY, ranks=steps.ranks)
    for layer in range(2):
        for dispatch in ("dynamic", "static"):
            a = layer_rank_loads(steps, layer, phy2log, 4, dispatch)
            b = layer_rank_loads(as_counts, layer, phy2log, 4, dispatch)
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])


# ----------------------------------------------------------------------------- properties

@st.composite
def problems(draw):
    E = draw(st.integers(2, 24))
    K = draw(st.integers(1, min(E, 6)))
    divisors = [r for r in range(1, E + 1) if any((E + x) % r == 0 and (E + x) // r <= E for x in range(0, E + 1))]
    R = draw(st.sampled_from(divisors))
    extra = [x for x in range(0, E + 1) if (E + x) % R == 0 and (E + x) // R <= E]
    redundant = draw(st.sampled_from(extra))
    seed = draw(st.integers(0, 2**32 - 1))
    n_steps = draw(st.integers(1, 12))
    dispatch = draw(st.sampled_from(["dynamic", "static"]))
    return E, K, R, redundant, seed, n_steps, dispatch


@settings(max_examples=60, deadline=None)
@given(problems())
def test_load_invariants(problem):
    E, K, R, redundant, seed, n_steps, dispatch = problem
    rng = np.random.default_rng(seed)
    model = ModelSpec.all_moe("m", 1, E, K)
    steps = random_steps(rng, model, n_steps, src_ranks=R)
    phy2log = random_placement(rng, E, R, redundant, swaps=10)
    distinct, tokens = layer_rank_loads(steps, 0, phy2log, R, dispatch)
    S = steps.num_steps
    assert distinct.shape == tokens.shape == (S, R)
    # Every valid (token, k) pair and every counted token lands on exactly one rank.
    per_step = np.zeros(S, np.int64)
    np.add.at(per_step, np.repeat(np.arange(S), np.diff(steps.token_offsets)),
              (steps.topk_ids[:, 0, :] >= 0).sum(axis=1))
    per_step[steps.count_steps] += steps.counts[:, 0, :].sum(axis=1).astype(np.int64)
    np.testing.assert_array_equal(tokens.sum(axis=1), per_step)
    # A rank reads at most its own slots, and only slots that got a token.
    assert (distinct <= (E + redundant) // R).all() and (distinct <= tokens).all() and (distinct >= 0).all()
    # The slowest rank cannot beat an even split of the distinct experts.
    total = layer_distinct_total(steps, 0)
    assert (distinct.max(axis=1) >= np.ceil(total / R)).all()
    assert (distinct.sum(axis=1) >= total).all()
    # Through the running sums too.
    sums = LayerSums(1, R)
    accumulate(sums, steps, Placement(model, R, phy2log[None]), CostModel(), dispatch)
    s = summarize(sums)
    assert s["e_max_distinct"] >= s["lower_bound"] - 1e-12
    assert 0 < s["token_balancedness"] <= 1 + 1e-12


# ----------------------------------------------------------------------------- cost model

def test_cost_model_formula_and_files(tmp_path):
    cm = CostModel(2.0, 0.5, 1.0)
    np.testing.assert_allclose(cm.cost(np.array([[0, 3]]), np.array([[0, 4]])), [[1.0, 9.0]])
    for f in (Path(__file__).parents[1] / "moeplace" / "cost" / "measured").glob("cost_*.json"):
        m = load_cost_model(f)
        assert m.a_us_per_expert > 0 and all(math.isfinite(v) for v in (m.b_us_per_token, m.c_us))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a_us_per_expert": 10, "b_us_per_token": "0.25", "c_us": 3, "provenance": {"x": 1}}))
    with pytest.raises(MoeplaceError, match="b_us_per_token must be a number"):      # a number as a string is refused
        load_cost_model(path)
    path.write_text(json.dumps({"a_us_per_expert": 10, "b_us_per_token": 0.25, "c_us": 3, "provenance": {"x": 1}}))
    assert load_cost_model(path) == CostModel(10.0, 0.25, 3.0, {"x": 1})


@pytest.mark.parametrize("content,match", [
    (None, "c.json"),
    ("{not json", "not valid JSON"),
    ('{"a_us_per_expert": 1, "c_us": 1}', "b_us_per_token is missing"),
    ('{"a_us_per_expert": "x", "b_us_per_token": 1, "c_us": 1}', "a_us_per_expert must be a number, got 'x'"),
    ('[1, 2, 3]', "must be an object, got a list"),
    ('{"a_us_per_expert": -1, "b_us_per_token": 1, "c_us": 1}', "a_us_per_expert must be at least 0"),
    ('{"a_us_per_expert": NaN, "b_us_per_token": 1, "c_us": 1}', "finite"),
])
def test_bad_cost_model_files(tmp_path, content, match):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(FormatError, match=match) as info:
        load_cost_model(path)
    assert "c.json" in str(info.value)
