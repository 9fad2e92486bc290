"""``moeplace capture`` against a local stand-in of SGLang's HTTP endpoints that writes a dump made by
SGLang's real recorder (see test_recorder_dump.make_real_dumps)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from moeplace.cli import main
from moeplace.commands.capture import capture_trace
from moeplace.errors import MoeplaceError

pytest.importorskip("torch")
pytest.importorskip("sglang")

from test_recorder_dump import make_real_dumps  # noqa: E402  (tests/ is on sys.path under pytest)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    return make_real_dumps(tmp_path_factory.mktemp("capture_dumps"))


SERVER_INFO = {"model_path": "openai/gpt-oss-20b", "expert_distribution_recorder_mode": "per_token"}


def _server(dump_dir: Path, source: Path, fail: str | None = None):
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):   # SGLang's /server_info: the resolved server arguments as JSON
            calls.append(self.path.strip("/"))
            self.send_response(200 if self.path == "/server_info" else 404)
            self.end_headers()
            self.wfile.write(json.dumps(SERVER_INFO).encode())

        def do_POST(self):
            name = self.path.strip("/")
            calls.append(name)
            if name == fail:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b"expert_distribution_recorder_mode is not set")
                return
            if name == "dump_expert_distribution_record" and source is not None:
                for f in source.glob("*.pt"):  # as SGLang: one file per rank, named by time
                    shutil.copy(f, dump_dir / f.name.replace(f.name.split("_")[3], f"{time.time():.4f}"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", calls


def test_capture_writes_a_trace(tmp_path, dumps):
    httpd, url, calls = _server(tmp_path, dumps / "per_pass")
    try:
        ticks = []
        path, steps = capture_trace(url, 0.3, tmp_path / "run.mptrace", tmp_path, progress=ticks.append)
    finally:
        httpd.shutdown()
    assert calls == ["server_info", "start_expert_distribution_record", "stop_expert_distribution_record",
                     "dump_expert_distribution_record"]
    from moeplace.trace.store import TraceReader

    reader = TraceReader(path)
    assert reader.header.ranks == [0, 1] and steps == sum(c.num_steps for c in reader) > 0
    assert reader.model.name == "openai/gpt-oss-20b"   # named as the server names it
    assert ticks  # progress was reported


def test_capture_cli(tmp_path, dumps, capsys):
    httpd, url, _ = _server(tmp_path, dumps / "per_token")
    try:
        main(["capture", "--url", url, "--seconds", "0.2", "-o", str(tmp_path / "t.mptrace"),
              "--dump-dir", str(tmp_path)])
    finally:
        httpd.shutdown()
    assert "steps" in capsys.readouterr().out and (tmp_path / "t.mptrace").exists()


def test_connection_refused_is_one_line(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(SystemExit) as e:
        main(["capture", "--url", f"http://127.0.0.1:{port}", "--seconds", "0", "-o", str(tmp_path / "x"),
              "--dump-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "connection refused" in err and "server_info" in err and err.startswith("error: ")


def test_http_error_and_missing_dump(tmp_path):
    httpd, url, calls = _server(tmp_path, None, fail="start_expert_distribution_record")
    try:
        with pytest.raises(MoeplaceError, match="HTTP 400.*expert_distribution_recorder_mode"):
            capture_trace(url, 0, tmp_path / "x.mptrace", tmp_path)
    finally:
        httpd.shutdown()
    httpd, url, calls = _server(tmp_path, None)  # answers, writes no dump
    try:
        with pytest.raises(MoeplaceError, match="no expert_distribution_recorder_.*written"):
            capture_trace(url, 0, tmp_path / "x.mptrace", tmp_path, dump_wait=0.3)
    finally:
        httpd.shutdown()
    assert not (tmp_path / "x.mptrace").exists()
