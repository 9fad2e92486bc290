"""The shard format: round trips, folders of shards, crash-cut and corrupt shards, streaming memory.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical slots.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace import steps as steps_module
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import (UNFINISHED, CHUNK_ARRAYS, WHOLE_ARRAYS, ShardWriter, TraceHeader, TraceReader,
                                  write_chunks, write_trace)

CHUNK_HEAD = 16  # b"MPCK", u32 length, u32 crc, u32 num_steps


def _mixed_steps(model: ModelSpec, rng: np.random.Generator, token_steps: int, count_steps: int,
                 max_rows: int = 5) -> RoutingSteps:
    """Token-row steps and count steps interleaved, with -1 (no expert) in some top-k slots.

    Top-k ids are distinct within a row, as a router's are.
    """
    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    parts = []
    kinds = ["t"] * token_steps + ["c"] * count_steps
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "t":
            rows = int(rng.integers(0, max_rows + 1))  # 0-row steps (idle) too
            ids = np.argsort(rng.random((rows, L, E)), axis=2)[:, :, :K]
            ids[rng.random(ids.shape) < 0.1] = -1
            parts.append(RoutingSteps.from_topk(model, ids, [rows], int(rng.choice([M.DECODE, M.TARGET_VERIFY])),
                                                int(rng.integers(0, 4))))
        else:
            counts = rng.integers(0, 50, (1, L, E)).astype(np.float64)
            parts.append(RoutingSteps.from_counts(model, counts, M.EXTEND, ranks=int(rng.integers(0, 4))))
    if not parts:
        return RoutingSteps.empty(model)
    return concat_steps(parts)


def _read_all(path, **kw) -> tuple[RoutingSteps | None, TraceReader]:
    reader = TraceReader(path, **kw)
    chunks = list(reader)
    return (concat_steps(chunks) if chunks else None), reader


def _assert_same_steps(a: RoutingSteps, b: RoutingSteps) -> None:
    assert a.model == b.model
    for name in CHUNK_ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


SHAPES = [
    # (num_hidden_layers, moe_layers, E, K, token_steps, count_steps, chunk_steps)
    (1, (0,), 4, 1, 7, 0, 3),
    (4, (1, 3), 8, 2, 5, 4, 2),
    (61, tuple(range(1, 61)), 384, 8, 6, 2, 4),
    (3, (0, 1, 2), 16, 16, 0, 5, 1),
    (2, (0, 1), 5, 3, 40, 10, 65536),
]


@pytest.mark.parametrize("hidden,moe,E,K,token_steps,count_steps,chunk_steps", SHAPES)
def test_round_trip(tmp_path, hidden, moe, E, K, token_steps, count_steps, chunk_steps):
    model = ModelSpec("m", hidden, moe, E, K)
    steps = _mixed_steps(model, np.random.default_rng(hidden * 7 + E), token_steps, count_steps)
    header = TraceHeader(model, "synthetic", ep_size=2, tp_size=4, nodes=1, ranks=[0, 1, 2, 3], notes="x")
    path = write_trace(tmp_path / "t", header, steps, chunk_steps=chunk_steps)
    assert path.name == "t.mptrace" and path.exists()
    assert not list(tmp_path.glob("*.part"))
    back, reader = _read_all(path)
    assert not reader.damaged
    _assert_same_steps(steps, back)
    h = reader.header
    assert (h.model, h.source, h.ep_size, h.tp_size, h.ranks, h.notes, h.id_space) == \
           (model, "synthetic", 2, 4, [0, 1, 2, 3], "x", "logical")
    # The chunking follows chunk_steps.
    sizes = [c.num_steps for c in TraceReader(path)]
    assert sum(sizes) == steps.num_steps and max(sizes) <= chunk_steps


def test_empty_trace_round_trip(tmp_path):
    model = ModelSpec("m", 2, (0, 1), 4, 2)
    path = write_trace(tmp_path / "e.mptrace", TraceHeader(model, "synthetic"), RoutingSteps.empty(model))
    reader = TraceReader(path)
    assert list(reader) == [] and not reader.damaged and reader.model == model


@pytest.mark.parametrize("E,K,redundant,layers", [(8, 2, 0, 2), (8, 2, 8, 3), (32, 4, 8, 2), (6, 1, 2, 1)])
def test_physical_ids_read_back_logical(tmp_path, E, K, redundant, layers):
    """Shards in physical id space (the tracer's) come back with logical ids and [S_c, L, E] counts."""
    rng = np.random.default_rng(E + redundant)
    model = ModelSpec.all_moe("phys", layers, E, K)
    P = E + redundant
    # Every expert once, then random extra replicas, shuffled per layer.
    phy2log = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, redundant)]))
                        for _ in range(layers)])
    logical = _mixed_steps(model, rng, token_steps=6, count_steps=3)

    # Physical ids: each (row, layer, k) goes to a random replica of its logical expert.
    ids = logical.topk_ids.astype(np.int64)
    phys_ids = np.full(ids.shape, -1, np.int64)
    for idx in zip(*np.nonzero(ids >= 0)):
        replicas = np.flatnonzero(phy2log[idx[1]] == ids[idx])
        phys_ids[idx] = rng.choice(replicas)
    # Physical counts: each logical count split over its replicas.
    phys_counts = np.zeros((logical.counts.shape[0], layers, P))
    for s in range(logical.counts.shape[0]):
        for layer in range(layers):
            for e in range(E):
                replicas = np.flatnonzero(phy2log[layer] == e)
                split = rng.multinomial(int(logical.counts[s, layer, e]), np.ones(replicas.size) / replicas.size)
                phys_counts[s, layer, replicas] = split

    header = TraceHeader(model, "moeplace-tracer", id_space="physical", physical_to_logical_map=phy2log.tolist(),
                         ep_size=2)
    arrays = {k: getattr(logical, k) for k in CHUNK_ARRAYS}
    arrays.update(topk_ids=phys_ids.astype(np.int16), counts=phys_counts)
    with ShardWriter(tmp_path / "p", header) as w:
        w.append_arrays(arrays)
    back, reader = _read_all(tmp_path / "p.mptrace")
    assert reader.header.id_space == "physical"
    _assert_same_steps(logical, back)


@pytest.mark.parametrize("bad_id", [6, 100, -2, -7])
def test_physical_id_outside_map_is_format_error(tmp_path, bad_id):
    """Slot ids past the map, or negative ones other than -1, are a bad file, not silently 'none'."""
    model = ModelSpec.all_moe("phys", 1, 4, 1)
    header = TraceHeader(model, "moeplace-tracer", id_space="physical", physical_to_logical_map=[[0, 1, 2, 3, 0, 1]])
    steps = RoutingSteps.from_topk(model, [[[0]]], [1], M.DECODE)
    arrays = {k: getattr(steps, k) for k in CHUNK_ARRAYS}
    arrays["topk_ids"] = np.array([[[bad_id]]], np.int16)
    arrays["counts"] = np.zeros((0, 1, 6))  # [S_c, L, P]
    with ShardWriter(tmp_path / "p", header) as w:
        w.append_arrays(arrays)
    with pytest.raises(FormatError, match="p.mptrace"):
        list(TraceReader(tmp_path / "p.mptrace"))


def test_folder_of_shards_reads_as_one(tmp_path):
    model = ModelSpec("m", 4, (1, 3), 8, 2)
    rng = np.random.default_rng(3)
    parts = []
    # Written out of name order: the reader joins shards in name order.
    for name, rank in (("run-r001-00000", 1), ("run-r000-00001", 0), ("run-r000-00000", 0)):
        steps = _mixed_steps(model, rng, 4, 2)
        steps.ranks[:] = rank
        with ShardWriter(tmp_path / name, TraceHeader(model, "moeplace-tracer", ranks=[rank])) as w:
            w.append(steps.take(np.arange(0, 3)))
            w.append(steps.take(np.arange(3, steps.num_steps)))
        parts.append((name, steps))
    # A shard never finished (.part) is read, its whole chunks, with a note; or left out when asked.
    with ShardWriter(tmp_path / "run-r002-00000", TraceHeader(model, "moeplace-tracer", ranks=[2])) as w:
        w.append(_mixed_steps(model, rng, 2, 0))
        partial = w.partial_path
        back, reader = _read_all(tmp_path, include_partial=False)
        assert [p.name for p in reader.shards] == sorted(name + ".mptrace" for name, _ in parts)
        assert reader.header.ranks == [0, 1] and not reader.damaged
        expected = concat_steps([s for _, s in sorted(parts)])
        _assert_same_steps(expected, back)
        with_partial, reader = _read_all(tmp_path)
        assert partial in reader.shards and with_partial.num_steps == expected.num_steps + 2
        assert reader.header.ranks == [0, 1, 2] and reader.damaged == [(partial, UNFINISHED)]


def test_folder_with_shards_of_other_models_is_rejected(tmp_path):
    a, b = ModelSpec("a", 2, (0, 1), 8, 2), ModelSpec("b", 2, (0, 1), 16, 2)
    write_trace(tmp_path / "x0", TraceHeader(a, "s"), RoutingSteps.empty(a))
    write_trace(tmp_path / "x1", TraceHeader(b, "s"), RoutingSteps.empty(b))
    with pytest.raises(FormatError, match="x1.mptrace"):
        TraceReader(tmp_path)


def test_empty_folder_and_missing_path(tmp_path):
    with pytest.raises(FormatError, match="no .mptrace shards"):
        TraceReader(tmp_path)
    with pytest.raises(FormatError, match="nope"):
        TraceReader(tmp_path / "nope")


# ----------------------------------------------------------------------------- damaged shards

@pytest.fixture()
def three_chunk_shard(tmp_path):
    """A shard of 3 chunks; returns (path, chunk boundaries [start0, start1, start2, end], chunks)."""
    model = ModelSpec("m", 3, (0, 2), 8, 2)
    steps = _mixed_steps(model, np.random.default_rng(5), 9, 3)
    chunks = [steps.take(np.arange(0, 4)), steps.take(np.arange(4, 8)), steps.take(np.arange(8, steps.num_steps))]
    with ShardWriter(tmp_path / "cut", TraceHeader(model, "synthetic")) as w:
        bounds = [w.bytes_written]
        for c in chunks:
            bounds.append(bounds[-1] + w.append(c))
    assert bounds[-1] == (tmp_path / "cut.mptrace").stat().st_size
    return tmp_path / "cut.mptrace", bounds, chunks


def _check_prefix(path, chunks, n_whole: int, reason: str | None) -> None:
    back, reader = _read_all(path)
    if n_whole:
        _assert_same_steps(concat_steps(chunks[:n_whole]), back)
    else:
        assert back is None
    if reason is None:
        assert reader.damaged == []
    else:
        assert len(reader.damaged) == 1
        assert reader.damaged[0][0] == path and reason in reader.damaged[0][1]


@pytest.mark.parametrize("cut", ["at_start", "head+1", "head+8", "head+15", "head_only", "payload+1", "mid",
                                 "end-1"])
def test_crash_cut_last_chunk(three_chunk_shard, cut):
    path, bounds, chunks = three_chunk_shard
    start, end = bounds[2], bounds[3]
    offset = {"at_start": start, "head+1": start + 1, "head+8": start + 8, "head+15": start + 15,
              "head_only": start + CHUNK_HEAD, "payload+1": start + CHUNK_HEAD + 1,
              "mid": (start + CHUNK_HEAD + end) // 2, "end-1": end - 1}[cut]
    data = path.read_bytes()
    path.write_bytes(data[:offset])
    if cut == "at_start":  # cut exactly between chunks: a clean, shorter shard
        _check_prefix(path, chunks, 2, None)
    elif offset - start < CHUNK_HEAD:
        _check_prefix(path, chunks, 2, "cut inside a chunk header")
    else:
        _check_prefix(path, chunks, 2, "cut inside a chunk")


def test_every_truncation_reads_a_prefix(three_chunk_shard):
    """Truncating anywhere after the shard header yields whole chunks only, never an exception."""
    path, bounds, chunks = three_chunk_shard
    data = path.read_bytes()
    offsets = sorted(set(range(bounds[0], bounds[-1], 7)) | {b + d for b in bounds[:-1] for d in (0, 1, 15, 16, 17)})
    for offset in offsets:
        path.write_bytes(data[:offset])
        whole = sum(b <= offset for b in bounds[1:])
        clean = offset in bounds
        _check_prefix(path, chunks, whole, None if clean else "cut")


@pytest.mark.parametrize("chunk", [0, 2])
def test_crc_mismatch_is_damage(three_chunk_shard, chunk):
    path, bounds, chunks = three_chunk_shard
    data = bytearray(path.read_bytes())
    data[(bounds[chunk] + CHUNK_HEAD + bounds[chunk + 1]) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    _check_prefix(path, chunks, chunk, "CRC mismatch")


def test_any_flipped_byte_in_last_chunk_never_misreads(three_chunk_shard):
    """A flip anywhere in the last chunk (its header fields included) drops that chunk only."""
    path, bounds, chunks = three_chunk_shard
    clean = path.read_bytes()
    start, end = bounds[2], bounds[3]
    positions = list(range(start, start + CHUNK_HEAD)) + list(range(start + CHUNK_HEAD, end, max(1, (end - start) // 40)))
    for pos in positions:
        data = bytearray(clean)
        data[pos] ^= 0x01
        path.write_bytes(bytes(data))
        back, reader = _read_all(path)
        _assert_same_steps(concat_steps(chunks[:2]), back)
        assert len(reader.damaged) == 1, pos


def test_damage_is_reported_once_per_pass(three_chunk_shard):
    """Iterating a reader twice (report reads the trace twice) does not repeat the damage."""
    path, bounds, chunks = three_chunk_shard
    path.write_bytes(path.read_bytes()[:bounds[3] - 1])
    reader = TraceReader(path)
    for _ in range(2):
        assert sum(c.num_steps for c in reader) == chunks[0].num_steps + chunks[1].num_steps
        assert len(reader.damaged) == 1


# ----------------------------------------------------------------------------- bad shard headers

def _header_bytes(d: dict) -> bytes:
    head = json.dumps(d).encode()
    return b"MPTRACE\x01" + struct.pack("<II", len(head), zlib.crc32(head)) + head


GOOD_HEADER = TraceHeader(ModelSpec("m", 2, (0, 1), 8, 2), "synthetic").to_json()


@pytest.mark.parametrize("content,match", [
    (b"", "bad magic"),
    (b"MPTRACE\x02" + b"\0" * 20, "bad magic"),
    (b"PK\x03\x04 not a shard at all", "bad magic"),
    (b"MPTRACE\x01\x10\x00", "truncated shard header"),
    (_header_bytes(GOOD_HEADER)[:-3], "truncated or corrupt shard header"),
    (_header_bytes(GOOD_HEADER)[:20] + b"X" + _header_bytes(GOOD_HEADER)[21:], "truncated or corrupt"),
    (b"MPTRACE\x01" + struct.pack("<II", 3, zlib.crc32(b"{x]")) + b"{x]", "not valid JSON"),
    (_header_bytes({**GOOD_HEADER, "format": "other"}), "not a moeplace trace header"),
    (_header_bytes({**GOOD_HEADER, "version": 2}), "version 2 is not supported"),
    (_header_bytes({k: v for k, v in GOOD_HEADER.items() if k != "model"}), "trace header: model is missing"),
    (_header_bytes({**GOOD_HEADER, "model": {**GOOD_HEADER["model"], "top_k": 99}}),
     "top_k 99 is more than num_experts"),
    (_header_bytes({**GOOD_HEADER, "id_space": "virtual"}), "id_space"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical"}), "physical_to_logical_map"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical", "physical_to_logical_map": [[0] * 8]}),
     "physical_to_logical_map"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical", "physical_to_logical_map": [list(range(9))] * 2}),
     "outside 0..7"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical", "physical_to_logical_map": [[0, 1], [2]]}),
     "physical_to_logical_map"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical", "physical_to_logical_map": [["a"] * 8] * 2}),
     "physical_to_logical_map"),
    (_header_bytes({**GOOD_HEADER, "id_space": "physical", "physical_to_logical_map": [[0.5] * 8] * 2}),
     "physical_to_logical_map"),
])
def test_bad_shard_header_is_format_error(tmp_path, content, match):
    path = tmp_path / "bad.mptrace"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=match) as info:
        TraceReader(path)
    assert "bad.mptrace" in str(info.value)


def test_garbage_chunk_with_good_crc_is_format_error(tmp_path):
    """A chunk whose CRC holds but whose payload is not our arrays is a bad file, not a crash cut."""
    payload = zlib.compress(b"not an npz")
    data = _header_bytes(GOOD_HEADER) + struct.pack("<4sIII", b"MPCK", len(payload), zlib.crc32(payload), 1) + payload
    path = tmp_path / "g.mptrace"
    path.write_bytes(data)
    with pytest.raises(FormatError, match="g.mptrace"):
        list(TraceReader(path))


def write_float_chunk(path, name: str) -> None:
    """A shard of one chunk laid out as our writers lay it out, but with ``name`` stored as float32."""
    model = ModelSpec("m", 2, (0, 1), 8, 2)
    steps = _mixed_steps(model, np.random.default_rng(4), 6, 2)
    arrays = {k: getattr(steps, k) for k in CHUNK_ARRAYS}
    arrays[name] = arrays[name].astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    payload = zlib.compress(buf.getvalue())
    with ShardWriter(path, TraceHeader(model, "synthetic")) as w:
        w._write(struct.pack("<4sIII", b"MPCK", len(payload), zlib.crc32(payload), steps.num_steps) + payload)


@pytest.mark.parametrize("name", WHOLE_ARRAYS)
def test_float_ids_sizes_or_offsets_are_a_format_error(tmp_path, name):
    """Ids, sizes and offsets stored as floats are refused, as in an .npz, never cast to integers: by a full read,
    and by the passes that read a chunk's first arrays only where they read that one."""
    write_float_chunk(tmp_path / "f", name)
    passes = {"modes": lambda r: list(r.modes()), "num_tokens": lambda r: list(r.step_tokens())}
    for read in (list, passes.get(name, list)):
        with pytest.raises(FormatError, match=f"f.mptrace: {name} must hold integers, not float32"):
            read(TraceReader(tmp_path / "f.mptrace"))


# ----------------------------------------------------------------------------- streaming

STREAM_STEPS = 10_000_000
STREAM_CHUNK = 65_536


def test_ten_million_steps_stream_with_bounded_memory(tmp_path):
    """10M one-token steps (170 MB in memory as arrays) stream chunk by chunk in a few MB."""
    model = ModelSpec("tiny", 1, (0,), 4, 1)
    rng = np.random.default_rng(0)
    full = RoutingSteps.from_topk(model, rng.integers(0, 4, (STREAM_CHUNK, 1, 1)), np.ones(STREAM_CHUNK, np.int64),
                                  M.DECODE)
    n_full, rest = divmod(STREAM_STEPS, STREAM_CHUNK)
    last = full.take(np.arange(rest))
    # Encode the two distinct chunks once, then repeat the full one's bytes (zlib is the slow part).
    path = tmp_path / "big.mptrace"
    with ShardWriter(path, TraceHeader(model, "synthetic")) as w:
        head_len = w.bytes_written
        full_len = w.append(full)
        w.append(last)
    data = path.read_bytes()
    head, full_bytes, last_bytes = data[:head_len], data[head_len:head_len + full_len], data[head_len + full_len:]
    with open(path, "wb") as f:
        f.write(head)
        for _ in range(n_full):
            f.write(full_bytes)
        f.write(last_bytes)
    expected = full.expert_token_counts()[0] * n_full + last.expert_token_counts()[0]

    script = textwrap.dedent(f"""
        import json, resource, sys
        import numpy as np
        from moeplace.trace.store import TraceReader
        reader = TraceReader(sys.argv[1])
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        steps, chunks, counts = 0, 0, np.zeros(4)
        for c in reader:
            steps += c.num_steps
            chunks += 1
            counts += c.expert_token_counts()[0]
            assert c.num_steps <= {STREAM_CHUNK}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"steps": steps, "chunks": chunks, "counts": counts.tolist(),
                          "growth_kb": peak - base, "damaged": len(reader.damaged)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["steps"] == STREAM_STEPS and res["chunks"] == n_full + 1 and res["damaged"] == 0
    np.testing.assert_array_equal(res["counts"], expected)
    in_memory_mb = sum(getattr(full, k).nbytes for k in CHUNK_ARRAYS) * STREAM_STEPS / STREAM_CHUNK / 2**20
    assert in_memory_mb > 150
    growth_mb = res["growth_kb"] / 1024  # ru_maxrss is in KiB on Linux
    assert growth_mb < 40, f"reading grew the peak RSS by {growth_mb:.0f} MiB (all steps: {in_memory_mb:.0f} MiB)"


# ----------------------------------------------------------------------------- RoutingSteps

def _naive_step_rows(steps: RoutingSteps) -> list[np.ndarray]:
    return [steps.topk_ids[steps.token_offsets[s]:steps.token_offsets[s + 1]] for s in range(steps.num_steps)]


def _naive_step_counts(steps: RoutingSteps) -> dict[int, np.ndarray]:
    return {int(s): steps.counts[i] for i, s in enumerate(steps.count_steps)}


@pytest.mark.parametrize("seed", range(4))
def test_take_and_select_keep_rows_and_counts_with_their_steps(seed):
    rng = np.random.default_rng(seed)
    model = ModelSpec("m", 4, (1, 3), 8, 2)
    steps = _mixed_steps(model, rng, 12, 6)
    rows, counts = _naive_step_rows(steps), _naive_step_counts(steps)
    for idx in (np.arange(steps.num_steps), np.sort(rng.choice(steps.num_steps, 7, replace=False)),
                np.array([0]), np.array([steps.num_steps - 1]), np.zeros(0, np.int64)):
        sub = steps.take(idx)
        sub.validate()
        assert sub.num_steps == idx.size
        np.testing.assert_array_equal(sub.modes, steps.modes[idx])
        np.testing.assert_array_equal(sub.ranks, steps.ranks[idx])
        np.testing.assert_array_equal(sub.num_tokens, steps.num_tokens[idx])
        for j, s in enumerate(idx):
            np.testing.assert_array_equal(_naive_step_rows(sub)[j], rows[s])
        sub_counts = _naive_step_counts(sub)
        assert sorted(sub_counts) == [j for j, s in enumerate(idx) if s in counts]
        for j, c in sub_counts.items():
            np.testing.assert_array_equal(c, counts[int(idx[j])])
        mask = np.zeros(steps.num_steps, bool)
        mask[idx] = True
        _assert_same_steps(steps.select(mask), sub)


def test_concat_is_the_inverse_of_splitting():
    rng = np.random.default_rng(7)
    model = ModelSpec("m", 4, (1, 3), 8, 2)
    steps = _mixed_steps(model, rng, 15, 5)
    cuts = [0, 3, 3, 11, steps.num_steps]  # an empty part too
    parts = [steps.take(np.arange(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]
    _assert_same_steps(concat_steps(parts), steps)
    with pytest.raises(MoeplaceError, match="no steps"):
        concat_steps([])


def test_layer_and_expert_token_counts():
    model = ModelSpec("m", 3, (0, 2), 4, 2)
    ids = np.array([[[0, 1], [2, 3]],
                    [[1, -1], [3, 2]],
                    [[0, 3], [-1, -1]]])
    steps = concat_steps([RoutingSteps.from_topk(model, ids, [2, 0, 1], M.DECODE),
                          RoutingSteps.from_counts(model, [[[5, 0, 0, 1], [0, 2, 0, 0]]], M.EXTEND)])
    step_of_row, row_in_step, layer_ids = steps.layer(1)
    assert step_of_row.tolist() == [0, 0, 2] and row_in_step.tolist() == [0, 1, 0]
    np.testing.assert_array_equal(layer_ids, ids[:, 1, :])
    np.testing.assert_array_equal(steps.expert_token_counts(), [[2 + 5, 2, 0, 1 + 1], [0, 2, 2, 2]])
    assert steps.count_steps.tolist() == [3] and steps.num_tokens.tolist() == [2, 0, 1, 3]  # 6 / top-2


def test_validate_names_each_inconsistency():
    model = ModelSpec("m", 2, (0, 1), 4, 2)
    good = lambda: _mixed_steps(model, np.random.default_rng(1), 4, 2)  # noqa: E731
    cases = [
        (lambda s: setattr(s, "ranks", s.ranks[:-1]), "disagree in length"),
        (lambda s: setattr(s, "topk_ids", s.topk_ids[:, :1]), "top-k ids have shape"),
        (lambda s: setattr(s, "token_offsets", s.token_offsets + 1), "token offsets"),
        (lambda s: s.topk_ids.__setitem__((0, 0, 0), 4), "out of range"),
        (lambda s: s.topk_ids.__setitem__((0, 0, 0), -2), "out of range"),
        (lambda s: setattr(s, "counts", s.counts[:, :, :3]), "counts have shape"),
        (lambda s: s.counts.__setitem__((0, 0, 0), np.nan), "NaN"),
        (lambda s: s.counts.__setitem__((0, 0, 0), -1), "negative"),
        (lambda s: s.count_steps.__setitem__(0, 99), "count step index"),
    ]
    for change, message in cases:
        steps = good()
        assert steps.topk_ids.shape[0] > 0 and steps.count_steps.size > 0
        steps.validate()
        change(steps)
        with pytest.raises(MoeplaceError, match=message):
            steps.validate()
    with pytest.raises(MoeplaceError, match="out of range"):
        RoutingSteps.from_topk(model, np.full((1, 2, 2), 4), [1], M.DECODE)


# ----------------------------------------------------------------------------- write_chunks

def test_write_chunks_leaves_nothing_when_the_source_fails(tmp_path):
    model = ModelSpec("m", 2, (0, 1), 8, 2)
    steps = RoutingSteps.from_topk(model, np.zeros((6, 2, 2), np.int16) + [0, 1], np.full(3, 2), 5)

    def chunks():
        yield steps
        yield steps
        raise KeyboardInterrupt   # Ctrl-C while the third chunk is being made

    with pytest.raises(KeyboardInterrupt):
        write_chunks(tmp_path / "t.mptrace", TraceHeader(model, "synthetic"), chunks())
    assert list(tmp_path.iterdir()) == []
    seen = []
    path, total = write_chunks(tmp_path / "t.mptrace", TraceHeader(model, "synthetic"), iter([steps] * 3), seen.append)
    assert total == 9 and seen == [3, 3, 3] and sum(c.num_steps for c in TraceReader(path)) == 9


# ----------------------------------------------------------------------------- modes without the ids

@pytest.mark.parametrize("cut", [None, "mid-last-chunk", "crc"])
def test_modes_pass_sees_what_a_full_read_sees(three_chunk_shard, cut):
    """reader.modes() yields each whole chunk's modes and finds the same damage as a full read."""
    path, bounds, chunks = three_chunk_shard
    data = bytearray(path.read_bytes())
    if cut == "mid-last-chunk":
        data = data[:(bounds[2] + bounds[3]) // 2]
    elif cut == "crc":
        data[(bounds[1] + CHUNK_HEAD + bounds[2]) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    full = TraceReader(path)
    want = [c.modes for c in full]
    fast = TraceReader(path)
    got = list(fast.modes())
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert fast.damaged == full.damaged


def test_modes_of_a_chunk_laid_out_otherwise(tmp_path):
    """A chunk whose npz does not start with modes (another writer) is decoded in full, not misread."""
    model = ModelSpec("m", 2, (0, 1), 8, 2)
    steps = _mixed_steps(model, np.random.default_rng(9), 6, 2)
    with ShardWriter(tmp_path / "x", TraceHeader(model, "synthetic")) as w:
        arrays = {k: getattr(steps, k) for k in reversed(CHUNK_ARRAYS)}
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        payload = zlib.compress(buf.getvalue())
        w._write(struct.pack("<4sIII", b"MPCK", len(payload), zlib.crc32(payload), steps.num_steps) + payload)
    reader = TraceReader(tmp_path / "x.mptrace")
    np.testing.assert_array_equal(np.concatenate(list(reader.modes())), steps.modes)
    assert not reader.damaged


def test_raw_chunks_keep_the_physical_ids(tmp_path):
    """The replica each step chose, as the tracer stored it (the reader's steps are logical)."""
    model = ModelSpec.all_moe("phys", 1, 4, 1)
    header = TraceHeader(model, "moeplace-tracer", id_space="physical", physical_to_logical_map=[[0, 1, 2, 3, 0, 1]])
    steps = RoutingSteps.from_topk(model, [[[0]], [[1]]], [1, 1], M.DECODE)
    arrays = {k: getattr(steps, k) for k in CHUNK_ARRAYS}
    arrays["topk_ids"] = np.array([[[4]], [[1]]], np.int16)   # expert 0 on its replica in slot 4
    arrays["counts"] = np.zeros((0, 1, 6))
    with ShardWriter(tmp_path / "p", header) as w:
        w.append_arrays(arrays)
    reader = TraceReader(tmp_path / "p.mptrace")
    (path, raw), = list(reader.raw_chunks())
    assert path.name == "p.mptrace" and raw["topk_ids"].ravel().tolist() == [4, 1]
    assert concat_steps(list(reader)).topk_ids.ravel().tolist() == [0, 1]


@pytest.mark.parametrize("shape,dtype", [((0,), np.int64), ((7,), np.uint8), ((5, 3, 2), np.int16),
                                         ((4, 6), np.float64), ((3, 2), ">i4")])
@pytest.mark.parametrize("fortran", [False, True])
def test_npz_views_equal_np_load(shape, dtype, fortran):
    """The chunk decoder's zero-copy npz reader gives what np.load gives, for any dtype, shape and order;
    a compressed npz, a cut one or another zip layout gives None (then np.load reads it)."""
    from moeplace.trace.store import _npz_arrays
    rng = np.random.default_rng(len(shape))
    a = np.asarray(rng.integers(0, 100, shape), dtype)
    arrays = {"first": a if not fortran else np.asfortranarray(a), "second": np.arange(11, dtype=np.int32)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    raw = buf.getvalue()
    got = _npz_arrays(raw)
    want = np.load(io.BytesIO(raw))
    assert list(got) == want.files
    for k in want.files:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        np.testing.assert_array_equal(got[k], want[k])
    assert list(_npz_arrays(raw, 1)) == ["first"]
    assert _npz_arrays(raw[:len(raw) // 2], 2) is None
    squeezed = io.BytesIO()
    np.savez_compressed(squeezed, **arrays)
    assert _npz_arrays(squeezed.getvalue()) is None


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 9), st.integers(0, 300), st.integers(0, 2**31 - 1),
       st.sampled_from([1, 7, 1 << 18]))
def test_expert_token_counts_is_the_tally_of_every_id(layers, top_k, experts, rows, seed, block):
    """Against a tally of each (row, layer, k) id in turn, -1 padding skipped, count steps added; with
    blocks of rows small enough to split the rows anywhere."""
    rng = np.random.default_rng(seed)
    model = ModelSpec("m", layers, tuple(range(layers)), experts, min(top_k, experts))
    top_k = model.top_k
    ids = rng.integers(-1, experts, (rows, layers, top_k))
    parts = [RoutingSteps.from_topk(model, ids, [rows], M.DECODE)]
    counts = rng.integers(0, 5, (2, layers, experts)).astype(float)
    parts.append(RoutingSteps.from_counts(model, counts, M.EXTEND))
    steps = concat_steps(parts)
    want = counts.sum(axis=0)
    for row, layer, k in np.ndindex(ids.shape):
        if ids[row, layer, k] >= 0:
            want[layer, ids[row, layer, k]] += 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps_module, "COUNT_BLOCK", block)
        got = steps.expert_token_counts()
    np.testing.assert_array_equal(got, want)
