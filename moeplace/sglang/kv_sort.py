"""KV free-list sort (defrag tier 0): turn on SGLang's own ``need_sort`` outside PD disaggregation.

SGLang 0.5.23 sets ``need_sort`` only for PD prefill/decode servers
(``KVCacheConfigurator._build_token_to_kv_pool_allocator`` in ``srt/mem_cache/kv_cache_configurator.py``).
With it, freed KV slots are parked (``release_pages`` for page size 1, ``staged_pages`` for paged
allocators) and sorted back into the free list when an allocation runs short, so later requests get
runs of adjacent slots instead of the scattered FIFO/LIFO order of recent frees.

``install()`` registers an AFTER hook through SGLang's ``HookRegistry``; SGLang applies it after
plugins load (``load_plugins`` -> ``HookRegistry.apply_hooks``). The moeplace plugin calls
``install()`` only when ``MOEPLACE_KV_SORT=1``; ``install()`` itself does not read the environment.

Flipping the attribute after construction is safe only where the constructor builds the parking
list whatever ``need_sort`` is: ``TokenToKVPoolAllocator.clear`` always makes ``release_pages`` and
``PagedTokenToKVPoolAllocator.clear`` always makes ``staged_pages``. Composite allocators (SWA,
HiSparse, page-interleave, unified pools) keep their sub-allocators' own setting and are left alone.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator"


def enable_need_sort(allocator: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook: set ``need_sort`` on a freshly built plain token or paged allocator; returns it."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    # Exact types: a subclass may build its free lists differently (page_interleave does).
    if type(allocator) in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        if not allocator.need_sort:
            allocator.need_sort = True
            logger.info("moeplace: KV free-list sort on for %s", type(allocator).__name__)
    else:
        logger.warning("moeplace: KV free-list sort not applied to %s (composite allocator)",
                       type(allocator).__name__)
    return allocator


def install() -> None:
    """Register the hook with SGLang's HookRegistry (idempotent). SGLang applies it at plugin load."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if any(hook is enable_need_sort for _, hook, _ in HookRegistry._hooks.get(TARGET, [])):
        return
    HookRegistry.register(TARGET, enable_need_sort, HookType.AFTER)
