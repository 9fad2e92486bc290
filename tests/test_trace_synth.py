"""Synthetic routing: the fast draw without replacement against the slow exact rule (Gumbel top-k),
streaming in bounded memory, and ``moeplace trace synth``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.cli import cli
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.load import open_trace
from moeplace.trace.steps import concat_steps
from moeplace.trace.synthetic import (KIMI_K2, SHAPES, SyntheticRouting, sample_topk, sample_topk_gumbel, softmax,
                                      synthetic_chunks)


def zipf(E: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, E + 1) ** s
    return p / p.sum()


# [D, E] distributions, k: flat, Zipf, one expert holding 95%, fewer than k experts with any real mass
CASES = {
    "flat": (np.full((1, 12), 1 / 12), 4),
    "zipf": (np.stack([zipf(16, 1.0), zipf(16, 1.5)[::-1]]), 3),
    "one-dominant": (np.array([[0.95] + [0.05 / 9] * 9]), 4),
    "short-support": (np.array([[0.5, 0.5 - 4e-12, 1e-12, 1e-12, 1e-12, 1e-12]]), 3),
    "kimi-like": (softmax(np.log(zipf(32, 1.0))[None] + 0.7 * np.random.default_rng(1).normal(0, 2, (3, 32))), 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_law_as_gumbel_top_k(case: str) -> None:
    """Inclusion of each expert, and the first pick, match the exact rule within sampling noise."""
    probs, k = CASES[case]
    D, E = probs.shape
    N = 30_000
    dist = np.random.default_rng(0).integers(D, size=N)
    fast = sample_topk(np.random.default_rng(1), probs, dist, k)
    slow = sample_topk_gumbel(np.random.default_rng(2), probs, dist, k)
    for d in range(D):
        rows = dist == d
        inc_fast = np.bincount(fast[rows].ravel(), minlength=E) / rows.sum()
        inc_slow = np.bincount(slow[rows].ravel(), minlength=E) / rows.sum()
        noise = 6 * np.sqrt(np.maximum(inc_slow * (1 - inc_slow), 1e-4) * 2 / rows.sum())
        assert np.all(np.abs(inc_fast - inc_slow) <= noise), (case, d, inc_fast, inc_slow)
        first_fast = np.bincount(fast[rows, 0], minlength=E) / rows.sum()
        noise = 6 * np.sqrt(np.maximum(probs[d] * (1 - probs[d]), 1e-4) / rows.sum())
        assert np.all(np.abs(first_fast - probs[d]) <= noise), (case, d)   # the first pick is a plain draw


@settings(max_examples=60, deadline=None)
@given(E=st.integers(2, 40), k_share=st.floats(0.05, 1.0), zeros=st.integers(0, 30), seed=st.integers(0, 2**31))
def test_rows_are_k_distinct_experts_in_range(E: int, k_share: float, zeros: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = max(1, int(k_share * E))
    probs = rng.dirichlet(np.full(E, 0.3), size=2)
    probs[:, rng.permutation(E)[:min(zeros, E - 1)]] = 0.0   # experts that are never routed to
    probs /= probs.sum(axis=1, keepdims=True)
    ids = sample_topk(rng, probs, rng.integers(2, size=500), k)
    assert ids.shape == (500, k) and ids.min() >= 0 and ids.max() < E
    assert (np.diff(np.sort(ids, axis=1), axis=1) > 0).all()


def test_same_seed_same_steps() -> None:
    routing = SyntheticRouting(ModelSpec.all_moe("m", 3, 64, 4), tokens_per_step=5, seed=7)
    steps = concat_steps(list(synthetic_chunks(routing, 1000)))
    assert steps.num_steps == 1000 and steps.topk_ids.shape == (5000, 3, 4)
    np.testing.assert_array_equal(concat_steps(list(synthetic_chunks(routing, 1000))).topk_ids, steps.topk_ids)
    other = concat_steps(list(synthetic_chunks(SyntheticRouting(routing.model, 5, seed=8), 1000)))
    assert not np.array_equal(other.topk_ids, steps.topk_ids)


def test_chunks_stay_near_the_chunk_budget() -> None:
    from moeplace.trace.store import CHUNK_BYTES

    sizes = [c.topk_ids.nbytes for c in synthetic_chunks(SyntheticRouting(KIMI_K2), 5000)]
    assert len(sizes) >= 2 and max(sizes) <= CHUNK_BYTES


def test_shapes_are_their_models() -> None:
    """The shape table against the numbers in each model's config.json (as model_config reads them)."""
    from moeplace.model.config import model_spec_from_hf_config

    configs = {
        "kimi-k2": {"num_hidden_layers": 61, "n_routed_experts": 384, "num_experts_per_tok": 8, "first_k_dense_replace": 1},
        "deepseek-v3": {"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
                        "first_k_dense_replace": 3},
        "qwen3-235b-a22b": {"num_hidden_layers": 94, "num_experts": 128, "num_experts_per_tok": 8},
        "qwen3-30b-a3b": {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8},
        "gpt-oss-120b": {"num_hidden_layers": 36, "num_local_experts": 128, "experts_per_token": 4},
        "gpt-oss-20b": {"num_hidden_layers": 24, "num_local_experts": 32, "experts_per_token": 4},
        "mixtral-8x7b": {"num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    }
    assert set(configs) == set(SHAPES)
    for shape, config in configs.items():
        want = model_spec_from_hf_config(config)
        got = SHAPES[shape][1]
        assert (got.num_hidden_layers, got.moe_layers, got.num_experts, got.top_k) == \
            (want.num_hidden_layers, want.moe_layers, want.num_experts, want.top_k), shape


# ----------------------------------------------------------------------------- the command

def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_synth_writes_a_trace(tmp_path: Path) -> None:
    code, out, err = run("trace", "synth", "--shape", "gpt-oss-20b", "--steps", 700, "--seed", 3,
                         "-o", tmp_path / "s.mptrace")
    assert code == 0, err
    assert "700 SYNTHETIC verify steps" in out and "openai/gpt-oss-20b" in out
    assert "synth: 700 of 700 steps (100%" in err   # progress on stderr
    trace = open_trace(tmp_path / "s.mptrace")
    steps = trace.load()
    assert steps.num_steps == 700 and (steps.num_tokens == 9).all() and (steps.modes == M.TARGET_VERIFY).all()
    assert trace.model == SHAPES["gpt-oss-20b"][1] and "SYNTHETIC" in trace.header.notes
    again = tmp_path / "again.mptrace"
    run("trace", "synth", "--shape", "gpt-oss-20b", "--steps", 700, "--seed", 3, "-o", again, "--json")
    np.testing.assert_array_equal(open_trace(again).load().topk_ids, steps.topk_ids)


def test_synth_takes_the_layout_of_any_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_hf_resolve import cache_model

    cache = tmp_path / "hub"
    config = {"num_hidden_layers": 5, "num_experts": 24, "num_experts_per_tok": 3, "mlp_only_layers": [0]}
    cache_model(cache, "org/moe-toy", "a" * 40, {"config.json": json.dumps(config)})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    code, out, err = run("trace", "synth", "--model", "org/moe-toy", "--steps", 50, "--mode", "decode",
                         "--tokens-per-step", 4, "-o", tmp_path / "t.mptrace", "--json")
    assert code == 0, err
    trace = open_trace(tmp_path / "t.mptrace")
    assert (trace.model.moe_layers, trace.model.num_experts, trace.model.top_k) == ((1, 2, 3, 4), 24, 3)
    assert "org/moe-toy" in trace.model.name and json.loads(out)["layout_of"] == "org/moe-toy"
    assert (trace.load().modes == M.DECODE).all()


@pytest.mark.parametrize("args, needle", [
    (["--shape", "kimi-k2", "--model", "x"], "not both"),
    (["--model", "org/not-cached"], "not in the Hugging Face cache"),
    (["--model", "{tmp}"], "has no config.json"),
    (["--shape", "gpt-5"], "Invalid value for '--shape'"),
])
def test_synth_refusals_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list, needle: str) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    res = subprocess.run([sys.executable, "-c", "from moeplace.cli import main; main()", "trace", "synth",
                          "--steps", "10", "-o", str(tmp_path / "x.mptrace"),
                          *[a.format(tmp=tmp_path) for a in args]], capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
    assert not list(tmp_path.glob("x.mptrace*"))


def test_synth_into_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    res = subprocess.run([sys.executable, "-c", "from moeplace.cli import main; main()", "trace", "synth",
                          "--steps", "10", "-o", str(blocker / "x.mptrace")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "cannot write" in res.stderr, res.stderr


def test_synth_streams_in_bounded_memory(tmp_path: Path) -> None:
    """10,000 Kimi-K2-shaped steps (86 MB of ids, 1.5 GB of Gumbel noise for the old sort-per-token rule)
    are made with far less memory than the ids alone."""
    # VmHWM, this process's own peak: ru_maxrss would keep the peak of the pytest process it was forked from
    code = ("import sys; from moeplace.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) // 1024)")
    res = subprocess.run([sys.executable, "-c", code, "trace", "synth", "--shape", "kimi-k2", "--steps", "10000",
                          "-o", str(tmp_path / "k.mptrace")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    peak_mb = int(res.stdout.strip().splitlines()[-1])
    ids_mb = 10000 * 9 * 60 * 8 * 2 / 2**20
    assert peak_mb < 450, (peak_mb, ids_mb)
    assert open_trace(tmp_path / "k.mptrace").count() == 10000
