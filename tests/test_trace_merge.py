"""``moeplace trace merge``: plain TP keeps one rank's copy, EP keeps all; output is atomic."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.commands.trace import merge_traces
from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import ShardWriter, TraceHeader, TraceReader

MODEL = ModelSpec("toy", 4, (1, 3), 8, 2)


def _steps(seed: int, rank: int = 0, n_steps: int = 3) -> RoutingSteps:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 4, n_steps)
    ids = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(sizes.sum())])
    return RoutingSteps.from_topk(MODEL, ids, sizes, 2, rank)


def _write(folder, rank: int, ep: int, tp: int, seed: int, **attention) -> RoutingSteps:
    steps = _steps(seed, rank)
    header = TraceHeader(MODEL, "moeplace-tracer", ep_size=ep, tp_size=tp, ranks=[rank], **attention)
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


@pytest.mark.parametrize("dp, groups, kept", [(1, [0, 0, 0, 0], [0]), (2, [0, 0, 1, 1], [0, 2]),
                                               (4, [0, 1, 2, 3], [0, 1, 2, 3])])
def test_ranks_of_one_attention_group_are_kept_once(tmp_path, capsys, dp, groups, kept):
    """EP 4 under tensor-parallel attention: every rank of an attention group routed the group's tokens
    (the headers say which group); one rank each is kept, and the output says so."""
    seeds = {g: 10 + g for g in groups}
    written = [_write(tmp_path, r, ep=4, tp=4, seed=seeds[g], attn_dp_size=dp, attn_dp_rank=g)
               for r, g in enumerate(groups)]
    out = tmp_path / "o" / "m.mptrace"
    main(["trace", "merge", str(tmp_path), "-o", str(out)])
    said = capsys.readouterr().out
    merged = concat_steps(list(TraceReader(out)))
    assert merged.num_steps == sum(written[r].num_steps for r in kept)
    assert sorted(set(merged.ranks.tolist())) == kept
    if len(kept) < len(groups):
        assert f"kept rank(s) {kept}" in said and "same tokens" in said
    else:
        assert "same tokens" not in said


def test_without_attention_in_the_headers_identical_ranks_are_found_by_content(tmp_path):
    """Shards of an older tracer (no attention fields), EP 2: the same steps on both ranks."""
    a = _write(tmp_path, 0, ep=2, tp=2, seed=5)
    _write(tmp_path, 1, ep=2, tp=2, seed=5)
    res = merge_traces([tmp_path], tmp_path / "o" / "m.mptrace")
    assert res.ranks_kept == [0] and res.steps == a.num_steps and "identical first" in res.same_tokens


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
    main(["trace", "merge", str(tmp_path), "--include-partial", "-o", str(tmp_path / "merged" / "m.mptrace")])
    assert "ranks [0, 1]" in capsys.readouterr().out


# ----------------------------------------------------------------------------- refusals: nothing written

def _merge_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main(["trace", "merge", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_refused(code: int, err: str, out_dir, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not list(out_dir.glob("merged*")), "nothing may be written on a refusal"


def test_shard_cut_in_half_is_refused(tmp_path, capsys):
    """A one-chunk shard cut in the middle holds no whole step: refused, not a 0-step trace."""
    _write(tmp_path, 0, ep=2, tp=1, seed=5)
    shard = tmp_path / "t-r000-00000.mptrace"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2 + 40])
    code, _, err = _merge_cli(capsys, shard, "-o", tmp_path / "merged.mptrace")
    _assert_refused(code, err, tmp_path, "no step to merge", "t-r000-00000.mptrace", "cut inside a chunk")


def test_empty_shards_are_refused(tmp_path, capsys):
    ShardWriter(tmp_path / "t-r000-00000", TraceHeader(MODEL, "t", ep_size=2, ranks=[0])).close()
    code, _, err = _merge_cli(capsys, tmp_path, "-o", tmp_path / "out" / "merged.mptrace")
    _assert_refused(code, err, tmp_path / "out", "no step to merge", "empty")


def test_cut_tail_after_whole_chunks_merges_them_with_a_warning(tmp_path, capsys):
    steps = [_steps(6, 0), _steps(7, 0)]
    with ShardWriter(tmp_path / "t-r000-00000", TraceHeader(MODEL, "t", ep_size=2, ranks=[0])) as w:
        for s in steps:
            w.append(s)
    shard = tmp_path / "t-r000-00000.mptrace"
    shard.write_bytes(shard.read_bytes()[:-5])
    code, out, err = _merge_cli(capsys, shard, "-o", tmp_path / "m" / "merged.mptrace")
    assert code == 0 and f"{steps[0].num_steps} steps" in out
    assert "warning:" in err and "cut inside a chunk" in err


def test_same_folder_twice_is_refused(tmp_path, capsys):
    _write(tmp_path, 0, ep=2, tp=2, seed=1)
    _write(tmp_path, 1, ep=2, tp=2, seed=2)
    code, _, err = _merge_cli(capsys, tmp_path, tmp_path, "-o", tmp_path / "o" / "merged.mptrace")
    _assert_refused(code, err, tmp_path / "o", "given twice", "t-r000-00000.mptrace")
    code, _, err = _merge_cli(capsys, tmp_path, tmp_path / "t-r001-00000.mptrace", "-o", tmp_path / "o" / "merged")
    _assert_refused(code, err, tmp_path / "o", "given twice", "t-r001-00000.mptrace")


def test_a_copy_of_a_shard_is_refused(tmp_path, capsys):
    _write(tmp_path, 0, ep=2, tp=2, seed=1)
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "renamed.mptrace").write_bytes((tmp_path / "t-r000-00000.mptrace").read_bytes())
    code, _, err = _merge_cli(capsys, tmp_path, tmp_path / "copy", "-o", tmp_path / "o" / "merged.mptrace")
    _assert_refused(code, err, tmp_path / "o", "hold the same steps", "renamed.mptrace")


def test_a_merged_trace_with_its_own_shards_is_refused(tmp_path, capsys):
    """merge DIR -o DIR/run.mptrace is refused (the output would be one of DIR's shards); a merged trace moved
    into DIR, then DIR merged again: the merged trace holds the shards' steps."""
    _write(tmp_path, 0, ep=2, tp=2, seed=1)
    _write(tmp_path, 1, ep=2, tp=2, seed=2)
    code, _, err = _merge_cli(capsys, tmp_path, "-o", tmp_path / "run.mptrace")
    _assert_refused(code, err, tmp_path, "inside the folder", "run.mptrace")
    assert _merge_cli(capsys, tmp_path, "-o", tmp_path / "elsewhere" / "run.mptrace")[0] == 0
    (tmp_path / "elsewhere" / "run.mptrace").rename(tmp_path / "run.mptrace")
    (tmp_path / "elsewhere").rmdir()
    code, _, err = _merge_cli(capsys, tmp_path, "-o", tmp_path / "o" / "merged.mptrace")
    _assert_refused(code, err, tmp_path / "o", "hold the same steps", "run.mptrace")
    code, _, err = _merge_cli(capsys, tmp_path / "run.mptrace", "-o", tmp_path / "run.mptrace")   # over an input
    assert code == 2 and "is the output of this merge" in err
    # two merged traces of different runs merge fine
    other = tmp_path / "other"
    other.mkdir()
    _write(other, 0, ep=2, tp=2, seed=3)
    assert _merge_cli(capsys, other, "-o", tmp_path / "run2.mptrace")[0] == 0
    code, out, _ = _merge_cli(capsys, tmp_path / "run.mptrace", tmp_path / "run2.mptrace",
                              "-o", tmp_path / "o" / "both.mptrace")
    assert code == 0 and "from 2 shard(s)" in out
