"""The sglang.srt.plugins entry point: found through importlib.metadata, off unless enabled."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "moeplace"]
    assert eps, "pip install -e . first: the sglang.srt.plugins entry point is missing"
    from moeplace.sglang.plugin import register

    assert eps[0].load() is register


def test_all_off_imports_nothing():
    code = ("import os, sys\n"
            "for k in list(os.environ):\n"
            "    k.startswith('MOEPLACE_') and os.environ.pop(k)\n"
            "from moeplace.sglang.plugin import register\n"
            "register()\n"
            "bad = [m for m in ('torch', 'sglang', 'moeplace.sglang.tracer') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_features_from_env(monkeypatch):
    from moeplace.sglang.plugin import enabled_features

    for k in ("MOEPLACE_TRACE", "MOEPLACE_TRACE_DIR", "MOEPLACE_KV_SORT", "MOEPLACE_VERIFY_KERNEL"):
        monkeypatch.delenv(k, raising=False)
    assert enabled_features() == []
    monkeypatch.setenv("MOEPLACE_TRACE_DIR", "/tmp/x")
    monkeypatch.setenv("MOEPLACE_KV_SORT", "1")
    assert enabled_features() == ["trace", "kv_sort"]


def assert_load_plugins(env: dict[str, str], checks: str) -> None:
    """SGLang's own load_plugins() in a fresh Python with ``env`` set, then ``checks`` (code) must pass."""
    code = ("import os\n"
            f"os.environ.update({env!r})\n"
            "from sglang.srt.plugins import load_plugins\n"
            "from sglang.srt.plugins.hook_registry import HookRegistry\n"
            "load_plugins()\n" + checks)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


def test_sglang_load_plugins_registers_the_tracer(tmp_path):
    """SGLang's own load_plugins() finds the entry point and the tracer's hooks land in HookRegistry."""
    pytest.importorskip("sglang")
    assert_load_plugins({"MOEPLACE_TRACE_DIR": str(tmp_path)},
                        "from moeplace.sglang import tracer\n"
                        "assert tracer._TRACER is not None\n"
                        "assert tracer.SELECT_EXPERTS in HookRegistry._patched, sorted(HookRegistry._patched)\n"
                        "assert tracer.MODEL_RUNNER_FORWARD in HookRegistry._patched\n"
                        "import sglang.srt.layers.moe.topk as topk\n"
                        "assert topk.select_experts.__wrapped__ is not None\n")
