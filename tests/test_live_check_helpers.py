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
    ("void mlav::split_kernel<40, 32>(mlav::SplitParams)", "split_kernel<40, 32>"),
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
