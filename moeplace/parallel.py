"""Independent jobs, one per MoE layer, on the machine's CPUs: forked worker processes.

The optimizer's phases are many numpy calls on arrays of a few thousand elements, which hold the GIL
for much of their time, so threads barely scale; forked workers read the parent's arrays without
copying them, and only each layer's small result comes back. Where fork is missing or unsafe
(Windows; macOS, whose system libraries do not survive it) or one CPU is all there is, the jobs run
in the calling process, so results never depend on the worker count.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, Iterator

_job: Callable[[int], Any] | None = None   # the forked workers' job, inherited rather than pickled
# Work (steps x slots x layers) below which a pool is not worth starting: forking two workers costs
# ~0.1 s, a Kimi-K2-sized placement (14,000 x 384 x 60 = 3e8) seconds.
PARALLEL_CELLS = 50_000_000


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def layer_workers(cells: int) -> int:
    """Workers worth starting for ``cells`` of work (steps x slots x layers): every usable CPU where the
    work passes PARALLEL_CELLS and numpy's BLAS was asked for one thread (the CLI does so), else 1, as
    each worker's BLAS threads would fight the other workers for the CPUs."""
    asked = next((os.environ[v] for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
                  if v in os.environ), None)
    return usable_cpus() if asked == "1" and cells >= PARALLEL_CELLS else 1


def map_layers(job: Callable[[int], Any], layers: int, workers: int) -> Iterator[tuple[int, Any]]:
    """(layer, job(layer)) for every layer < ``layers``, in the order they finish, on up to ``workers``
    forked processes. A job's exception is raised here; on any exit the jobs not started are dropped."""
    global _job
    if workers <= 1 or layers <= 1 or not sys.platform.startswith("linux"):
        for layer in range(layers):
            yield layer, job(layer)
        return
    _job = job
    try:
        with ProcessPoolExecutor(min(workers, layers), mp_context=multiprocessing.get_context("fork"),
                                 initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
            futures = {pool.submit(_run, layer): layer for layer in range(layers)}
            try:
                for done in as_completed(futures):
                    yield futures[done], done.result()
            finally:
                pool.shutdown(cancel_futures=True)
    finally:
        _job = None


def _run(layer: int) -> Any:
    return _job(layer)
