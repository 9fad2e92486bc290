"""How contiguous SGLang's KV allocations are, measured inside a live server (``MOEPLACE_KV_STATS=FILE``).

A diagnostic, off unless the variable names a file: it shows what ``MOEPLACE_KV_SORT=1`` buys on a
real server's traffic (``docs/kv-sort.md``). An AFTER hook on the plain token and paged allocators'
``alloc`` counts, for every allocation of at least ``MIN_TOKENS`` slots (a prefill or a verify
batch's drafts), its runs of consecutive slot ids. The count is summed on the device (no sync per
allocation); every ``FLUSH_SECONDS`` one host sync reads the sums and the file is rewritten
atomically as JSON::

    {"allocations": N, "tokens": T, "runs": R, "single_run": S, "tokens_per_run": T / R,
     "single_run_share": S / N, "need_sort": bool, "allocator": name}

Every rank allocates alike, so every rank writes the same file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("moeplace.kv_stats")

ENV = "MOEPLACE_KV_STATS"
TARGETS = ("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc",
           "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc")
MIN_TOKENS = 16
FLUSH_SECONDS = 2.0


class AllocationRuns:
    """Sums over the allocations seen; ``write`` turns them into the JSON file."""

    def __init__(self, path: Path, min_tokens: int = MIN_TOKENS, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.path = path
        self.min_tokens = min_tokens
        self.flush_seconds = flush_seconds
        self.allocations = 0
        self.tokens = 0
        self._sums: Any = None  # device [runs, single_run]
        self._last_write = time.monotonic()
        self._allocator = ""
        self._need_sort = False

    def __call__(self, result: Any, allocator: Any, need_size: int, *args: Any, **kwargs: Any) -> None:
        """AFTER hook: ``result`` is the allocated slot ids [need_size] (None when the pool is short)."""
        if result is None or int(need_size) < self.min_tokens or result.numel() < 2:
            return None
        import torch

        breaks = (result[1:] - result[:-1] != 1).sum()
        if self._sums is None:
            self._sums = torch.zeros(2, dtype=torch.int64, device=result.device)
        self._sums += torch.stack([breaks + 1, (breaks == 0).to(torch.int64)])
        self.allocations += 1
        self.tokens += int(result.numel())
        self._allocator = type(allocator).__name__
        self._need_sort = bool(getattr(allocator, "need_sort", False))
        if time.monotonic() - self._last_write > self.flush_seconds:
            self.write()
        return None

    def summary(self) -> dict:
        runs, single = (int(x) for x in self._sums.tolist()) if self._sums is not None else (0, 0)
        return {"allocations": self.allocations, "tokens": self.tokens, "runs": runs, "single_run": single,
                "tokens_per_run": self.tokens / runs if runs else None,
                "single_run_share": single / self.allocations if self.allocations else None,
                "need_sort": self._need_sort, "allocator": self._allocator, "min_tokens": self.min_tokens}

    def write(self) -> None:
        self._last_write = time.monotonic()
        try:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.summary()))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("moeplace: cannot write KV allocation stats to %s (%s)", self.path, e)


def install() -> AllocationRuns:
    """Register the AFTER hooks (SGLang applies them at plugin load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    path = Path(os.environ[ENV].strip())
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"{ENV}={path}: must name a file in an existing folder")
    runs = AllocationRuns(path)
    for target in TARGETS:
        HookRegistry.register(target, runs, HookType.AFTER)
    return runs
