"""The commands' outputs on the shipped trace, byte for byte against files written by an earlier build:
stdout, the placement files and SGLang's file of ``optimize``, ``report --json``, ``compare`` and
``advise``. A change that means to alter one of them rewrites the files on purpose:
``MOEPLACE_WRITE_GOLDEN=1 pytest tests/test_outputs_unchanged.py``, and the diff shows what moved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplace.cli import cli

SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "gptoss20b-sample.mptrace"
GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
FAST = ["--max-steps", "600", "--effort", "2e7"]

# name: (command line, files it writes beside stdout); the paths are relative to the run's folder
RUNS = {
    "optimize": (["optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "-o", "a.json",
                  "--sglang-out", "a.sglang.json"], ["a.json", "a.sglang.json"]),
    "optimize-spares": (["optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--redundant", "8",
                         "--dispatch", "balanced", *FAST, "-o", "b.json", "--sglang-out", "b.sglang.json"],
                        ["b.json", "b.sglang.json"]),
    "report": (["report", SAMPLE, "--placement", "a.json", "--mode", "verify", "--json"], []),
    "compare": (["compare", SAMPLE, "a.json", "b.json", "--holdout", "0.3", "--mode", "verify"], []),
    "advise": (["advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--max-steps", "600"], []),
}


def _text(raw: str) -> str:
    """Output with the trace's absolute path (which differs between checkouts) named by a placeholder."""
    return raw.replace(str(SAMPLE), "<SAMPLE>")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
    """Every run in order (report and compare read the placements the optimize runs wrote): file name -> text."""
    folder = tmp_path_factory.mktemp("golden-run")
    found: dict[str, str] = {}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        for name, (args, files) in RUNS.items():
            result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            found[f"{name}.stdout"] = _text(result.stdout)
            for file in files:
                found[file] = _text((folder / file).read_text())
    finally:
        os.chdir(cwd)
    if os.environ.get("MOEPLACE_WRITE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for file, text in found.items():
            (GOLDEN / file).write_text(text)
    return found


def _expected_files() -> list[str]:
    return [f"{name}.stdout" for name in RUNS] + [f for _, files in RUNS.values() for f in files]


@pytest.mark.parametrize("file", _expected_files())
def test_output_unchanged(outputs: dict[str, str], file: str) -> None:
    assert outputs[file] == (GOLDEN / file).read_text(), f"{file} differs from {GOLDEN / file}"
