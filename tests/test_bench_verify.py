"""The verify benchmark's Sm90Config variants from the command line (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_verify as bench  # noqa: E402
from moeplace_kernels.mla_verify_api import Sm90Config  # noqa: E402


@pytest.mark.parametrize("text,expected", [
    ("tma_runs=0", Sm90Config(tma_runs=False)),
    ("min_tiles=2, pdl=0", Sm90Config(min_tiles=2, pdl=False)),
    ("combine_slices=4,tma_runs=0,evict_first=1", Sm90Config(combine_slices=4, tma_runs=False)),
])
def test_fields_become_the_config(text, expected):
    cfg = bench.sm90_config(text)
    assert cfg == expected
    assert all(type(getattr(cfg, k)) is type(getattr(Sm90Config(), k)) for k in vars(cfg))


@pytest.mark.parametrize("text,says", [
    ("tma=1", "'tma=1' is not FIELD=VALUE"),
    ("tma_runs", "is not FIELD=VALUE"),
    ("pdl=yes", "pdl must be an integer, got 'yes'"),
    ("tma_runs=2", "tma_runs must be 0 or 1, got 2"),
    ("combine_slices=3", "combine_slices must be 0 (by the batch), 1, 2 or 4"),
])
def test_bad_fields_are_refused_in_one_line(text, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_verify.py", "--sm90-config", text])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1]
