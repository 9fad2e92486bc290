"""The moeplace trace format on disk: shard files of CRC-checked, zlib-compressed chunks.

A trace is one shard file (``*.mptrace``) or a folder of them (one or more per rank, appended
while a server runs). Each shard starts with the trace header, then holds chunks of steps::

    shard  := b"MPTRACE\\x01" u32 header_len u32 header_crc header_json chunk*
    chunk  := b"MPCK" u32 payload_len u32 payload_crc u32 num_steps zlib(npz(arrays))

A chunk cut short by a crash, or one whose CRC fails, ends the shard for the reader: it is
counted in ``TraceReader.damaged`` and skipped, never misread. See ``traces/FORMAT.md``.
"""

from __future__ import annotations

import datetime as _dt
import io
import itertools
import json
import os
import struct
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from moeplace.errors import FormatError, MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import RoutingSteps

FORMAT_VERSION = 1
SHARD_SUFFIX = ".mptrace"
PARTIAL_SUFFIX = ".part"
_SHARD_MAGIC = b"MPTRACE\x01"
_CHUNK_MAGIC = b"MPCK"
_U32x2 = struct.Struct("<II")
_CHUNK_HEAD = struct.Struct("<4sIII")


@dataclass
class TraceHeader:
    """What every shard of a trace says about itself.

    physical_to_logical_map: [L, P] the map in force at capture when ``id_space`` is "physical"
    (the router sees physical slot ids); None when ids are already logical.
    """

    model: ModelSpec
    source: str
    id_space: str = "logical"
    physical_to_logical_map: list[list[int]] | None = None
    ep_size: int = 1
    tp_size: int = 1
    nodes: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    # Attention data parallelism at capture (None: not recorded). Ranks of one attention DP group
    # route the same tokens; with attn_dp_size 1 every rank does (tensor-parallel attention).
    attn_dp_size: int | None = None
    attn_dp_rank: int | None = None
    aggregate_only: bool = False
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    notes: str = ""
    merged_from: list[str] = field(default_factory=list)   # shard_identity of each shard merged into this one
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_json()
        return {"format": "moeplace-trace", **d}

    @classmethod
    def from_json(cls, d: Any, path: object = "<header>") -> "TraceHeader":
        """The header a file holds, checked against its schema (``trace/header_schema.py``) first."""
        if not isinstance(d, dict):
            raise FormatError(path, f"trace header must be a JSON object, got {type(d).__name__}")
        if d.get("format") != "moeplace-trace":
            raise FormatError(path, "not a moeplace trace header")
        if d.get("version") != FORMAT_VERSION:
            raise FormatError(path, f"trace format version {d.get('version')!r} is not supported (want {FORMAT_VERSION})")
        from moeplace.model.schema import validate
        from moeplace.trace.header_schema import TraceHeaderSchema

        checked = validate(TraceHeaderSchema, d, path, "trace header")
        try:
            model = ModelSpec.from_json(d["model"])
            fields = {k: getattr(checked, k) for k in cls.__dataclass_fields__ if k in d and k != "model"}
            return cls(model=model, **fields)
        except MoeplaceError as e:
            raise FormatError(path, f"bad trace header: {e}") from None


# The note ``TraceReader.damaged`` holds for a ``.part`` shard it reads.
UNFINISHED = "never finished by its writer (a server killed hard, or one still writing); its whole chunks are read"

CHUNK_ARRAYS = ("modes", "num_tokens", "ranks", "token_offsets", "topk_ids", "count_steps", "counts")
WHOLE_ARRAYS = CHUNK_ARRAYS[:-1]   # ids, sizes and offsets: a float there is a bad file, never cast to an integer


# zlib level 1: on Kimi-K2-shaped ids it packs to 0.69 of the raw size at 35 MB/s, level 6 to 0.68 at
# 9 MB/s (one 4096-step chunk, 2-core CPU machine); the writer's speed is worth more than 1%.
ZLIB_LEVEL = 1
# A writer's chunk holds at most this many raw bytes of arrays (and at most MAX_CHUNK_STEPS steps), so
# that a reader, which holds one chunk at a time, stays in bounded memory.
CHUNK_BYTES = 32 << 20
MAX_CHUNK_STEPS = 65536
# Chunks a reader decodes ahead on other threads: decompression, most of a read's time, then runs
# on two cores (a 20,000-step Kimi-K2-shaped trace: BENCHMARKS.md#optimizer-and-cli-speed).
DECODE_AHEAD = 2


def _encode_chunk(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: arrays[k] for k in CHUNK_ARRAYS})
    payload = zlib.compress(buf.getvalue(), ZLIB_LEVEL)
    head = _CHUNK_HEAD.pack(_CHUNK_MAGIC, len(payload), zlib.crc32(payload), len(arrays["modes"]))
    return head + payload


def shard_path(path: str | os.PathLike) -> Path:
    """The file a writer given ``path`` makes: ``path`` itself if it ends in .mptrace, else ``path.mptrace``."""
    path = Path(path)
    return path if path.suffix == SHARD_SUFFIX else path.with_name(path.name + SHARD_SUFFIX)


class ShardWriter:
    """Appends chunks of steps to one shard file.

    The shard is written as ``NAME.mptrace.part`` and renamed to ``NAME.mptrace`` on ``close()``,
    so a reader of the folder sees only whole shards; a crash leaves a ``.part`` whose cut chunk
    the reader detects by length and CRC.
    """

    def __init__(self, path: str | os.PathLike, header: TraceHeader) -> None:
        self.path = shard_path(path)
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.header = header
        self.bytes_written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.partial_path.exists() and not self.partial_path.is_file():   # a FIFO would block the open
            raise MoeplaceError(f"{self.partial_path}: is not a regular file; moeplace writes only regular files")
        self._file: BinaryIO | None = open(self.partial_path, "wb")
        head = json.dumps(header.to_json(), separators=(",", ":")).encode()
        self._write(_SHARD_MAGIC + _U32x2.pack(len(head), zlib.crc32(head)) + head)

    def _write(self, data: bytes) -> None:
        assert self._file is not None, "shard is closed"
        self._file.write(data)
        self.bytes_written += len(data)

    def append(self, steps: RoutingSteps) -> int:
        """Write one chunk of steps; returns the bytes it took."""
        return self.append_arrays({k: getattr(steps, k) for k in CHUNK_ARRAYS})

    def append_arrays(self, arrays: dict[str, np.ndarray]) -> int:
        """Write one chunk from raw arrays (the RoutingSteps fields, ids in the header's id space:
        with physical ids, ``topk_ids`` hold slot ids and ``counts`` are [S_c, L, P])."""
        chunk = _encode_chunk(arrays)
        self._write(chunk)
        self._file.flush()
        return len(chunk)

    def close(self) -> Path:
        """Flush, fsync and rename the shard to its final name."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            if self.path.exists() and not self.path.is_file():   # a device, FIFO or folder: never replaced
                self.partial_path.unlink(missing_ok=True)
                raise MoeplaceError(f"{self.path}: is not a regular file; moeplace replaces only regular files")
            os.replace(self.partial_path, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the shard being written."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self.partial_path.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        self.abort() if exc_type else self.close()


def chunk_steps_for(steps: RoutingSteps) -> int:
    """Steps per chunk that keep a chunk near CHUNK_BYTES (at least 1, at most MAX_CHUNK_STEPS)."""
    nbytes = steps.topk_ids.nbytes + steps.counts.nbytes + 32 * steps.num_steps
    per_step = nbytes / max(steps.num_steps, 1)
    return int(min(MAX_CHUNK_STEPS, max(1, CHUNK_BYTES // max(per_step, 1))))


def write_trace(path: str | os.PathLike, header: TraceHeader, steps: RoutingSteps,
                chunk_steps: int | None = None) -> Path:
    """Write ``steps`` as a single-shard trace at ``path`` (atomically: temp name, then rename).

    chunk_steps: steps per chunk (default: ``chunk_steps_for(steps)``).
    """
    return write_chunks(path, header, split_chunks(steps, chunk_steps))[0]


def split_chunks(steps: RoutingSteps, chunk_steps: int | None = None) -> Iterator[RoutingSteps]:
    """``steps`` cut into chunks of ``chunk_steps`` (default: ``chunk_steps_for(steps)``), in order."""
    size = chunk_steps or chunk_steps_for(steps)
    for start in range(0, steps.num_steps, size):
        yield steps.take(np.arange(start, min(start + size, steps.num_steps)))


def write_chunks(path: str | os.PathLike, header: TraceHeader, chunks: Iterable[RoutingSteps],
                 progress: Callable[[int], None] = lambda steps: None) -> tuple[Path, int]:
    """Write each chunk of ``chunks`` as one chunk of a single-shard trace at ``path`` (a ``.part``
    file renamed when complete; removed on any error or interrupt). Returns (path, steps written).

    A second thread compresses and writes chunk i while the caller makes chunk i + 1 (zlib lets go
    of the GIL); no other chunk waits, so memory stays bounded whatever the number of chunks.
    ``progress(n)`` is called with the steps of each chunk once it is on disk.
    """
    total = 0
    with ShardWriter(path, header) as writer, ThreadPoolExecutor(max_workers=1) as pool:
        writing: Future | None = None
        for steps in chunks:   # made here while the previous chunk is being written
            if writing is not None:
                progress(writing.result())
            writing = pool.submit(_append_counted, writer, steps)
            total += steps.num_steps
        if writing is not None:
            progress(writing.result())
    return writer.path, total


def _append_counted(writer: "ShardWriter", steps: RoutingSteps) -> int:
    writer.append(steps)
    return steps.num_steps


def read_shard_header(path: Path, f: BinaryIO) -> TraceHeader:
    magic = f.read(len(_SHARD_MAGIC))
    if magic != _SHARD_MAGIC:
        raise FormatError(path, "not a moeplace trace shard (bad magic)")
    raw = f.read(_U32x2.size)
    if len(raw) < _U32x2.size:
        raise FormatError(path, "truncated shard header")
    length, crc = _U32x2.unpack(raw)
    head = f.read(length)
    if len(head) != length or zlib.crc32(head) != crc:
        raise FormatError(path, "truncated or corrupt shard header")
    try:
        return TraceHeader.from_json(json.loads(head), path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(path, "shard header is not valid JSON") from None


def shard_identity(path: str | os.PathLike) -> str | None:
    """What tells one shard's content from another's, from its first bytes: the CRCs of its header
    and of its first chunk. None for a shard with no whole chunk header (no step to count twice)."""
    path = Path(path)
    with open(path, "rb") as f:
        read_shard_header(path, f)   # checks it; the file now stands at the first chunk
        chunk_head = f.read(_CHUNK_HEAD.size)
        f.seek(len(_SHARD_MAGIC))
        _, header_crc = _U32x2.unpack(f.read(_U32x2.size))
    if len(chunk_head) < _CHUNK_HEAD.size:
        return None
    _, _, chunk_crc, num_steps = _CHUNK_HEAD.unpack(chunk_head)
    return f"{header_crc:08x}-{chunk_crc:08x}-{num_steps}"


class TraceReader:
    """Streams the chunks of a trace (a shard file or a folder of shards) with bounded memory.

    Ids come back logical: physical ids are mapped through each shard's physical_to_logical_map.
    ``damaged`` lists (shard, reason) for every shard whose tail was cut or corrupt, and for every
    ``.part`` shard read (one its writer never finished: a server killed hard, or one still writing).
    A folder's ``.part`` shards are read unless ``include_partial`` is False.
    """

    def __init__(self, path: str | os.PathLike, include_partial: bool = True) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            patterns = [f"*{SHARD_SUFFIX}"] + ([f"*{SHARD_SUFFIX}{PARTIAL_SUFFIX}"] if include_partial else [])
            self.shards = sorted(p for pat in patterns for p in self.path.glob(pat))
            if not self.shards:
                raise FormatError(self.path, f"folder holds no {SHARD_SUFFIX} shards")
        elif self.path.is_file():
            self.shards = [self.path]
        else:
            raise FormatError(self.path, "no such file or folder")
        self.damaged: list[tuple[Path, str]] = []
        self.headers = [self._header(p) for p in self.shards]
        first = self.headers[0]
        for p, h in zip(self.shards, self.headers):
            if h.model != first.model:
                raise FormatError(p, f"shard is for model {h.model.name!r} ({h.model.num_experts} experts), "
                                     f"others for {first.model.name!r} ({first.model.num_experts} experts)")

    @staticmethod
    def _header(path: Path) -> TraceHeader:
        with open(path, "rb") as f:
            return read_shard_header(path, f)

    @property
    def header(self) -> TraceHeader:
        """The first shard's header, with the ranks of all shards."""
        h = self.headers[0]
        ranks = sorted({r for x in self.headers for r in x.ranks})
        return TraceHeader(**{**h.__dict__, "ranks": ranks})

    @property
    def model(self) -> ModelSpec:
        return self.headers[0].model

    def __iter__(self) -> Iterator[RoutingSteps]:
        """Each whole chunk's steps, in order. Chunks are decoded DECODE_AHEAD ahead on other threads
        (zlib lets go of the GIL), so memory holds at most DECODE_AHEAD + 2 chunks."""
        self.damaged.clear()  # each pass reports what it found, once
        with ThreadPoolExecutor(max_workers=DECODE_AHEAD) as pool:
            for path, header in zip(self.shards, self.headers):
                self._note_unfinished(path)
                p2l = np.asarray(header.physical_to_logical_map, np.int64) if header.id_space == "physical" else None
                decoding = ((pool.submit(self._decode, path, header, payload, p2l), num_steps)
                            for payload, num_steps in self._payloads(path))
                for future, num_steps in _read_ahead(decoding, DECODE_AHEAD):
                    steps = future.result()
                    if steps.num_steps != num_steps:  # the chunk header is outside the CRC
                        self.damaged.append((path, "chunk header disagrees with its payload"))
                        break
                    yield steps

    def raw_chunks(self) -> Iterator[tuple[Path, dict[str, np.ndarray]]]:
        """(shard, the chunk's arrays as stored) for each whole chunk: ids in the shard's own id space
        (under EP, the physical slots each step chose), nothing mapped or checked beyond the CRC."""
        self.damaged.clear()
        for path in self.shards:
            self._note_unfinished(path)
            for payload, _ in self._payloads(path):
                try:
                    yield path, _chunk_arrays(payload)
                except (ValueError, zlib.error, OSError) as e:
                    raise FormatError(path, f"unreadable chunk: {e}") from None

    def modes(self) -> Iterator[np.ndarray]:
        """Each whole chunk's forward modes [S], in the order and with the damage checks of iterating
        the reader, but decompressing only the start of each chunk (modes is its first array): a
        pass that counts steps costs the reading of the file, not the decoding of its ids."""
        for modes, in self._leading(("modes",)):
            yield modes

    def step_tokens(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(modes [S], num_tokens [S]) of each whole chunk, as cheaply as ``modes`` (its first two arrays)."""
        yield from self._leading(("modes", "num_tokens"))

    def _leading(self, names: tuple[str, ...]) -> Iterator[tuple[np.ndarray, ...]]:
        """The leading arrays ``names`` (in CHUNK_ARRAYS order) of each whole chunk."""
        self.damaged.clear()
        for path, header in zip(self.shards, self.headers):
            self._note_unfinished(path)
            for payload, num_steps in self._payloads(path):
                arrays = _leading_arrays(payload, num_steps, names)
                if arrays is None:   # not laid out as our writers do: decode it all
                    steps = self._decode(path, header, payload, None)
                    arrays = tuple(getattr(steps, name) for name in names)
                if any(a.shape != (num_steps,) for a in arrays):
                    self.damaged.append((path, "chunk header disagrees with its payload"))
                    break
                yield arrays

    def _note_unfinished(self, path: Path) -> None:
        if path.name.endswith(SHARD_SUFFIX + PARTIAL_SUFFIX):
            self.damaged.append((path, UNFINISHED))

    def _payloads(self, path: Path) -> Iterator[tuple[bytes, int]]:
        """(CRC-checked compressed payload, steps its header claims) of each whole chunk of one shard;
        a cut or corrupt chunk ends the shard and is recorded in ``damaged``."""
        with open(path, "rb") as f:
            read_shard_header(path, f)
            while True:
                head = f.read(_CHUNK_HEAD.size)
                if not head:
                    return
                if len(head) < _CHUNK_HEAD.size:
                    self.damaged.append((path, "cut inside a chunk header"))
                    return
                magic, length, crc, num_steps = _CHUNK_HEAD.unpack(head)
                if magic != _CHUNK_MAGIC:
                    self.damaged.append((path, "bad chunk magic"))
                    return
                payload = f.read(length)
                if len(payload) != length:
                    self.damaged.append((path, "cut inside a chunk"))
                    return
                if zlib.crc32(payload) != crc:
                    self.damaged.append((path, "chunk CRC mismatch"))
                    return
                yield payload, num_steps

    @staticmethod
    def _decode(path: Path, header: TraceHeader, payload: bytes, p2l: np.ndarray | None) -> RoutingSteps:
        try:
            a = _chunk_arrays(payload)
            floats = next((name for name in WHOLE_ARRAYS if a[name].dtype.kind not in "iu"), None)
            if floats:
                raise FormatError(path, f"{floats} must hold integers, not {a[floats].dtype}")
            ids = a["topk_ids"]
            counts = a["counts"]
            if p2l is not None:
                ids = _physical_to_logical_ids(ids, p2l)
                counts = _physical_to_logical_counts(counts, p2l, header.model.num_experts)
            steps = RoutingSteps(header.model, a["modes"].astype(np.uint8, copy=False),
                                 a["num_tokens"].astype(np.int32, copy=False), a["ranks"].astype(np.int16, copy=False),
                                 a["token_offsets"].astype(np.int64, copy=False), ids.astype(np.int16, copy=False),
                                 a["count_steps"].astype(np.int64, copy=False), counts.astype(np.float64, copy=False))
        except (KeyError, ValueError, zlib.error, OSError, IndexError) as e:
            raise FormatError(path, f"unreadable chunk: {e}") from None
        try:
            steps.validate()
        except MoeplaceError as e:
            raise FormatError(path, str(e)) from None
        return steps


def _read_ahead(items: Iterator, n: int) -> Iterator:
    """``items`` in order, the next n already drawn while the caller handles the current one."""
    waiting = deque(itertools.islice(items, n))
    for item in items:
        waiting.append(item)
        yield waiting.popleft()
    yield from waiting


def _leading_arrays(payload: bytes, num_steps: int, names: tuple[str, ...]) -> tuple[np.ndarray, ...] | None:
    """The arrays ``names`` [S] that start a chunk's npz, in order, from a few decompressed bytes; None if
    the payload does not start with them (then the caller decodes the whole chunk)."""
    try:
        head = zlib.decompressobj().decompress(payload, 1024 * len(names) + 8 * num_steps * len(names))
    except zlib.error:
        return None
    arrays = _npz_arrays(head, len(names))
    if arrays is None or tuple(arrays) != names or any(a.dtype.kind not in "iu" for a in arrays.values()):
        return None   # the caller decodes the whole chunk, which refuses non-integer arrays
    out = [a.copy() for a in arrays.values()]   # not views of the decompressed bytes, most of them unused
    out[0] = out[0].astype(np.uint8, copy=False) if names[0] == "modes" else out[0]
    return tuple(out)


def _chunk_arrays(payload: bytes) -> dict[str, np.ndarray]:
    """A chunk's arrays from its compressed payload: views of the decompressed bytes where our writers laid
    them out (``_npz_arrays``), else as ``np.load`` reads them."""
    raw = zlib.decompress(payload)
    arrays = _npz_arrays(raw)
    if arrays is None:
        z = np.load(io.BytesIO(raw), allow_pickle=False)
        arrays = {k: z[k] for k in z.files}
    return arrays


def _npz_arrays(buf: bytes, count: int | None = None) -> dict[str, np.ndarray] | None:
    """The arrays of the npz in ``buf`` (the first ``count`` only, where given) as read-only views of it,
    not copies: the members as ``np.savez`` stores them (uncompressed, sizes known). None where ``buf``
    is laid out otherwise or ends early; then the caller reads it with ``np.load``."""
    out: dict[str, np.ndarray] = {}
    pos, view = 0, memoryview(buf)
    try:
        while buf[pos:pos + 4] == b"PK\x03\x04" and (count is None or len(out) < count):
            flags, method = struct.unpack_from("<HH", buf, pos + 6)
            name_len, extra_len = struct.unpack_from("<HH", buf, pos + 26)
            name = bytes(view[pos + 30:pos + 30 + name_len]).decode()
            if method != 0 or flags & 0x8 or not name.endswith(".npy"):   # compressed, or sizes after the data
                return None
            start = pos + 30 + name_len + extra_len
            header = io.BytesIO(view[start:start + 65536])   # an npy header is shorter
            version = np.lib.format.read_magic(header)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(header)
            size = int(np.prod(shape, dtype=np.int64))
            data = start + header.tell()
            if dtype.hasobject or data + size * dtype.itemsize > len(buf):
                return None
            out[name[:-4]] = np.frombuffer(buf, dtype, size, data).reshape(shape, order="F" if fortran else "C")
            pos = data + size * dtype.itemsize
    except (ValueError, UnicodeDecodeError, struct.error):
        return None
    return out if out and (count is None or len(out) == count) else None


def _physical_to_logical_ids(ids: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """ids: [T, L, K] physical slot ids (-1 = none) -> logical ids."""
    L, P = p2l.shape
    if ids.size and (ids.max() >= P or ids.min() < -1):
        raise ValueError(f"physical ids {ids.min()}..{ids.max()} outside the map's {P} slots (or -1 for none)")
    layer = np.arange(L)[None, :, None]
    out = p2l[layer, np.maximum(ids, 0)]
    return np.where(ids >= 0, out, -1)


def _physical_to_logical_counts(counts: np.ndarray, p2l: np.ndarray, num_experts: int) -> np.ndarray:
    """counts: [S, L, P] per physical slot -> [S, L, E] per logical expert."""
    S, L, P = counts.shape
    if P != p2l.shape[1]:
        raise ValueError(f"counts have {P} physical slots, the map {p2l.shape[1]}")
    out = np.zeros((S, L, num_experts))
    for layer in range(L):
        np.add.at(out[:, layer, :], (slice(None), p2l[layer]), counts[:, layer, :])
    return out
