"""``moeplace capture`` against real local servers that misbehave: every network failure is one line on
stderr, exit code 2, no traceback, no trace file, and no long wait.

Each server is a real socket on 127.0.0.1: one that never answers, one that resets or closes the
connection, one that speaks something other than HTTP, and HTTP servers that answer with errors,
with what is not JSON, or without a recorder.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import pytest

from moeplace.cli import main

pytest.importorskip("torch")   # capture checks first that it can read the dump it will get

RECORDING = {"model_path": "m", "expert_distribution_recorder_mode": "per_token"}


class RawServer:
    """Accepts connections and hands each socket to ``behave`` (after reading the request)."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.behave = behave
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            conn.recv(65536)
            self.behave(conn)

    def close(self) -> None:
        for conn in [self.sock, *self.held]:
            conn.close()


def never_answer(conn: socket.socket) -> None:
    pass   # keep the connection open, say nothing


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close with RST
    conn.close()


def close_quietly(conn: socket.socket) -> None:
    conn.close()


def not_http(conn: socket.socket) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    conn.close()


HANG = (0, b"")   # a route that never answers


def http_server(routes: dict[tuple[str, str], tuple[int, bytes]]) -> ThreadingHTTPServer:
    """Answers ``(method, path)`` with ``(status, body)``; HANG never answers; anything else 404."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            status, body = routes.get((self.command, self.path), (404, b"<html><body>Not Found</body></html>"))
            if (status, body) == HANG:
                time.sleep(30)
                return
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def raw() -> Iterator[Callable[[Callable], RawServer]]:
    servers = []

    def make(behave: Callable) -> RawServer:
        servers.append(RawServer(behave))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def http() -> Iterator[Callable[[dict], str]]:
    servers = []

    def make(routes: dict) -> str:
        servers.append(http_server(routes))
        return f"http://127.0.0.1:{servers[-1].server_address[1]}"

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def run_capture(tmp_path: Path, capsys, url: str, *extra: str) -> tuple[int, str, float]:
    """Run ``moeplace capture`` (0 s of recording); (exit code, stderr, seconds taken)."""
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["capture", "--url", url, "--seconds", "0", "-o", str(tmp_path / "t.mptrace"),
              "--dump-dir", str(tmp_path), *extra])
    return e.value.code, capsys.readouterr().err, time.monotonic() - start


def assert_one_line(tmp_path: Path, code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not list(tmp_path.glob("t.mptrace*"))   # nothing written, not even a temp file


def test_server_that_never_answers_times_out(tmp_path, capsys, raw):
    server = raw(never_answer)
    code, err, took = run_capture(tmp_path, capsys, server.url, "--timeout", "1")
    assert_one_line(tmp_path, code, err, "server_info", "no answer within 1 s", "--timeout")
    assert took < 10


def test_default_timeout_is_well_under_a_minute() -> None:
    from moeplace.commands.capture import capture

    timeout = next(p for p in capture.params if p.name == "timeout")
    assert timeout.default <= 30


@pytest.mark.parametrize("behave, needle", [
    (reset, "reset the connection"),
    (close_quietly, "closed the connection without an answer"),
    (not_http, "the answer is not HTTP"),
])
def test_connection_dropped_or_garbled(tmp_path, capsys, raw, behave, needle):
    code, err, took = run_capture(tmp_path, capsys, raw(behave).url)
    assert_one_line(tmp_path, code, err, needle)
    assert took < 10


def test_refused(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"   # closed again: nothing listens there
    code, err, _ = run_capture(tmp_path, capsys, url)
    assert_one_line(tmp_path, code, err, "connection refused")


@pytest.mark.parametrize("routes, needles", [
    ({("GET", "/server_info"): (500, b"<html>\n<h1>Internal Server Error</h1>\noops: scheduler died\n")},
     ["HTTP 500", "oops: scheduler died"]),
    ({("GET", "/server_info"): (200, b"<html>welcome</html>")}, ["not JSON", "SGLang"]),
    ({("GET", "/server_info"): (200, b"[1, 2]")}, ["not an object"]),
    ({("GET", "/server_info"): (200, json.dumps({"expert_distribution_recorder_mode": None}).encode())},
     ["without an expert distribution recorder", "--expert-distribution-recorder-mode"]),
    ({("GET", "/server_info"): (200, json.dumps(RECORDING).encode()),
      ("POST", "/start_expert_distribution_record"): (400, b"expert_distribution_recorder_mode is not set")},
     ["start_expert_distribution_record", "HTTP 400", "is not set"]),
    ({}, ["not an SGLang server", "/server_info"]),   # no server info at all: another HTTP server
    ({("GET", "/server_info"): (200, json.dumps(RECORDING).encode()),
      ("POST", "/start_expert_distribution_record"): (501, b"Unsupported method ('POST')")},
     ["HTTP 501", "is this an SGLang server?"]),
])
def test_http_answers_that_are_wrong(tmp_path, capsys, http, routes, needles):
    code, err, _ = run_capture(tmp_path, capsys, http(routes))
    assert_one_line(tmp_path, code, err, *needles)


def test_hang_at_stop_is_one_line(tmp_path, capsys, http):
    """Recording started, then the server hangs: the stop call's timeout is reported, as one line."""
    url = http({("GET", "/server_info"): (200, json.dumps(RECORDING).encode()),
                ("POST", "/start_expert_distribution_record"): (200, b"ok"),
                ("POST", "/stop_expert_distribution_record"): HANG})
    code, err, took = run_capture(tmp_path, capsys, url, "--timeout", "0.5")
    assert_one_line(tmp_path, code, err, "stop_expert_distribution_record", "no answer within 0.5 s")
    assert took < 10


@pytest.mark.parametrize("url, needle", [
    ("127.0.0.1:30000", "want http://HOST:PORT"),
    ("ftp://127.0.0.1:30000", "want http://HOST:PORT"),
    ("http://127.0.0.1:99999", "port"),
])
def test_bad_url(tmp_path, capsys, url, needle):
    code, err, _ = run_capture(tmp_path, capsys, url)
    assert_one_line(tmp_path, code, err, needle)


def test_sigterm_while_recording_stops_the_recorder(tmp_path, http):
    """SIGTERM during the recording (a job scheduler ending the capture) unwinds as Ctrl-C does: the
    server is told to stop recording, nothing is written, the exit code says terminated."""
    import signal
    import subprocess
    import sys

    calls: list[str] = []

    class Recorded(dict):
        def get(self, key, default=None):
            calls.append(key[1])
            return super().get(key, default)

    url = http(Recorded({("GET", "/server_info"): (200, json.dumps(RECORDING).encode()),
                         ("POST", "/start_expert_distribution_record"): (200, b"ok"),
                         ("POST", "/stop_expert_distribution_record"): (200, b"ok")}))
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", "capture", "--url", url, "--seconds", "60",
                             "-o", str(tmp_path / "t.mptrace"), "--dump-dir", str(tmp_path)],
                            cwd=Path(__file__).parents[1], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "/start_expert_distribution_record" not in calls and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err
    assert calls[-1] == "/stop_expert_distribution_record"
    assert not list(tmp_path.iterdir())
