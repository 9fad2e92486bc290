"""The tracer's hooks on SGLang's real modules (CPU): HookRegistry applies them, the router's result
is unchanged and the recorded ids are what the router chose."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")


@pytest.fixture
def hooked(tmp_path):
    """Apply the tracer's hooks through SGLang's HookRegistry; undo them afterwards."""
    from sglang.srt.layers.moe import topk
    from sglang.srt.model_executor import model_runner
    from sglang.srt.plugins.hook_registry import HookRegistry

    from moeplace.sglang import tracer as tr

    saved = (topk.select_experts, model_runner.ModelRunner.__dict__["forward"])
    HookRegistry.reset()
    t = tr.install(tr.TracerConfig(tmp_path, max_tokens=8, capacity=16, flush_steps=2, prefix="t"),
                   describe=lambda: tr.Layout("toy", 4, 8, 8))
    HookRegistry.apply_hooks()
    yield t, topk, model_runner
    tr.uninstall()
    # Put SGLang's originals back everywhere the registry propagated its wrappers.
    from sglang.srt.plugins.hook_registry import _propagate_patch

    wrapped_select = topk.select_experts
    topk.select_experts = saved[0]
    _propagate_patch(wrapped_select, saved[0], topk)
    model_runner.ModelRunner.forward = saved[1]
    HookRegistry.reset()


def test_hooks_are_applied_by_the_registry(hooked):
    t, topk, model_runner = hooked
    from moeplace.sglang import tracer as tr

    assert topk.select_experts.__wrapped__ is not None
    assert model_runner.ModelRunner.forward.__wrapped__.__qualname__ == "ModelRunner.forward"
    assert tr._TRACER is t


def test_select_experts_result_unchanged_and_ids_recorded(hooked, tmp_path):
    t, topk, _ = hooked
    from sglang.srt.layers.moe.topk import TopKConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from moeplace.sglang import tracer as tr
    from moeplace.trace.steps import concat_steps
    from moeplace.trace.store import TraceReader

    cfg = TopKConfig(top_k=4, torch_native=True, renormalize=True)
    original = topk.select_experts.__wrapped__
    g = torch.Generator().manual_seed(0)
    chosen = []
    for step, n in enumerate([3, 5, 2]):
        h = torch.randn(n, 16, generator=g)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE if step else ForwardMode.EXTEND, batch_size=n,
                          input_ids=torch.arange(n), req_pool_indices=torch.arange(n),
                          seq_lens=torch.ones(n, dtype=torch.int64), out_cache_loc=torch.arange(n),
                          seq_lens_sum=n)
        per_layer = []

        def forward(runner, forward_batch):
            for layer in (1, 3):
                logits = torch.randn(n, 8, generator=g)
                out = topk.select_experts(h, logits, cfg, layer_id=layer)  # the hooked SGLang function
                ref = original(h, logits, cfg, layer_id=layer)
                assert torch.equal(out.topk_ids, ref.topk_ids) and torch.equal(out.topk_weights, ref.topk_weights)
                per_layer.append(out.topk_ids.numpy())
            return "output"

        # ModelRunner.forward itself needs a loaded model; the AROUND hook is driven with a stand-in
        # forward and a real ForwardBatch.
        runner = types.SimpleNamespace(is_draft_worker=False)
        assert tr.around_model_runner_forward(forward, runner, fb) == "output"
        chosen.append(np.stack(per_layer, axis=1))
    t.close()
    steps = concat_steps(list(TraceReader(tmp_path)))
    assert steps.model.moe_layers == (1, 3)
    assert steps.modes.tolist() == [1, 2, 2] and steps.num_tokens.tolist() == [3, 5, 2]
    np.testing.assert_array_equal(steps.topk_ids, np.concatenate(chosen))


def test_topk_module_forward_native_goes_through_the_hook(hooked):
    t, topk, _ = hooked
    from sglang.srt.layers.moe.topk import TopKConfig

    cfg = TopKConfig(top_k=2, torch_native=True)
    seen = []
    t.on_router = lambda layer, ids: seen.append((layer, ids.clone()))
    out = topk.select_experts(torch.randn(4, 8), torch.randn(4, 8), cfg, layer_id=2)
    assert seen and seen[0][0] == 2 and torch.equal(seen[0][1], out.topk_ids)
    # Draft-model MoE blocks opt out of capture: nothing recorded.
    seen.clear()
    topk.select_experts(torch.randn(4, 8), torch.randn(4, 8),
                        TopKConfig(top_k=2, torch_native=True, allow_routed_experts_capture=False), layer_id=2)
    assert not seen
