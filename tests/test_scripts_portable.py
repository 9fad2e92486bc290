"""Scripts know no one machine: no absolute default paths; data beside the checkout is found from it. Every
benchmark says in its docstring what it asks, what it measures against and where its figures go."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
BENCHMARKS = [p for p in SCRIPTS if p.name.startswith(("bench_", "calibrate_", "check_", "replay_", "live_"))
              and p.name != "bench_inputs.py"]
sys.path.insert(0, str(ROOT / "scripts"))      # as when a script runs: its folder first on the path


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_absolute_path_literals(script: Path) -> None:
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            assert not (text.startswith(("/work/", "/tmp/", "/root/", "/home/")) and "\n" not in text), \
                f"{script.name}:{node.lineno}: machine-specific path {text!r}"


def test_replay_placement_finds_the_gptoss_routing_beside_the_checkout() -> None:
    spec = importlib.util.spec_from_file_location("replay_placement", ROOT / "scripts" / "replay_placement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.GPTOSS == ROOT.parent / "shared/traces-real/gptoss20b-fingerprint/gptoss20b_routing_topk_ids.npz"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_states_its_question_baseline_and_output(script: Path) -> None:
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    for field in ("Question:", "Baseline:", "Output:"):
        assert f"\n{field} " in doc, f"{script.name}: its docstring has no '{field}' line"
