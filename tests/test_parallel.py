"""moeplace.parallel: every layer's result once, from forked workers or in process, and a job's error
raised to the caller."""

from __future__ import annotations

import os

import pytest

from moeplace.parallel import PARALLEL_CELLS, layer_workers, map_layers, usable_cpus


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_layer_once(workers):
    results = dict(map_layers(lambda layer: (layer * layer, os.getpid()), 7, workers))
    assert {layer: square for layer, (square, _) in results.items()} == {i: i * i for i in range(7)}
    pids = {pid for _, pid in results.values()}
    assert (os.getpid() in pids) == (workers == 1)


def fail_on_three(layer: int) -> int:
    if layer == 3:
        raise ValueError("layer 3 failed")
    return layer


@pytest.mark.parametrize("workers", [1, 2])
def test_a_jobs_error_reaches_the_caller(workers):
    with pytest.raises(ValueError, match="layer 3 failed"):
        list(map_layers(fail_on_three, 6, workers))


def test_usable_cpus_is_positive():
    assert usable_cpus() >= 1


@pytest.mark.parametrize("variables,expect_all", [({"OPENBLAS_NUM_THREADS": "1"}, True), ({"OMP_NUM_THREADS": "1"}, True),
                                                  ({}, False), ({"OPENBLAS_NUM_THREADS": "4", "OMP_NUM_THREADS": "1"}, False)])
def test_workers_only_where_blas_runs_one_thread_and_the_work_is_large(variables, expect_all, monkeypatch):
    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert layer_workers(PARALLEL_CELLS) == (usable_cpus() if expect_all else 1)
    assert layer_workers(PARALLEL_CELLS - 1) == 1


def test_a_worker_starts_no_pool_of_its_own(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    inner = dict(map_layers(lambda layer: layer_workers(PARALLEL_CELLS), 2, 2))
    assert inner == {0: 1, 1: 1}
