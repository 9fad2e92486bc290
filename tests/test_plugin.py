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


BLOCKED = ("import os, sys\n"
           "for k in list(os.environ):\n"
           "    k.startswith('MOEPLACE_') and os.environ.pop(k)\n"
           "os.environ.update({env!r})\n"
           "sys.modules[{blocked!r}] = None   # an import error inside SGLang, as a broken install has\n"
           "from sglang.srt.plugins import load_plugins\n"
           "load_plugins()\n"
           "print('served without the feature')\n")


@pytest.mark.parametrize("env, blocked, switch", [
    # a HookRegistry target whose module cannot be imported: SGLang logs it and goes on
    ({"MOEPLACE_TRACE": "1"}, "sglang.srt.model_executor.model_runner", "MOEPLACE_TRACE"),
    ({"MOEPLACE_KV_SORT": "1"}, "sglang.srt.mem_cache.kv_cache_configurator", "MOEPLACE_KV_SORT"),
    ({"MOEPLACE_DISPATCH": "balanced"}, "sglang.srt.eplb.expert_location_dispatch", "MOEPLACE_DISPATCH"),
    # a feature whose install itself fails: SGLang logs "Failed to execute general plugin" and goes on
    ({"MOEPLACE_VERIFY_KERNEL": "1"}, "sglang.srt.layers.attention.triton_backend", "MOEPLACE_VERIFY_KERNEL"),
])
def test_a_feature_that_cannot_hook_stops_the_process_with_one_line(tmp_path, env, blocked, switch):
    """SGLang's own load_plugins() would serve on without the feature; the plugin stops it instead."""
    pytest.importorskip("sglang")
    env = {**env, "MOEPLACE_TRACE_DIR": str(tmp_path)} if switch == "MOEPLACE_TRACE" else env
    res = subprocess.run([sys.executable, "-c", BLOCKED.format(env=env, blocked=blocked)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 2 and "served without the feature" not in res.stdout, res.stderr[-3000:]
    ours = [line for line in res.stderr.splitlines() if line.startswith("moeplace:")]
    assert len(ours) == 1 and switch in ours[0] and "stopping" in ours[0], res.stderr[-3000:]
    assert blocked in ours[0] or "ModuleNotFoundError" in ours[0] or "ImportError" in ours[0], ours[0]


def test_every_feature_applies_through_sglang_load_plugins(tmp_path):
    """All features on at once: every target they register is patched, and nothing stops."""
    pytest.importorskip("sglang")
    assert_load_plugins({"MOEPLACE_TRACE_DIR": str(tmp_path), "MOEPLACE_KV_SORT": "1",
                         "MOEPLACE_DISPATCH": "balanced", "MOEPLACE_VERIFY_KERNEL": "1",
                         "MOEPLACE_KV_STATS": str(tmp_path / "kv.json")},
                        "assert set(HookRegistry._hooks) <= HookRegistry._patched, "
                        "set(HookRegistry._hooks) - HookRegistry._patched\n"
                        "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend\n"
                        "assert TritonAttnBackend._moeplace_verify_installed\n")
