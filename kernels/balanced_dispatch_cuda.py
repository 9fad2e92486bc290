"""Loader of the CUDA balanced-dispatch kernel (``balanced_dispatch.cu``: the balanced rule and the rule by cost):
built on first use, then cached.

``torch.utils.cpp_extension.load`` compiles the source with nvcc for the GPU in use (a few seconds: the
source includes only the CUDA runtime) into torch's extension folder (``$TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``), rebuilds it when the source, flags or toolkit change, and serialises
concurrent builds with a lock file. The library is called through ctypes with raw pointers and the
caller's CUDA stream: no host synchronisation, no allocation, so launches can be captured in CUDA graphs.

Where no nvcc is found, the GPU is older than sm_80 (the kernel needs ``__reduce_min_sync``), or the
build fails, :func:`load` logs one warning line and returns None; the caller uses the Triton kernel.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "balanced_dispatch.cu"
MIN_CAPABILITY = (8, 0)

_Ptr, _Int = ctypes.c_void_p, ctypes.c_int


class DispatchLibrary:
    """The built kernel: a typed wrapper of its C entry point."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        lib.moeplace_balanced_dispatch.argtypes = [_Ptr, _Ptr, _Ptr, _Ptr, _Ptr] + [_Int] * 7 + [_Ptr]
        lib.moeplace_balanced_dispatch.restype = _Int
        # a benchmark build of an older source may lack it
        self.has_cost = hasattr(lib, "moeplace_weighted_cost_dispatch")
        if self.has_cost:
            lib.moeplace_weighted_cost_dispatch.argtypes = [_Ptr, _Ptr, _Ptr, _Ptr, _Ptr] + [_Int] * 12 + [_Ptr]
            lib.moeplace_weighted_cost_dispatch.restype = _Int
        lib.moeplace_cuda_error_string.argtypes = [_Int]
        lib.moeplace_cuda_error_string.restype = ctypes.c_char_p
        self.path = path
        self._lib = lib

    def launch(self, ids: int, out: int, masks: int, slots: int, num_rows: Optional[int],
               num_rows_is_64: bool, ids_are_64: bool, rows: int, k: int, experts: int,
               ranks: int, max_augment: int, stream: int) -> None:
        """One launch on ``stream`` (a cudaStream_t as int); raises RuntimeError on a launch error."""
        err = self._lib.moeplace_balanced_dispatch(ids, out, masks, slots, num_rows, int(num_rows_is_64),
                                                   int(ids_are_64), rows, k, experts, ranks, max_augment,
                                                   stream)
        self._raise(err, "balanced_dispatch")

    def launch_cost(self, ids: int, out: int, masks: int, slots: int, num_rows: Optional[int],
                    num_rows_is_64: bool, ids_are_64: bool, rows: int, k: int, experts: int, ranks: int,
                    max_augment: int, weights: tuple[int, int, int, int], max_rounds: int, stream: int) -> None:
        """One launch of the rule by cost (weights: read, pair, block, block_m; up to max_rounds moves) on
        ``stream``."""
        if not self.has_cost:
            raise RuntimeError(f"{self.path} has no moeplace_weighted_cost_dispatch (a build of an older source)")
        read, pair, block, block_m = weights
        err = self._lib.moeplace_weighted_cost_dispatch(ids, out, masks, slots, num_rows, int(num_rows_is_64),
                                                        int(ids_are_64), rows, k, experts, ranks, max_augment,
                                                        read, pair, block, block_m, max_rounds, stream)
        self._raise(err, "cost_dispatch")

    def _raise(self, err: int, name: str) -> None:
        if err != 0:
            raise RuntimeError(f"{name} launch failed: {self._lib.moeplace_cuda_error_string(err).decode()}")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags for one GPU generation (machine code for it, nothing else to compile)."""
    major, minor = capability
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


NVCC_FLAGS = ("-O3", "-std=c++17")


def build(capability: tuple[int, int], verbose: bool = False) -> str:
    """Path of the library for ``capability``, compiled unless cached. Raises on a failed build."""
    from torch.utils import cpp_extension

    major, minor = capability
    return cpp_extension.load(
        name=f"moeplace_balanced_dispatch_sm{major}{minor}", sources=[str(SOURCE)],
        extra_cuda_cflags=[*NVCC_FLAGS, *arch_flags(capability)], is_python_module=False, verbose=verbose)


def find_nvcc() -> Optional[str]:
    """nvcc as torch's extension builder will find it, or None."""
    import os

    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return None
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    return nvcc if os.access(nvcc, os.X_OK) else None


_lock = threading.Lock()
_loaded: dict[tuple[int, int], Optional[DispatchLibrary]] = {}


def load(capability: tuple[int, int]) -> Optional[DispatchLibrary]:
    """The library for a GPU of ``capability`` (built on first use), or None after one warning line."""
    with _lock:
        if capability not in _loaded:
            _loaded[capability] = _load_or_warn(capability)
        return _loaded[capability]


def _load_or_warn(capability: tuple[int, int]) -> Optional[DispatchLibrary]:
    if capability < MIN_CAPABILITY:
        log.warning("moeplace: the CUDA balanced-dispatch kernel needs compute capability 8.0, the GPU "
                    "has %d.%d; using the Triton kernel", *capability)
        return None
    if find_nvcc() is None:
        log.warning("moeplace: no nvcc found (set CUDA_HOME); balanced dispatch uses the Triton kernel "
                    "instead of the CUDA one")
        return None
    try:
        return DispatchLibrary(build(capability))
    except (OSError, RuntimeError, ImportError, SystemExit) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("moeplace: CUDA balanced-dispatch kernel unavailable (%s); using the Triton kernel",
                    first[:300])
        return None
