"""KV free-list sort hook, run through SGLang 0.5.23's real HookRegistry, KVCacheConfigurator and allocators."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.kv_cache_configurator")
pytestmark = pytest.mark.sglang

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator, _PoolSizes  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from moeplace.sglang import kv_sort  # noqa: E402

POOL_TOKENS = 64


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    """A real ServerArgs published into SGLang's runtime context (page size 1, no PD); restored after."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    state = runtime_context.snapshot_context()
    runtime_context.publish(ServerArgs(model_path=str(folder), skip_tokenizer_init=True, device="cpu"),
                            role="scheduler")
    yield runtime_context
    runtime_context.restore_context(state)


@pytest.fixture
def hook_registry():
    """Give each test a clean HookRegistry and the original, unpatched configurator method."""
    original = KVCacheConfigurator.__dict__["_build_token_to_kv_pool_allocator"]
    hooks, patched = dict(HookRegistry._hooks), set(HookRegistry._patched)
    HookRegistry.reset()
    yield HookRegistry
    setattr(KVCacheConfigurator, "_build_token_to_kv_pool_allocator", original)
    HookRegistry.reset()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.update(patched)


def build_allocator(published) -> object:
    """Call SGLang's real ``_build_token_to_kv_pool_allocator`` on the smallest configurator it reads."""
    configurator = object.__new__(KVCacheConfigurator)  # only the fields the method touches
    for name, value in dict(device="cpu", kv_cache_dtype=torch.bfloat16, is_hybrid_swa=False,
                            hybrid_gdn_config=None, kv_shard_size=1, is_draft_worker=False, page_size=1).items():
        setattr(configurator, name, value)
    sizes = _PoolSizes(max_total_num_tokens=POOL_TOKENS, max_running_requests=8, full_max_total_num_tokens=None,
                       swa_max_total_num_tokens=None, c4_max_total_num_tokens=0, c128_max_total_num_tokens=0,
                       c4_state_pool_size=0, c128_state_pool_size=0, c4_state_dtype=None, c128_state_dtype=None)
    return configurator._build_token_to_kv_pool_allocator(
        sizes=sizes, token_to_kv_pool=None, is_dsv4_model=False, req_to_token_pool=None,
        token_to_kv_pool_allocator=None)


def test_without_install_need_sort_stays_off(published, hook_registry) -> None:
    hook_registry.apply_hooks()
    allocator = build_allocator(published)
    assert type(allocator) is TokenToKVPoolAllocator and allocator.need_sort is False


def test_install_turns_need_sort_on(published, hook_registry) -> None:
    kv_sort.install()
    kv_sort.install()  # idempotent: one hook, not two
    assert len(hook_registry._hooks[kv_sort.TARGET]) == 1
    hook_registry.apply_hooks()
    allocator = build_allocator(published)
    assert type(allocator) is TokenToKVPoolAllocator and allocator.need_sort is True


def test_sorted_allocator_still_allocates_and_frees(published, hook_registry) -> None:
    kv_sort.install()
    hook_registry.apply_hooks()
    allocator = build_allocator(published)
    a, b, c = allocator.alloc(20), allocator.alloc(20), allocator.alloc(20)
    assert allocator.available_size() == POOL_TOKENS - 60
    allocator.free(b)
    allocator.free(a[10:])
    assert allocator.available_size() == POOL_TOKENS - 30  # parked frees still count as free
    got = allocator.alloc(30)  # runs short of the 4 unparked slots: sorts the parked ones back in
    assert got is not None and torch.equal(got, torch.cat([torch.arange(11, 21), torch.arange(21, 41)]))
    assert allocator.alloc(5) is None  # exactly 4 left
    live = torch.cat([a[:10], c, got])
    allocator.free(live)
    everything = allocator.alloc(POOL_TOKENS)
    assert torch.equal(torch.sort(everything).values, torch.arange(1, POOL_TOKENS + 1))  # no loss, no duplicate


def test_without_sort_free_list_is_fifo(published) -> None:
    """The baseline the sort improves on: frees append to the free list in free order."""
    allocator = TokenToKVPoolAllocator(POOL_TOKENS, torch.bfloat16, "cpu", None, need_sort=False)
    a, b = allocator.alloc(30), allocator.alloc(30)
    allocator.free(b)
    allocator.free(a)
    got = allocator.alloc(8)  # the 4 never used, then the first of b
    assert got.tolist() == [61, 62, 63, 64, 31, 32, 33, 34]


def test_paged_allocator_is_sorted_too(published) -> None:
    allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size=4, dtype=torch.bfloat16, device="cpu",
                                            kvcache=None, need_sort=False)
    assert kv_sort.enable_need_sort(allocator) is allocator and allocator.need_sort is True


def test_composite_allocators_are_left_alone() -> None:
    class Composite:
        need_sort = False

    composite = Composite()
    assert kv_sort.enable_need_sort(composite) is composite and composite.need_sort is False
