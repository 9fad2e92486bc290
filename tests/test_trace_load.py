"""Trace sources: top-k npz windows, logical_count JSON, moeplace shards; Trace.load mode and stride; bad inputs.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.load import open_trace, read_logical_count_json, read_topk_npz
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import TraceHeader, write_trace

REPO = Path(__file__).parents[1]
SAMPLE = REPO / "traces" / "gptoss20b-sample.mptrace"
REAL = Path(__file__).parents[2] / "shared" / "traces-real"
GPTOSS_NPZ = REAL / "gptoss20b-fingerprint" / "gptoss20b_routing_topk_ids.npz"
DSV3_JSON = REAL / "sglang-dsv3-ep-stats" / "decode_in1000out1000.json"


# ----------------------------------------------------------------------------- top-k npz

def _row_coded_npz(path: Path, offsets: list[int], L: int = 2, K: int = 2, E: int = 64) -> np.ndarray:
    """ids[r, 0, 0] = r so each step's rows can be read back; returns ids [T, L, K]."""
    T = offsets[-1]
    ids = np.zeros((T, L, K), np.int64)
    ids[:, 0, 0] = np.arange(T)
    ids[:, :, 1:] = (np.arange(T)[:, None, None] + 1 + np.arange(L)[None, :, None]) % E
    np.savez(path, topk_ids=ids.astype(np.uint8), example_offsets=np.asarray(offsets), num_experts=E,
             model_name="toy-npz")
    return ids


def test_npz_windows_cut_within_examples(tmp_path):
    path = tmp_path / "ids.npz"
    ids = _row_coded_npz(path, [0, 10, 13, 31, 35])  # examples of 10, 3, 18, 4 tokens
    header, steps = read_topk_npz(path, window=4)
    # Example 0: rows 0-3, 4-7 (8, 9 dropped); example 1: none; example 2: 13-16, 17-20, 21-24, 25-28;
    # example 3: 31-34. No window straddles two examples.
    starts = [0, 4, 13, 17, 21, 25, 31]
    assert steps.num_steps == len(starts)
    np.testing.assert_array_equal(steps.topk_ids[:, 0, 0], np.concatenate([np.arange(s, s + 4) for s in starts]))
    np.testing.assert_array_equal(steps.topk_ids, ids[np.concatenate([np.arange(s, s + 4) for s in starts])])
    assert (steps.modes == M.TARGET_VERIFY).all() and (steps.num_tokens == 4).all()
    np.testing.assert_array_equal(steps.token_offsets, 4 * np.arange(len(starts) + 1))
    assert steps.count_steps.size == 0
    assert header.model == ModelSpec.all_moe("toy-npz", 2, 64, 2)
    assert header.source == "converted:ids.npz" and "4" in header.notes and not header.aggregate_only


def test_npz_window_longer_than_every_run_is_named(tmp_path):
    path = tmp_path / "ids.npz"
    _row_coded_npz(path, [0, 10, 13, 31, 35])
    with pytest.raises(MoeplaceError, match=r"--window 40: longer than the longest run .* \(18 tokens\)"):
        open_trace(path, window=40)


@pytest.mark.parametrize("window", [1, 3, 9, 18])
def test_npz_window_count(tmp_path, window):
    path = tmp_path / "ids.npz"
    offsets = [0, 10, 13, 31, 35]
    _row_coded_npz(path, offsets)
    trace = open_trace(path, window=window)
    steps = trace.load()
    assert steps.num_steps == sum(n // window for n in np.diff(offsets))
    # Each window is `window` consecutive rows of one example.
    rows = steps.topk_ids[:, 0, 0].astype(np.int64).reshape(-1, window)
    assert (np.diff(rows, axis=1) == 1).all()
    example = np.searchsorted(offsets, rows, side="right") - 1
    assert (example == example[:, :1]).all()


def test_npz_without_offsets_or_metadata(tmp_path):
    path = tmp_path / "plain.npz"
    np.savez(path, topk_ids=np.array([[[0, 3]], [[1, 2]], [[2, 1]], [[3, 0]], [[0, 1]]]))
    header, steps = read_topk_npz(path, window=2)
    assert header.model == ModelSpec.all_moe("plain", 1, 4, 2)  # experts from the largest id
    assert steps.num_steps == 2


def test_open_trace_rejects_window_zero(tmp_path):
    path = tmp_path / "ids.npz"
    _row_coded_npz(path, [0, 10])
    with pytest.raises(MoeplaceError, match="window"):
        open_trace(path, window=0)


@pytest.mark.skipif(not GPTOSS_NPZ.exists(), reason="shared GPT-OSS routing file not present")
def test_real_gptoss_npz_and_shipped_sample():
    offsets = np.load(GPTOSS_NPZ)["example_offsets"]
    windows = np.diff(offsets) // 9
    real = open_trace(GPTOSS_NPZ).load()
    assert real.num_steps == windows.sum()
    assert (real.model.num_moe_layers, real.model.num_experts, real.model.top_k) == (24, 32, 4)
    assert (real.modes == M.TARGET_VERIFY).all()
    # The shipped sample is every 8th example of it, cut the same way.
    sample = open_trace(SAMPLE).load()
    example = np.repeat(np.arange(windows.size), windows)
    expected = real.select(example % 8 == 0)
    assert sample.num_steps == expected.num_steps
    np.testing.assert_array_equal(sample.topk_ids, expected.topk_ids)
    np.testing.assert_array_equal(sample.token_offsets, expected.token_offsets)


def test_shipped_sample_opens():
    trace = open_trace(SAMPLE)
    m = trace.model
    assert (m.num_hidden_layers, m.num_moe_layers, m.num_experts, m.top_k) == (24, 24, 32, 4)
    assert "REAL" in trace.header.notes and not trace.header.aggregate_only
    steps = sum(c.num_steps for c in trace.chunks())
    assert steps > 1000 and trace.damaged == []


# ----------------------------------------------------------------------------- logical_count JSON

def test_logical_count_2d_with_dense_layers(tmp_path):
    counts = np.zeros((5, 6))
    counts[1] = [1, 2, 3, 4, 5, 6]
    counts[3] = [0, 0, 7, 0, 0, 1]
    counts[4] = [1, 1, 1, 1, 1, 1]
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    header, steps = read_logical_count_json(path, top_k=2)
    assert header.model == ModelSpec("stats", 5, (1, 3, 4), 6, 2)
    assert header.aggregate_only and header.source == "sglang-logical-count:stats.json"
    assert steps.num_steps == 1 and steps.topk_ids.shape[0] == 0
    np.testing.assert_array_equal(steps.counts[0], counts[[1, 3, 4]])
    np.testing.assert_array_equal(steps.expert_token_counts(), counts[[1, 3, 4]])


def test_logical_count_3d_is_summed_and_top_k_defaults_to_8(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, (4, 3, 16)).astype(float)
    counts[:, 0] = 0  # first layer dense
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"logical_count": counts.tolist(), "other": 1}))
    trace = open_trace(path)
    assert trace.model.moe_layers == (1, 2) and trace.model.top_k == 8
    assert "assumed" in trace.header.notes
    steps = trace.load()
    np.testing.assert_array_equal(steps.counts[0], counts.sum(axis=0)[1:])
    assert steps.modes.tolist() == [M.UNKNOWN]


@pytest.mark.skipif(not DSV3_JSON.exists(), reason="shared SGLang DeepSeek-V3 stats not present")
def test_real_dsv3_logical_count():
    trace = open_trace(DSV3_JSON)
    m = trace.model
    assert (m.num_hidden_layers, m.num_moe_layers, m.num_experts) == (61, 58, 256)
    assert m.moe_layers == tuple(range(3, 61))  # layers 0-2 are dense
    assert trace.header.aggregate_only
    raw = np.asarray(json.loads(DSV3_JSON.read_text())["logical_count"], float)
    np.testing.assert_array_equal(trace.load().counts[0], raw.reshape(-1, 61, 256).sum(axis=0)[3:])


# ----------------------------------------------------------------------------- Trace.load

MODEL = ModelSpec("m", 3, (0, 2), 8, 2)
MODE_CYCLE = [M.DECODE, M.TARGET_VERIFY, M.EXTEND, M.TARGET_VERIFY, M.IDLE, M.MIXED, M.DRAFT_EXTEND]


def _moded_trace(tmp_path, n_steps: int, chunk_steps: int) -> tuple[Path, RoutingSteps]:
    """Steps whose only row has ids (s % 8, (s + 1) % 8) in layer 0, so a step's identity is readable."""
    rng = np.random.default_rng(1)
    parts = []
    for s in range(n_steps):
        mode = MODE_CYCLE[s % len(MODE_CYCLE)]
        if mode == M.EXTEND and s % 2:  # some prefill steps as counts
            counts = rng.integers(0, 9, (1, 2, 8)).astype(float)
            parts.append(RoutingSteps.from_counts(MODEL, counts, mode, num_tokens=[s]))
        else:
            ids = np.array([[[s % 8, (s + 1) % 8], [0, 1]]])
            steps = RoutingSteps.from_topk(MODEL, ids, [1], mode)
            steps.num_tokens[:] = s  # step number, to identify it after filtering
            parts.append(steps)
    steps = concat_steps(parts)
    path = write_trace(tmp_path / "m", TraceHeader(MODEL, "synthetic"), steps, chunk_steps=chunk_steps)
    return path, steps


@pytest.mark.parametrize("mode", ["all", "verify", "decode", "prefill"])
def test_load_filters_by_mode(tmp_path, mode):
    path, steps = _moded_trace(tmp_path, 50, chunk_steps=6)
    got = open_trace(path).load(mode)
    want = steps.select(M.mode_mask(steps.modes, mode))
    assert got.num_steps == want.num_steps > 0
    for name in ("modes", "num_tokens", "token_offsets", "topk_ids", "count_steps", "counts"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert set(got.modes.tolist()) <= set(M.MODE_SELECTIONS[mode])


@pytest.mark.parametrize("mode,max_steps", [("all", 7), ("all", 49), ("all", 50), ("all", 500), ("verify", 5),
                                            ("decode", 1), ("prefill", 3)])
def test_load_max_steps_is_evenly_spaced(tmp_path, mode, max_steps):
    path, steps = _moded_trace(tmp_path, 50, chunk_steps=4)
    mode_idx = np.flatnonzero(M.mode_mask(steps.modes, mode))
    n = mode_idx.size
    picks = mode_idx[np.arange(max_steps) * n // max_steps] if n > max_steps else mode_idx
    got = open_trace(path).load(mode, max_steps=max_steps)
    assert got.num_steps == min(max_steps, n)
    # num_tokens holds the original step number.
    np.testing.assert_array_equal(got.num_tokens, picks)
    want = steps.take(picks)
    np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_array_equal(got.count_steps, want.count_steps)


@pytest.mark.parametrize("mode,max_steps", [("all", 7), ("all", 49), ("all", 50), ("all", 51), ("verify", 5),
                                            ("verify", 500), ("decode", 1), ("prefill", 3), ("all", None)])
@pytest.mark.parametrize("source", ["shards", "npz"])
def test_load_counted_is_load_and_count(tmp_path, mode, max_steps, source):
    """One pass where every step is kept, two reads otherwise: the steps of ``load`` and the total of ``count``."""
    if source == "shards":
        path, _ = _moded_trace(tmp_path, 50, chunk_steps=4)
    else:
        path = tmp_path / "ids.npz"
        _row_coded_npz(path, [0, 40])
    got, total = open_trace(path, window=2).load_counted(mode, max_steps)
    want = open_trace(path, window=2).load(mode, max_steps=max_steps)
    assert total == open_trace(path, window=2).count(mode)
    for name in ("modes", "num_tokens", "token_offsets", "topk_ids", "count_steps", "counts"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_load_counted_on_a_damaged_shard_counts_what_load_reads(tmp_path):
    path, _ = _moded_trace(tmp_path, 20, chunk_steps=8)
    data = path.read_bytes()
    path.write_bytes(data[:-10])   # the last chunk cut: the steps before it are read
    for max_steps in (5, 100):
        got, total = open_trace(path).load_counted("all", max_steps)
        assert total == open_trace(path).count("all") == 16
        assert got.num_steps == min(max_steps, 16)


def test_load_in_memory_source_with_stride(tmp_path):
    path = tmp_path / "ids.npz"
    _row_coded_npz(path, [0, 40])
    got = open_trace(path, window=2).load("verify", max_steps=6)  # 20 windows -> 0, 3, 6, 10, 13, 16
    windows = np.arange(6) * 20 // 6
    np.testing.assert_array_equal(got.topk_ids[:, 0, 0], np.concatenate([[2 * w, 2 * w + 1] for w in windows]))
    assert open_trace(path, window=2).load("prefill").num_steps == 0


def test_load_unknown_mode(tmp_path):
    path, _ = _moded_trace(tmp_path, 5, chunk_steps=4)
    with pytest.raises(MoeplaceError, match="unknown mode"):
        open_trace(path).load("sideways")


def test_folder_and_damaged_shard_via_open_trace(tmp_path):
    path, steps = _moded_trace(tmp_path, 20, chunk_steps=8)
    folder = tmp_path / "dir"
    folder.mkdir()
    data = path.read_bytes()
    (folder / "a.mptrace").write_bytes(data)
    (folder / "b.mptrace").write_bytes(data[:-5])  # last chunk cut
    trace = open_trace(folder)
    got = trace.load()
    assert got.num_steps == 20 + 16
    assert len(trace.damaged) == 1 and trace.damaged[0][0].name == "b.mptrace"


# ----------------------------------------------------------------------------- bad inputs

def _npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def _bad_sources(tmp_path: Path) -> list[tuple[Path, str]]:
    ok_ids = np.zeros((10, 2, 2), np.int64)
    ok_ids[:, :, 1] = 1
    good = _npz(tmp_path / "good.npz", topk_ids=ok_ids, example_offsets=np.array([0, 10]))
    compressed = tmp_path / "comp.npz"
    np.savez_compressed(compressed, topk_ids=np.random.default_rng(0).integers(0, 8, (3000, 3, 2)))
    corrupt = tmp_path / "corrupt.npz"
    raw = bytearray(compressed.read_bytes())
    raw[200] ^= 0xFF
    corrupt.write_bytes(bytes(raw))
    cases = [
        (tmp_path / "missing.mptrace", "no such file"),
        (tmp_path / "garbage.bin", "unknown trace format"),
        (tmp_path / "garbage.mptrace", "bad magic"),
        (tmp_path / "garbage.npz", "not a top-k ids .npz"),
        (tmp_path / "truncated.npz", "not a top-k ids .npz"),
        (corrupt, "not a top-k ids .npz"),
        (_npz(tmp_path / "noids.npz", other=np.zeros(3)), "not a top-k ids .npz"),
        (_npz(tmp_path / "flat.npz", topk_ids=np.zeros((10, 2))), "shape"),
        (_npz(tmp_path / "offs.npz", topk_ids=ok_ids, example_offsets=np.array([0, 5, 11])), "example_offsets"),
        (_npz(tmp_path / "offs2.npz", topk_ids=ok_ids, example_offsets=np.array([0, 7, 5, 10])), "example_offsets"),
        (_npz(tmp_path / "offs3.npz", topk_ids=ok_ids, example_offsets=np.zeros(0, np.int64)), "example_offsets"),
        (_npz(tmp_path / "range.npz", topk_ids=ok_ids + 8, num_experts=8), "outside the 8 experts"),
        (_npz(tmp_path / "neg.npz", topk_ids=ok_ids - 3, num_experts=8), ""),
        (_npz(tmp_path / "empty.npz", topk_ids=np.zeros((0, 2, 2), np.int64)), ""),
        (tmp_path / "notjson.json", "not valid JSON"),
        (tmp_path / "binary.json", "not valid JSON"),
        (tmp_path / "nokey.json", "no 'logical_count'"),
        (tmp_path / "list.json", "no 'logical_count'"),
        (tmp_path / "ragged.json", "not a rectangular array"),
        (tmp_path / "strings.json", "not a rectangular array"),
        (tmp_path / "neg.json", "negative"),
        (tmp_path / "nan.json", "NaN"),
        (tmp_path / "inf.json", "infinite"),
        (tmp_path / "onedim.json", "shape"),
        (tmp_path / "fourdim.json", "shape"),
        (tmp_path / "emptylist.json", "shape"),
        (tmp_path / "zeros.json", "all zero"),
    ]
    (tmp_path / "garbage.bin").write_bytes(b"\x00\x01garbage" * 10)
    (tmp_path / "garbage.mptrace").write_bytes(b"\x00\x01garbage" * 10)
    (tmp_path / "garbage.npz").write_bytes(b"\x00\x01garbage" * 10)
    (tmp_path / "truncated.npz").write_bytes(good.read_bytes()[:300])
    (tmp_path / "notjson.json").write_text('{"logical_count": [[1, 2]')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "nokey.json").write_text('{"physical_count": [[1, 2]]}')
    (tmp_path / "list.json").write_text("[[1, 2], [3, 4]]")
    (tmp_path / "ragged.json").write_text('{"logical_count": [[1, 2], [3]]}')
    (tmp_path / "strings.json").write_text('{"logical_count": [["a", "b"]]}')
    (tmp_path / "neg.json").write_text('{"logical_count": [[1, -2]]}')
    (tmp_path / "nan.json").write_text('{"logical_count": [[1, NaN]]}')
    (tmp_path / "inf.json").write_text('{"logical_count": [[1, Infinity]]}')
    (tmp_path / "onedim.json").write_text('{"logical_count": [1, 2, 3]}')
    (tmp_path / "fourdim.json").write_text('{"logical_count": [[[[1, 2]]]]}')
    (tmp_path / "emptylist.json").write_text('{"logical_count": []}')
    (tmp_path / "zeros.json").write_text('{"logical_count": [[0, 0], [0, 0]]}')
    return cases


def test_bad_inputs_are_format_errors_naming_the_file(tmp_path):
    for path, match in _bad_sources(tmp_path):
        with pytest.raises(FormatError) as info:
            open_trace(path).load()
        assert path.name in str(info.value), (path.name, str(info.value))
        assert match in str(info.value), (path.name, str(info.value))


# ----------------------------------------------------------------------------- modes and synthetic traces

def test_mode_mask_selections():
    modes = np.array([M.UNKNOWN, M.EXTEND, M.DECODE, M.MIXED, M.IDLE, M.TARGET_VERIFY, M.DRAFT_EXTEND], np.uint8)
    assert M.mode_mask(modes, "verify").tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert M.mode_mask(modes, "decode").tolist() == [0, 0, 1, 0, 0, 1, 0]
    assert M.mode_mask(modes, "prefill").tolist() == [0, 1, 0, 1, 0, 0, 0]
    assert M.mode_mask(modes, "all").all()
    assert set(M.MODE_NAMES) == set(range(7))


def test_synthetic_steps_shape_determinism_and_label():
    from moeplace.trace.synthetic import KIMI_K2, synthetic_steps

    header, steps = synthetic_steps(5, tokens_per_step=3, seed=1)
    assert header.model == KIMI_K2 and (KIMI_K2.num_hidden_layers, KIMI_K2.num_moe_layers) == (61, 60)
    assert "SYNTHETIC" in header.notes and "SYNTHETIC" in header.model.name and header.source == "synthetic"
    assert steps.topk_ids.shape == (15, 60, 8) and (steps.modes == M.TARGET_VERIFY).all()
    steps.validate()
    # Top-k ids of a token are distinct experts.
    srt = np.sort(steps.topk_ids, axis=2)
    assert (np.diff(srt, axis=2) > 0).all()
    np.testing.assert_array_equal(synthetic_steps(5, tokens_per_step=3, seed=1)[1].topk_ids, steps.topk_ids)
    assert not np.array_equal(synthetic_steps(5, tokens_per_step=3, seed=2)[1].topk_ids, steps.topk_ids)


def test_synthetic_skew_and_coactivation_do_what_they_say():
    from moeplace.dispatch.loads import layer_distinct_total
    from moeplace.trace.synthetic import synthetic_steps

    model = ModelSpec.all_moe("s", 2, 64, 4)
    _, flat = synthetic_steps(300, 9, model, skew=0.0, coactivation=0.0, seed=3)
    _, skewed = synthetic_steps(300, 9, model, skew=1.5, coactivation=0.0, seed=3)
    _, topical = synthetic_steps(300, 9, model, skew=0.0, coactivation=1.5, seed=3)
    share = lambda s: (s.expert_token_counts().max(axis=1) / s.expert_token_counts().sum(axis=1)).mean()  # noqa
    assert share(skewed) > 2 * share(flat)
    distinct = lambda s: np.mean([layer_distinct_total(s, layer).mean() for layer in range(2)])  # noqa
    assert distinct(topical) < 0.8 * distinct(flat)  # tokens of one step share experts


def test_steps_from_counts_follow_the_counts():
    from moeplace.trace.synthetic import steps_from_counts

    model = ModelSpec.all_moe("s", 1, 8, 2)
    counts = np.array([[100.0, 50, 25, 0, 0, 0, 0, 25]])
    steps = steps_from_counts(model, counts, 400, tokens_per_step=5, seed=0)
    assert steps.num_steps == 400 and steps.topk_ids.shape == (2000, 1, 2)
    got = steps.expert_token_counts()[0]
    assert got[[3, 4, 5, 6]].sum() < 0.02 * got.sum()  # experts with no tokens (almost) never drawn
    assert got[0] > got[1] > got[2]


@pytest.mark.parametrize("mode", ["all", "verify", "decode"])
def test_step_tokens_reads_what_load_reads_without_the_ids(mode, tmp_path):
    """``step_tokens`` (the first two arrays of each chunk) equals the loaded steps' token counts, on the
    shipped sample and on a trace whose chunks are decoded in full (the in-memory npz reader)."""
    sample = open_trace(Path(__file__).parent.parent / "traces" / "gptoss20b-sample.mptrace")
    np.testing.assert_array_equal(sample.step_tokens(mode), sample.load(mode).num_tokens)
    ids = np.random.default_rng(0).integers(0, 8, (40, 1, 2)).astype(np.int64)
    np.savez(tmp_path / "r.npz", topk_ids=ids)
    npz = open_trace(tmp_path / "r.npz")
    np.testing.assert_array_equal(npz.step_tokens(mode), npz.load(mode).num_tokens)
