"""Which MLA verify kernel runs where (CPU only): Hopper kernel on sm_90 only, Triton elsewhere,
and a missing or broken compiler falls back to Triton with one warning line, not a crash."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from moeplace_kernels import mla_verify_sm90  # noqa: E402
from moeplace_kernels.mla_verify_api import (  # noqa: E402
    COMBINE_SLICE_CTAS_PER_SM, MlaVerify, Sm90Config, combine_slices, select_backend,
    sm90_rows)


class Loader:
    """Stand-in for mla_verify_sm90.load that counts its calls."""

    def __init__(self, library):
        self.library = library
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.library


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0), None])
def test_auto_never_builds_off_hopper(capability):
    load = Loader(object())
    assert select_backend("auto", capability, load) == "triton"
    assert load.calls == 0


def test_auto_takes_hopper_kernel_on_sm90_when_it_builds():
    assert select_backend("auto", (9, 0), Loader(object())) == "sm90"
    assert select_backend("auto", (9, 0), Loader(None)) == "triton"
    assert select_backend("triton", (9, 0), Loader(object())) == "triton"


def test_forced_sm90_refuses_other_devices_and_missing_library():
    with pytest.raises(ValueError, match="9.0"):
        select_backend("sm90", (12, 0), Loader(object()))
    with pytest.raises(RuntimeError, match="could not be built"):
        select_backend("sm90", (9, 0), Loader(None))
    with pytest.raises(ValueError, match="backend must be"):
        select_backend("cutlass", (9, 0), Loader(object()))


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """load() as on first use: empty cache folder, nothing loaded yet in this process."""
    monkeypatch.setenv("MOEPLACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mla_verify_sm90, "_loaded", {})
    return tmp_path


def _fake_nvcc(folder: Path, build: str) -> Path:
    """An executable ``nvcc`` in ``folder`` that answers --version and otherwise runs the shell lines ``build``."""
    fake = folder / "nvcc"
    fake.write_text("#!/bin/sh\necho 'fake nvcc 0.0'\n[ \"$1\" = --version ] && exit 0\n" + build)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_missing_compiler_warns_once_and_falls_back(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(mla_verify_sm90, "find_nvcc", lambda: None)
    with caplog.at_level(logging.WARNING, logger=mla_verify_sm90.__name__):
        assert mla_verify_sm90.load() is None
        assert mla_verify_sm90.load() is None  # cached: no second warning
        assert select_backend("auto", (9, 0), mla_verify_sm90.load) == "triton"
    lines = _warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0] and "nvcc" in lines[0], lines


def test_failing_compiler_warns_once_and_falls_back(fresh_loader, monkeypatch, caplog):
    fake = _fake_nvcc(fresh_loader, "echo 'x.cu(1): error: broken' >&2\nexit 1\n")
    monkeypatch.setattr(mla_verify_sm90, "find_nvcc", lambda: str(fake))
    with caplog.at_level(logging.WARNING, logger=mla_verify_sm90.__name__):
        assert mla_verify_sm90.load() is None
        assert mla_verify_sm90.load() is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0] and "error: broken" in lines[0], lines
    assert not list((fresh_loader / "cache").rglob("*.so")), "no half-written library is kept"


def test_serialised_wgmma_warns_and_keeps_the_build(fresh_loader, caplog):
    fake = _fake_nvcc(fresh_loader, "while [ \"$1\" != -o ]; do shift; done; echo lib > \"$2\"\n"
                                    "echo \"ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async "
                                    "instructions are serialized due to ...\" >&2\n")
    with caplog.at_level(logging.WARNING, logger=mla_verify_sm90.__name__):
        path = mla_verify_sm90.build(str(fake))
    assert path.read_text() == "lib\n"
    lines = _warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0] and "one at a time" in lines[0], lines


def test_find_nvcc_prefers_cuda_home(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert mla_verify_sm90.find_nvcc() == str(nvcc)


def test_cpu_device_uses_triton_without_building(monkeypatch):
    def fail():
        raise AssertionError("load() must not run off sm_90")

    monkeypatch.setattr(mla_verify_sm90, "load", fail)
    assert MlaVerify(8, 9, 2, device="cpu").backend == "triton"


@pytest.mark.parametrize("rows,expected", [
    (8, (0, 16, 1)), (32, (1, 32, 1)), (36, (2, 48, 1)), (64, (3, 64, 1)), (72, (4, 72, 1)),
    (80, (2, 48, 2)), (144, (4, 72, 2)), (16 * 16, (3, 64, 4)), (128 * 16, (4, 72, 29)),
])
def test_sm90_row_blocks(rows, expected):
    variant, per_block, blocks = sm90_rows(rows)
    assert (variant, per_block, blocks) == expected
    assert per_block * blocks >= rows and per_block <= 72


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_combine_slices_are_the_most_whose_grid_is_at_most_3_ctas_per_sm(sms):
    limit = COMBINE_SLICE_CTAS_PER_SM * sms
    for rows in range(1, 30 * sms, 7):
        slices = combine_slices(rows, sms)
        assert slices in (1, 2, 4)
        assert slices == 1 or rows * slices <= limit
        assert slices == 4 or rows * 2 * slices > limit
    # 8 heads x 9 drafts: one request 4, two 2, four to sixteen 1 (the benchmark's best)
    assert [combine_slices(b * 72, 132) for b in (1, 2, 4, 8, 16)] == [4, 2, 1, 1, 1]


@pytest.mark.parametrize("slices", [-1, 3, 8])
def test_sm90_config_refuses_other_slice_counts(slices):
    with pytest.raises(ValueError, match="combine_slices"):
        Sm90Config(combine_slices=slices)


@pytest.mark.skipif(mla_verify_sm90.find_nvcc() is None, reason="no nvcc here")
def test_library_builds_and_matches_its_ctypes_mirrors(fresh_loader, caplog):
    """A real build (no GPU needed to load it): struct sizes and variants agree with Python, and ptxas
    issues the products asynchronously (no warning at all)."""
    with caplog.at_level(logging.WARNING, logger=mla_verify_sm90.__name__):
        lib = mla_verify_sm90.load()
    assert lib is not None
    assert not _warnings(caplog)
    assert lib.path.parent == fresh_loader / "cache" / "kernels"
    assert all(n >= 17 for n in lib.ring_blocks)  # the loop's deadlock-free minimum
    # the short layout splits a block's rows between the two consumer warpgroups, 8-row aligned each,
    # and only blocks larger than it take it
    assert lib.short_rows % 16 == 0 and lib.short_rows < max(mla_verify_sm90.ROWS_PER_BLOCK)
    assert mla_verify_sm90.build(mla_verify_sm90.find_nvcc()) == lib.path  # cached
    assert os.path.getsize(lib.path) > 0
