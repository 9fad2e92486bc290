"""``moeplace trace merge``: plain TP keeps one rank's copy, EP keeps all; output is atomic."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.commands.trace import merge_traces
from moeplace.model import ModelSpec
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import ShardWriter, TraceHeader, TraceReader

MODEL = ModelSpec("toy", 4, (1, 3), 8, 2)


def _steps(seed: int, rank: int = 0, n_steps: int = 3) -> RoutingSteps:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 4, n_steps)
    ids = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(sizes.sum())])
    return RoutingSteps.from_topk(MODEL, ids, sizes, 2, rank)


def _write(folder, rank: int, ep: int, tp: int, seed: int) -> RoutingSteps:
    steps = _steps(seed, rank)
    header = TraceHeader(MODEL, "moeplace-tracer", ep_size=ep, tp_size=tp, ranks=[rank])
    with ShardWriter(folder / f"t-r{rank:03d}-00000", header) as w:
        w.append(steps)
    return steps


def test_plain_tp_keeps_one_rank(tmp_path):
    a = _write(tmp_path, 0, ep=1, tp=2, seed=0)
    _write(tmp_path, 1, ep=1, tp=2, seed=0)  # same tokens on the other TP rank
    res = merge_traces([tmp_path], tmp_path / "out" / "merged.mptrace")
    assert res.steps == a.num_steps and res.ranks_kept == [0] and len(res.shards_skipped) == 1
    merged = concat_steps(list(TraceReader(res.out)))
    np.testing.assert_array_equal(merged.topk_ids, a.topk_ids)


def test_ep_keeps_all_ranks(tmp_path):
    a = _write(tmp_path, 0, ep=2, tp=2, seed=1)
    b = _write(tmp_path, 1, ep=2, tp=2, seed=2)
    res = merge_traces(sorted(tmp_path.glob("*.mptrace")), tmp_path / "merged.mptrace")
    merged = concat_steps(list(TraceReader(res.out)))
    assert res.ranks_kept == [0, 1] and merged.num_steps == a.num_steps + b.num_steps
    assert merged.ranks.tolist() == [0] * a.num_steps + [1] * b.num_steps
    np.testing.assert_array_equal(merged.topk_ids, np.concatenate([a.topk_ids, b.topk_ids]))


def test_model_mismatch_is_one_line_and_leaves_nothing(tmp_path, capsys):
    _write(tmp_path, 0, ep=2, tp=2, seed=1)
    other = ModelSpec("other", 4, (1, 3), 16, 2)
    with ShardWriter(tmp_path / "x-r001-00000", TraceHeader(other, "t", ranks=[1])) as w:
        w.append(RoutingSteps.from_topk(other, np.zeros((1, 2, 2), np.int16), [1], 2))
    out = tmp_path / "o" / "merged.mptrace"
    with pytest.raises(SystemExit) as e:
        main(["trace", "merge", str(tmp_path / "t-r000-00000.mptrace"), str(tmp_path / "x-r001-00000.mptrace"),
              "-o", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "x-r001-00000.mptrace" in err and "model" in err
    assert not out.exists() and not list(out.parent.glob("*"))  # the .part was removed


def test_cli_merge_and_partial(tmp_path, capsys):
    _write(tmp_path, 0, ep=2, tp=1, seed=3)
    steps = _steps(4, 1)
    w = ShardWriter(tmp_path / "t-r001-00000", TraceHeader(MODEL, "t", ep_size=2, ranks=[1]))
    w.append(steps)
    w._file.flush()  # a rank that crashed: its shard is still .part
    main(["trace", "merge", str(tmp_path), "--include-partial", "-o", str(tmp_path / "m.mptrace")])
    assert "ranks [0, 1]" in capsys.readouterr().out
