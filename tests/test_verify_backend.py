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


def _bare_backend(**attrs):
    """A real TritonAttnBackend object with only the attributes ``attach`` reads.

    Its __init__ needs a whole ModelRunner; every method we exercise is SGLang's own.
    """
    backend = object.__new__(triton_backend.TritonAttnBackend)
    base = dict(use_mla=True, is_draft_runner=False, num_draft_tokens=3, page_size=1,
                device="cpu", num_head=2, use_verify_shared_kv=False)
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
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, "init_cuda_graph_state", cls.init_cuda_graph_state)
    monkeypatch.setenv(verify_backend.ENV_FLAG, "1")
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR, raising=False)
    orig = cls.__init__
    verify_backend.install()
    wrapped = cls.__init__
    assert wrapped is not orig and wrapped.__wrapped__ is orig
    verify_backend.install()  # idempotent
    assert cls.__init__ is wrapped
    monkeypatch.delattr(cls, verify_backend._INSTALLED_ATTR)


def test_attach_fills_the_verify_seam_for_mla_only():
    from moeplace.sglang.verify_backend import attach

    mla = _bare_backend()
    assert attach(mla)
    assert mla.use_verify_shared_kv and mla.verify_shared_kv_fwd == mla._moeplace_verify.forward
    assert not attach(_bare_backend(use_mla=False))
    assert not attach(_bare_backend(is_draft_runner=True))
    assert not attach(_bare_backend(page_size=16))


def test_mask_layout_follows_sglang_verify_mask():
    import torch
    from sglang.srt.layers.attention.verify_mask import VerifyMask
    from sglang.srt.speculative.eagle_utils import TreeMaskMode
    from moeplace.sglang.verify_backend import attach

    backend = _bare_backend()
    attach(backend)
    state = backend._moeplace_verify
    assert state.mask_layout() == "full"
    backend._verify_mask = VerifyMask(buffer=torch.zeros(4, dtype=torch.uint8),
                                      mode=TreeMaskMode.QLEN_ONLY, max_bs=1)
    assert state.mask_layout() == "qlen_only"


def test_seam_refuses_what_it_cannot_serve():
    import torch
    from moeplace.sglang.verify_backend import attach

    backend = _bare_backend()
    attach(backend)
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


_SEAM_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_mla_verify import make_case
    from test_verify_backend import _bare_backend
    from moeplace.sglang.verify_backend import attach
    from moeplace_kernels.mla_verify_ref import mla_verify_ref
    backend = _bare_backend()
    attach(backend)
    c = make_case(2, [3, 3], 2, [5, 40], tree="binary", layout="full", device="cpu")
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


def test_seam_matches_reference_in_interpreter():
    """SGLang's verify_shared_kv_fwd argument order, FULL_MASK, through Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _SEAM_SCRIPT.format(tests=os.path.dirname(__file__))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
