"""Every file moeplace reads is checked against its schema: any JSON value in any field of a trace header, a
placement file, SGLang's placement file or a cost-model file is either read or refused as one line naming
the file (a MoeplaceError), never another exception, and a file that is read holds what its schema says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.cost.model import CostModel, load_cost_model
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement, load_placement, placement_to_json
from moeplace.model.spec import MAX_EXPERTS, ModelSpec
from moeplace.trace.store import TraceHeader

MODEL = ModelSpec("toy", 4, (1, 2, 3), 16, 4)
HEADER = TraceHeader(MODEL, "synthetic", id_space="physical", physical_to_logical_map=[list(range(16)) + [0]] * 3,
                     ep_size=4, ranks=[0, 1], attn_dp_size=2, attn_dp_rank=1).to_json()
PLACEMENT = placement_to_json(Placement(MODEL, 4, np.tile(np.arange(16), (3, 1))))
COST = CostModel(20.0, 1.0, 70.0, r_us_per_block=2.0, block_m=16).to_json()

# JSON values of every kind, the odd ones first: huge, negative, fractional, non-finite, wrong types, nesting.
ODD = st.sampled_from([None, True, False, 0, -1, 1.5, 8.0, 10**12, 2**40, -2**63, 1e308, float("inf"),
                       float("nan"), "", "8", "abc", [], [1, 2], [[1]], {}, {"a": 1}])
VALUES = st.one_of(ODD, st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                                                 inner, max_size=3),
                                     max_leaves=6))


def _paths(obj, prefix=()):
    """Every (path of keys/indices) into a JSON object, the object itself included, lists up to 2 deep."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(prefix) < 3:
        for i, v in enumerate(obj[:2]):
            yield from _paths(v, prefix + (i,))


def _replaced(obj, path, value):
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replaced(obj[path[0]], path[1:], value)
    return out


def _check(read, original, data) -> None:
    """Replace one field of ``original`` (or drop it) by a drawn value; ``read`` must succeed or raise MoeplaceError."""
    paths = list(_paths(original))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(VALUES)
    if path and isinstance(original, dict) and data.draw(st.booleans()) and len(path) == 1:
        changed = {k: v for k, v in original.items() if k != path[0]}
    else:
        changed = _replaced(original, path, value)
    try:
        read(changed)
    except MoeplaceError as e:
        assert "\n" not in str(e)


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(data=st.data())
def test_any_trace_header_is_read_or_refused(data) -> None:
    def read(d):
        header = TraceHeader.from_json(d, "h.mptrace")
        assert 1 <= header.model.num_experts <= MAX_EXPERTS and header.ep_size >= 1
        assert all(isinstance(r, int) and r >= 0 for r in header.ranks)
    _check(read, HEADER, data)


@FAST
@given(data=st.data())
def test_any_placement_file_is_read_or_refused(data, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("p") / "p.json"

    def read(d):
        path.write_text(json.dumps(d))
        p = load_placement(path)
        assert p.phy2log.shape[1] % p.ranks == 0 and p.ranks % p.nodes == 0
    _check(read, PLACEMENT, data)


@FAST
@given(data=st.data())
def test_any_sglang_placement_file_is_read_or_refused(data, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("s") / "s.json"

    def read(d):
        path.write_text(json.dumps(d))
        load_placement(path, model=MODEL, ranks=4)
    _check(read, {"physical_to_logical_map": [list(range(16))] * 4}, data)


@FAST
@given(data=st.data())
def test_any_cost_model_file_is_read_or_refused(data, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("c") / "c.json"

    def read(d):
        path.write_text(json.dumps(d))
        c = load_cost_model(path)
        assert all(0 <= v <= 1e6 for v in (c.a_us_per_expert, c.b_us_per_token, c.c_us))
    _check(read, COST, data)


def test_the_error_names_file_field_expectation_and_value(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PLACEMENT, "ranks": 4.0}))
    try:
        load_placement(path)
    except MoeplaceError as e:
        assert str(e) == f"{path}: placement: ranks must be a whole number, got 4.0"
    else:
        raise AssertionError("ranks 4.0 was accepted")
