"""The numpy commands ask BLAS for one thread and numpy for no huge-page advice before numpy loads, unless
the environment says otherwise; `launch` and `capture` (whose SGLang inherits the environment) are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, sys
import click
from moeplace.cli import cli
cli.get_command(click.Context(cli), sys.argv[1])
out = {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                     "NUMPY_MADVISE_HUGEPAGE")}
numpy = sys.modules.get("numpy")
out["hugepage"] = numpy._core.multiarray._get_madvise_hugepage() if numpy else None
print(json.dumps(out))
"""


def blas_environment(command: str, **preset: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                          "OMP_NUM_THREADS", "NUMPY_MADVISE_HUGEPAGE")}
    env.update(preset, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE, command], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def blas(probed: dict) -> dict:
    return {k: v for k, v in probed.items() if k not in ("hugepage", "NUMPY_MADVISE_HUGEPAGE")}


@pytest.mark.parametrize("command", ["optimize", "report", "compare", "advise", "trace"])
def test_numpy_commands_ask_for_one_blas_thread(command):
    probed = blas_environment(command)
    assert blas(probed) == {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": None}
    assert probed["hugepage"] is False   # numpy, loaded by the command's module, gives no huge-page advice


def test_huge_page_advice_set_in_the_environment_wins():
    assert blas_environment("optimize", NUMPY_MADVISE_HUGEPAGE="1")["hugepage"] is True


def test_a_count_in_the_environment_wins():
    assert blas(blas_environment("optimize", OMP_NUM_THREADS="4")) == {"OPENBLAS_NUM_THREADS": None,
                                                                 "MKL_NUM_THREADS": None, "OMP_NUM_THREADS": "4"}
    assert blas_environment("optimize", OPENBLAS_NUM_THREADS="2")["OPENBLAS_NUM_THREADS"] == "2"


@pytest.mark.parametrize("command", ["launch", "capture"])
def test_commands_that_start_sglang_leave_the_environment_alone(command):
    assert blas_environment(command)["NUMPY_MADVISE_HUGEPAGE"] is None
    assert blas(blas_environment(command)) == {"OPENBLAS_NUM_THREADS": None, "MKL_NUM_THREADS": None,
                                         "OMP_NUM_THREADS": None}
