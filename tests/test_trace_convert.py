"""``moeplace trace convert``: any source moeplace reads becomes one .mptrace with the same steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner

from moeplace.cli import cli
from moeplace.trace.load import open_trace

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"


def test_convert_npz_keeps_every_step(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(16)[:2] for _ in range(3)]) for _ in range(50)]).astype(np.int16)
    np.savez(tmp_path / "run_topk_ids.npz", topk_ids=ids, example_offsets=np.array([0, 20, 50]))
    result = CliRunner().invoke(cli, ["trace", "convert", str(tmp_path / "run_topk_ids.npz"), "--window", "4",
                                      "-o", str(tmp_path / "run.mptrace")])
    assert result.exit_code == 0, result.output
    want = open_trace(tmp_path / "run_topk_ids.npz", window=4).load()
    got = open_trace(tmp_path / "run.mptrace").load()
    assert got.num_steps == want.num_steps == 5 + 7 and "12 steps" in result.stdout
    np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
    np.testing.assert_array_equal(got.modes, want.modes)


def test_convert_a_folder_with_a_cut_shard_warns(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.mptrace").write_bytes(SAMPLE.read_bytes())
    (tmp_path / "in" / "b.mptrace").write_bytes(SAMPLE.read_bytes()[:-10])
    result = CliRunner().invoke(cli, ["trace", "convert", str(tmp_path / "in"), "-o", str(tmp_path / "out.mptrace")])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("warning:") == 1 and "b.mptrace" in result.stderr
    assert open_trace(tmp_path / "out.mptrace").count() == open_trace(SAMPLE).count()   # a whole, b cut before any step
