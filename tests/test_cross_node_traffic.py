"""Cross-node token traffic: the evaluation's figures against a per-token reference under every dispatch
rule, properties of the pure functions, and optimize showing them with --nodes (and not without)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.analysis.report import evaluate
from moeplace.cli import cli
from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import fast_rule_step, replica_layout
from moeplace.dispatch.by_cost import cost_rule_step, rule_weights
from moeplace.dispatch.loads import static_dispatch_table
from moeplace.dispatch.traffic import node_of_rank, rank_cross_sends, source_ranks, static_cross_sends
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps, concat_steps
from test_algorithms import tiny_model, tiny_steps
from test_wide_ep import synth_trace


def random_placement(rng: np.random.Generator, layers: int, experts: int, ranks: int, redundant: int) -> np.ndarray:
    """[L, E + redundant]: every expert once, the spare slots on random experts, no rank holding one twice."""
    out = []
    for _ in range(layers):
        while True:
            phy2log = rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, redundant)]))
            per_rank = phy2log.reshape(ranks, -1)
            if all(np.unique(row).size == row.size for row in per_rank):
                out.append(phy2log)
                break
    return np.array(out, np.int64)


def reference_cross_sends(steps: RoutingSteps, phy2log: np.ndarray, ranks: int, nodes: int, rule: str,
                          cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(cross-node sends [L], sends [L]) token by token: each (token row, top-k) pair goes to the replica
    the rule picks, and counts as crossing where that replica's rank is on another node than the step's
    source rank (the step's rank, or rank i % R for step i where the steps name fewer than R ranks)."""
    L, P = phy2log.shape
    E = steps.model.num_experts
    spr, per_node = P // ranks, ranks // nodes
    trace_ranks = [int(r) for r in steps.ranks]
    spread = len(set(trace_ranks)) < ranks
    count_row = {int(s): i for i, s in enumerate(steps.count_steps)}
    cross, sends = np.zeros(L, np.int64), np.zeros(L, np.int64)
    for layer in range(L):
        layer_map = phy2log[layer]
        table = static_dispatch_table(layer_map, E, ranks, nodes)
        masks = replica_layout(layer_map, E, ranks).masks
        for s in range(steps.num_steps):
            source = s % ranks if spread else trace_ranks[s] % ranks
            if s in count_row:
                counts = steps.counts[count_row[s], layer].astype(np.int64)
                # a count step's rows are unknown: c tokens are rows 0..c-1 of the expert
                pairs = [(e, row) for e in range(E) for row in range(counts[e])]
            else:
                rows = steps.topk_ids[steps.token_offsets[s]:steps.token_offsets[s + 1], layer]
                pairs = [(int(e), row) for row, ids in enumerate(rows) for e in ids if e >= 0]
                counts = np.bincount([e for e, _ in pairs], minlength=E)
            received = np.zeros(ranks, np.int64)   # sends each rank receives
            if rule == "balanced":
                pick = fast_rule_step(counts, masks, ranks)
                for e, _ in pairs:
                    received[pick[e]] += 1
            elif rule == "cost":
                received += cost_rule_step(counts, masks, ranks, rule_weights(cost)).sum(axis=0)
            else:
                for e, row in pairs:
                    replicas = np.flatnonzero(layer_map == e)
                    slot = replicas[row % replicas.size] if rule == "dynamic" else table[source, e]
                    received[slot // spr] += 1
            for r in range(ranks):
                sends[layer] += received[r]
                if r // per_node != source // per_node:
                    cross[layer] += received[r]
    return cross, sends


def case_steps(model, ranks: int, seed: int, spread: bool, with_counts: bool) -> RoutingSteps:
    """9-token steps, on one recorded rank (spread: round robin) or on random ranks covering them all;
    with_counts: count steps among them."""
    rng = np.random.default_rng(seed)
    steps = tiny_steps(model, 3 * ranks, ranks, seed=seed)
    steps.ranks = (np.zeros(steps.num_steps) if spread else rng.permutation(steps.num_steps) % ranks).astype(np.int16)
    if not with_counts:
        return steps
    counts = (rng.random((5, model.num_moe_layers, model.num_experts)) < 0.3) * rng.integers(1, 7, (5, model.num_moe_layers, model.num_experts))
    counted = RoutingSteps.from_counts(model, counts.astype(np.float64), 0,
                                       ranks=0 if spread else rng.integers(0, ranks, 5))
    return concat_steps([steps.slice(0, ranks), counted, steps.slice(ranks, steps.num_steps)])


@pytest.mark.parametrize("rule", ["dynamic", "static", "balanced", "cost"])
@pytest.mark.parametrize("ranks, nodes, experts, redundant", [
    (4, 2, 8, 4), (8, 2, 16, 8), (8, 4, 16, 0), (6, 3, 12, 12), (12, 3, 24, 12), (16, 8, 32, 16)])
@pytest.mark.parametrize("spread, with_counts", [(True, False), (False, True)])
def test_evaluation_matches_the_token_by_token_reference(rule, ranks, nodes, experts, redundant, spread, with_counts):
    model = tiny_model(experts, top_k=4)
    seed = ranks * 100 + nodes + redundant
    steps = case_steps(model, ranks, seed, spread, with_counts)
    phy2log = random_placement(np.random.default_rng(seed), model.num_moe_layers, experts, ranks, redundant)
    placement = Placement(model, ranks, phy2log, nodes=nodes)
    got = evaluate({"p": placement}, [steps], CostModel(), rule)[0]
    want_cross, want_sends = reference_cross_sends(steps, phy2log, ranks, nodes, rule, CostModel())
    np.testing.assert_array_equal(got.sums.cross_node_sends, want_cross)
    np.testing.assert_array_equal(got.sums.sends, want_sends)
    s = got.summary
    assert s["cross_node_share"] == pytest.approx(want_cross.sum() / want_sends.sum())
    assert s["cross_node_sends_per_layer"] == pytest.approx(want_cross.sum() / steps.num_steps / model.num_moe_layers)
    assert s["source_ranks"] == ("round robin" if spread else "trace")


def test_chunks_continue_the_round_robin():
    """Steps streamed in chunks come from the same source ranks as in one piece."""
    model = tiny_model(16, top_k=4)
    steps = case_steps(model, 8, 7, spread=True, with_counts=False)
    placement = Placement(model, 8, random_placement(np.random.default_rng(7), 2, 16, 8, 8), nodes=4)
    whole = evaluate({"p": placement}, [steps], CostModel(), "static")[0].sums
    parts = evaluate({"p": placement}, [steps.slice(0, 5), steps.slice(5, steps.num_steps)], CostModel(),
                     "static")[0].sums
    np.testing.assert_array_equal(parts.cross_node_sends, whole.cross_node_sends)
    assert whole.cross_node_sends.sum() > 0


def test_one_node_has_no_cross_node_figures():
    model = tiny_model(16, top_k=4)
    steps = tiny_steps(model, 20, 8, seed=1)
    summary = evaluate({"p": Placement(model, 8, random_placement(np.random.default_rng(1), 2, 16, 8, 8))}, [steps],
                       CostModel(), "dynamic")[0].summary
    assert "cross_node_share" not in summary and "cross_node_share" not in summary["per_layer"]


# ----------------------------------------------------------------------------- properties

@st.composite
def layer_cases(draw):
    nodes = draw(st.sampled_from([1, 2, 3, 4]))
    ranks = nodes * draw(st.integers(1, 4))
    experts = ranks * draw(st.integers(1, 3))
    per_rank = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if experts // ranks + per_rank > experts:   # a rank would hold an expert twice
        per_rank = 0
    phy2log = random_placement(rng, 1, experts, ranks, per_rank * ranks)[0]
    steps = draw(st.integers(1, 12))
    expert_sends = (rng.random((steps, experts)) < 0.4) * rng.integers(1, 9, (steps, experts))
    source = rng.integers(0, ranks, steps)
    return ranks, nodes, phy2log, expert_sends, source


def per_step(count, sends: np.ndarray, source: np.ndarray) -> np.ndarray:
    """[S, 2] (cross, all) of each step alone, by ``count(sends[s:s+1], source[s:s+1])``."""
    return np.array([count(sends[s:s + 1], source[s:s + 1]) for s in range(sends.shape[0])])


def rank_sends_of(expert_sends: np.ndarray, phy2log: np.ndarray, ranks: int) -> np.ndarray:
    """[S, R] sends per rank where every expert's sends go to its first replica."""
    rank_of = (np.arange(phy2log.size) // (phy2log.size // ranks))[np.unique(phy2log, return_index=True)[1]]
    return expert_sends @ np.eye(ranks, dtype=np.int64)[rank_of]


@settings(max_examples=60, deadline=None)
@given(layer_cases())
def test_property_share_bounds_and_one_node(case):
    ranks, nodes, phy2log, expert_sends, source = case
    by_rank = rank_sends_of(expert_sends, phy2log, ranks)
    for n in (nodes, 1):
        static = per_step(lambda x, src: static_cross_sends(x, phy2log, ranks, n, src), expert_sends, source)
        blind = per_step(lambda x, src: rank_cross_sends(x, src, n), by_rank, source)
        for steps in (static, blind):
            np.testing.assert_array_equal(steps[:, 1], expert_sends.sum(axis=1))
            assert np.all((0 <= steps[:, 0]) & (steps[:, 0] <= steps[:, 1]))
            if n == 1:
                assert not steps[:, 0].any()
        assert static_cross_sends(expert_sends, phy2log, ranks, n, source) == tuple(static.sum(axis=0))
        assert rank_cross_sends(by_rank, source, n) == tuple(blind.sum(axis=0))


@settings(max_examples=40, deadline=None)
@given(layer_cases())
def test_property_static_replicas_on_more_nodes_keep_more_inside(case):
    """Under static, a replica of every expert on every node: no send leaves its node; a spare replica
    added to every rank never adds a cross-node send."""
    ranks, nodes, phy2log, expert_sends, source = case
    E = expert_sends.shape[1]
    per_node = ranks // nodes
    if E % per_node == 0:
        everywhere = np.tile(np.arange(E).reshape(per_node, -1), (nodes, 1)).ravel()   # each node holds all E
        assert static_cross_sends(expert_sends, everywhere, ranks, nodes, source) == (0, expert_sends.sum())
    by_rank = phy2log.reshape(ranks, -1)
    if by_rank.shape[1] < E:
        rng = np.random.default_rng(int(expert_sends.sum()))
        spare = [rng.choice(np.setdiff1d(np.arange(E), row)) for row in by_rank]
        more = np.column_stack([by_rank, spare]).ravel()                                # each rank: one more
        count = lambda placed: per_step(lambda x, src: static_cross_sends(x, placed, ranks, nodes, src),
                                        expert_sends, source)[:, 0]
        assert np.all(count(more) <= count(phy2log))


@settings(max_examples=40, deadline=None)
@given(layer_cases(), st.integers(0, 1000))
def test_property_static_closed_form_is_the_table_at_any_seed(case, seed):
    """The static rule's crossing sends do not depend on the seed of SGLang's fair choice."""
    ranks, nodes, phy2log, expert_sends, source = case
    table = static_dispatch_table(phy2log, expert_sends.shape[1], ranks, nodes, seed)         # [R, E]
    node = node_of_rank(ranks, nodes)
    spr = phy2log.size // ranks
    remote = node[table[source] // spr] != node[source][:, None]                          # [S, E]
    cross = per_step(lambda x, src: static_cross_sends(x, phy2log, ranks, nodes, src), expert_sends, source)[:, 0]
    np.testing.assert_array_equal(cross, (expert_sends * remote).sum(axis=1))


def test_single_copy_static_and_by_rank_agree():
    """With one replica per expert the static rule and the source-blind count are the same."""
    rng = np.random.default_rng(0)
    phy2log = rng.permutation(24)
    expert_sends = rng.integers(0, 4, (30, 24))
    source = rng.integers(0, 8, 30)
    static = per_step(lambda x, src: static_cross_sends(x, phy2log, 8, 4, src), expert_sends, source)
    blind = per_step(lambda x, src: rank_cross_sends(x, src, 4), rank_sends_of(expert_sends, phy2log, 8), source)
    np.testing.assert_array_equal(static, blind)
    assert 0 < static[:, 0].sum() < static[:, 1].sum()


def test_source_ranks_spread_round_robin_only_when_the_steps_name_too_few():
    own, spread = source_ranks(np.array([3, 1, 0, 2, 1]), 4)
    assert not spread and own.tolist() == [3, 1, 0, 2, 1]
    rr, spread = source_ranks(np.zeros(5, np.int16), 4, first=2)
    assert spread and rr.tolist() == [2, 3, 0, 1, 2]
    with pytest.raises(Exception, match="do not split"):
        node_of_rank(6, 4)


# ----------------------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_trace(tmp_path_factory.mktemp("xnode"), "gpt-oss-20b", 120)


def test_optimize_shows_cross_node_traffic_with_nodes(trace, tmp_path):
    base = ["optimize", str(trace), "--ranks", "8", "--holdout", "0.5", "-o", str(tmp_path / "p.json"),
            "--redundant", "8", "--dispatch", "balanced"]
    runner = CliRunner()
    text = runner.invoke(cli, [*base, "--nodes", "2"])
    assert text.exit_code == 0, text.output
    assert "cross-node" in text.stdout and "note: the steps name fewer source ranks" in text.stdout
    for dispatch in ("balanced", "static"):
        rows = json.loads(runner.invoke(cli, [*base, "--nodes", "2", "--json", "--dispatch", dispatch]).stdout)["rows"]
        assert len(rows) >= 3 and all(0 < r["cross_node_share"] <= 1 and r["nodes"] == 2
                                      and r["source_ranks"] == "round robin" for r in rows)
    flat = runner.invoke(cli, [*base, "--json"])
    assert flat.exit_code == 0 and not any("cross_node_share" in r for r in json.loads(flat.stdout)["rows"])
    flat = runner.invoke(cli, base)
    assert flat.exit_code == 0 and "cross-node" not in flat.stdout and "source ranks" not in flat.stdout
