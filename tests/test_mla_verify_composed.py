"""The composed verify path (FlashMLA's prefix + our tree/merge kernel) against the fp32 oracle.

CPU: the tree/merge kernel, the block-table kernel and the query gather run in Triton's
interpreter, one subprocess for all cases (TRITON_INTERPRET must be set before Triton loads);
FlashMLA's part is stood in for by an fp32 prefix-only attention in FlashMLA's layouts (out
[B, s_q, H, 512], lse [B, H, s_q] as a strided view of [B, s_q, H]), with NaN in every row the
merge must not read and +inf lse where a request has no prefix, as FlashMLA writes there.
Also on the CPU: which path runs where (``select_backend``, ``prefer_composed``), one warning line.
GPU (sm_90 with sgl_flash_mla): the whole path through ``MlaVerify`` on 64-token pages.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
from test_mla_verify import check, check_graph_replay, make_case, paged_ids  # noqa: E402

from moeplace_kernels import mla_verify_api, mla_verify_composed  # noqa: E402
from moeplace_kernels.mla_verify_api import (  # noqa: E402
    composed_refusal, prefer_composed, select_backend)

# id: (d_list, heads, contexts, tree, layout, mask_indptr given)
INTERP_CASES = {
    "ragged-qlen-empty-prefix": ([9, 4, 1], 2, [0, 40, 7], "random", "qlen_only", True),
    "ragged-full-16-drafts": ([16, 3, 7, 1], 2, [5, 0, 64, 65], "random", "full", True),
    "chain-causal": ([5, 5], 2, [33, 1], "chain", "causal", False),
    "binary-16-drafts": ([16], 2, [100], "binary", "qlen_only", True),
    "one-draft-full": ([1, 1], 2, [3, 0], "random", "full", True),
    "qlen-at-b-dmax2": ([9, 9], 3, [10, 20], "random", "qlen_only", False),
}

_SCRIPT = textwrap.dedent("""
    import json, sys, torch, triton
    sys.path.insert(0, {tests!r})
    from test_mla_verify_composed import (INTERP_CASES, CHUNK_CASES, PLAN_CASES, chunk_index,
                                          chunk_layout, fake_flash_chunks, fake_flash_prefix)
    from test_mla_verify import make_case, paged_ids
    from moeplace_kernels.mla_verify_api import _MASK_MODES
    from moeplace_kernels.mla_verify_composed import (
        tree_merge, _block_table_kernel, _chunk_plan_kernel, _chunk_queries_kernel,
        _pad_queries_kernel)
    from moeplace_kernels.mla_verify_ref import mla_verify_ref
    res = {{}}
    scale = 576 ** -0.5
    for i, (cid, (d_list, H, ctx, tree, layout, has_mip)) in enumerate(INTERP_CASES.items()):
        case = make_case(len(d_list), d_list, H, ctx, tree=tree, layout=layout, device="cpu",
                         seed=i)
        if not has_mip:
            case["mask_indptr"] = None
        d_max = max(d_list)
        o_pre, l_pre = fake_flash_prefix(case, d_max, scale)
        T = case["q"].shape[0]
        ref, ref_lse = mla_verify_ref(**case, sm_scale=scale, d_max=d_max)
        args = (case["q"], case["k_ext"], case["v_ext"], case["mask"], _MASK_MODES[layout],
                case["mask_indptr"], case["qo_indptr"], case["kv_indptr"])
        # uniform (row offsets computed, not loaded) where every request has d_max drafts;
        # split: the tree part alone (phase 1, FlashMLA's stream partner), then the merge
        variants = [("", False, False), ("-split", False, True)]
        if T == len(d_list) * d_max:
            variants += [("-uniform", True, False), ("-uniform-split", True, True)]
        for suffix, uniform, split in variants:
            out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
            lse = torch.full((T, H), float("nan"))
            if split:
                o_tree = torch.full((T + 3, H, 512), float("nan"))
                l_tree = torch.full((T + 3, H), float("nan"))
                tree_merge(*args, None, None, None, None, scale, d_max, upcast=True,
                           uniform=uniform, phase=1, o_tree=o_tree, l_tree=l_tree)
                tree_merge(*args, o_pre, l_pre, out, lse, scale, d_max, upcast=True,
                           uniform=uniform, phase=2, o_tree=o_tree, l_tree=l_tree)
            else:
                tree_merge(*args, o_pre, l_pre, out, lse, scale, d_max, upcast=True,
                           uniform=uniform)
            res[cid + suffix] = dict(
                nan=bool(out.isnan().any() or lse.isnan().any()),
                err=((out.float() - ref).norm() / ref.norm()).item(),
                lse_err=(lse - ref_lse).abs().max().item())
    # The batch's prefixes as FlashMLA chunk requests, merged by the kernel (with the tree).
    for i, (cid, (d_list, ctx, chunks)) in enumerate(CHUNK_CASES.items()):
        H = 2
        case = make_case(len(d_list), d_list, H, ctx, tree="random", layout="qlen_only",
                         device="cpu", seed=50 + i)
        d_max = max(d_list)
        o_pre, l_pre, start, tail = fake_flash_chunks(case, d_max, scale, chunks)
        ref, ref_lse = mla_verify_ref(**case, sm_scale=scale, d_max=d_max)
        args = (case["q"], case["k_ext"], case["v_ext"], case["mask"], _MASK_MODES["qlen_only"],
                case["mask_indptr"], case["qo_indptr"], case["kv_indptr"])
        T = case["q"].shape[0]
        uniform = T == len(d_list) * d_max
        chunked = dict(chunks=chunks, chunk_start=start, chunk_tail=tail)
        for suffix, split in (("", False), ("-split", True)):
            out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
            lse = torch.full((T, H), float("nan"))
            if split:
                o_tree = torch.full((T, H, 512), float("nan"))
                l_tree = torch.full((T, H), float("nan"))
                tree_merge(*args, None, None, None, None, scale, d_max, upcast=True,
                           uniform=uniform, phase=1, o_tree=o_tree, l_tree=l_tree)
                tree_merge(*args, o_pre, l_pre, out, lse, scale, d_max, upcast=True,
                           uniform=uniform, phase=2, o_tree=o_tree, l_tree=l_tree, **chunked)
            else:
                tree_merge(*args, o_pre, l_pre, out, lse, scale, d_max, upcast=True,
                           uniform=uniform, **chunked)
            res["chunks-" + cid + suffix] = dict(
                nan=bool(out.isnan().any() or lse.isnan().any()),
                err=((out.float() - ref).norm() / ref.norm()).item(),
                lse_err=(lse - ref_lse).abs().max().item())
    # Chunk plan: the oracle's balanced layout, page ids in order, empty chunks past the batch.
    g = torch.Generator().manual_seed(1)
    for key, (ctx, chunks) in PLAN_CASES.items():
        ids, pages_of = paged_ids(ctx, sum((n + 63) // 64 for n in ctx) + 5, g)
        kvp = torch.tensor([0] + ctx, dtype=torch.int32).cumsum(0).int()
        span, layout, n_full = chunk_layout(ctx, chunks)
        table = torch.full((chunks, span + 2), -1, dtype=torch.int32)
        seqlens = torch.full((chunks,), -1, dtype=torch.int32)
        owner = torch.full((chunks,), -1, dtype=torch.int32)
        start = torch.full((len(ctx) + 2,), -1, dtype=torch.int32)
        tail = torch.full((len(ctx) + 1,), -7, dtype=torch.int32)
        _chunk_plan_kernel[(chunks,)](kvp, ids, table, seqlens, start, tail, owner,
                                      table.stride(0), len(ctx), CHUNKS=chunks,
                                      B_P2=triton.next_power_of_2(len(ctx)), PAGE_SIZE=64,
                                      BLOCK=4)
        want_start, want_tail = chunk_index(layout, n_full, len(ctx))
        ok = start[:len(ctx) + 1].tolist() == want_start and int(start[-1]) == -1
        ok &= tail[:len(ctx)].tolist() == want_tail and int(tail[-1]) == -7
        for c in range(chunks):
            if c < len(layout):
                b, first, last = layout[c]
                want_n = min(last * 64, ctx[b]) - first * 64
                want_pages = pages_of[b][first:last]
            else:
                b, want_n, want_pages = len(ctx) - 1, 0, [0]
            ok &= int(owner[c]) == b and int(seqlens[c]) == want_n
            ok &= table[c, :len(want_pages)].tolist() == want_pages
            ok &= bool((table[c, len(want_pages):] == -1).all())
        res["chunk_plan-" + key] = dict(ok=bool(ok))
    # Chunk requests' queries: each its request's drafts (ragged: only those).
    q = torch.randn(7, 3, 576).to(torch.bfloat16)
    for uniform, qo, d_max in ((False, [0, 4, 5, 7], 4), (True, [0, 2, 4, 6], 2)):
        qo_t = torch.tensor(qo, dtype=torch.int32)
        owner = torch.tensor([2, 0, 1, 1, 2], dtype=torch.int32)
        dst = torch.zeros(5, d_max, 3, 576, dtype=torch.bfloat16)
        _chunk_queries_kernel[(5, d_max, 2)](q, dst, owner, qo_t, 3, q.stride(0), q.stride(1),
                                          D_MAX=d_max, UNIFORM=uniform, C=576, BLOCK_C=1024,
                                          HB=2)
        want = torch.zeros_like(dst)
        for c, b in enumerate(owner.tolist()):
            want[c, :qo[b + 1] - qo[b]] = q[qo[b]:qo[b + 1]]
        res[f"chunk_queries-{{int(uniform)}}"] = dict(ok=bool(torch.equal(dst, want)))
    # Block table: shuffled pages, lengths 0, 1, 64, 65, 300; wider table than needed.
    g = torch.Generator().manual_seed(0)
    ctx = [0, 1, 64, 65, 300]
    ids, pages_of = paged_ids(ctx, 40, g)
    kvp = torch.tensor([0] + ctx, dtype=torch.int32).cumsum(0).int()
    table = torch.full((5, 12), -1, dtype=torch.int32)
    seqlens = torch.zeros(5, dtype=torch.int32)
    _block_table_kernel[(5, 2)](kvp, ids, table, seqlens, table.stride(0), PAGE_SIZE=64,
                                BLOCK=4, NPROG=2)
    ok = seqlens.tolist() == ctx
    for b, pages in enumerate(pages_of):
        want = pages if pages else [0]
        ok &= table[b, :len(want)].tolist() == want and bool((table[b, len(want):] == -1).all())
    res["block_table"] = dict(ok=bool(ok))
    # Query gather for ragged draft counts.
    q = torch.randn(7, 3, 576).to(torch.bfloat16)
    qo = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    pad = torch.zeros(3, 4, 3, 576, dtype=torch.bfloat16)
    _pad_queries_kernel[(3, 4, 2)](q, pad, qo, 3, q.stride(0), q.stride(1), D_MAX=4, C=576,
                                   BLOCK_C=1024, HB=2)
    want = torch.zeros_like(pad)
    want[0, :4], want[1, :1], want[2, :2] = q[0:4], q[4:5], q[5:7]
    res["pad_queries"] = dict(ok=bool(torch.equal(pad, want)))
    print("RESULT" + json.dumps(res))
""")


def fake_flash_prefix(case, d_max: int, scale: float):
    """FlashMLA's (out, lse) for the prefix alone, in fp32, in its layouts.

    out [B, d_max, H, 512] bf16, lse [B, H, d_max] fp32 (a view of [B, d_max, H] memory, as
    FlashMLA returns it). Rows past a request's drafts hold NaN; a request without prefix gets
    out NaN (FlashMLA: 0, but NaN shows any read) and lse +inf (FlashMLA's value).
    """
    qo, kvp = case["qo_indptr"].tolist(), case["kv_indptr"].tolist()
    bs, H = len(qo) - 1, case["q"].shape[1]
    out = torch.full((bs, d_max, H, 512), float("nan"))
    lse = torch.full((bs, d_max, H), float("nan"))
    for b in range(bs):
        D, N = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        if N == 0:
            lse[b, :D] = float("inf")
            continue
        kv = case["kv_pool"][case["kv_indices"][kvp[b]:kvp[b + 1]].long(), 0].float()
        s = torch.einsum("dhc,nc->dhn", case["q"][qo[b]:qo[b + 1]].float(), kv) * scale
        lse[b, :D] = torch.logsumexp(s, -1)
        out[b, :D] = torch.einsum("dhn,nc->dhc", torch.softmax(s, -1), kv[:, :512])
    return out.to(torch.bfloat16), lse.permute(0, 2, 1)


# id: (drafts per request, prefix tokens per request, chunks): the prefixes as FlashMLA chunk
# requests (one request, or a batch; empty prefixes, fewer pages than chunks, ragged drafts)
CHUNK_CASES = {"empty": ([9], [0], 4), "one-token": ([9], [1], 4), "one-page-66": ([9], [64], 66),
               "ragged-end": ([5], [700], 3), "more-chunks-than-pages": ([16], [130], 8),
               "many": ([9], [2000], 10), "many-steps": ([9], [4000], 30),
               "batch-uniform": ([9, 9, 9, 9], [65, 2000, 1, 640], 10),
               "batch-ragged-drafts": ([9, 4, 16], [700, 0, 130], 8),
               "batch-empty": ([5, 5], [0, 0], 4), "batch-one-each": ([3, 9], [3000, 64], 2),
               "batch-skewed": ([9, 9, 9], [64, 9000, 130], 33)}

# id: (prefix tokens per request, chunks): the chunk plan kernel against ``chunk_layout``
PLAN_CASES = {"0-4": ([0], 4), "1-4": ([1], 4), "64-4": ([64], 4), "65-4": ([65], 4),
              "300-4": ([300], 4), "300-66": ([300], 66), "4000-7": ([4000], 7),
              "batch-ragged": ([0, 1, 64, 65, 3000, 129], 11),
              "batch-skewed": ([64, 64, 20000, 0, 640], 66), "batch-exact": ([640, 640], 10),
              "batch-tight": ([6400, 64, 64], 3), "batch-empty": ([0, 0, 0], 5)}


def chunk_layout(ctx: list[int], chunks: int) -> tuple[int, list[tuple[int, int, int]], int]:
    """The chunk plan by brute force: (S, [(request, first page, end page)] in FlashMLA's
    order, number of full chunks), S the fewest pages per chunk such that the requests'
    cdiv(pages, S) chunks fit in ``chunks``: every request's full runs of S pages in request
    order, then the requests' tails (the pages left over), in request order."""
    pages = [(n + 63) // 64 for n in ctx]
    span = next(s for s in range(1, max(pages + [1]) + 1)
                if sum(-(-p // s) for p in pages) <= chunks)
    full = [(b, i * span, (i + 1) * span) for b, p in enumerate(pages) for i in range(p // span)]
    tails = [(b, p - p % span, p) for b, p in enumerate(pages) if p % span]
    return span, full + tails, len(full)


def chunk_index(layout: list[tuple[int, int, int]], n_full: int,
                bs: int) -> tuple[list[int], list[int]]:
    """(chunk starts [B + 1]: each request's full chunks, tails [B]: its tail chunk or -1) of a
    ``chunk_layout``, as the plan kernel writes them."""
    start = [0]
    for b in range(bs):
        start.append(start[-1] + sum(1 for o, _, _ in layout[:n_full] if o == b))
    tail = [-1] * bs
    for c in range(n_full, len(layout)):
        tail[layout[c][0]] = c
    return start, tail


def fake_flash_chunks(case, d_max: int, scale: float, chunks: int):
    """``fake_flash_prefix`` of a batch whose prefixes FlashMLA ran as the ``chunk_layout``
    chunk requests: out [chunks, d_max, H, 512], lse [chunks, H, d_max] (+inf for an empty
    chunk, FlashMLA's value; NaN in its out, which the merge must not read), and the chunk
    starts [B + 1] and tails [B] int32 (``chunk_index``)."""
    qo, kvp = case["qo_indptr"].tolist(), case["kv_indptr"].tolist()
    ctx = [kvp[b + 1] - kvp[b] for b in range(len(kvp) - 1)]
    _, layout, n_full = chunk_layout(ctx, chunks)
    outs, lses = [], []
    for c in range(chunks):
        b, first, last = layout[c] if c < len(layout) else (0, 0, 0)
        lo, hi = kvp[b] + min(first * 64, ctx[b]), kvp[b] + min(last * 64, ctx[b])
        sub = dict(case, kv_indices=case["kv_indices"][lo:hi],
                   q=case["q"][qo[b]:qo[b + 1]],
                   qo_indptr=torch.tensor([0, qo[b + 1] - qo[b]], dtype=torch.int32),
                   kv_indptr=torch.tensor([0, hi - lo], dtype=torch.int32))
        o, l = fake_flash_prefix(sub, d_max, scale)
        outs.append(o)
        lses.append(l.permute(0, 2, 1))
    start, tail = chunk_index(layout, n_full, len(ctx))
    return (torch.cat(outs), torch.cat(lses).permute(0, 2, 1),
            torch.tensor(start, dtype=torch.int32), torch.tensor(tail, dtype=torch.int32))


@pytest.fixture(scope="module")
def interp_results():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=os.path.dirname(__file__))],
                         env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert res.returncode == 0 and line, res.stderr[-3000:]
    return json.loads(line[len("RESULT"):])


UNIFORM_CASES = [cid for cid, (d_list, *_) in INTERP_CASES.items() if len(set(d_list)) == 1]


@pytest.mark.parametrize("cid", [c + s for c in INTERP_CASES for s in ("", "-split")]
                         + [c + s for c in UNIFORM_CASES for s in ("-uniform", "-uniform-split")])
def test_tree_merge_kernel_in_interpreter(interp_results, cid):
    """Every case in one launch and split in two (tree part, then merge); where all requests
    have D_max drafts also with computed row offsets."""
    r = interp_results[cid]
    assert not r["nan"], "NaN in output: a row FlashMLA left unwritten or empty was read"
    assert r["err"] < 1e-2, r
    assert r["lse_err"] < 2e-2, r


@pytest.mark.parametrize("cid", [f"chunks-{c}{s}" for c in CHUNK_CASES for s in ("", "-split")])
def test_chunked_prefix_merge_in_interpreter(interp_results, cid):
    """The prefixes (one request's or a batch's) as FlashMLA chunk requests, merged with the
    tree in one launch and after a separate tree part; empty chunks (lse +inf, out NaN) and
    other requests' chunks are never read."""
    r = interp_results[cid]
    assert not r["nan"], "NaN in output: an empty chunk's row was read"
    assert r["err"] < 1e-2, r
    assert r["lse_err"] < 2e-2, r


@pytest.mark.parametrize("key", list(PLAN_CASES))
def test_chunk_plan_kernel_in_interpreter(interp_results, key):
    assert interp_results["chunk_plan-" + key]["ok"]


@pytest.mark.parametrize("uniform", [0, 1])
def test_chunk_queries_kernel_in_interpreter(interp_results, uniform):
    assert interp_results[f"chunk_queries-{uniform}"]["ok"]


@pytest.mark.parametrize("seed", range(200))
def test_chunk_layout_is_balanced(seed):
    """The oracle's own promises: every request's pages covered once, in order, by at most
    ``chunks`` chunks of at most S pages, the full ones (S pages) first; S - 1 would not fit."""
    rng = random.Random(seed)
    chunks = rng.choice([2, 7, 33, 44, 66])
    ctx = [rng.choice([0, 1, 64, 65, rng.randint(0, 200000)])
           for _ in range(rng.randint(1, chunks - 1))]
    span, layout, n_full = chunk_layout(ctx, chunks)
    pages = [(n + 63) // 64 for n in ctx]
    assert len(layout) <= chunks and all(0 < last - first <= span for _, first, last in layout)
    assert all(last - first == span for _, first, last in layout[:n_full])
    assert all(last - first < span for _, first, last in layout[n_full:])
    for b, p in enumerate(pages):
        runs = sorted((f, e) for o, f, e in layout if o == b)
        assert [f for f, _ in runs] + [p] == [0] + [e for _, e in runs] or (p == 0 and not runs)
    if span > 1:
        assert sum(-(-p // (span - 1)) for p in pages) > chunks


def test_block_table_kernel_in_interpreter(interp_results):
    assert interp_results["block_table"]["ok"]


def test_pad_queries_kernel_in_interpreter(interp_results):
    assert interp_results["pad_queries"]["ok"]


# --- which path runs (CPU) ------------------------------------------------------------------
class Loader:
    def __init__(self, thing):
        self.thing, self.calls = thing, 0

    def __call__(self):
        self.calls += 1
        return self.thing


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_takes_composed_on_sm90_with_64_token_pages():
    for page in (64, 128):
        assert select_backend("auto", (9, 0), Loader(object()), Loader(object()), page, 9) \
            == "composed"
    # Without FlashMLA: the own kernel (load_flash_mla warns itself, tested below).
    assert select_backend("auto", (9, 0), Loader(object()), Loader(None), 64, 9) == "sm90"
    assert select_backend("auto", (9, 0), Loader(None), Loader(None), 64, 9) == "triton"


@pytest.mark.parametrize("capability", [(8, 0), (10, 0), (12, 0), None])
def test_auto_never_composes_off_hopper(capability):
    flash = Loader(object())
    assert select_backend("auto", capability, Loader(object()), flash, 64, 9) == "triton"
    assert flash.calls == 0


@pytest.mark.parametrize("page,drafts,reason", [(1, 9, "page size 1"), (16, 9, "page size 16"),
                                                (None, 9, "unknown"), (64, 17, "at most 16")])
def test_auto_warns_one_line_where_composed_cannot_serve(monkeypatch, caplog, page, drafts,
                                                         reason):
    monkeypatch.setattr(mla_verify_api, "_warned", set())
    flash = Loader(object())
    with caplog.at_level(logging.WARNING, logger=mla_verify_api.__name__):
        for _ in range(3):
            assert select_backend("auto", (9, 0), Loader(object()), flash, page, drafts) == "sm90"
    lines = _warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0] and reason in lines[0], lines
    assert "--page-size 64" in lines[0] or drafts > 16
    assert flash.calls == 0  # not even imported where the pool rules it out


def test_forced_composed_insists():
    with pytest.raises(ValueError, match="9.0"):
        select_backend("composed", (8, 0), Loader(object()), Loader(object()), 64, 9)
    with pytest.raises(ValueError, match="64-token pages"):
        select_backend("composed", (9, 0), Loader(object()), Loader(object()), 1, 9)
    with pytest.raises(RuntimeError, match="sgl_flash_mla"):
        select_backend("composed", (9, 0), Loader(object()), Loader(None), 64, 9)
    assert select_backend("composed", (9, 0), Loader(None), Loader(object()), 64, 9) == "composed"


def test_merge_config_refuses_pdl_with_side_stream():
    with pytest.raises(ValueError, match="side_stream"):
        mla_verify_composed.MergeConfig(pdl=True, side_stream=True)


def test_composed_refusal_reasons():
    assert composed_refusal(64, 16) is None and composed_refusal(256, 1) is None
    assert "page size 32" in composed_refusal(32, 9)
    assert "16 drafts" in composed_refusal(64, 17)


def test_missing_flash_mla_warns_once(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_flash(name, *a, **kw):
        if name == "flash_mla":
            raise ImportError("No module named 'flash_mla'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(mla_verify_composed, "_flash", {})
    monkeypatch.setattr(builtins, "__import__", no_flash)
    with caplog.at_level(logging.WARNING, logger=mla_verify_composed.__name__):
        assert mla_verify_composed.load_flash_mla() is None
        assert mla_verify_composed.load_flash_mla() is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "flash_mla" in lines[0] and "\n" not in lines[0], lines


def test_rule_is_by_rows_and_drafts():
    """Composed only where the own sm90 kernel would need several row blocks (16 heads x 9
    drafts, 8 x 10) or is not there (Triton); never past the composed path's tree size."""
    assert not prefer_composed(8, 17) and not prefer_composed(16, 17)
    assert not prefer_composed(8, 9) and not prefer_composed(4, 16) and not prefer_composed(6, 12)
    assert prefer_composed(16, 9) and prefer_composed(8, 10) and prefer_composed(5, 16)
    assert prefer_composed(8, 9, own_backend="triton")


def test_env_override_and_cpu_device(monkeypatch):
    from moeplace_kernels.mla_verify_api import MlaVerify

    monkeypatch.setenv(mla_verify_api.BACKEND_ENV, "composed")
    with pytest.raises(ValueError, match="9.0"):
        MlaVerify(8, 9, 2, device="cpu", page_size=64)
    monkeypatch.delenv(mla_verify_api.BACKEND_ENV)
    op = MlaVerify(8, 9, 2, device="cpu", page_size=64)
    assert op.backend == "triton" and op.path == "triton" and op.plan(
        torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
        torch.zeros(1, dtype=torch.long)) is None


def test_composed_buffers_reserved_ahead():
    """Sized once for the longest kv_indices (before any capture), never shrunk by a plan."""
    cv = mla_verify_composed.ComposedVerify(object(), 8, 9, 4, torch.device("cpu"))
    cv.reserve(4, 64 * 1000 + 1)
    table = cv.block_table
    assert table.shape == (4, 1001) and cv.seqlens.shape == (4,)
    cv.reserve(2, 640)
    assert cv.block_table is table


# --- GPU: the whole path ----------------------------------------------------------------------
def _need_composed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's dense decode needs compute capability 9.0")
    if mla_verify_composed.load_flash_mla() is None:
        pytest.skip("sgl_flash_mla does not import here")


def paged_case(d_list, H, ctx, tree="random", layout="qlen_only", seed=0):
    """make_case's problem on a pool of shuffled 64-token pages, NaN in every unused slot."""
    case = make_case(len(d_list), d_list, H, ctx, tree=tree, layout=layout, shuffle=False,
                     nan_pool=False, device="cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    pages = sum((n + 63) // 64 for n in ctx) + 3
    ids, _ = paged_ids(ctx, pages, g)
    pool = torch.full((pages * 64, 1, 576), float("nan")).to(torch.bfloat16)
    if ids.numel():
        pool[ids] = torch.randn(ids.numel(), 1, 576, generator=g).to(torch.bfloat16)
    case.update(kv_pool=pool, kv_indices=ids)
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def check_composed(case, d_max, op=None, plan=True):
    from moeplace_kernels.mla_verify_api import MlaVerify
    from moeplace_kernels.mla_verify_ref import mla_verify_ref

    H, bs = case["q"].shape[1], case["qo_indptr"].shape[0] - 1
    op = op or MlaVerify(H, d_max, bs, backend="composed", page_size=64)
    assert op.path == "composed"
    out = torch.full((case["q"].shape[0], H, 512), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    lse = torch.full(out.shape[:2], float("nan"), device="cuda")
    p = op.plan(case["qo_indptr"], case["kv_indptr"], case["kv_indices"]) if plan else None
    for _ in range(2):  # two "layers" on one plan
        op.forward(**case, out=out, lse=lse, plan=p)
    ref, ref_lse = mla_verify_ref(**case, sm_scale=op.sm_scale, d_max=d_max)
    assert not out.isnan().any(), "NaN in output"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 63, 64, 65, 4096, 65536, 185000])
@pytest.mark.parametrize("tree", ["chain", "binary", "random"])
def test_composed_contexts_and_trees(ctx, tree):
    _need_composed()
    check_composed(paged_case([9], 8, [ctx], tree=tree, seed=ctx), 9)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["qlen_only", "full", "causal"])
@pytest.mark.parametrize("plan", [True, False])
def test_composed_layouts(layout, plan):
    _need_composed()
    tree = "chain" if layout == "causal" else "random"
    check_composed(paged_case([9, 9, 9], 8, [100, 5000, 70], tree=tree, layout=layout), 9,
                   plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_composed_ragged_random(seed):
    """1..16 drafts per request, empty and one-token prefixes, 8 or 16 heads."""
    _need_composed()
    rng = random.Random(seed)
    bs = rng.choice([2, 5, 11])
    d_list = [rng.randint(1, 16) for _ in range(bs)]
    ctx = [rng.choice([0, 1, 65, 1000, 9000, 70000]) for _ in range(bs)]
    layout = ["qlen_only", "full"][seed % 2]
    check_composed(paged_case(d_list, [8, 16][seed % 2], ctx, layout=layout, seed=seed),
                   max(d_list))


@pytest.mark.gpu
def test_composed_batch8_and_auto_backend():
    """Under "auto" at page 64 the composed backend is kept (which path serves goes by shape: the
    test below); the composed path on a batch of 8 against the reference."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    assert MlaVerify(8, 9, 8, page_size=64).backend == "composed"
    op = MlaVerify(8, 9, 8, backend="composed", page_size=64)
    check_composed(paged_case([9] * 8, 8, [4096 * (1 + 4 * b) for b in range(8)], seed=3), 9, op=op)


@pytest.mark.gpu
def test_auto_one_row_block_runs_the_own_kernel():
    """Under "auto" at page 64 batches of 8 heads x 9 drafts run the own sm90 kernel (their pages
    copied by TMA), of 16 heads the composed path; both against the reference."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    for heads in (8, 16):
        op = MlaVerify(heads, 9, 3, page_size=64)
        own_serves = heads == 8 and op.own_backend == "sm90"
        assert op.path == ("sm90" if own_serves else "composed")
        for bs, ctx in ((1, [70001]), (3, [70001, 65, 9000])):
            check(paged_case([9] * bs, heads, ctx, seed=heads + bs), 9, op=op)


MERGE_CONFIGS = [dict(), dict(pdl=True), dict(uniform=False), dict(pdl=True, uniform=False),
                 dict(side_stream=True), dict(side_stream=True, uniform=False),
                 dict(dv_split=8, num_warps=2, pdl=True), dict(dv_split=2, num_warps=8),
                 dict(batch_chunks=True), dict(batch_chunks=True, pdl=True),
                 dict(batch_chunks=True, uniform=False), dict(batch_chunks=True, chunks=6),
                 dict(batch_chunks=True, chunks=5), dict(batch_chunks=True, chunks=6,
                                                         uniform=False), dict(chunks=0),
                 dict(batch_chunks=True, batch_chunk_unroll=0),
                 dict(batch_chunks=True, batch_chunk_unroll=8),
                 dict(batch_chunks=True, batch_chunk_block=4, batch_chunk_num_warps=4),
                 dict(batch_chunks=True, batch_chunk_dv_split=16, batch_chunk_num_warps=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MERGE_CONFIGS, ids=str)
@pytest.mark.parametrize("d_list", [[16, 9, 1, 4, 16], [16] * 5], ids=["ragged", "uniform"])
def test_composed_merge_configs(cfg, d_list):
    """Every merge-kernel setting the benchmark sweeps (any may become the default), on a ragged
    batch and on one where every request has D_max drafts (row offsets computed, not loaded);
    the batch as chunk requests (batch_chunks: 66, or 6: one or two per request) or on
    FlashMLA's own split (the default, or 5 chunks for 5 requests)."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    op = MlaVerify(8, 16, 5, backend="composed", page_size=64,
                   merge_config=mla_verify_composed.MergeConfig(**cfg))
    want = op.composed.chunks if cfg.get("batch_chunks") and op.composed.chunks > 5 else 0
    assert op.composed.chunks_for(5) == want
    check_composed(paged_case(d_list, 8, [0, 65, 9000, 1, 70000], layout="full", seed=7), 16,
                   op=op)


ONE_REQUEST_CONFIGS = [dict(), dict(chunks=0), dict(chunks=7), dict(pdl=True),
                       dict(side_stream=True), dict(chunk_dv_split=4, chunk_block=16),
                       dict(chunk_dv_split=32, chunk_block=4, chunk_num_warps=4),
                       dict(chunk_block=4), dict(chunk_dv_split=32)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ONE_REQUEST_CONFIGS, ids=str)
@pytest.mark.parametrize("ctx", [0, 1, 65, 9000, 185000])
def test_composed_one_request_chunked_or_not(cfg, ctx):
    """A batch of one request: its prefix as FlashMLA chunk requests (the default: one per SM
    part), as 7, or as one; every merge setting the benchmark sweeps for it."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    op = MlaVerify(8, 9, 1, backend="composed", page_size=64,
                   merge_config=mla_verify_composed.MergeConfig(**cfg))
    want = op.composed.chunks if cfg.get("chunks") is None else cfg["chunks"]
    assert op.plan(*(torch.zeros(2, dtype=torch.int32, device="cuda"),) * 2,
                   torch.zeros(64, dtype=torch.long, device="cuda")).chunks == want
    check_composed(paged_case([9], 8, [ctx], seed=ctx + 5), 9, op=op)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,drafts", [(16, 9), (16, 16), (8, 1), (8, 16)])
@pytest.mark.parametrize("ctx", [5000, 70000])
def test_composed_one_request_other_shapes(heads, drafts, ctx):
    """The chunked layout where FlashMLA has fewer SM parts (16 heads x 16 drafts: 4 row blocks,
    33 parts) or one draft, and a request with fewer drafts than the op's maximum (query gather)."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    op = MlaVerify(heads, 16, 1, backend="composed", page_size=64)
    assert op.composed.chunks == mla_verify_composed.flash_sm_parts(op.device, heads * 16)
    check_composed(paged_case([drafts], heads, [ctx], seed=heads + drafts), 16, op=op)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", [dict(), dict(pdl=True), dict(side_stream=True),
                                   dict(batch_chunks=True)], ids=str)
@pytest.mark.parametrize("bs", [1, 4])
def test_composed_cuda_graph_replay_with_new_lengths(merge, bs):
    """Plan and forward captured once; replays with other lengths in the same buffers (one
    request: the chunked layout)."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    D, H, cap = 9, 8, 70016
    op = MlaVerify(H, D, bs, backend="composed", page_size=64,
                   merge_config=mla_verify_composed.MergeConfig(**merge))

    def forward(static, out):
        plan = op.plan(static["qo_indptr"], static["kv_indptr"], static["kv_indices"])
        for _ in range(2):
            op.forward(static["q"], static["k_ext"], static["v_ext"], static["kv_pool"],
                       static["qo_indptr"], static["kv_indptr"], static["kv_indices"],
                       mask=static["mask"], mask_layout="qlen_only",
                       mask_indptr=static["mask_indptr"], out=out, plan=plan)

    lengths = [[64, 4096, 1, 300], [cap, 1, 63, 20000], [5, 0, 65536, 64], [0], [130]]
    lengths = [ctx[:bs] for ctx in lengths if len(ctx) >= bs]
    cases = ((ctx, paged_case([D] * bs, H, ctx, seed=seed + 10))
             for seed, ctx in enumerate(lengths))
    check_graph_replay(forward, paged_case([D] * bs, H, [64, 4096, 1, 300][:bs], seed=1), cases,
                       pool_rows=(bs * cap // 64 + 8) * 64, index_rows=bs * cap, sm_scale=op.sm_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_composed_batch_chunks_skewed(seed):
    """Batches as chunk requests (``batch_chunks``) where one request holds most of the KV (it
    gets most chunks) and others hold a page or none, at 8 and 16 heads (66 and 44 chunks);
    shuffled pages."""
    _need_composed()
    from moeplace_kernels.mla_verify_api import MlaVerify

    rng = random.Random(100 + seed)
    bs = rng.choice([2, 3, 8, 16])
    heads = [8, 16][seed % 2]
    ctx = [rng.choice([0, 1, 64, 3000, 150000 if b == 0 else 20000]) for b in range(bs)]
    op = MlaVerify(heads, 9, bs, backend="composed", page_size=64,
                   merge_config=mla_verify_composed.MergeConfig(batch_chunks=True))
    assert op.plan(*(torch.zeros(bs + 1, dtype=torch.int32, device="cuda"),) * 2,
                   torch.zeros(64, dtype=torch.long, device="cuda")).chunks == op.composed.chunks
    check_composed(paged_case([9] * bs, heads, ctx, seed=seed + 30), 9, op=op)
