"""Independent jobs, one per MoE layer, on the machine's CPUs: forked worker processes.

The optimizer's phases are many numpy calls on arrays of a few thousand elements, which hold the GIL
for much of their time, so threads barely scale; forked workers read the parent's arrays without
copying them, and only each layer's small result comes back. Where fork is missing or unsafe
(Windows; macOS, whose system libraries do not survive it) or one CPU is all there is, the jobs run
in the calling process, so results never depend on the worker count.

The workers are plain forks, each talking to the parent over its own pipe: no queue, no lock, no
helper thread. A pool that forks while its own feeder thread holds a lock (``ProcessPoolExecutor``)
can leave a worker blocked on that lock forever, and a parent that waits for it at Ctrl-C with it.
Here every exit of the caller (a result taken, an error, Ctrl-C, SIGTERM) kills the workers still
running (SIGKILL) and reaps them at once; a worker also dies with its parent (Linux's PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, Callable, Iterator

# Work (steps x slots x layers) below which a pool is not worth starting: forking two workers costs
# ~0.1 s, a Kimi-K2-sized placement (14,000 x 384 x 60 = 3e8) seconds.
PARALLEL_CELLS = 50_000_000
_PR_SET_PDEATHSIG = 1
_in_worker = False   # set in a forked worker (``layer_workers``)


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def layer_workers(cells: int) -> int:
    """Workers worth starting for ``cells`` of work (steps x slots x layers): every usable CPU where the
    work passes PARALLEL_CELLS and numpy's BLAS was asked for one thread (the CLI does so), else 1, as
    each worker's BLAS threads would fight the other workers for the CPUs; 1 inside a worker (a job of one
    pool, say one of ``advise``'s layouts, that runs a pooled search)."""
    if _in_worker:
        return 1   # a worker's jobs run in it: a pool of its own would fight its siblings for the CPUs
    asked = next((os.environ[v] for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
                  if v in os.environ), None)
    return usable_cpus() if asked == "1" and cells >= PARALLEL_CELLS else 1


def map_layers(job: Callable[[int], Any], layers: int, workers: int) -> Iterator[tuple[int, Any]]:
    """(layer, job(layer)) for every layer < ``layers``, in the order they finish, on up to ``workers``
    forked processes. A job's exception is raised here; on any exit the workers are killed and reaped."""
    if workers <= 1 or layers <= 1 or not sys.platform.startswith("linux"):
        for layer in range(layers):
            yield layer, job(layer)
        return
    pool: dict[Connection, int] = {}   # parent's end of each worker's pipe -> the worker's pid
    try:
        for _ in range(min(workers, layers)):
            conn, pid = _fork_worker(job, list(pool))
            pool[conn] = pid
        todo = iter(range(layers))
        busy = []
        for conn in pool:
            layer = next(todo, None)
            if layer is not None:
                conn.send(layer)
                busy.append(conn)
        while busy:
            for conn in wait(busy):
                try:
                    layer, ok, value = conn.recv()
                except EOFError:
                    raise RuntimeError(f"a layer worker (pid {pool[conn]}) ended without its result") from None
                if not ok:
                    raise value
                yield layer, value
                following = next(todo, None)
                if following is None:
                    busy.remove(conn)
                else:
                    conn.send(following)
    finally:
        _stop(pool)


def _fork_worker(job: Callable[[int], Any], siblings: list[Connection]) -> tuple[Connection, int]:
    """Fork one worker running ``job`` on each layer the parent sends; (parent's end of its pipe, pid)."""
    global _in_worker
    parent_end, child_end = Pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:   # the worker: never returns into the caller's code
        _in_worker = True
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the parent's to handle
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _die_with_parent(parent)
            parent_end.close()
            for other in siblings:
                other.close()
            _serve(job, child_end)
        except BaseException:   # noqa: BLE001 (the parent sees the pipe close and raises)
            code = 1
        finally:
            os._exit(code)
    child_end.close()
    return parent_end, pid


def _serve(job: Callable[[int], Any], conn: Connection) -> None:
    while True:
        try:
            layer = conn.recv()
        except EOFError:
            return
        try:
            reply = (layer, True, job(layer))
        except Exception as e:  # noqa: BLE001 (raised again in the parent)
            reply = (layer, False, e)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 (a result or error that does not pickle)
            conn.send((layer, False, RuntimeError(f"layer {layer}: {type(e).__name__}: {e}")))


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when its parent dies (Linux), and end now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _stop(pool: dict[Connection, int]) -> None:
    """Kill every worker (those done have exited or are waiting for work) and reap them: never waits on one."""
    for conn, pid in pool.items():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        conn.close()
    for pid in pool.values():
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
