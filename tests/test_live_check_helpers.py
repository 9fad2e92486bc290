"""The live SGLang check's pure helpers (the servers themselves run on the GPU machine only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import live_sglang_check as live  # noqa: E402


@pytest.mark.parametrize("a, b, share, first", [
    ([[1, 2, 3]], [[1, 2, 3]], 1.0, [-1]),
    ([[1, 2, 3]], [[1, 9, 3]], 2 / 3, [1]),
    ([[1, 2], [5]], [[1, 2, 7], [6]], 2 / 4, [2, 0]),   # a longer answer counts its extra tokens as unequal
])
def test_equal_token_share(a, b, share, first):
    wrap = lambda xs: [{"output_ids": x} for x in xs]  # noqa: E731
    got_share, got_first = live.equal_token_share(wrap(a), wrap(b))
    assert got_share == pytest.approx(share) and got_first == first


@pytest.mark.parametrize("name, bare", [
    ("void mlav::split_kernel<40, 32>(mlav::SplitParams)", "split_kernel"),
    ("void flash::flash_fwd_splitkv_mla_kernel<Traits<flash::Sm90, 64>, true>(flash::Params)",
     "flash_fwd_splitkv_mla_kernel"),
    ("mlav::combine_kernel(mlav::CombineParams)", "combine_kernel"),
    ("_fwd_kernel", "_fwd_kernel"),
])
def test_bare_name(name, bare):
    assert live.bare_name(name) == bare


def test_the_profilers_names_of_both_backends_are_matched():
    """As the H200's profile named them: our template kernels and SGLang's Triton kernel."""
    ours = ["void mlav::split_kernel<40, 32>(mlav::SplitParams)", "mlav::combine_kernel(mlav::CombineParams)"]
    assert all(live.bare_name(n).startswith(live.ATTENTION_KERNELS["moeplace"]) for n in ours)
    assert [live.bare_name(n).startswith(live.MAIN_KERNEL["moeplace"]) for n in ours] == [True, False]
    assert not live.bare_name("fused_moe_kernel").startswith(live.ATTENTION_KERNELS["triton"])


def test_the_composed_paths_kernels_are_matched_once_per_layer():
    """FlashMLA's decode and combine count as verify attention; our tree/merge kernel, one a layer, counts the passes."""
    composed = ["void flash::flash_fwd_splitkv_mla_kernel<T, true>(flash::Params)",
                "void flash::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 64>(flash::Params)",
                "_tree_merge_kernel"]
    assert all(live.bare_name(n).startswith(live.ATTENTION_KERNELS["moeplace"]) for n in composed)
    assert [live.bare_name(n).startswith(live.MAIN_KERNEL["moeplace"]) for n in composed] == [False, False, True]


def test_rank_choices_compare_the_slots_each_rank_recorded(tmp_path):
    """Two ranks' tracers (the real RoutingTracer, CPU tensors): equal choices compare equal, one
    different replica on one rank does not."""
    torch = pytest.importorskip("torch")
    from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig

    p2l = [[0, 1, 2, 3, 0, 1]] * 3   # [H, P]: 4 experts, 6 slots; experts 0 and 1 have a second replica
    for folder, flip in ((tmp_path / "same", False), (tmp_path / "differ", True)):
        for rank in (0, 1):
            cfg = TracerConfig(folder, max_tokens=8, capacity=16, flush_steps=4, prefix="ep")
            tracer = RoutingTracer(cfg, lambda r=rank: Layout("toy", 3, 4, 6, p2l, ep_size=2, rank=r))
            for step in range(5):
                slots = [[0, 4], [1, 2]] if not (flip and rank == 1 and step == 3) else [[4, 0], [1, 2]]
                for layer in (1, 2):
                    tracer.on_router(layer, torch.tensor(slots, dtype=torch.int32))
                tracer.end_pass(5, 2)
            tracer.close()
        choices = live.rank_choices(folder)
        assert sorted(choices) == [0, 1] and len(choices[0]) == 5
        assert (choices[0] == choices[1]) is not flip


@pytest.mark.sglang
def test_the_two_gpu_run_prepares_placements_and_launch_refuses_the_wrong_ones(tmp_path):
    """The 2-GPU run's CPU side on the Kimi-expert-shaped model: placements for 2 ranks, and `launch`
    refuses another EP size, another model and DP attention with balanced dispatch, one line each."""
    pytest.importorskip("sglang")
    model = Path(__file__).resolve().parents[1] / "tests" / "data" / "kimi-k2-shaped-2moe"
    live.prepare_ep_placements(model, tmp_path, experts=384, steps=300)
    for name in ("deepseek.json", "stepaware.json", "balanced.json", "ep4.json", "other.json"):
        assert (tmp_path / name).is_file(), name
    refused = live.ep_launch_refusals(model, tmp_path, 39000, experts=384)
    for what, res in refused.items():
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (what, res.stderr)


@pytest.mark.parametrize("extra_at", [None, 5])
def test_capture_check_says_where_the_capture_left_the_tracers_order(tmp_path, extra_at):
    """The capture check passes on an in-order window of the tracer's steps; where the tracer has a step
    the capture lacks, it fails and says where, and that the rest still follows in order."""
    import subprocess
    import types

    import numpy as np

    from moeplace.model.spec import ModelSpec
    from moeplace.trace.store import write_trace
    from moeplace.trace.synthetic import synthetic_steps

    header, steps = synthetic_steps(30, 3, ModelSpec("toy", 2, (0, 1), 16, 2), seed=1)
    window = np.arange(4, 20)
    traced = steps if extra_at is None else steps.take(np.delete(np.arange(30), 4 + extra_at))
    write_trace(tmp_path / "srv-merged.mptrace", header, steps)
    write_trace(tmp_path / "capture.mptrace", header, traced.take(window))
    server = types.SimpleNamespace(name="srv")
    check = live.check_capture(server, tmp_path / "capture.mptrace", subprocess.CompletedProcess([], 0, "", ""),
                               tmp_path)
    assert check.ok is (extra_at is None)
    if extra_at is not None:
        assert check.figures["first_unequal_capture_step"] == extra_at
        assert check.figures["in_order_subsequence"] == window.size
        assert check.figures["tracer_steps_between"] == 1
        skipped = check.figures["tracer_steps_skipped"]
        assert [(s["before_capture_step"], s["trace_step"]) for s in skipped] == [(extra_at, 4 + extra_at)]
        assert skipped[0]["rows"] == 3 and skipped[0]["same_ids_as_previous"] is False
