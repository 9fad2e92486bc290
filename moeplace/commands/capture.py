"""``moeplace capture``: record a running SGLang server's routing with its own expert-distribution recorder.

Calls ``/start_expert_distribution_record``, waits, ``/stop_expert_distribution_record`` and
``/dump_expert_distribution_record``, then converts the dump files the server wrote (to
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``, default the system temp folder, on the server's machine)
into a moeplace trace. The server must run with ``--expert-distribution-recorder-mode``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

import click

from moeplace.commands.common import Progress
from moeplace.commands.options import MAX_SECONDS, FiniteFloatRange, out_option
from moeplace.errors import MoeplaceError
from moeplace.files.outputs import check_outputs

ENDPOINTS = ("start_expert_distribution_record", "stop_expert_distribution_record", "dump_expert_distribution_record")
SERVER_INFO = ("server_info", "get_server_info")   # SGLang 0.5.23's name, then the deprecated one
NOT_SGLANG_STATUSES = (405, 501)   # method not allowed / not implemented: SGLang serves these endpoints
CONTROL_TIMEOUT = 30.0   # s: server info, start and stop answer at once on a live server
DUMP_TIMEOUT = 600.0     # s: the dump call returns once every rank has written its records to disk


def default_dump_dir() -> Path:
    """Where SGLang writes dumps when the variable is unset (``tempfile.gettempdir()``)."""
    return Path(os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or tempfile.gettempdir())


def check_url(url: str) -> str:
    """``url`` without a trailing slash; MoeplaceError unless it is http(s)://host[:port][/path]."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MoeplaceError(f"--url {url!r}: want http://HOST:PORT, e.g. http://127.0.0.1:30000")
    try:
        parts.port
    except ValueError:
        raise MoeplaceError(f"--url {url!r}: the port is not a number from 0 to 65535") from None
    return url.rstrip("/")


def call_endpoint(url: str, name: str, timeout: float = CONTROL_TIMEOUT, method: str = "POST") -> bytes:
    """``method url/name``; return the body, or raise MoeplaceError with one line on any failure.

    Every way a server can fail is named: refused, reset or closed without an answer, no answer
    within ``timeout`` seconds, an answer that is not HTTP, and HTTP errors (with the body's first line).
    """
    full = f"{url}/{name}"
    request = urllib.request.Request(full, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        text = [line.strip() for line in _read_quietly(e).decode(errors="replace").splitlines()]
        said = next((line for line in text if line and not line.startswith("<")), "")   # not an HTML page's markup
        hint = " (is this an SGLang server?)" if e.code in NOT_SGLANG_STATUSES else ""
        raise HttpStatusError(e.code, f"{full}: HTTP {e.code} {e.reason}{': ' + said[:200] if said else ''}{hint}"
                              ) from None
    except urllib.error.URLError as e:   # failures before the request was sent: connect, DNS, TLS
        raise MoeplaceError(f"{full}: cannot reach SGLang: {_network_problem(e.reason, timeout)}") from None
    except (OSError, http.client.HTTPException) as e:   # failures while waiting for or reading the answer
        raise MoeplaceError(f"{full}: {_network_problem(e, timeout)}") from None


class HttpStatusError(MoeplaceError):
    """The server answered with an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _network_problem(reason: object, timeout: float) -> str:
    """One phrase for a socket or HTTP failure."""
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the server running, on this host and port?)"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s (--timeout; is the server busy or hung?)"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    if isinstance(reason, ConnectionResetError):
        return "the server reset the connection without an answer"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason.strerror})"
    if isinstance(reason, http.client.HTTPException):
        return f"the answer is not HTTP ({type(reason).__name__}: {_one_line(str(reason))[:80]})"
    if isinstance(reason, OSError):
        return reason.strerror or _one_line(str(reason)) or type(reason).__name__
    return _one_line(str(reason))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_quietly(response: urllib.error.HTTPError) -> bytes:
    try:
        return response.read()
    except (OSError, http.client.HTTPException):
        return b""


def check_server(url: str, timeout: float = CONTROL_TIMEOUT) -> dict:
    """SGLang's ``/server_info`` JSON; MoeplaceError if the server is unreachable, has no such endpoint
    (another HTTP server), its answer is not JSON, or it runs without an expert distribution recorder."""
    for name in SERVER_INFO:
        try:
            body = call_endpoint(url, name, timeout, method="GET")
        except HttpStatusError as e:
            if e.status == 404:
                continue
            raise
        try:
            info = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MoeplaceError(f"{url}/{name}: the answer is not JSON (is this an SGLang server?): "
                                f"{body[:60]!r}") from None
        if not isinstance(info, dict):
            raise MoeplaceError(f"{url}/{name}: the answer is JSON but not an object (is this an SGLang server?)")
        if "expert_distribution_recorder_mode" in info and not info["expert_distribution_recorder_mode"]:
            raise MoeplaceError(f"{url}: the server runs without an expert distribution recorder; restart it with "
                                f"--expert-distribution-recorder-mode per_token (or stat for counts only)")
        return info
    raise MoeplaceError(f"{url}: not an SGLang server (it has neither /{SERVER_INFO[0]} nor /{SERVER_INFO[1]}; "
                        f"is the port SGLang's --port?)")


def find_new_dumps(dump_dir: Path, since: float, wait: float = 10.0) -> list[Path]:
    """Recorder dumps in ``dump_dir`` written after ``since`` (epoch seconds), waiting up to ``wait`` s."""
    from moeplace.trace.recorder_dump import DUMP_PREFIX

    deadline = time.monotonic() + wait
    while True:
        found = sorted(p for p in dump_dir.glob(f"{DUMP_PREFIX}*.pt") if p.stat().st_mtime >= since - 1.0)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def capture_trace(url: str, seconds: float, out: str | os.PathLike, dump_dir: str | os.PathLike | None = None,
                  progress: Callable[[float], None] | None = None, dump_wait: float = 10.0,
                  timeout: float = CONTROL_TIMEOUT, dump_timeout: float = DUMP_TIMEOUT) -> tuple[Path, int]:
    """Record ``seconds`` of routing from the server at ``url`` into the trace file ``out``.

    Returns (trace path, steps). Raises MoeplaceError for an unreachable or misbehaving server, an
    HTTP error, a server without a recorder, no dump, an output that cannot be written, or no torch
    to read the dump with (the last two checked before recording starts, so that no capture is
    thrown away at the last step).
    """
    from moeplace.trace.recorder_dump import read_recorder_dump, require_torch
    from moeplace.trace.store import shard_path, write_trace

    url = check_url(url)
    check_outputs({"-o": shard_path(out)})
    require_torch("capture (it reads the recorder dumps SGLang writes)")
    folder = Path(dump_dir) if dump_dir else default_dump_dir()
    if not folder.is_dir():
        raise MoeplaceError(f"{folder}: dump folder does not exist (pass --dump-dir)")
    info = check_server(url, timeout)
    started = time.time()
    call_endpoint(url, ENDPOINTS[0], timeout)
    try:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            if progress:
                progress(min(seconds, seconds - max(0.0, end - time.monotonic())))
    finally:
        call_endpoint(url, ENDPOINTS[1], timeout)  # stop even when interrupted: the server must not record forever
    call_endpoint(url, ENDPOINTS[2], dump_timeout)
    dumps = find_new_dumps(folder, started, dump_wait)
    if not dumps:
        raise MoeplaceError(f"{folder}: no expert_distribution_recorder_*.pt written since the capture started "
                            "(is the server on this machine? pass --dump-dir or set "
                            "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR as the server has it)")
    header, steps = read_recorder_dump(dumps)
    header.source = f"moeplace capture {url} ({seconds:g} s); " + header.source
    if isinstance(info.get("model_path"), str):   # name the model as the server does, not by the dump's shape
        header.model = dataclasses.replace(header.model, name=info["model_path"])
    path = write_trace(out, header, steps)
    return path, steps.num_steps


@click.command()
@click.option("--url", required=True, help="SGLang server, e.g. http://127.0.0.1:30000")
@click.option("--seconds", type=FiniteFloatRange(0, MAX_SECONDS), default=30, show_default=True, help="How long to record.")
@out_option("Trace file to write (.mptrace).")
@click.option("--dump-dir", type=click.Path(file_okay=False),
              help="Where the server writes dumps (its SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR; default: temp folder).")
@click.option("--timeout", type=FiniteFloatRange(0, MAX_SECONDS, min_open=True), default=CONTROL_TIMEOUT, show_default=True,
              help="Seconds to wait for each control call (server info, start, stop) to answer.")
@click.option("--dump-timeout", type=FiniteFloatRange(0, MAX_SECONDS, min_open=True), default=DUMP_TIMEOUT,
              show_default=True, help="Seconds to wait for the dump call (every rank writes its records).")
def capture(url: str, seconds: float, out: str, dump_dir: str | None, timeout: float, dump_timeout: float) -> None:
    """Record a running SGLang server's expert routing into a moeplace trace.

    The server needs --expert-distribution-recorder-mode (per_token keeps each token's experts;
    stat keeps counts only). Run this on the server's machine, or point --dump-dir at a shared folder.

    \b
    Example:
      moeplace capture --url http://127.0.0.1:30000 --seconds 60 -o run1.mptrace
    """
    progress = Progress(seconds, "recording", "s")
    elapsed = [0.0]

    def advance(now: float) -> None:
        progress(now - elapsed[0])
        elapsed[0] = now

    path, steps = capture_trace(url, seconds, out, dump_dir, advance, timeout=timeout, dump_timeout=dump_timeout)
    click.echo(f"wrote {path}: {steps} steps")
