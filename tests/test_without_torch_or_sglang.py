"""Where torch or SGLang cannot be imported (a laptop with only ``pip install moeplace``): inputs and
commands that need them say so in one line, exit 2, write nothing, and never show a traceback.

Each case runs moeplace in a subprocess whose ``sitecustomize`` makes the import of torch (or
SGLang) fail as it does when the package is not installed; the blocker reaches the subprocesses
moeplace starts itself (``moeplace launch`` asks its Python whether SGLang is there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from moeplace.files.placement import Placement, save_placement
from moeplace.model.spec import ModelSpec

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"
BLOCKER = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def python_without(blocked: set[str], tmp_path: Path, *args: object) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` where the ``blocked`` top-level packages cannot be imported."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{site}:{repo}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)


def moeplace_without(blocked: set[str], tmp_path: Path, *args: object) -> subprocess.CompletedProcess:
    """Run the moeplace CLI where the ``blocked`` top-level packages cannot be imported."""
    return python_without(blocked, tmp_path, "-c", "from moeplace.cli import main; main()", *args)


def assert_one_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_the_blocker_blocks(tmp_path):
    res = python_without({"torch"}, tmp_path, "-c", "import torch")
    assert res.returncode != 0 and "No module named 'torch'" in res.stderr


@pytest.mark.parametrize("command", ["report", "optimize", "convert"])
def test_recorder_dump_without_torch(tmp_path, command):
    dump = tmp_path / "expert_distribution_recorder_1767000000.0.pt"
    dump.write_bytes(b"PK\x03\x04 not read: torch is missing first")
    args = {"report": ["report", dump], "optimize": ["optimize", dump, "--ranks", "8", "-o", "p.json"],
            "convert": ["trace", "convert", dump, "-o", "t.mptrace"]}[command]
    res = moeplace_without({"torch"}, tmp_path, *args)
    line = assert_one_line(res, dump.name, "needs torch", "pip install 'moeplace[sglang]'")
    assert "moeplace trace convert" in line   # the way out where torch cannot be installed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dump.name, "site"])   # nothing written


def test_sglang_placement_pt_without_torch(tmp_path):
    placement = tmp_path / "init_expert_location.pt"
    placement.write_bytes(b"not read")
    res = moeplace_without({"torch"}, tmp_path, "compare", SAMPLE, placement, "--ranks", "8")
    assert_one_line(res, placement.name, "needs torch")


def test_capture_without_torch_stops_before_recording(tmp_path):
    """The dump is read with torch at the end: without torch, capture refuses before touching the server."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        res = moeplace_without({"torch"}, tmp_path, "capture", "--url", f"http://127.0.0.1:{httpd.server_address[1]}",
                               "--seconds", "0", "-o", "t.mptrace", "--dump-dir", tmp_path)
    finally:
        httpd.shutdown()
    assert_one_line(res, "capture", "needs torch")
    assert calls == [] and not (tmp_path / "t.mptrace").exists()


def test_launch_without_sglang(tmp_path):
    config = {"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.all_moe("m", 2, 8, 2)
    save_placement(tmp_path / "p.json", Placement(spec, 2, np.tile(np.arange(8), (2, 1))))
    res = moeplace_without({"sglang"}, tmp_path, "launch", "--placement", "p.json", "--",
                           "--model-path", tmp_path / "m", "--tp", "2", "--ep", "2")
    assert_one_line(res, "SGLang is not installed", "pip install 'moeplace[sglang]'")
    assert not (tmp_path / "p.sglang.json").exists()   # nothing written before the refusal
    # --dry-run needs no SGLang: it checks, writes SGLang's file and prints the command
    res = moeplace_without({"sglang"}, tmp_path, "launch", "--placement", "p.json", "--dry-run", "--",
                           "--model-path", tmp_path / "m", "--tp", "2", "--ep", "2")
    assert res.returncode == 0 and "sglang.launch_server" in res.stdout, res.stderr
