"""Placements: validity checks with specific messages, derived replica tables, files (ours and SGLang's).

Dimension letters: L MoE layers, E logical experts, P physical slots, R ranks.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from moeplace.errors import FormatError, MoeplaceError, PlacementError
from moeplace.model.spec import ModelSpec
from moeplace.files.placement import (Placement, check_placement, load_placement, placement_problems, replica_table,
                                save_placement, save_sglang, sglang_physical_to_logical)

MODEL = ModelSpec("toy", 5, (1, 2, 4), 8, 2)  # layers 0 and 3 dense


def _valid(rng: np.random.Generator, model: ModelSpec = MODEL, ranks: int = 4, redundant: int = 4) -> Placement:
    """Contiguous layout with experts relabelled per layer and slots shuffled within ranks."""
    E, P = model.num_experts, model.num_experts + redundant
    spr = P // ranks
    rows = []
    for _ in range(model.num_moe_layers):
        row = rng.permutation(E)[np.arange(P) % E]
        rows.append(np.concatenate([rng.permutation(row[r * spr:(r + 1) * spr]) for r in range(ranks)]))
    return Placement(model, ranks, np.stack(rows), algorithm="test", trace="t.mptrace", metrics={"x": 1.5})


# ----------------------------------------------------------------------------- validity

def test_valid_placements_have_no_problems():
    rng = np.random.default_rng(0)
    for ranks, redundant in [(1, 0), (2, 0), (4, 4), (8, 0), (4, 8), (2, 8)]:
        p = _valid(rng, ranks=ranks, redundant=redundant)
        assert placement_problems(p) == []
        check_placement(p)
        assert p.num_physical == 8 + redundant and p.num_redundant == redundant
        assert p.slots_per_rank == (8 + redundant) // ranks
        np.testing.assert_array_equal(p.rank_of_slot(), np.repeat(np.arange(ranks), p.slots_per_rank))


def _broken(change) -> Placement:
    p = _valid(np.random.default_rng(1))  # P = 12, R = 4: 3 slots per rank
    change(p)
    return p


def _set(layer: int, slot: int, value: int):
    def change(p: Placement) -> None:
        p.phy2log[layer, slot] = value
    return change


def _duplicate_on_rank(p: Placement) -> None:
    p.phy2log[1, 1] = p.phy2log[1, 0]  # slots 0 and 1 are both on rank 0


@pytest.mark.parametrize("change,message", [
    (_set(0, 5, 99), "expert ids must lie in [0, 8)"),
    (_set(2, 0, -1), "expert ids must lie in [0, 8)"),
    (lambda p: setattr(p, "phy2log", p.phy2log[:2]), "placement has 2 layers, model 'toy' has 3 MoE layers"),
    (lambda p: setattr(p, "phy2log", p.phy2log[:, :6]), "fewer than the 8 experts"),
    (lambda p: setattr(p, "ranks", 5), "12 slots per layer do not split evenly over 5 ranks"),
    (lambda p: setattr(p, "ranks", 0), "ranks (0) must be a positive multiple of nodes"),
    (lambda p: (setattr(p, "ranks", 4), setattr(p, "nodes", 3)), "ranks (4) must be a positive multiple of nodes (3)"),
    (lambda p: setattr(p, "phy2log", p.phy2log[0]), "must be 2-D"),
    (lambda p: setattr(p, "phy2log", p.phy2log.astype(float)), "must hold integers"),
    (_duplicate_on_rank, "layer 1: rank 0 holds two replicas of expert(s)"),
])
def test_each_problem_has_a_specific_message(change, message):
    p = _broken(change)
    problems = placement_problems(p)
    assert any(message in x for x in problems), problems
    with pytest.raises(PlacementError, match=re.escape(message)):
        check_placement(p)


def test_missing_expert_is_named():
    p = Placement(MODEL, 2, np.tile(np.arange(8), (3, 1)))
    p.phy2log[1] = [0, 1, 2, 4, 5, 6, 2, 7]  # expert 3 gone; 2 on ranks 0 and 1
    problems = placement_problems(p)
    assert problems == ["layer 1: experts 3 have no slot"]


def test_many_problems_are_capped_at_five():
    p = Placement(MODEL, 2, np.zeros((3, 8), np.int64))  # every layer: 7 experts missing, duplicates
    problems = placement_problems(p)
    assert len(problems) == 9  # per layer: missing experts, and each of the 2 ranks duplicates
    with pytest.raises(PlacementError, match=r"\(and 4 more\)"):
        check_placement(p)
    assert "1, 2, 3, 4, 5, ..." in problems[0]


# ----------------------------------------------------------------------------- replica table

def naive_replica_table(phy2log: np.ndarray, E: int) -> tuple[list, np.ndarray]:
    L, P = phy2log.shape
    lists = [[[p for p in range(P) if phy2log[layer, p] == e] for e in range(E)] for layer in range(L)]
    return lists, np.array([[len(x) for x in layer] for layer in lists])


@pytest.mark.parametrize("E,R,redundant,seed", [(8, 4, 4, 0), (8, 2, 0, 1), (16, 8, 16, 2), (6, 3, 12, 3),
                                                 (32, 8, 8, 4)])
def test_replica_table_matches_naive_loop(E, R, redundant, seed):
    model = ModelSpec.all_moe("m", 3, E, 2)
    p = _valid(np.random.default_rng(seed), model, R, redundant)
    log2phy, nrep = replica_table(p.phy2log, E)
    lists, naive_n = naive_replica_table(p.phy2log, E)
    np.testing.assert_array_equal(nrep, naive_n)
    assert log2phy.shape == (3, E, naive_n.max())
    for layer in range(3):
        for e in range(E):
            row = log2phy[layer, e].tolist()
            assert row == lists[layer][e] + [-1] * (log2phy.shape[2] - len(lists[layer][e]))


def test_replica_table_of_an_unused_expert():
    log2phy, nrep = replica_table(np.array([[0, 0, 2]]), 3)
    assert nrep.tolist() == [[2, 0, 1]]
    assert log2phy.tolist() == [[[0, 1], [-1, -1], [2, -1]]]


# ----------------------------------------------------------------------------- files

def test_save_load_round_trip(tmp_path):
    p = _valid(np.random.default_rng(2), ranks=4, redundant=4)
    p.nodes = 2
    path = tmp_path / "sub" / "placement.json"
    save_placement(path, p)
    data = json.loads(path.read_text())
    assert data["format"] == "moeplace-placement" and data["num_physical_experts"] == 12
    q = load_placement(path)
    assert (q.model, q.ranks, q.nodes, q.algorithm, q.trace, q.metrics) == (MODEL, 4, 2, "test", "t.mptrace",
                                                                            {"x": 1.5})
    np.testing.assert_array_equal(q.phy2log, p.phy2log)
    assert q.phy2log.dtype == np.int64
    # With the trace's model and rank count given, it still loads.
    load_placement(path, model=MODEL, ranks=4)
    assert [x.name for x in tmp_path.rglob("*")] == ["sub", "placement.json"]  # no temp files left


def test_save_invalid_placement_writes_nothing(tmp_path):
    p = _broken(_set(0, 0, 99))
    with pytest.raises(PlacementError):
        save_placement(tmp_path / "bad.json", p)
    with pytest.raises(PlacementError):
        save_sglang(tmp_path / "bad_sglang.json", p)
    assert list(tmp_path.iterdir()) == []
    # An existing file is left as it was.
    (tmp_path / "bad.json").write_text("old")
    with pytest.raises(PlacementError):
        save_placement(tmp_path / "bad.json", p)
    assert (tmp_path / "bad.json").read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_sglang_json_round_trip_drops_dense_rows(tmp_path):
    p = _valid(np.random.default_rng(3), ranks=4, redundant=4)
    path = tmp_path / "init_expert_location.json"
    save_sglang(path, p)
    data = json.loads(path.read_text())
    assert list(data) == ["physical_to_logical_map"]  # SGLang splats the dict: one key only
    full = np.array(data["physical_to_logical_map"])
    assert full.shape == (5, 12)
    np.testing.assert_array_equal(full[[1, 2, 4]], p.phy2log)
    np.testing.assert_array_equal(full[[0, 3]], np.tile(np.arange(12) % 8, (2, 1)))
    np.testing.assert_array_equal(sglang_physical_to_logical(p), full)
    q = load_placement(path, model=MODEL, ranks=4, nodes=2)
    np.testing.assert_array_equal(q.phy2log, p.phy2log)
    assert (q.model, q.ranks, q.nodes, q.algorithm) == (MODEL, 4, 2, "sglang-file")


def test_sglang_json_with_moe_rows_only(tmp_path):
    p = _valid(np.random.default_rng(4), ranks=2, redundant=0)
    path = tmp_path / "moe_only.json"
    path.write_text(json.dumps({"physical_to_logical_map": p.phy2log.tolist()}))
    np.testing.assert_array_equal(load_placement(path, model=MODEL, ranks=2).phy2log, p.phy2log)


def test_sglang_pt_file(tmp_path):
    torch = pytest.importorskip("torch")
    p = _valid(np.random.default_rng(5), ranks=4, redundant=4)
    path = tmp_path / "loc.pt"
    torch.save({"physical_to_logical_map": torch.tensor(sglang_physical_to_logical(p), dtype=torch.int32)}, path)
    q = load_placement(path, model=MODEL, ranks=4)
    np.testing.assert_array_equal(q.phy2log, p.phy2log)
    assert isinstance(q.phy2log, np.ndarray)


def test_sglang_file_needs_model_and_ranks(tmp_path):
    path = tmp_path / "s.json"
    save_sglang(path, _valid(np.random.default_rng(6)))
    with pytest.raises(PlacementError, match="s.json: an SGLang placement file needs"):
        load_placement(path)
    with pytest.raises(PlacementError, match="s.json"):
        load_placement(path, model=MODEL, ranks=5)  # 12 slots over 5 ranks
    other = ModelSpec("other", 7, (1, 2, 3, 4, 5, 6), 8, 2)
    with pytest.raises(PlacementError, match="s.json: 5 rows, model 'other' has 7 layers"):
        load_placement(path, model=other, ranks=4)


def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


def _bad_files(tmp_path):
    p = _valid(np.random.default_rng(7))
    good = {"format": "moeplace-placement", "version": 1, "model": MODEL.to_json(), "ranks": 4, "nodes": 1,
            "physical_to_logical_map": p.phy2log.tolist()}
    bad_ids = [row[:] for row in good["physical_to_logical_map"]]
    bad_ids[0][0] = 1.5
    out_of_range = [row[:] for row in good["physical_to_logical_map"]]
    out_of_range[2][3] = 99
    return [
        ("missing.json", None, FormatError, "no such file"),
        ("notjson.json", "{not json", FormatError, "not valid JSON"),
        ("binary.json", b"\x80\x81\xff garbage", FormatError, "not valid JSON"),
        ("list.json", [[0, 1], [2, 3]], FormatError, "no 'physical_to_logical_map'"),
        ("nokey.json", {"format": "moeplace-placement"}, FormatError, "no 'physical_to_logical_map'"),
        ("float.json", {**good, "physical_to_logical_map": bad_ids}, FormatError, "must be a whole number"),
        ("strings.json", {**good, "physical_to_logical_map": [["a", "b"]]}, FormatError, "[0][0] must be a whole number, got 'a'"),
        ("numstring.json", {**good, "physical_to_logical_map": [[0, "17"]]}, FormatError, "[0][1] must be a whole number, got '17'"),
        ("bools.json", {**good, "physical_to_logical_map": [[True, False]]}, FormatError, "[0][0] must be a whole number, got True"),
        ("huge.json", {**good, "physical_to_logical_map": [[0, 1e30]]}, FormatError, "[0][1] must be a whole number, got 1e+30"),
        ("ragged.json", {**good, "physical_to_logical_map": [[0, 1], [2]]}, FormatError, "slots], got 2 rows of 1/2 slots"),
        ("nulls.json", {**good, "physical_to_logical_map": [[0, None]]}, FormatError, "[0][1] must be a whole number, got null"),
        ("onedim.json", {**good, "physical_to_logical_map": list(range(12))}, FormatError, "physical_to_logical_map[0] must be a list, got 0"),
        ("version.json", {**good, "version": 9}, FormatError, "version 9"),
        ("noranks.json", {k: v for k, v in good.items() if k != "ranks"}, FormatError, "ranks is missing"),
        ("badranks.json", {**good, "ranks": "four"}, FormatError, "ranks must be a whole number, got 'four'"),
        ("nomodel.json", {k: v for k, v in good.items() if k != "model"}, FormatError, "model is missing"),
        ("badmodel.json", {**good, "model": {"name": "x"}}, FormatError, "model.num_hidden_layers is missing"),
        ("modeltopk.json", {**good, "model": {**MODEL.to_json(), "top_k": 99}}, FormatError, "top_k 99 is more than num_experts 8"),
        ("modelstr.json", {**good, "model": "toy"}, FormatError, "model must be an object, got 'toy'"),
        ("invalid.json", {**good, "physical_to_logical_map": out_of_range}, FormatError, "expert id 99, outside 0..7"),
        ("sglang_invalid.json", {"physical_to_logical_map": out_of_range}, PlacementError, "must lie in [0, 8)"),
        ("badpt.pt", b"not a torch file", FormatError, "not a readable torch file"),
    ]


def test_bad_placement_files_name_the_path(tmp_path):
    for name, content, error, match in _bad_files(tmp_path):
        path = tmp_path / name
        if content is not None:
            _write(path, content)
        if name.endswith(".pt"):
            pytest.importorskip("torch")
        with pytest.raises(error) as info:
            load_placement(path, model=MODEL, ranks=4)
        assert isinstance(info.value, MoeplaceError)
        assert name in str(info.value) and match in str(info.value), (name, str(info.value))


def test_placement_for_another_model_or_rank_count(tmp_path):
    path = tmp_path / "p.json"
    save_placement(path, _valid(np.random.default_rng(8)))
    wider = ModelSpec("wide", 5, (1, 2, 4), 16, 2)
    with pytest.raises(PlacementError, match="p.json: placement is for 'toy'.*the trace for 'wide'"):
        load_placement(path, model=wider, ranks=4)
    deeper = ModelSpec("deep", 6, (1, 2, 4, 5), 8, 2)
    with pytest.raises(PlacementError, match="4 MoE layers"):
        load_placement(path, model=deeper, ranks=4)
    with pytest.raises(PlacementError, match="p.json: placement is for 4 ranks, not 8"):
        load_placement(path, model=MODEL, ranks=8)
