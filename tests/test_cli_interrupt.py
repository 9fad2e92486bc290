"""Ctrl-C and SIGTERM end a command within a second at any moment of its run, leaving all of its outputs
or none: a real ``optimize`` (placement, SGLang's file and plots) signalled at many moments, and the layer
workers' pool signalled while a worker is stuck (on a lock no one will release)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeplace import cli as cli_module
from moeplace.cli import Terminated
from moeplace.files import atomic

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "gptoss20b-sample.mptrace"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
GRACE_S = 1.0   # from the signal to the process's end


@pytest.fixture(autouse=True)
def sigint_as_at_a_terminal():
    """The commands here start with SIGINT handled, as a foreground command whose user presses Ctrl-C does: a
    test run started in the background of a shell script has SIGINT ignored (POSIX), which its children would
    inherit through exec, and a command that inherits SIGINT ignored rightly keeps ignoring it."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _signal_after(argv: list[str], delay: float, signum: int, cwd: Path) -> tuple[int | None, float, str]:
    """Run ``argv``, send ``signum`` after ``delay`` s: (exit code, seconds from the signal to its end, stderr);
    exit code None if it ran on past the grace time (then it is killed)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    time.sleep(delay)
    sent = time.perf_counter()
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=GRACE_S + 9)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, float("inf"), err.decode()
    return proc.returncode, time.perf_counter() - sent, err.decode()


# (seconds after start, signal): spread over optimize's run on the shipped sample (start-up, reading, the
# search, the table and the writes, ~3-7 s on a shared 2-core machine); any moment past its end finds it done.
MOMENTS = [(0.2, signal.SIGINT), (0.7, signal.SIGINT), (1.2, signal.SIGTERM), (1.8, signal.SIGINT),
           (2.5, signal.SIGINT), (3.2, signal.SIGTERM), (4.0, signal.SIGINT), (5.0, signal.SIGINT),
           (6.0, signal.SIGINT)]


@pytest.mark.parametrize("delay, signum", MOMENTS, ids=[f"{d}s-{s.name}" for d, s in MOMENTS])
def test_optimize_ends_at_once_and_leaves_all_or_nothing(tmp_path: Path, delay: float, signum: signal.Signals) -> None:
    argv = [sys.executable, "-m", "moeplace", "optimize", str(SAMPLE), "--ranks", "8", "--mode", "verify",
            "-o", "out/p.json", "--sglang-out", "out/s.json", "--plot-dir", "out/plots"]
    code, took, err = _signal_after(argv, delay, signum, tmp_path)
    assert code is not None, f"still running {GRACE_S + 9:.0f} s after {signum.name}: {err[-500:]}"
    assert took <= GRACE_S, f"{took:.2f} s from {signum.name} to the end"
    assert "Traceback" not in err, err
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    if code == 0 or (code == -signum and (tmp_path / "out" / "p.json").exists()):   # done before the signal
        assert json.loads((tmp_path / "out" / "p.json").read_text())["format"] == "moeplace-placement"
        assert json.loads((tmp_path / "out" / "s.json").read_text())["physical_to_logical_map"]
        assert not [p for p in left if Path(p).name.startswith(".")], left
    else:
        assert code in (128 + signum, -signum), (code, err)   # its exit code, or the signal itself at start-up
        assert err.strip().splitlines()[-1] == ("interrupted" if signum == signal.SIGINT else "terminated"), err
        assert left == [], f"left behind: {left}"


STUCK_POOL = """
import os, sys, threading, time
from moeplace.parallel import map_layers
held = threading.Lock()
held.acquire()                       # never released: a worker that takes it waits forever
def job(layer):
    with open(f"{sys.argv[1]}/worker-{os.getpid()}", "w"):
        pass
    if layer == 0:
        held.acquire()
    time.sleep(60)
print("started", flush=True)
try:
    list(map_layers(job, 4, 2))
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stuck_worker_does_not_hold_the_parent(tmp_path: Path, signum: signal.Signals) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_POOL)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)   # its own group: all killed on failure
    assert proc.stdout.readline() == b"started\n"
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("worker-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
    assert len(workers) == 2
    sent = time.perf_counter()
    proc.send_signal(signum)
    if signum == signal.SIGINT:   # the pool's own exit, timed apart from the interpreter's
        ready, _, _ = select.select([proc.stdout], [], [], GRACE_S + 9)
        if not ready:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"the parent waited on its workers after {signum.name}")
        assert proc.stdout.readline() == b"stopped\n"
        assert time.perf_counter() - sent <= GRACE_S
    try:
        proc.communicate(timeout=GRACE_S + 9)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the parent waited on its workers after {signum.name}")
    time.sleep(0.1)
    for pid in workers:   # killed and reaped, not left running
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.mark.parametrize("signalled, code, says", [(KeyboardInterrupt, 130, "interrupted"),
                                                   (Terminated, 128 + signal.SIGTERM, "terminated")])
def test_a_signal_during_an_extensions_import_ends_as_that_signal(monkeypatch, capsys, signalled, code, says):
    # a C extension whose init a signal interrupts (matplotlib's ft2font) raises ImportError from the signal's error
    def interrupted_import(*args, **kwargs):
        try:
            raise signalled()
        except signalled as e:
            raise ImportError("initialization failed") from e

    monkeypatch.setattr(cli_module.cli, "main", interrupted_import)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["optimize"])
    assert exit_info.value.code == code
    assert capsys.readouterr().err.strip() == says


def test_an_import_error_of_its_own_is_not_taken_for_a_signal(monkeypatch):
    def broken_import(*args, **kwargs):
        raise ImportError("no module named x")

    monkeypatch.setattr(cli_module.cli, "main", broken_import)
    with pytest.raises(ImportError, match="no module named x"):
        cli_module.main(["optimize"])


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("signalled", [KeyboardInterrupt, Terminated])
def test_a_signal_between_the_folders_and_the_temp_file_leaves_no_folder(tmp_path: Path, monkeypatch, nested: bool,
                                                                         signalled: type) -> None:
    """The output's folders are made before its temp file; a signal in between (here raised by mkstemp
    itself) must still remove them."""
    def interrupted(*args, **kwargs):
        raise signalled()

    monkeypatch.setattr(atomic.tempfile, "mkstemp", interrupted)
    target = tmp_path / "out" / "deeper" / "p.json"
    with pytest.raises(signalled):
        if nested:
            with atomic.all_or_nothing():
                atomic.atomic_write_text(target, "{}")
        else:
            atomic.atomic_write_text(target, "{}")
    assert not list(tmp_path.iterdir())
