"""``moeplace capture``: record a running SGLang server's routing with its own expert-distribution recorder.

Calls ``/start_expert_distribution_record``, waits, ``/stop_expert_distribution_record`` and
``/dump_expert_distribution_record``, then converts the dump files the server wrote (to
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``, default the system temp folder, on the server's machine)
into a moeplace trace. The server must run with ``--expert-distribution-recorder-mode``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import click

from moeplace.errors import MoeplaceError

ENDPOINTS = ("start_expert_distribution_record", "stop_expert_distribution_record", "dump_expert_distribution_record")


def default_dump_dir() -> Path:
    """Where SGLang writes dumps when the variable is unset (``tempfile.gettempdir()``)."""
    return Path(os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or tempfile.gettempdir())


def call_endpoint(url: str, name: str, timeout: float = 600.0) -> None:
    """POST ``url/name``; raise MoeplaceError with one line on any failure."""
    full = f"{url.rstrip('/')}/{name}"
    try:
        with urllib.request.urlopen(urllib.request.Request(full, data=b"", method="POST"), timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace").strip().splitlines()
        hint = " (was the server started with --expert-distribution-recorder-mode?)" if e.code >= 400 else ""
        raise MoeplaceError(f"{full}: HTTP {e.code} {e.reason}{': ' + body[0][:200] if body else ''}{hint}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        what = "connection refused (is the server running?)" if isinstance(reason, ConnectionRefusedError) \
            else str(reason)
        raise MoeplaceError(f"{full}: cannot reach SGLang: {what}") from None
    except (socket.timeout, TimeoutError):
        raise MoeplaceError(f"{full}: no answer within {timeout:.0f} s") from None


def find_new_dumps(dump_dir: Path, since: float, wait: float = 10.0) -> list[Path]:
    """Recorder dumps in ``dump_dir`` written after ``since`` (epoch seconds), waiting up to ``wait`` s."""
    from moeplace.sglang.recorder_dump import DUMP_PREFIX

    deadline = time.monotonic() + wait
    while True:
        found = sorted(p for p in dump_dir.glob(f"{DUMP_PREFIX}*.pt") if p.stat().st_mtime >= since - 1.0)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def capture_trace(url: str, seconds: float, out: str | os.PathLike, dump_dir: str | os.PathLike | None = None,
                  progress: Callable[[float], None] | None = None, dump_wait: float = 10.0) -> tuple[Path, int]:
    """Record ``seconds`` of routing from the server at ``url`` into the trace file ``out``.

    Returns (trace path, steps). Raises MoeplaceError for an unreachable server, an HTTP error or no dump.
    """
    from moeplace.sglang.recorder_dump import read_recorder_dump  # needs torch
    from moeplace.trace.store import write_trace

    folder = Path(dump_dir) if dump_dir else default_dump_dir()
    if not folder.is_dir():
        raise MoeplaceError(f"{folder}: dump folder does not exist (pass --dump-dir)")
    started = time.time()
    call_endpoint(url, ENDPOINTS[0])
    try:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            if progress:
                progress(min(seconds, seconds - max(0.0, end - time.monotonic())))
    finally:
        call_endpoint(url, ENDPOINTS[1])  # stop even when interrupted, so the server does not record forever
    call_endpoint(url, ENDPOINTS[2])
    dumps = find_new_dumps(folder, started, dump_wait)
    if not dumps:
        raise MoeplaceError(f"{folder}: no expert_distribution_recorder_*.pt written since the capture started "
                            "(is the server on this machine? pass --dump-dir or set "
                            "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR as the server has it)")
    header, steps = read_recorder_dump(dumps)
    header.source = f"moeplace capture {url} ({seconds:g} s); " + header.source
    path = write_trace(out, header, steps)
    return path, steps.num_steps


@click.command()
@click.option("--url", required=True, help="SGLang server, e.g. http://127.0.0.1:30000")
@click.option("--seconds", type=click.FloatRange(min=0), default=30, show_default=True, help="How long to record.")
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="Trace file to write (.mptrace).")
@click.option("--dump-dir", type=click.Path(file_okay=False),
              help="Where the server writes dumps (its SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR; default: temp folder).")
def capture(url: str, seconds: float, out: str, dump_dir: str | None) -> None:
    """Record a running SGLang server's expert routing into a moeplace trace.

    The server needs --expert-distribution-recorder-mode (per_token keeps each token's experts;
    stat keeps counts only). Run this on the server's machine, or point --dump-dir at a shared folder.

    \b
    Example:
      moeplace capture --url http://127.0.0.1:30000 --seconds 60 -o run1.mptrace
    """
    with click.progressbar(length=int(seconds * 10), label="recording", file=sys.stderr) as bar:
        done = [0]

        def progress(elapsed: float) -> None:
            step = int(elapsed * 10)
            bar.update(step - done[0])
            done[0] = step

        path, steps = capture_trace(url, seconds, out, dump_dir, progress)
    click.echo(f"wrote {path}: {steps} steps")
