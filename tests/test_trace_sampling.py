"""optimize samples a long trace by default and says so; the sample is read in bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.analysis.optimize import DEFAULT_SAMPLE_STEPS
from moeplace.cli import cli
from moeplace.trace.load import open_trace
from moeplace.trace.store import split_chunks, write_chunks
from moeplace.trace.synthetic import SHAPES, SyntheticRouting, synthetic_chunks

STEPS = DEFAULT_SAMPLE_STEPS + 5_000
SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("long") / "gptoss-shaped.mptrace"
    routing = SyntheticRouting(SHAPES["gpt-oss-20b"][1], seed=2)
    return write_chunks(path, routing.header(), synthetic_chunks(routing, STEPS))[0]


def optimize(trace: Path, tmp_path: Path, *extra: str) -> dict:
    result = CliRunner().invoke(cli, ["optimize", str(trace), "--ranks", "8", "--effort", "2e7", "--json",
                                      "-o", str(tmp_path / "p.json"), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_optimize_samples_by_default_and_says_so(long_trace: Path, tmp_path: Path) -> None:
    data = optimize(long_trace, tmp_path)
    assert data["fit_steps"] + data["eval_steps"] == DEFAULT_SAMPLE_STEPS
    assert data["note"].startswith(f"used {DEFAULT_SAMPLE_STEPS:,} of the trace's {STEPS:,} steps (all modes), evenly spaced")
    assert "--max-steps" in data["note"]
    short = optimize(SAMPLE, tmp_path)   # 3,007 steps: all used, nothing to say
    assert short["fit_steps"] + short["eval_steps"] == 3007 and short["note"] == ""


def test_the_note_is_printed(long_trace: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["optimize", str(long_trace), "--ranks", "8", "--effort", "2e7",
                                      "--max-steps", "3000", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert f"note: used 3,000 of the trace's {STEPS:,} steps (all modes), evenly spaced" in result.stdout


def test_a_sample_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """Reading an evenly spaced 600 of 12,000 steps holds the sample and a chunk, never the trace."""
    routing = SyntheticRouting(SHAPES["gpt-oss-20b"][1], seed=3)
    chunks = (part for chunk in synthetic_chunks(routing, 12_000) for part in split_chunks(chunk, 500))
    path = write_chunks(tmp_path / "t.mptrace", routing.header(), chunks)[0]
    full = open_trace(path).load()
    peaks = {}
    for limit in (600, None):
        trace = open_trace(path)
        tracemalloc.start()
        steps = trace.load("all", limit)
        peaks[limit] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if limit:
            picks = np.arange(600) * 12_000 // 600   # evenly spaced, exactly 600
            np.testing.assert_array_equal(steps.topk_ids, full.take(picks).topk_ids)
        del steps
    assert peaks[600] < 0.3 * peaks[None], peaks
