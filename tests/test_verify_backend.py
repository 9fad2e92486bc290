"""Wiring of the verify kernel into SGLang 0.5.23's real TritonAttnBackend (CPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
triton_backend = pytest.importorskip("sglang.srt.layers.attention.triton_backend")
pytestmark = pytest.mark.sglang


HOOKED = ("__init__", "init_cuda_graph_state", "init_forward_metadata",
          "init_forward_metadata_in_graph")


def _bare_backend(**attrs):
    """A real TritonAttnBackend object with only the attributes ``attach`` reads.

    Its __init__ needs a whole ModelRunner; every method we exercise is SGLang's own.
    """
    backend = object.__new__(triton_backend.TritonAttnBackend)
    base = dict(use_mla=True, is_draft_runner=False, num_draft_tokens=3, page_size=1,
                device="cpu", num_head=2, use_verify_shared_kv=False, _verify_mask=None)
    for k, v in {**base, **attrs}.items():
        setattr(backend, k, v)
    return backend


def test_import_moeplace_does_not_import_torch():
    code = "import sys, moeplace, moeplace.sglang.verify_backend; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_install_is_a_noop_without_the_flag(monkeypatch):
    from moeplace.sglang import verify_backend

    monkeypatch.delenv(verify_backend.ENV_FLAG, raising=False)
    before = triton_backend.TritonAttnBackend.__init__
    verify_backend.install()
    assert triton_backend.TritonAttnBackend.__init__ is before


def test_install_wraps_init_and_graph_state_once(monkeypatch):
    from moeplace.sglang import verify_backend

    cls = triton_backend.TritonAttnBackend
    for name in HOOKED:  # restored after the test
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setenv(verify_backend.ENV_FLAG, "1")
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)
    orig = cls.__init__
    verify_backend.install()
    wrapped = cls.__init__
    assert wrapped is not orig and wrapped.__wrapped__ is orig
    verify_backend.install()  # idempotent
    assert cls.__init__ is wrapped
    for name in HOOKED[1:]:
        assert getattr(cls, name).__wrapped__ is not None
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR)


def test_attach_fills_the_verify_seam_for_mla_only():
    from moeplace.sglang.verify_backend import attach

    mla = _bare_backend()
    assert attach(mla)
    assert mla.use_verify_shared_kv and mla.verify_shared_kv_fwd == mla._moeplace_verify.forward
    assert not attach(_bare_backend(use_mla=False))
    assert not attach(_bare_backend(is_draft_runner=True))
    assert not attach(_bare_backend(dcp_size=2))
    assert attach(_bare_backend(page_size=16))  # slot ids stay per token: see the next test


def test_sglang_paged_kv_addresses_are_per_token_slots():
    """Why page size > 1 needs no page table: SGLang's paged address of token slot s,
    (s // P) * page_stride + (s % P) * tok_stride, is s * slot_stride for its KV buffers."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import _extract_kv_strides

    buf = torch.zeros(64, 1, 576, dtype=torch.bfloat16)
    for page in (1, 16, 64):
        slot, _, page_stride, tok_stride = _extract_kv_strides(buf, page)
        s = torch.arange(64)
        assert torch.equal((s // page) * page_stride + (s % page) * tok_stride, s * slot)


def test_mask_layout_follows_sglang_verify_mask():
    import torch
    from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
    from moeplace.sglang.verify_backend import attach

    backend = _bare_backend()
    attach(backend)
    state = backend._moeplace_verify
    assert backend._verify_mask is None  # attach leaves SGLang's mask alone
    assert state.mask_layout() == "full"
    backend._verify_mask = maybe_create_verify_mask(  # what SGLang allocates on its own
        is_draft_runner=False, skip_prefill=False, max_bs=2, max_context_len=16,
        num_draft_tokens=3, device="cpu", is_read=True, dtype=torch.uint8)
    expected = {"QLEN_ONLY": "qlen_only", "FULL_MASK": "full"}[backend._verify_mask.mode.name]
    assert state.mask_layout() == expected


def _graph_ready_backend(**attrs):
    """A bare backend with what SGLang's own ``init_cuda_graph_state`` reads (tiny sizes)."""
    import torch

    base = dict(dllm_attention=None, max_kv_splits=2, v_head_dim=512, swa_v_head_dim=None,
                lean_total_programs=2, lean_block_m=16, max_context_len=1000,
                sliding_window_size=None, use_sliding_window_kv_pool=False, skip_prefill=False,
                device=torch.device("cpu"))
    return _bare_backend(**{**base, **attrs})


@pytest.mark.parametrize("hooked", [False, True])
def test_graph_state_keeps_sglang_full_mask_and_takes_an_ngram_capture(monkeypatch, hooked):
    """SGLang's real init_cuda_graph_state gives FULL_MASK of max_bs x D x (context + D) cells,
    hooked or not, and the NGRAM worker's capture mask (D x (1 + D) per request, seq_len 1) fits
    it as SGLang copies it in ``_update_target_verify_buffers``. A QLEN_ONLY buffer (max_bs x D x D)
    failed that copy in a live server: 648 vs 720 cells at batch 8 x 9 drafts."""
    import torch
    from sglang.srt.speculative.ngram_info import NgramVerifyInput
    from moeplace.sglang import verify_backend

    cls = triton_backend.TritonAttnBackend
    for name in HOOKED:  # restored after the test
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)
    monkeypatch.setattr("sglang.srt.speculative.eagle_utils._is_cpu", False)  # a GPU server
    backend = _graph_ready_backend()
    if hooked:
        monkeypatch.setenv(verify_backend.ENV_FLAG, "1")
        verify_backend.install()
        verify_backend.attach(backend)
    max_bs, drafts = 8, 3
    backend.init_cuda_graph_state(max_bs, max_bs * drafts)
    vm = backend.verify_mask
    assert vm.mode.name == "FULL_MASK" and vm.buffer.numel() == max_bs * drafts * (1000 + drafts)
    if hooked:
        assert backend._moeplace_verify.max_bs == max_bs
        assert backend._moeplace_verify.mask_layout() == "full"
    ngram = NgramVerifyInput(custom_mask=torch.ones(max_bs * drafts * (1 + drafts), dtype=torch.bool),
                             draft_token_num=drafts)
    custom_mask = vm.buffer
    custom_mask[: ngram.custom_mask.shape[0]] = ngram.custom_mask  # SGLang's own statement
    assert int(custom_mask.sum()) == ngram.custom_mask.numel()
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)


def _qlen_only_mask():
    """SGLang's QLEN_ONLY verify mask (its CPU layout), which SGLang's GPU kernels cannot read."""
    import torch
    from sglang.srt.layers.attention.verify_mask import VerifyMask
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    return VerifyMask(buffer=torch.zeros(0, dtype=torch.uint8), mode=TreeMaskMode.QLEN_ONLY, max_bs=0)


def test_seam_refuses_what_it_cannot_serve():
    import torch
    from moeplace.sglang.verify_backend import attach

    backend = _bare_backend()
    attach(backend)
    backend._verify_mask = _qlen_only_mask()
    q = torch.zeros(3, 2, 576, dtype=torch.bfloat16)
    k = torch.zeros(3, 1, 576, dtype=torch.bfloat16)
    v = torch.zeros(3, 1, 512, dtype=torch.bfloat16)
    pool = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    ind = torch.tensor([0, 3], dtype=torch.int32)
    args = (q, k, v, torch.empty(3, 2, 512), pool, pool[..., :512], ind, ind,
            torch.arange(3), None, True, None, 3, 1.0, 1.0)
    fwd = backend.verify_shared_kv_fwd
    assert fwd(*args, logit_cap=30.0) is False
    assert fwd(*args, sliding_window_size=128) is False
    assert fwd(*(a.float() if i == 0 else a for i, a in enumerate(args))) is False
    # With a tree mask in the QLEN_ONLY layout SGLang's kernel cannot take over: say so.
    masked = list(args)
    masked[9] = torch.ones(9, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="QLEN_ONLY"):
        fwd(*masked, logit_cap=30.0)


_SEAM_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_mla_verify import make_case
    from test_verify_backend import _bare_backend
    from moeplace.sglang.verify_backend import attach
    from moeplace_kernels.mla_verify_ref import mla_verify_ref
    backend = _bare_backend()
    attach(backend)
    if {layout!r} == "qlen_only":
        from test_verify_backend import _qlen_only_mask
        backend._verify_mask = _qlen_only_mask()
    c = make_case(2, [3, 3], 2, [5, 40], tree="binary", layout={layout!r}, device="cpu")
    o = torch.full((6, 2, 512), float("nan"), dtype=torch.bfloat16)
    ran = backend.verify_shared_kv_fwd(
        c["q"], c["k_ext"], c["v_ext"], o, c["kv_pool"], c["kv_pool"][..., :512],
        c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["mask"], True, c["mask_indptr"],
        3, 1.0, 1.0, 576 ** -0.5)
    ref, _ = mla_verify_ref(**c, sm_scale=576 ** -0.5)
    err = ((o.float() - ref).norm() / ref.norm()).item()
    assert ran and err < 1e-2, err
    print("ok")
""")


@pytest.mark.parametrize("layout", ["qlen_only", "full"])
def test_seam_matches_reference_in_interpreter(layout):
    """SGLang's verify_shared_kv_fwd argument order, both mask layouts, Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _SEAM_SCRIPT.format(tests=os.path.dirname(__file__), layout=layout)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
