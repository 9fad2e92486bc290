"""The benchmarks' inputs, made one way for every script: real GPT-OSS-20B routing as 9-token verify steps
(the full recording beside the checkout, or the sample shipped in ``traces/``), its steps grouped by the
example (request) they come from, and SYNTHETIC Kimi-K2-shaped steps on a share of its 60 MoE layers.

Scripts import it as ``bench_inputs`` (``scripts/`` is on ``sys.path`` when a script runs). moeplace is
imported inside the functions, so a GPU-side script that only needs the paths imports nothing more.
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moeplace.trace.steps import RoutingSteps

ROOT = Path(__file__).resolve().parents[1]
# The full GPT-OSS-20B recording sits beside the checkout (--gptoss elsewhere); the sample ships with it.
GPTOSS = ROOT.parent / "shared/traces-real/gptoss20b-fingerprint/gptoss20b_routing_topk_ids.npz"
SAMPLE = ROOT / "traces" / "gptoss20b-sample.mptrace"
VERIFY_TOKENS = 9          # a request verifying 8 drafts
# The GPT-OSS recording's datasets (the examples' ``dataset`` field), by benchmark
DATASETS = {"MMLU": ("mmlu_test", "mmlu_validation", "mmlu_dev"), "MMLU-Pro": ("mmlu_pro_test", "mmlu_pro_validation"),
            "GPQA": ("gpqa_extended", "gpqa_main", "gpqa_diamond"), "SORRY-Bench": ("sorry_bench_base",)}
KIMI_MOE_LAYERS = 60


def gptoss_steps(path: str | Path = GPTOSS, mode: str = "verify") -> "RoutingSteps":
    """The recording's steps of ``mode`` (a per-token .npz is cut into 9-token verify windows)."""
    from moeplace.trace.load import open_trace

    return open_trace(path, window=VERIFY_TOKENS).load(mode)


def example_steps(path: str | Path = GPTOSS) -> list[np.ndarray]:
    """Step indices of each example of a per-token .npz, in the order ``gptoss_steps`` numbers them
    (the reader keeps each example's whole windows and drops its last partial one)."""
    with np.load(path) as z:
        offsets = z["example_offsets"]
    windows = np.diff(offsets) // VERIFY_TOKENS
    first = np.concatenate([[0], np.cumsum(windows)])
    return [np.arange(first[x], first[x + 1]) for x in range(windows.size)]


def kimi_shaped(layers: int, num_steps: int, tokens_per_step: int = VERIFY_TOKENS, seed: int = 0) -> "RoutingSteps":
    """SYNTHETIC steps of ``layers`` Kimi-K2-shaped MoE layers (384 experts, top-8; the synthetic layers are
    drawn alike, so a benchmark scales a sum over them by ``KIMI_MOE_LAYERS / layers``)."""
    from moeplace.model.spec import ModelSpec
    from moeplace.trace.synthetic import synthetic_steps

    model = ModelSpec(f"SYNTHETIC kimi-k2-shaped, {layers} of {KIMI_MOE_LAYERS} MoE layers", layers + 1,
                      tuple(range(1, layers + 1)), 384, 8)
    return synthetic_steps(num_steps, tokens_per_step=tokens_per_step, model=model, seed=seed)[1]


def pct(value: float, base: float) -> str:
    """``value`` against ``base`` as a signed percentage, e.g. "-20.0%"."""
    return f"{100 * (value / base - 1):+.1f}%"


def relabel(steps: "RoutingSteps", perms: np.ndarray) -> "RoutingSteps":
    """``steps`` with expert e of layer l renamed perms[l, e]."""
    from moeplace.trace.steps import RoutingSteps

    ids = steps.topk_ids.astype(np.int64)
    out = np.where(ids >= 0, perms[np.arange(ids.shape[1])[None, :, None], np.maximum(ids, 0)], -1)
    return RoutingSteps.from_topk(steps.model, out, np.diff(steps.token_offsets), steps.modes)
