"""Loader of the Hopper (sm_90a) MLA verify kernel: build once with nvcc, load with ctypes.

The kernel is CUDA C++ (``csrc/mla_verify_sm90.cu``, design in its opening comment and in
``docs/verify-kernel.md``). It needs no PyTorch headers: nvcc turns it into a small shared
library with a C entry point, built on first use (about 15 s) into the user's cache folder
(``$MOEPLACE_CACHE``, else ``$XDG_CACHE_HOME/moeplace``, else ``~/.cache/moeplace``) under a name
that hashes the sources, the nvcc version and the flags, so an edited source or another nvcc
builds anew and concurrent processes never see a half-written file (written to a temporary name,
then renamed). Launches go to the caller's CUDA stream through the C entry point: no host
synchronisation and no allocation, so they can be captured in CUDA graphs.

Where no nvcc is found, or the build or load fails, :func:`load` logs one warning line and
returns None; the caller falls back to the Triton kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("mla_verify_sm90.cu", "wgmma_ops.inc")
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared",
              "-Xcompiler", "-fPIC")
ROWS_PER_BLOCK = (16, 32, 48, 64, 72)  # kernel variants: rows of one CTA (two warpgroups)
MAX_DRAFT = 64  # draft tokens per request the combine kernel holds
MAX_SPLITS = 1024  # CTAs along the KV tiles (per request at most that many partials)
# ptxas's note where it issues the wgmma one at a time (C7519 in nvcc 13.5, C7520 in 13.0: matched by its text)
SERIALISED_WGMMA = "wgmma.mma_async instructions are serialized"

_Ptr = ctypes.c_void_p
_I64 = ctypes.c_longlong
_I32 = ctypes.c_int
_F32 = ctypes.c_float


class SplitParams(ctypes.Structure):
    """Mirror of ``mlav::SplitParams`` (checked against the library's sizeof)."""

    _fields_ = [("q", _Ptr), ("kv", _Ptr), ("kv_indices", _Ptr), ("kv_indptr", _Ptr),
                ("qo_indptr", _Ptr), ("o_part", _Ptr), ("l_part", _Ptr),
                ("q_stride_t", _I64), ("q_stride_h", _I64), ("kv_stride", _I64),
                ("idx64", _I32), ("kvp64", _I32), ("qop64", _I32), ("batch", _I32),
                ("heads", _I32), ("row_blocks", _I32), ("rows_pad", _I32), ("grid_x", _I32),
                ("min_tiles", _I32), ("evict_first", _I32), ("scale_log2", _F32),
                ("short_blocks", _I32), ("tma_runs", _I32), ("kv_rows", _I64)]


class CombineParams(ctypes.Structure):
    """Mirror of ``mlav::CombineParams`` (checked against the library's sizeof)."""

    _fields_ = [("q", _Ptr), ("k_ext", _Ptr), ("v_ext", _Ptr), ("mask", _Ptr),
                ("mask_indptr", _Ptr), ("kv_indptr", _Ptr), ("qo_indptr", _Ptr),
                ("o_part", _Ptr), ("l_part", _Ptr), ("out", _Ptr), ("lse", _Ptr),
                ("q_stride_t", _I64), ("q_stride_h", _I64), ("ke_stride", _I64),
                ("ve_stride", _I64), ("out_stride_t", _I64), ("out_stride_h", _I64),
                ("lse_stride_t", _I64), ("lse_stride_h", _I64),
                ("mip64", _I32), ("kvp64", _I32), ("qop64", _I32), ("mask_mode", _I32),
                ("batch", _I32), ("heads", _I32), ("d_max", _I32), ("rows_pad", _I32),
                ("grid_x", _I32), ("min_tiles", _I32), ("scale_log2", _F32), ("slices", _I32),
                ("short_blocks", _I32), ("grid_size", _I32)]


class Sm90Library:
    """The loaded shared library: typed wrappers of its C entry points."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.mlav_setup.argtypes = [_I32]
        lib.mlav_forward.argtypes = [_I32, ctypes.POINTER(SplitParams),
                                     ctypes.POINTER(CombineParams), _Ptr, _I32, _I32]
        lib.mlav_probe.argtypes = [_Ptr] * 6 + [_I32]
        lib.mlav_error_string.restype = ctypes.c_char_p
        lib.mlav_struct_sizes.argtypes = [ctypes.POINTER(_I32), ctypes.POINTER(_I32)]
        sizes = (_I32(), _I32())
        lib.mlav_struct_sizes(ctypes.byref(sizes[0]), ctypes.byref(sizes[1]))
        if (sizes[0].value, sizes[1].value) != (ctypes.sizeof(SplitParams),
                                                ctypes.sizeof(CombineParams)):
            raise OSError(f"{path}: parameter structs differ from the ctypes mirrors")
        rows = tuple(lib.mlav_rows_per_block(v) for v in range(len(ROWS_PER_BLOCK)))
        if rows != ROWS_PER_BLOCK:
            raise OSError(f"{path}: kernel variants {rows}, expected {ROWS_PER_BLOCK}")
        self.ring_blocks = tuple(lib.mlav_ring_blocks(v) for v in range(len(ROWS_PER_BLOCK)))
        try:  # rows of a row block in the split kernel's short layout (sizes the workspace)
            self.short_rows = lib.mlav_short_rows()
        except AttributeError:
            raise OSError(f"{path}: no mlav_short_rows entry point (a build from before the short "
                          "layout)") from None
        self._lib = lib
        self._ready: set[int] = set()

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what}: {self._lib.mlav_error_string(err).decode()}")

    def setup(self, device: int) -> None:
        """Raise the split kernels' shared-memory limit on ``device`` (once; not in a capture)."""
        if device not in self._ready:
            self._check(self._lib.mlav_setup(device), "mla_verify_sm90 setup")
            self._ready.add(device)

    def forward(self, variant: int, split: SplitParams, combine: CombineParams, stream: int,
                device: int, pdl: bool) -> None:
        """Launch split + combine on ``stream`` (a cudaStream_t as int)."""
        self._check(self._lib.mlav_forward(variant, ctypes.byref(split), ctypes.byref(combine),
                                           stream, int(pdl), device), "mla_verify_sm90 launch")

    def probe(self, k: int, q: int, p: int, s_out: int, o_out: int, stream: int,
              device: int) -> None:
        """Layout probe (tests): S^T = K Q^T and O^T = V^T P^T for one 64 x 40 tile."""
        self._check(self._lib.mlav_probe(k, q, p, s_out, o_out, stream, device),
                    "mla_verify_sm90 probe")


def cache_dir() -> Path:
    """Where built kernels are kept (same folder convention as the scripts' wheel cache)."""
    if os.environ.get("MOEPLACE_CACHE"):
        return Path(os.environ["MOEPLACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeplace"


def find_nvcc() -> Optional[str]:
    """nvcc from $CUDA_HOME / $CUDA_PATH, the PATH, or /usr/local/cuda; None if absent."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def library_path(nvcc: str, csrc: Path = CSRC) -> Path:
    """Cache path of the library for the sources in ``csrc``, this nvcc and these flags."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((csrc / name).read_bytes())
    digest.update(version.encode())
    digest.update(" ".join(NVCC_FLAGS).encode())
    return cache_dir() / "kernels" / f"mla_verify_sm90-{digest.hexdigest()[:16]}.so"


def build(nvcc: str, csrc: Path = CSRC) -> Path:
    """Compile the library from ``csrc`` unless cached; returns its path. Raises on a failed build."""
    target = library_path(nvcc, csrc)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run([nvcc, *NVCC_FLAGS, "-o", tmp, str(csrc / SOURCES[0])],
                             capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln),
                         res.stderr.strip()[-300:])
            raise RuntimeError(f"nvcc failed: {first}")
        if SERIALISED_WGMMA in res.stdout + res.stderr:
            log.warning("moeplace: ptxas issues the Hopper MLA verify kernel's wgmma one at a time (its note: "
                        "'%s'): the kernel is correct but slow with this nvcc", SERIALISED_WGMMA)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_lock = threading.Lock()
_loaded: dict[str, Optional[Sm90Library]] = {}


def load() -> Optional[Sm90Library]:
    """The library (built on first use), or None after one warning line if it cannot be had."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load_or_warn()
        return _loaded["lib"]


def _load_or_warn() -> Optional[Sm90Library]:
    nvcc = find_nvcc()
    if nvcc is None:
        log.warning("moeplace: no nvcc found (set CUDA_HOME); the MLA verify kernel uses Triton "
                    "instead of the Hopper kernel")
        return None
    try:
        return Sm90Library(build(nvcc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("moeplace: Hopper MLA verify kernel unavailable (%s); using Triton",
                    str(exc).splitlines()[0][:300])
        return None
