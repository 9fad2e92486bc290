"""Balanced dispatch and the rule by cost wired into SGLang 0.5.23 (CPU): the AROUND hook on
topk_ids_logical_to_physical, driven with SGLang's real ExpertLocationDispatchInfo built from our placement file
by SGLang's start-up code."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.algorithms import PlacementProblem, solve
from moeplace.dispatch.balanced import fast_rule_step, replica_layout
from moeplace.files.placement import Placement, save_sglang
from moeplace.model.config import model_spec_from_folder
from moeplace.trace.synthetic import synthetic_steps
from test_plugin import assert_load_plugins
from test_sglang_export import TINY_DSV3, publish

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.eplb.expert_location_dispatch")
pytestmark = pytest.mark.sglang

RANKS, REDUNDANT = 4, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """SGLang's context and expert-location metadata for a tiny DeepSeek-V3 on 4 EP ranks, from a placement
    fitted for balanced dispatch; restored afterwards."""
    pytest.importorskip("sglang.srt.models.deepseek_v2", reason="SGLang's DeepSeek model class does not import")
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el

    folder = tmp_path_factory.mktemp("tiny-dsv3")
    (folder / "config.json").write_text(json.dumps(TINY_DSV3))
    spec = model_spec_from_folder(folder)
    _, steps = synthetic_steps(400, 9, spec, seed=3)
    phy2log = solve("stepaware", PlacementProblem(spec, steps, RANKS, redundant=REDUNDANT, dispatch="balanced"))
    placement = Placement(spec, RANKS, phy2log)
    path = folder / "init_expert_location.json"
    save_sglang(path, placement)

    state = rc.snapshot_context()
    saved_meta = el.get_global_expert_location_metadata()
    publish(folder, rc, RANKS, REDUNDANT, init=str(path))
    rc.get_context().override("moeplace-test", moe_a2a_backend="none", ep_dispatch_algorithm="dynamic")
    meta = el.compute_initial_expert_location_metadata(ModelConfig.from_server_args(rc.get_server_args()),
                                                       moe_ep_rank=0)
    el.set_global_expert_location_metadata(meta, allow_overwrite=True)
    yield placement, rc
    el.set_global_expert_location_metadata(saved_meta, allow_overwrite=True)
    # publish stamped this module's ranks into the parallel context's own dict, which the snapshot
    # holds by reference: clear it, or the next module's publish meets a 4-rank topology
    rc.get_parallel().clear_stamp()
    rc.restore_context(state)


@pytest.fixture
def hooked(server):
    """Our hook (balanced rule) applied by SGLang's HookRegistry; SGLang's function put back afterwards."""
    yield from _hooked(server, "balanced")


@pytest.fixture
def hooked_cost(server):
    """The same hook running the rule by cost with q = 3 (moves pay from 3 pairs a batch)."""
    yield from _hooked(server, "cost", q=3)


def _hooked(server, rule: str, q: int | None = None):
    from sglang.srt.eplb import expert_location_dispatch as eld
    from sglang.srt.layers.moe import topk
    from sglang.srt.plugins.hook_registry import HookRegistry, _propagate_patch

    from moeplace.sglang import balanced_dispatch as bd

    from sglang.srt.eplb import expert_location as el

    original = eld.topk_ids_logical_to_physical
    original_placement = el.compute_initial_expert_location_metadata
    HookRegistry.reset()
    weights = None if q is None else bd.RuleWeights(q)
    state = bd.install(bd.DispatchConfig(rule, max_tokens=16 if rule == "balanced" else 64, q=weights))
    HookRegistry.apply_hooks()
    yield state, topk, original
    for module, name, fn in ((eld, "topk_ids_logical_to_physical", original),
                             (el, "compute_initial_expert_location_metadata", original_placement)):
        wrapped = getattr(module, name)
        setattr(module, name, fn)
        _propagate_patch(wrapped, fn, module)
    bd._DISPATCH = None
    HookRegistry.reset()


def expected(placement: Placement, moe_index: int, ids: np.ndarray) -> np.ndarray:
    """What the rule must give: moeplace.dispatch.balanced on the placement we wrote."""
    layout = replica_layout(placement.phy2log[moe_index], placement.model.num_experts, RANKS)
    counts = np.bincount(ids[ids >= 0], minlength=placement.model.num_experts)
    pick = fast_rule_step(counts, layout.masks, RANKS)
    return np.where(ids >= 0, layout.slots[np.maximum(ids, 0), pick[np.maximum(ids, 0)]], -1)


@pytest.mark.parametrize("rows", [1, 9, 16])
def test_router_ids_become_the_rules_slots(hooked, server, rows):
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    state, topk, _ = hooked
    placement, _ = server
    rng = np.random.default_rng(rows)
    for moe_index, layer_id in enumerate(placement.model.moe_layers):
        info = ExpertLocationDispatchInfo.init_new(layer_id)
        assert info.rank_invariant and info.ep_dispatch_algorithm == "dynamic"
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(rows)]).astype(np.int32)
        if rows > 1:
            ids[0, 1] = -1
        out = topk.topk_ids_logical_to_physical(torch.from_numpy(ids), info)     # the name topk.py calls
        assert out.dtype == torch.int32
        np.testing.assert_array_equal(out.numpy(), expected(placement, moe_index, ids))


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_router_ids_become_the_cost_rules_slots(hooked_cost, server, rows):
    """MOEPLACE_DISPATCH=cost on SGLang's real dispatch info: the slots of cost_rule_step, split experts' entries
    in entry order (the kernels' oracle), padding rows past num_rows on the lowest replica rank."""
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo
    from test_cost_dispatch_kernel import expected_cost

    from moeplace.sglang import balanced_dispatch as bd

    state, topk, _ = hooked_cost
    placement, _ = server
    rng = np.random.default_rng(rows)
    moved = 0
    for moe_index, layer_id in enumerate(placement.model.moe_layers):
        info = ExpertLocationDispatchInfo.init_new(layer_id)
        layout = replica_layout(placement.phy2log[moe_index], placement.model.num_experts, RANKS)
        multi = np.flatnonzero([bin(int(m)).count("1") > 1 for m in layout.masks])
        hot = np.concatenate([multi, rng.permutation(np.setdiff1d(np.arange(16), multi))])[:6]   # moves pay
        ids = np.stack([rng.choice(hot, 4, replace=False) for _ in range(rows)]).astype(np.int32)
        out = topk.topk_ids_logical_to_physical(torch.from_numpy(ids), info)
        assert out.dtype == torch.int32
        want = expected_cost(ids.astype(np.int64), layout.masks, layout.slots, rows, 3)
        np.testing.assert_array_equal(out.numpy(), want)
        balanced = expected(placement, moe_index, ids)
        moved += int((want != balanced).sum())
        layer = state.layers[info.partial_logical_to_all_physical_map.data_ptr()]
        valid = max(rows // 2, 1)
        padded = bd.dispatch_on_host(torch.from_numpy(ids), layer, valid, 3).numpy()
        np.testing.assert_array_equal(padded, expected_cost(ids.astype(np.int64), layout.masks, layout.slots,
                                                            valid, 3))
    if rows == 64:
        assert moved > 0, "the rule by cost made no move on any layer"


def test_tables_derived_from_sglangs_map_match_ours(hooked, server):
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    from moeplace.sglang.balanced_dispatch import _Layer

    placement, _ = server
    for moe_index, layer_id in enumerate(placement.model.moe_layers):
        layer = _Layer(ExpertLocationDispatchInfo.init_new(layer_id), RANKS, 16)
        ours = replica_layout(placement.phy2log[moe_index], placement.model.num_experts, RANKS)
        np.testing.assert_array_equal(layer.masks.numpy(), ours.masks)
        np.testing.assert_array_equal(layer.slots.numpy(), ours.slots)


def test_large_batches_and_missing_info_keep_sglangs_rule(hooked, server):
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    _, topk, original = hooked
    placement, _ = server
    info = ExpertLocationDispatchInfo.init_new(placement.model.moe_layers[0])
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 16, (17, 4)).astype(np.int32))  # > 16 rows
    assert torch.equal(topk.topk_ids_logical_to_physical(ids, info), original(ids, info))
    assert topk.topk_ids_logical_to_physical(ids, None) is ids


def test_output_buffers_alternate_and_are_reused(hooked, server):
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    state, topk, _ = hooked
    placement, _ = server
    info = ExpertLocationDispatchInfo.init_new(placement.model.moe_layers[0])
    ids = torch.zeros((3, 4), dtype=torch.int32)
    topk.topk_ids_logical_to_physical(ids, info)
    layer = state.layers[info.partial_logical_to_all_physical_map.data_ptr()]
    a, b = (layer.out_for(ids).data_ptr() for _ in range(2))
    assert a != b and layer.out_for(ids).data_ptr() == a


def test_tables_follow_a_re_placement_in_place(hooked, server):
    """After SGLang's metadata update writes a new map in place (what its updater does on a re-placement),
    ``refresh`` re-derives every cached layer's tables into the same tensors (CUDA graphs read their addresses)
    and the rule picks the new map's slots."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    from moeplace.files.placement import sglang_physical_to_logical
    from moeplace.sglang import balanced_dispatch as bd

    state, topk, _ = hooked
    placement, rc = server
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(9)]).astype(np.int32)
    infos = [ExpertLocationDispatchInfo.init_new(layer_id) for layer_id in placement.model.moe_layers]
    for info in infos:
        topk.topk_ids_logical_to_physical(torch.from_numpy(ids), info)      # tables cached
    addresses = {key: (layer.slots.data_ptr(), layer.masks.data_ptr()) for key, layer in state.layers.items()}
    meta = el.get_global_expert_location_metadata()
    moved = Placement(placement.model, RANKS, np.roll(placement.phy2log, RANKS // 2 * 5, axis=1))   # ranks renamed
    old_map = meta.physical_to_logical_map_cpu.clone()
    config = ModelConfig.from_server_args(rc.get_server_args())
    layers = list(range(placement.model.num_hidden_layers))
    try:
        meta.update(el.ExpertLocationMetadata.init_by_mapping(
            config, torch.from_numpy(sglang_physical_to_logical(moved)), moe_ep_rank=0), update_layer_ids=layers)
        bd.refresh()
        assert {key: (layer.slots.data_ptr(), layer.masks.data_ptr()) for key, layer in state.layers.items()} == addresses
        for moe_index, info in enumerate(infos):
            out = topk.topk_ids_logical_to_physical(torch.from_numpy(ids), info)
            np.testing.assert_array_equal(out.numpy(), expected(moved, moe_index, ids))
    finally:
        meta.update(el.ExpertLocationMetadata.init_by_mapping(config, old_map, moe_ep_rank=0), update_layer_ids=layers)
        bd.refresh()


def test_dp_attention_is_refused_with_one_line(hooked, server):
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    state, topk, _ = hooked
    placement, rc = server
    info = ExpertLocationDispatchInfo.init_new(placement.model.moe_layers[0])
    info.rank_invariant = False                                           # an all-to-all backend ...
    # (stamped, not the scoped override: SGLang's snapshot holds the scoped dict by reference, and the
    # fixture clears the stamps)
    rc.get_parallel().override_permanently(attn_dp_size=2, attn_tp_size=2)   # ... with DP attention
    with pytest.raises(SystemExit, match="DP attention"):
        topk.topk_ids_logical_to_physical(torch.zeros((2, 4), dtype=torch.int32), info)
    assert not state.checked
    rc.get_parallel().override_permanently(attn_dp_size=1, attn_tp_size=RANKS)
    topk.topk_ids_logical_to_physical(torch.zeros((2, 4), dtype=torch.int32), info)   # DeepEP, TP attention
    assert state.checked


def test_a_server_with_nothing_to_choose_stops_at_start(hooked, server, capsys):
    """SGLang's own start-up placement code, hooked: spares pass; EP 1 or no second replica stop the
    server with one line (SGLang would never call the remap there: the rule would be silently off)."""
    import dataclasses

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el

    from moeplace.sglang import balanced_dispatch as bd

    placement, rc = server
    meta = el.compute_initial_expert_location_metadata(ModelConfig.from_server_args(rc.get_server_args()),
                                                       moe_ep_rank=0)   # through the hook: no stop
    assert meta.ep_size == RANKS and bd.nothing_to_choose(meta) is None
    single = dataclasses.replace(meta, logical_to_all_physical_map_num_valid=torch.ones_like(
        meta.logical_to_all_physical_map_num_valid))
    for metadata, words in ((dataclasses.replace(meta, ep_size=1), "expert parallelism of size 1"),
                            (single, "no expert has a second replica")):
        with pytest.raises(SystemExit) as stop:
            bd.check_placement(metadata)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and words in err[0] and "MOEPLACE_DISPATCH" in err[0]


@pytest.mark.parametrize("env, message", [
    ({"MOEPLACE_DISPATCH": "fastest"}, "MOEPLACE_DISPATCH='fastest': takes balanced or cost"),
    ({"MOEPLACE_DISPATCH": "cost"}, "MOEPLACE_DISPATCH=cost needs MOEPLACE_DISPATCH_Q"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "0"}, "an integer from 1 to 65536"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "4.5"}, "got '4.5'"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "70000"}, "an integer from 1 to 65536"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "281", "MOEPLACE_DISPATCH_WEIGHTS": "281,1,0,0"},
     "set one of MOEPLACE_DISPATCH_Q and MOEPLACE_DISPATCH_WEIGHTS, not both"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "281,1,150"}, "must be read,pair,block,block_m"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "281,1,150,0"}, "got '281,1,150,0'"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "281,1,150,24"}, "block_m a power of two"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "0,1,0,0"}, "read from 1"),
    ({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "lots"}, "must be a positive integer"),
    ({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "0"}, "must be a positive integer"),
])
def test_bad_settings_stop_the_plugin_with_one_line(monkeypatch, capsys, env, message):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from moeplace.sglang.plugin import register

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    HookRegistry.reset()
    with pytest.raises(SystemExit) as stop:
        register()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeplace: ") and message in err[0]
    assert not HookRegistry._hooks.get("sglang.srt.eplb.expert_location_dispatch.topk_ids_logical_to_physical")


def test_plugin_registers_the_hook_through_sglang():
    assert_load_plugins({"MOEPLACE_DISPATCH": "balanced"},
                        "from moeplace.sglang import balanced_dispatch as bd\n"
                        "assert bd._DISPATCH is not None and bd._DISPATCH.config.max_tokens == 64\n"
                        "assert bd.TARGET in HookRegistry._patched, sorted(HookRegistry._patched)\n"
                        "assert bd.PLACEMENT in HookRegistry._patched\n"
                        "import sglang.srt.layers.moe.topk as topk\n"
                        "assert topk.topk_ids_logical_to_physical.__wrapped__ is not None\n")


def test_plugin_registers_the_cost_rule_through_sglang():
    assert_load_plugins({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "281"},
                        "from moeplace.sglang import balanced_dispatch as bd\n"
                        "assert bd._DISPATCH.config == bd.DispatchConfig('cost', 1024, bd.RuleWeights(281)), "
                        "bd._DISPATCH.config\n"
                        "assert bd.TARGET in HookRegistry._patched, sorted(HookRegistry._patched)\n")


def test_plugin_takes_the_weights_with_row_blocks():
    assert_load_plugins({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "4096,0,2510,16"},
                        "from moeplace.sglang import balanced_dispatch as bd\n"
                        "assert bd._DISPATCH.config.q == bd.RuleWeights(4096, 0, 2510, 16), bd._DISPATCH.config\n")
