"""A shard whose tail was cut (a crash mid-write) is skipped with one warning by every command that
reads it, and when nothing readable is left the error names the cut first (traces/FORMAT.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"
FAST = {"optimize": ["--max-steps", "600", "--effort", "2e7", "-o", "p.json"],
        "advise": ["--max-steps", "600", "--effort", "2e6"],
        "report": [], "compare": []}


def moeplace(cwd: Path, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from moeplace.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture
def folder_with_cut_shard(tmp_path: Path) -> Path:
    folder = tmp_path / "trace"
    folder.mkdir()
    data = SAMPLE.read_bytes()
    (folder / "a.mptrace").write_bytes(data)
    (folder / "b.mptrace").write_bytes(data[:-10])   # its last chunk is cut
    return folder


@pytest.mark.parametrize("command", list(FAST))
def test_every_command_warns_once(tmp_path: Path, folder_with_cut_shard: Path, command: str) -> None:
    args = [command, folder_with_cut_shard, "--ranks", "8", "--mode", "verify", *FAST[command]]
    if command == "compare":
        assert moeplace(tmp_path, "optimize", folder_with_cut_shard, "--ranks", "8", *FAST["optimize"]).returncode == 0
        args.insert(2, tmp_path / "p.json")
    res = moeplace(tmp_path, *args)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    warnings = [line for line in res.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1, res.stderr
    assert "b.mptrace" in warnings[0] and "cut inside a chunk" in warnings[0] and "skipped" in warnings[0]


@pytest.mark.parametrize("command", ["report", "optimize", "advise"])
def test_nothing_left_but_the_cut_names_the_cut_first(tmp_path: Path, command: str) -> None:
    data = SAMPLE.read_bytes()
    cut = tmp_path / "cut.mptrace"
    cut.write_bytes(data[:len(data) // 3])   # inside the first chunk: no whole step at all
    res = moeplace(tmp_path, command, cut, "--ranks", "8", *FAST[command])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(errors) == 1 and errors[0].startswith(f"error: {cut}: cut inside a chunk"), res.stderr  # cause first
    assert "warning" not in res.stderr   # the error says it all
