"""The verify seam at SGLang page size 64 (the composed path), on the CPU, with SGLang 0.5.23's
real TritonAttnBackend, ForwardMode and paged allocator: the page size reaches MlaVerify, the
per-batch plan is made where SGLang makes its metadata and reaches every layer's call, and
SGLang's page-aligned slot ids give the block table FlashMLA reads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
triton_backend = pytest.importorskip("sglang.srt.layers.attention.triton_backend")
pytestmark = pytest.mark.sglang

sys.path.insert(0, os.path.dirname(__file__))
from test_verify_backend import _bare_backend  # noqa: E402


def _mode(name: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode[name]


class FakeOp:
    """Stands in for MlaVerify: records plan and forward calls."""

    backend, num_heads, max_bs = "composed", 2, 8

    def __init__(self):
        self.planned, self.forwarded = [], []

    def plan(self, qo_indptr, kv_indptr, kv_indices):
        self.planned.append((qo_indptr, kv_indptr, kv_indices))
        return ("plan", len(self.planned))

    def forward(self, *args, **kwargs):
        self.forwarded.append(kwargs["plan"])


@pytest.fixture
def hooked(monkeypatch):
    """install() over stubs of SGLang's two metadata methods (their bodies need a ModelRunner)."""
    from moeplace.sglang import verify_backend

    cls = triton_backend.TritonAttnBackend
    calls = []
    for name in ("__init__", "init_cuda_graph_state"):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setattr(cls, "init_forward_metadata",
                        lambda self, fb: calls.append(("eager", fb.forward_mode)))
    monkeypatch.setattr(cls, "init_forward_metadata_in_graph",
                        lambda self, fb: calls.append(("in_graph", fb.forward_mode)))
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)
    monkeypatch.setenv(verify_backend.ENV_FLAG, "1")
    verify_backend.install()
    yield cls, calls
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)


def _metadata(bs=2, drafts=3):
    qo = torch.arange(0, (bs + 1) * drafts, drafts, dtype=torch.int32)
    kvp = torch.tensor([0, 64, 200], dtype=torch.int32)[:bs + 1]
    return SimpleNamespace(qo_indptr=qo, kv_indptr=kvp, kv_indices=torch.arange(200))


def test_plan_made_after_sglang_metadata_for_target_verify_only(hooked):
    from moeplace.sglang.verify_backend import attach

    cls, calls = hooked
    backend = _bare_backend(page_size=64)
    attach(backend)
    op = FakeOp()
    backend._moeplace_verify.ops = {2: op}
    backend._moeplace_verify.max_bs = op.max_bs  # as after init_cuda_graph_state
    backend.forward_metadata = _metadata()
    for method in (cls.init_forward_metadata, cls.init_forward_metadata_in_graph):
        for mode in ("DECODE", "EXTEND", "DRAFT_EXTEND_V2", "TARGET_VERIFY"):
            method(backend, SimpleNamespace(forward_mode=_mode(mode)))
    assert [c[0] for c in calls] == ["eager"] * 4 + ["in_graph"] * 4  # SGLang's own ran first
    md = backend.forward_metadata
    assert len(op.planned) == 2  # once per TARGET_VERIFY batch, from SGLang's own tensors
    assert all(p[0] is md.qo_indptr and p[1] is md.kv_indptr and p[2] is md.kv_indices
               for p in op.planned)


def test_every_layer_gets_the_batch_plan(hooked):
    from moeplace.sglang.verify_backend import attach

    cls, _ = hooked
    backend = _bare_backend(page_size=64)
    attach(backend)
    state = backend._moeplace_verify
    op = FakeOp()
    state.ops, state.max_bs = {2: op}, op.max_bs
    backend.forward_metadata = md = _metadata()
    cls.init_forward_metadata(backend, SimpleNamespace(forward_mode=_mode("TARGET_VERIFY")))
    q = torch.zeros(6, 2, 576, dtype=torch.bfloat16)
    k = torch.zeros(6, 1, 576, dtype=torch.bfloat16)
    v = torch.zeros(6, 1, 512, dtype=torch.bfloat16)
    pool = torch.zeros(256, 1, 576, dtype=torch.bfloat16)
    for _layer in range(3):
        assert backend.verify_shared_kv_fwd(
            q, k, v, torch.empty(6, 2, 512), pool, pool[..., :512], md.qo_indptr, md.kv_indptr,
            md.kv_indices, None, True, None, 3, 1.0, 1.0)
    assert op.forwarded == [("plan", 1)] * 3 and len(op.planned) == 1


@pytest.mark.parametrize("page", [1, 64])
def test_page_size_reaches_mla_verify(page):
    from moeplace.sglang.verify_backend import attach

    backend = _bare_backend(page_size=page)
    attach(backend)
    state = backend._moeplace_verify
    state.reserve(2)
    op = state.ops[2]
    assert state.page_size == page and op.page_size == page
    assert op.backend == "triton"  # a CPU device: neither FlashMLA nor the Hopper kernel
    state.plan(_metadata())
    assert state.plans == {2: None}  # the own kernels plan inside each launch


_ALLOC_SCRIPT = textwrap.dedent("""
    import torch
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
    from moeplace_kernels.mla_verify_composed import _block_table_kernel
    g = torch.Generator().manual_seed(0)
    P = 64
    free = torch.randperm(200, generator=g)[1:] # page 0 is SGLang's padding page
    # Two requests: a prefill, then an extend of each (prefix not on a page boundary).
    slots = [[], []]
    for prefix, seq in (([0, 0], [100, 7]), ([100, 7], [230, 70])):
        pre, sl = torch.tensor(prefix), torch.tensor(seq)
        last = torch.tensor([s[-1] if s else -1 for s in slots])
        out = torch.empty(int((sl - pre).sum()), dtype=torch.int64)
        alloc_extend_naive(pre, sl, last, free, out, P, "cpu")
        used = (-(-sl // P) - (-(-pre // P))).sum()
        free = free[int(used):]
        at = 0
        for b in range(2):
            n = int(sl[b] - pre[b])
            slots[b] += out[at:at + n].tolist()
            at += n
    ctx = [len(s) for s in slots]
    kv_indices = torch.tensor(slots[0] + slots[1])
    kv_indptr = torch.tensor([0, ctx[0], ctx[0] + ctx[1]], dtype=torch.int32)
    table = torch.zeros(2, 8, dtype=torch.int32)
    seqlens = torch.zeros(2, dtype=torch.int32)
    _block_table_kernel[(2, 2)](kv_indptr, kv_indices, table, seqlens, table.stride(0),
                                PAGE_SIZE=P, BLOCK=4, NPROG=2)
    for b in range(2):
        t = torch.arange(ctx[b])
        assert torch.equal(table[b, t // P].long() * P + t % P, torch.tensor(slots[b])), b
    assert seqlens.tolist() == ctx
    print("ok", ctx)
""")


def test_sglang_paged_slots_give_flashmla_block_table():
    """SGLang's own paged allocation (``alloc_extend_naive``, shuffled free pages, a prefill then
    an extend off a page boundary) lays a request's token t at page(t) * 64 + t % 64, so the block
    table that ``_block_table_kernel`` derives (Triton's interpreter) maps back to every slot."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _ALLOC_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
