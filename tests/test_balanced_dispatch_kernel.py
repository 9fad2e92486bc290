"""The balanced-dispatch kernels against ``moeplace.dispatch.balanced.fast_rule_step``, bit for bit.

GPU tests carry ``@pytest.mark.gpu`` and skip without CUDA: both kernels (CUDA and Triton) over random
layouts (1 to 32 ranks, up to 4096 experts, 1 to R replicas, layouts that need many augmenting paths),
K in 1/4/8, N in 1/9/64/128, -1 and out-of-range ids, padding rows, int64 ids, in place, inputs that are
views not 16-byte aligned, and CUDA-graph capture replayed with new inputs. On the CPU: the Triton kernel in Triton's interpreter on small cases,
the input checks, and the fallback to Triton when the CUDA kernel cannot be built.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from moeplace.dispatch.balanced import fast_rule_step, replica_layout  # noqa: E402
from moeplace_kernels import balanced_dispatch_cuda  # noqa: E402
from moeplace_kernels.balanced_dispatch import (balanced_dispatch, dispatch_tables,  # noqa: E402
                                                select_backend)

HAS_CUDA = torch.cuda.is_available()
BACKENDS = ("cuda", "triton")
STYLES = ("two", "any", "few")


# ----------------------------------------------------------------------------- cases and the oracle

def random_masks(rng: np.random.Generator, experts: int, ranks: int, style: str) -> np.ndarray:
    """[E] replica masks. two: every expert on 2 ranks (many augmenting paths); any: 1..R replicas;
    few: 30% of the experts on up to 3 ranks, the rest on one."""
    masks = np.zeros(experts, np.int64)
    for e in range(experts):
        if style == "two":
            n = min(2, ranks)
        elif style == "any":
            n = int(rng.integers(1, ranks + 1))
        else:
            n = min(3, ranks) if rng.random() < 0.3 else 1
        for r in rng.choice(ranks, n, replace=False):
            masks[e] |= 1 << int(r)
    return masks


def slots_of(rng: np.random.Generator, masks: np.ndarray, ranks: int) -> np.ndarray:
    """[E, R] distinct shuffled slot ids where a replica is, -1 elsewhere."""
    on = ((masks[:, None] >> np.arange(ranks)) & 1).astype(bool)
    slots = np.full(on.shape, -1, np.int64)
    slots[on] = rng.permutation(int(on.sum()))
    return slots


def random_ids(rng: np.random.Generator, rows: int, k: int, experts: int) -> np.ndarray:
    """[N, K] distinct experts per row; 5% of the entries -1, and one id out of range when N*K > 4."""
    ids = np.stack([rng.choice(experts, k, replace=experts < k) for _ in range(rows)])
    ids = np.where(rng.random(ids.shape) < 0.05, -1, ids)
    if ids.size > 4:
        ids.flat[rng.integers(ids.size)] = experts + 3
    return ids


def expected(ids: np.ndarray, masks: np.ndarray, slots: np.ndarray, num_rows: int,
             max_augment: int | None) -> np.ndarray:
    """[N, K] slots by ``fast_rule_step`` on the valid rows; padding rows: the lowest replica rank."""
    experts, ranks = slots.shape
    known = (ids >= 0) & (ids < experts)
    counts = np.bincount(ids[:num_rows][known[:num_rows]], minlength=experts)
    pick = fast_rule_step(counts, masks, ranks, max_augment)
    lowest = np.array([(int(m) & -int(m)).bit_length() - 1 for m in masks])
    out = np.full(ids.shape, -1, np.int64)
    for (row, j), e in np.ndenumerate(ids):
        if known[row, j]:
            out[row, j] = slots[e, pick[e] if row < num_rows else lowest[e]]
    return out


def make_case(seed: int, experts: int, ranks: int, rows: int, k: int, style: str) -> dict:
    rng = np.random.default_rng(seed)
    masks = random_masks(rng, experts, ranks, style)
    return dict(masks=masks, slots=slots_of(rng, masks, ranks), ids=random_ids(rng, rows, k, experts),
                num_rows=int(rng.integers(0, rows + 1)) if seed % 2 else rows)


def run_case(case: dict, device: str, backend: str, dtype=torch.int32, max_augment: int | None = 16,
             with_num_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(kernel output, expected) for one case."""
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), device)
    ids = torch.from_numpy(case["ids"]).to(device=device, dtype=dtype)
    num_rows = case["num_rows"] if with_num_rows else len(case["ids"])
    nr = torch.tensor(num_rows, dtype=torch.int32, device=device) if with_num_rows else None
    out = balanced_dispatch(ids, masks, slots, nr, max_augment=max_augment, backend=backend)
    assert out.dtype == dtype and out.shape == ids.shape
    return out.cpu().numpy(), expected(case["ids"], case["masks"], case["slots"], num_rows, max_augment)


def _layout(masks: np.ndarray, slots: np.ndarray):
    from moeplace.dispatch.balanced import ReplicaLayout

    return ReplicaLayout(masks, slots)


# ----------------------------------------------------------------------------- GPU: against the oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 16, 32])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_kernel_matches_fast_rule_step(backend, ranks, k, rows):
    for i, style in enumerate(STYLES):
        case = make_case(1000 * ranks + 10 * rows + k + i, 384, ranks, rows, k, style)
        got, want = run_case(case, "cuda", backend)
        np.testing.assert_array_equal(got, want, err_msg=f"{style} layout, {case['num_rows']} valid rows")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_augment_cap_int64_and_sizes(backend):
    """No cap, cap 0 and 1, int64 ids, no num_rows, few experts (all active), the largest sizes."""
    cases = [(make_case(1, 384, 32, 64, 8, "two"), dict(max_augment=None)),
             (make_case(2, 384, 16, 64, 8, "two"), dict(max_augment=0)),
             (make_case(3, 384, 8, 9, 8, "two"), dict(max_augment=1, dtype=torch.int64)),
             (make_case(4, 8, 3, 9, 8, "any"), dict(with_num_rows=False)),
             (make_case(5, 40, 8, 9, 4, "few"), dict(dtype=torch.int64, with_num_rows=False)),
             (make_case(6, 4096, 32, 128, 8, "two"), {}),     # 1024 entries, the most experts
             (make_case(8, 4096, 32, 128, 8, "any"), dict(dtype=torch.int64)),   # > 48 KB of shared memory
             (make_case(9, 384, 8, 128, 8, "few"), {}),       # more entries than the CUDA kernel's threads
             (make_case(7, 1, 1, 3, 1, "any"), {})]
    for case, options in cases:
        got, want = run_case(case, "cuda", backend, **options)
        np.testing.assert_array_equal(got, want, err_msg=str(options))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_placement_layout_in_place(backend):
    """A layout made by ``replica_layout`` from a placement (8 ranks, 96 spare slots), ids overwritten."""
    rng = np.random.default_rng(11)
    E, R, spare = 384, 8, 12
    ranks = np.array_split(rng.permutation(E), R)
    phy2log = np.concatenate([np.concatenate([own, rng.choice(np.setdiff1d(np.arange(E), own), spare,
                                                               replace=False)]) for own in ranks])
    layout = replica_layout(phy2log, E, R)
    masks, slots = dispatch_tables(layout, "cuda")
    for seed in range(4):
        ids_np = random_ids(np.random.default_rng(seed), 9 * (seed + 1), 8, E)
        ids = torch.from_numpy(ids_np).to(device="cuda", dtype=torch.int32)
        balanced_dispatch(ids, masks, slots, out=ids, backend=backend)
        want = expected(ids_np, layout.masks, layout.slots, len(ids_np), 16)
        np.testing.assert_array_equal(ids.cpu().numpy(), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, k, ranks", [(9, 8, 8), (3, 5, 3), (64, 8, 16)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_unaligned_views(backend, rows, k, ranks):
    """ids, masks, slots and num_rows as views one element into their storage (4-byte aligned only)."""
    case = make_case(31 + rows, 384, ranks, rows, k, "any")
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), "cuda")

    def shifted(tensor: torch.Tensor) -> torch.Tensor:
        view = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device="cuda")[1:].view(tensor.shape)
        return view.copy_(tensor)

    ids = shifted(torch.from_numpy(case["ids"]).to(device="cuda", dtype=torch.int32))
    num_rows = shifted(torch.tensor(case["num_rows"], dtype=torch.int32, device="cuda"))
    out = shifted(torch.full_like(ids, -7))
    balanced_dispatch(ids, shifted(masks), shifted(slots), num_rows, out, backend=backend)
    want = expected(case["ids"], case["masks"], case["slots"], case["num_rows"], 16)
    np.testing.assert_array_equal(out.cpu().numpy(), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_graph_replay_with_new_inputs(backend):
    """Captured once, replayed with new ids and row counts in the same buffers: no sync, no allocation."""
    rows, k = 72 // 8, 8
    case = make_case(21, 384, 8, rows, k, "any")
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), "cuda")
    ids = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
    num_rows = torch.tensor(rows, dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)
    balanced_dispatch(ids, masks, slots, num_rows, out, backend=backend)   # build / compile
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        balanced_dispatch(ids, masks, slots, num_rows, out, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        balanced_dispatch(ids, masks, slots, num_rows, out, backend=backend)
    for seed in range(5):
        rng = np.random.default_rng(100 + seed)
        new_ids = random_ids(rng, rows, k, 384)
        valid = int(rng.integers(0, rows + 1))
        ids.copy_(torch.from_numpy(new_ids))
        num_rows.fill_(valid)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(),
                                      expected(new_ids, case["masks"], case["slots"], valid, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_inputs_on_two_devices_rejected():
    case = make_case(0, 16, 2, 2, 2, "any")
    masks, slots = dispatch_tables(_layout(case["masks"], case["slots"]), "cpu")
    ids = torch.from_numpy(case["ids"]).to(device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="masks is on cpu"):
        balanced_dispatch(ids, masks, slots)


# ----------------------------------------------------------------------------- CPU: input checks

def _good(device="cpu"):
    return dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32, device=device),
                masks=torch.ones(8, dtype=torch.int32, device=device),
                slots=torch.zeros(8, 3, dtype=torch.int32, device=device))


@pytest.mark.parametrize("change, error, text", [
    (dict(topk_ids=[[0, 1]]), TypeError, "topk_ids must be a torch.Tensor"),
    (dict(topk_ids=torch.zeros(4, 2)), TypeError, "topk_ids must be int32 or int64, got float32"),
    (dict(topk_ids=torch.zeros(4, 2, 1, dtype=torch.int32)), ValueError, "2 dimension"),
    (dict(topk_ids=torch.zeros(2, 4, dtype=torch.int32).t()), ValueError, "contiguous"),
    (dict(topk_ids=torch.zeros(1025, 8, dtype=torch.int32)), ValueError, "at most 8192 ids"),
    (dict(masks=torch.ones(8, dtype=torch.int64)), TypeError, "masks must be int32, got int64"),
    (dict(masks=torch.ones(7, dtype=torch.int32)), ValueError, "masks has 7 experts, slots 8"),
    (dict(slots=torch.zeros(3, 8, dtype=torch.int32).t()), ValueError, "slots must be contiguous"),
    (dict(slots=torch.zeros(8, 33, dtype=torch.int32)), ValueError, "1 to 32 ranks"),
    (dict(num_rows=torch.zeros(2, dtype=torch.int32)), ValueError, "num_rows must hold one value"),
    (dict(num_rows=torch.zeros(1)), TypeError, "num_rows must be int32 or int64"),
    (dict(out=torch.zeros(4, 2, dtype=torch.int64)), TypeError, "out must be int32"),
    (dict(out=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "out has shape"),
    (dict(max_augment=-1), ValueError, "max_augment"),
    (dict(max_augment=2.5), ValueError, "max_augment"),
    ({}, ValueError, "needs CUDA tensors"),
])
def test_bad_input_is_one_clear_line(change, error, text, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(error, match=text) as info:
        balanced_dispatch(**{**_good(), **change})
    assert "\n" not in str(info.value)


def test_unknown_backend_is_one_line(monkeypatch):
    monkeypatch.setenv("MOEPLACE_DISPATCH_BACKEND", "fast")
    with pytest.raises(ValueError, match="one of auto, cuda, triton, got 'fast'"):
        select_backend("auto", (9, 0))


def test_dispatch_tables_keep_rank_31():
    masks = np.array([1 << 31 | 1, 1 << 5], np.int64)
    slots = np.full((2, 32), -1, np.int64)
    slots[0, [0, 31]], slots[1, 5] = [3, 9], 4
    m, s = dispatch_tables(_layout(masks, slots), "cpu")
    assert m.dtype == torch.int32 and m.tolist() == [-(1 << 31) + 1, 32]
    assert s.dtype == torch.int32 and s[0, 31].item() == 9


# ----------------------------------------------------------------------------- CPU: fallback to Triton

@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(balanced_dispatch_cuda, "_loaded", {})
    monkeypatch.delenv("MOEPLACE_DISPATCH_BACKEND", raising=False)
    return monkeypatch


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_missing_compiler_falls_back_to_triton_with_one_warning(fresh_loader, caplog):
    fresh_loader.setattr(balanced_dispatch_cuda, "find_nvcc", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", (9, 0)) == "triton"
        assert select_backend("auto", (9, 0)) == "triton"   # warned once, remembered
    lines = _warnings(caplog)
    assert len(lines) == 1 and "nvcc" in lines[0] and "Triton" in lines[0] and "\n" not in lines[0]
    with pytest.raises(RuntimeError, match="could not be built"):
        select_backend("cuda", (9, 0))


def test_failed_build_falls_back_with_its_first_line(fresh_loader, caplog):
    def broken(capability, verbose=False):
        raise RuntimeError("Error building extension 'moeplace_balanced_dispatch_sm90'\nnvcc output")

    fresh_loader.setattr(balanced_dispatch_cuda, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    fresh_loader.setattr(balanced_dispatch_cuda, "build", broken)
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", (9, 0)) == "triton"
    lines = _warnings(caplog)
    assert len(lines) == 1 and "Error building extension" in lines[0] and "\n" not in lines[0]


def test_old_gpu_uses_triton(fresh_loader, caplog):
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", (7, 5)) == "triton"
    assert len(_warnings(caplog)) == 1 and "8.0" in _warnings(caplog)[0]
    assert select_backend("triton", (9, 0)) == "triton"
    assert select_backend("auto", None) == "triton"


def test_cuda_source_compiles(tmp_path, monkeypatch):
    """The CUDA source builds through torch's extension builder (compile only; skipped without nvcc)."""
    from torch.utils import cpp_extension

    if balanced_dispatch_cuda.find_nvcc() is None or \
            not (Path(cpp_extension.CUDA_HOME) / "include" / "cuda_runtime.h").exists():
        pytest.skip("no CUDA toolkit (nvcc and headers) here")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert Path(balanced_dispatch_cuda.build((9, 0))).exists()


# ----------------------------------------------------------------------------- CPU: Triton interpreter

_INTERP_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_balanced_dispatch_kernel import make_case, run_case
    for seed, (E, R, N, K, style, dtype, cap) in enumerate([
            (40, 1, 9, 4, "any", torch.int32, 16), (40, 3, 9, 8, "two", torch.int64, 16),
            (64, 8, 9, 8, "two", torch.int32, None), (64, 8, 16, 4, "two", torch.int32, 1),
            (96, 32, 9, 8, "two", torch.int32, 16), (96, 32, 4, 8, "few", torch.int64, 0)]):
        got, want = run_case(make_case(seed, E, R, N, K, style), "cpu", "triton", dtype, cap)
        assert np.array_equal(got, want), (seed, got, want)
    print("ok")
""")


def test_triton_kernel_in_interpreter():
    """The Triton kernel itself, in Triton's CPU interpreter, against fast_rule_step."""
    run_in_triton_interpreter(_INTERP_SCRIPT, timeout=600)


def run_in_triton_interpreter(script: str, timeout: int) -> None:
    """Run ``script`` (``{tests}``: this folder, to import the tests' helpers) in a fresh Python with Triton's
    CPU interpreter on (it must be set before Triton loads); it passes when it exits 0 and prints ok."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script.format(tests=os.path.dirname(__file__))], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
