"""Scripts know no one machine: no absolute default paths; data beside the checkout is found from it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


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
