"""Online re-placement wired into SGLang 0.5.23's real classes (CPU): SGLang's expert-location metadata and updater
move the weights, its rebalancer (``EPLBManager``) runs moeplace's ``rebalance``, the tracer follows the map, the
control folder's requests are answered by the decider process.

The server here is a tiny DeepSeek-V3 at EP 1 with a permuted map (SGLang then remaps router ids), one process
(a gloo group of one), its expert weights small CPU tensors whose rows carry the id of the expert they hold, so a
move that lands the wrong expert in a slot shows.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from moeplace.files.placement import Placement, save_sglang, sglang_physical_to_logical
from moeplace.model.config import model_spec_from_folder
from test_sglang_export import TINY_DSV3, publish

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.eplb.expert_location_updater")
pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """SGLang's context at EP 1 with a permuted initial map, its metadata, a gloo group of one; restored after."""
    pytest.importorskip("sglang.srt.models.deepseek_v2", reason="SGLang's DeepSeek model class does not import")
    import torch.distributed as dist
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el

    folder = tmp_path_factory.mktemp("tiny-dsv3-online")
    (folder / "config.json").write_text(json.dumps(TINY_DSV3))
    spec = model_spec_from_folder(folder)
    rng = np.random.default_rng(0)
    start = Placement(spec, 1, np.stack([rng.permutation(spec.num_experts) for _ in spec.moe_layers]))
    save_sglang(folder / "init.json", start)
    state = rc.snapshot_context()
    saved_meta = el.get_global_expert_location_metadata()
    publish(folder, rc, 1, 0, init=str(folder / "init.json"))
    rc.get_context().override("moeplace-test", moe_a2a_backend="none", ep_dispatch_algorithm="dynamic",
                              enable_eplb=True, eplb_rebalance_num_iterations=4,
                              expert_distribution_recorder_buffer_size=4)
    rc.get_parallel().override_permanently(tp_rank=0, moe_ep_rank=0)   # one process: rank 0 of every group
    model_config = ModelConfig.from_server_args(rc.get_server_args())
    el.set_global_expert_location_metadata(el.compute_initial_expert_location_metadata(model_config, moe_ep_rank=0),
                                           allow_overwrite=True)

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{folder / 'group'}", rank=0, world_size=1)
    yield SimpleNamespace(spec=spec, start=start, model_config=model_config, folder=folder)
    if started:
        dist.destroy_process_group()
    el.set_global_expert_location_metadata(saved_meta, allow_overwrite=True)
    rc.get_parallel().clear_stamp()
    rc.restore_context(state)


def current_map():
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return get_global_expert_location_metadata().physical_to_logical_map_cpu.numpy().copy()


def weights_for(full: np.ndarray, moe_layers) -> dict:
    """Each MoE layer's expert weights as SGLang's updater takes them: [P, ...] tensors, row p holding expert
    ``full[layer, p]``'s id."""
    return {layer: [torch.tensor(full[layer], dtype=torch.float32)[:, None].repeat(1, 3),
                    torch.tensor(full[layer], dtype=torch.int64)[:, None].repeat(1, 2)] for layer in moe_layers}


def held(weights: dict) -> dict:
    return {layer: tensors[0][:, 0].numpy().astype(np.int64).tolist() for layer, tensors in weights.items()}


@pytest.fixture
def online(server, tmp_path, monkeypatch):
    """A tracer (window only) that saw passes of the server's MoE layers, and a Replacer on it (no dispatch hook
    installed: SGLang's own rule runs)."""
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    from moeplace.sglang import balanced_dispatch

    monkeypatch.setattr(balanced_dispatch, "_DISPATCH", None)

    from moeplace.sglang.online import OnlineConfig, Replacer
    from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig
    from moeplace.trace import modes as M

    spec = server.spec
    E = spec.num_experts
    full = current_map()
    tracer = RoutingTracer(TracerConfig(tmp_path / "traces", capacity=64, flush_steps=4, flush_seconds=0.05,
                                        write_shards=False, window=200),
                           lambda: Layout(spec.name, spec.num_hidden_layers, E, E, full))
    tracer.live_map = current_map
    rng = np.random.default_rng(1)
    for _ in range(60):                      # verify passes of 9 rows, router ids physical (slots)
        tracer.begin_pass()
        for layer in spec.moe_layers:
            tracer.on_router(layer, torch.from_numpy(rng.choice(E, (9, spec.top_k)).astype(np.int32)))
        tracer.end_pass(M.TARGET_VERIFY, 9)
    deadline = time.monotonic() + 30
    while (tracer.window is None or len(tracer.window) < 60) and time.monotonic() < deadline:
        time.sleep(0.05)
    refreshed = []
    replacer = Replacer(OnlineConfig(window=200, period=1000, chunk=1, folder=tmp_path / "online", poll_seconds=0.05),
                        tracer, refresh=lambda: refreshed.append(1))
    runner = SimpleNamespace(model_config=server.model_config, expert_location_updater=ExpertLocationUpdater(),
                             model=SimpleNamespace(routed_experts_weights_of_layer=weights_for(full, spec.moe_layers)))
    yield SimpleNamespace(replacer=replacer, tracer=tracer, runner=runner, refreshed=refreshed, full=full)
    replacer.close()
    tracer.close()


def wait_for(path, seconds: float = 60.0) -> dict:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(path.read_text())


def scrambled(server, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(server.spec.num_experts) for _ in server.spec.moe_layers])


def test_a_requested_placement_moves_real_weights_a_chunk_per_pass(server, online):
    spec = server.spec
    replacer, runner = online.replacer, online.runner
    replacer.on_pass_end(runner)                                  # reads the server, starts the worker
    assert replacer.served is not None and replacer.served.dispatch == "dynamic"
    target = scrambled(server, 7)
    (replacer.config.folder / "request-a.json").write_text(json.dumps({"kind": "apply", "placement": target.tolist()}))
    assert wait_for(replacer.config.folder / "response-a.json")["replace"]
    versions = len(online.tracer._maps)
    for _ in range(len(spec.moe_layers) + 1):                     # a layer a pass (chunk 1)
        replacer.on_pass_end(runner)
        online.tracer.begin_pass()
    new_full = sglang_physical_to_logical(Placement(spec, 1, target))
    moe = list(spec.moe_layers)
    assert np.array_equal(current_map()[moe], new_full[moe])                    # SGLang's map, written in place
    assert held(runner.model.routed_experts_weights_of_layer) == {l: new_full[l].tolist() for l in moe}   # the weights
    assert len(online.refreshed) == len(moe) and replacer.replacements == 1
    assert replacer.moved_replicas == int((online.full[moe] != new_full[moe]).sum())
    assert len(online.tracer._maps) > versions                                  # later passes carry the new map
    status = json.loads((replacer.config.folder / "status-r000.json").read_text())
    assert status["replacements"] == 1


def test_bad_requests_are_answered_with_one_line(server, online):
    replacer, runner = online.replacer, online.runner
    replacer.on_pass_end(runner)
    folder = replacer.config.folder
    (folder / "request-b.json").write_text(json.dumps({"kind": "apply", "placement": [[0, 1]]}))
    (folder / "request-c.json").write_text(json.dumps({"kind": "shuffle"}))
    assert "must be" in wait_for(folder / "response-b.json")["error"]
    assert "unknown request" in wait_for(folder / "response-c.json")["error"]
    duplicate = np.tile(np.arange(server.spec.num_experts), (len(server.spec.moe_layers), 1))
    duplicate[0, 1] = 0
    (folder / "request-d.json").write_text(json.dumps({"kind": "apply", "placement": duplicate.tolist()}))
    assert "no slot" in wait_for(folder / "response-d.json")["error"]


def test_a_dry_run_decides_in_the_decider_process_and_moves_nothing(server, online):
    replacer, runner = online.replacer, online.runner
    replacer.on_pass_end(runner)
    before = current_map()
    (replacer.config.folder / "request-e.json").write_text(json.dumps({"kind": "dry-run"}))
    answer = wait_for(replacer.config.folder / "response-e.json", 120)
    assert answer["line"].startswith("keep") and answer["steps"] == 60     # at EP 1 no placement gains
    for _ in range(3):
        replacer.on_pass_end(runner)
    assert np.array_equal(current_map(), before) and replacer.replacements == 0


def test_sglang_s_rebalancer_runs_moeplace_s_rebalance(server, online):
    """EP 2 and more: SGLang's EPLBManager (its schedule, its update_expert_location_with_recovery) with moeplace's
    REPLACE hook on ``rebalance``; rank 0's decision broadcast over the process group (of one here). The manager is
    built without ``__init__``, whose recorder needs a GPU: its schedule (``on_forward_pass_end``, ``_entrypoint``)
    and chunking are SGLang's own."""
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from moeplace.sglang.online import REBALANCE

    replacer, runner = online.replacer, online.runner
    original = EPLBManager.rebalance
    HookRegistry.reset()
    HookRegistry.register(REBALANCE, lambda manager: replacer.rebalance(manager), HookType.REPLACE)
    HookRegistry.apply_hooks()
    try:
        manager = EPLBManager.__new__(EPLBManager)
        updater = ExpertLocationUpdater()
        vars(manager).update(_model_config=server.model_config, _get_model=lambda: runner.model,
                             _get_expert_location_updater=lambda: updater, _get_expert_backup_client=lambda: None,
                             _get_weight_updater=lambda: SimpleNamespace(update_weights_from_disk=None),
                             _rebalance_layers_per_chunk=2, _rebalance_num_iterations=4,
                             _rebalance_disabled_reason=None, _rebalance_disabled_logged=False)
        manager.reset_generator()
        target = scrambled(server, 11)
        replacer._started(server.model_config)
        assert replacer.ask("apply", "f", target)
        wait_for(replacer.config.folder / "response-f.json")
        for _ in range(6):                       # SGLang rebalances after its 4th pass, 2 layers a pass
            manager.on_forward_pass_end()
        new_full = sglang_physical_to_logical(Placement(server.spec, 1, target))
        moe = list(server.spec.moe_layers)
        assert np.array_equal(current_map()[moe], new_full[moe])
        assert held(runner.model.routed_experts_weights_of_layer) == {l: new_full[l].tolist() for l in moe}
        assert replacer.replacements == 1
    finally:
        EPLBManager.rebalance = original
        HookRegistry.reset()


def test_the_plugin_installs_online_re_placement_through_sglang(tmp_path):
    """SGLang's own load_plugins() with MOEPLACE_ONLINE: the tracer keeps the window without writing shards, and
    the rebalancer's hook and the start-up check land in HookRegistry."""
    from test_plugin import assert_load_plugins

    assert_load_plugins({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_WINDOW": "300", "MOEPLACE_ONLINE_DIR": str(tmp_path)},
                        "from moeplace.sglang import online, tracer\n"
                        "assert online._REPLACER is not None and online._REPLACER.config.folder.name == "
                        f"{tmp_path.name!r}\n"
                        "assert tracer._TRACER.config.window == 300 and not tracer._TRACER.config.write_shards\n"
                        "assert online._REPLACER.on_pass_end in tracer._TRACER.listeners\n"
                        "assert online.REBALANCE in HookRegistry._patched, sorted(HookRegistry._patched)\n"
                        "assert online.PLACEMENT in HookRegistry._patched\n")


def test_a_server_online_re_placement_cannot_run_on_stops_at_start(server, capsys):
    """Without an expert map (router ids are the slots), moved weights would serve the wrong experts: the check
    on SGLang's initial placement stops the server with one line. (Runs last: it changes the context.)"""
    from sglang.srt import runtime_context as rc
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from moeplace.sglang.online import check_server, server_problem

    assert server_problem(get_global_expert_location_metadata()) is None
    rc.get_context().override("moeplace-test-trivial", init_expert_location="trivial", enable_eplb=False)
    with pytest.raises(SystemExit) as stop:
        check_server(get_global_expert_location_metadata())
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MOEPLACE_ONLINE" in err[0] and "--init-expert-location" in err[0]


def test_the_request_command_is_answered_by_the_server_s_worker(server, online, capsys):
    from moeplace.cli import main
    from moeplace.files.placement import save_placement

    replacer = online.replacer
    replacer.on_pass_end(online.runner)
    main(["online", "request", str(replacer.config.folder), "--dry-run", "--wait", "120"])
    assert capsys.readouterr().out.startswith("keep")
    spares = np.concatenate([np.tile(np.arange(16), (3, 1)), np.tile([0, 1], (3, 1))], axis=1)
    save_placement(replacer.config.folder / "other.json", Placement(server.spec, 2, spares))   # 18 slots, not 16
    with pytest.raises(SystemExit) as refused:
        main(["online", "request", str(replacer.config.folder), "--placement",
              str(replacer.config.folder / "other.json"), "--wait", "60"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused" in err[0] and "16 slots" in err[0]
