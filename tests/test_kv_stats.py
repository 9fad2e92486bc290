"""KV allocation runs (``MOEPLACE_KV_STATS``) on SGLang 0.5.23's real allocators, hooked by its HookRegistry."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.allocator.token")
pytestmark = pytest.mark.sglang

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from moeplace.sglang import kv_stats  # noqa: E402


def runs_of(ids: torch.Tensor) -> int:
    """The oracle: 1 + the places where the next slot is not this one + 1."""
    values = ids.tolist()
    return 1 + sum(b != a + 1 for a, b in zip(values, values[1:]))


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    originals = {cls: cls.__dict__["alloc"] for cls in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)}
    hooks, patched = dict(HookRegistry._hooks), set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setenv(kv_stats.ENV, str(tmp_path / "kv.json"))
    stats = kv_stats.install()
    HookRegistry.apply_hooks()
    yield stats
    for cls, fn in originals.items():
        setattr(cls, "alloc", fn)
    HookRegistry.reset()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.update(patched)


@pytest.mark.parametrize("need_sort", [False, True])
def test_runs_match_the_oracle_on_a_churned_allocator(hooked, need_sort):
    allocator = TokenToKVPoolAllocator(256, torch.bfloat16, "cpu", None, need_sort=need_sort)
    g = torch.Generator().manual_seed(0)
    live, expected = [], []
    for step in range(60):
        size = int(torch.randint(4, 48, (1,), generator=g))
        got = allocator.alloc(size)
        if got is None:   # the pool is short: free a random half of what is live
            order = torch.randperm(len(live), generator=g).tolist()
            for i in sorted(order[: len(live) // 2], reverse=True):
                allocator.free(live.pop(i))
            continue
        live.append(got)
        if size >= kv_stats.MIN_TOKENS:
            expected.append(runs_of(got))
    summary = hooked.summary()
    assert summary["allocations"] == len(expected) and summary["runs"] == sum(expected)
    assert summary["single_run"] == sum(r == 1 for r in expected)
    assert summary["need_sort"] is need_sort and summary["allocator"] == "TokenToKVPoolAllocator"
    hooked.write()
    on_disk = json.loads(hooked.path.read_text())
    assert on_disk == json.loads(json.dumps(summary)) and not list(hooked.path.parent.glob(".*.tmp"))


def test_small_and_failed_allocations_are_not_counted(hooked):
    allocator = TokenToKVPoolAllocator(32, torch.bfloat16, "cpu", None, need_sort=False)
    assert allocator.alloc(kv_stats.MIN_TOKENS - 1) is not None
    assert allocator.alloc(64) is None
    assert hooked.summary()["allocations"] == 0


def test_paged_allocator_is_measured(hooked):
    allocator = PagedTokenToKVPoolAllocator(64, page_size=4, dtype=torch.bfloat16, device="cpu", kvcache=None,
                                            need_sort=False)
    got = allocator.alloc(16)
    assert hooked.summary()["allocations"] == 1 and hooked.summary()["runs"] == runs_of(got)


def test_a_path_in_no_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(kv_stats.ENV, str(tmp_path / "missing" / "kv.json"))
    with pytest.raises(ValueError, match="existing folder"):
        kv_stats.install()
