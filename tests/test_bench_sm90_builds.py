"""The sm90 build comparison's arguments: slice settings, refusals in one line (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_sm90_builds as bench  # noqa: E402
import cuda_timing  # noqa: E402


def test_slice_settings_of_earlier_rules():
    # 8 heads x 9 drafts on 132 SMs: what combine_slices chose before four were kept for one request
    assert [bench.slices_for("one-wave", b, 72, 132) for b in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]
    # the rule of 2ff9045: four for one request, two up to eight, one at sixteen
    assert [bench.slices_for("lean-wave", b, 72, 132) for b in (1, 2, 4, 8, 16)] == [4, 2, 2, 2, 1]
    assert bench.slices_for("rule", 8, 72, 132) == 0
    assert bench.slices_for("2", 1, 72, 132) == 2


@pytest.mark.parametrize("argv,says", [
    (["HEAD", "--cases", "b3 1k"], "unknown case 'b3 1k'"),
    (["HEAD:3"], "SLICES must be rule, one-wave, lean-wave, 1, 2 or 4"),
    (["HEAD", "HEAD:rule"], "give each BUILD:SLICES once"),
    (["HEAD", "--rounds", "0"], "--rounds must be at least 1"),
    (["HEAD", "--held", "-1"], "--held must be 0 (off) or a number of seconds"),
    (["HEAD", "--held", "0.5"], "--held needs at least 1 second (nvidia-smi samples every 100 ms)"),
])
def test_bad_arguments_exit_2_with_one_line(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_sm90_builds.py", *argv])
    assert bench.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_unknown_revision_and_missing_file_are_refused(tmp_path):
    with pytest.raises(bench.Refusal, match="not a revision"):
        bench.sources("no-such-revision")
    with pytest.raises(bench.Refusal, match="no such file"):
        bench.sources(str(tmp_path / "kernel.cu"))


def test_a_cu_path_takes_its_own_include_else_the_tree_s(tmp_path):
    (tmp_path / "k.cu").write_text("// kernel")
    assert bench.sources(str(tmp_path / "k.cu"))[1] == (bench.ROOT / "kernels" / "csrc" / bench.INCLUDE).read_text()
    (tmp_path / bench.INCLUDE).write_text("// ops")
    assert bench.sources(str(tmp_path / "k.cu")) == ("// kernel", "// ops")


def test_held_mode_without_nvidia_smi_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["bench_sm90_builds.py", "HEAD", "--held", "3"])
    assert bench.main() == 2
    assert capsys.readouterr().err.strip() == (
        "bench_sm90_builds: --held needs nvidia-smi on the PATH (it samples the clock and power)")


def test_clock_and_power_are_the_medians_of_the_samples():
    text = "1980, 375.20\n1792, 690.1\n[N/A], [N/A]\n1650, 693.0\n17\n"
    assert cuda_timing.smi_samples(text) == (1792.0, 690.1)
    with pytest.raises(RuntimeError, match="no clock and power samples"):
        cuda_timing.smi_samples("[N/A], [N/A]\n")
