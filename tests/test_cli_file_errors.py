"""What the file system refuses (a folder where a file should be, a full disk, no permission) is one
line and exit code 2, as for any other bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"


def test_a_folder_named_like_a_shard(tmp_path: Path) -> None:
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "a.mptrace").write_bytes(SAMPLE.read_bytes())
    (tmp_path / "trace" / "b.mptrace").mkdir()   # not a shard: a folder
    res = subprocess.run([sys.executable, "-c", "from moeplace.cli import main; main()", "report",
                          str(tmp_path / "trace")], capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "b.mptrace" in lines[0], res.stderr
