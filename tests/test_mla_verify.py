"""MLA tree-verify kernels against the fp32 reference: shapes, trees, layouts, graphs, sm_120.

GPU tests carry ``@pytest.mark.gpu`` and skip without CUDA; most run both backends, the Hopper
CUDA kernel (``sm90``, skipped off compute capability 9.0 or without nvcc) and the Triton kernel,
against the same reference. The CPU tests run the Triton kernel in Triton's interpreter on a tiny
case and compile (without running) the sm_120 configuration; ``test_mla_verify_select.py`` checks
the backend choice on the CPU.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
SM_SCALE = 576 ** -0.5
BACKENDS = ["sm90", "triton"]


def need_backend(backend: str) -> None:
    """Skip unless ``backend`` runs here (sm90: an sm_90 GPU and a buildable library)."""
    if backend == "sm90":
        from moeplace_kernels import mla_verify_sm90

        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm90 kernel needs compute capability 9.0")
        if mla_verify_sm90.load() is None:
            pytest.skip("the sm90 kernel could not be built here")


def make_op(H, d_max, max_bs, backend, device="cuda", **kw):
    """MlaVerify on ``backend`` (skipping when it cannot run here)."""
    from moeplace_kernels.mla_verify_api import MlaVerify

    need_backend(backend)
    op = MlaVerify(H, d_max, max_bs, device=device, backend=backend, **kw)
    assert op.backend == backend
    return op


def tree_parents(kind: str, D: int, rng: random.Random) -> list[int]:
    """Parent of each draft token (-1 for the root) for a chain, binary or random tree."""
    if kind == "chain":
        return [i - 1 for i in range(D)]
    if kind == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, D)]
    return [-1] + [rng.randrange(i) for i in range(1, D)]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[D, D] bool: token i sees itself and its ancestors."""
    D = len(parents)
    m = torch.zeros(D, D, dtype=torch.bool)
    for i in range(D):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def make_case(bs, d_list, H, ctx, tree="random", layout="qlen_only", shuffle=True,
              nan_pool=True, device="cuda", seed=0):
    """Random verify problem: dict of kernel arguments (ragged drafts via d_list)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    T = sum(d_list)
    total = sum(ctx)
    slots = total + 64
    pool = torch.randn(slots, 1, 576, generator=g).to(torch.bfloat16)
    ids = torch.randperm(slots, generator=g)[:total] if shuffle else torch.arange(total) + 7
    if nan_pool:  # unused slots hold NaN: any stray read shows up in the output
        used = torch.zeros(slots, dtype=torch.bool)
        used[ids] = True
        pool[~used] = float("nan")
    d_max = max(d_list)
    masks, full_parts = [], []
    for b, D in enumerate(d_list):
        m = tree_mask(tree_parents(tree, D, rng))
        q_pad = torch.zeros(d_max, d_max, dtype=torch.bool)
        q_pad[:D, :D] = m
        masks.append(m.reshape(-1))
        full_parts.append(torch.cat([torch.ones(D, ctx[b], dtype=torch.bool), m], 1).reshape(-1))
    qo = torch.tensor([0] + list(torch.tensor(d_list).cumsum(0)), dtype=torch.int32)
    kvp = torch.tensor([0] + list(torch.tensor(ctx).cumsum(0)), dtype=torch.int32)
    if layout == "qlen_only":
        mask = torch.cat(masks).to(torch.uint8)
        mask_indptr = torch.tensor([0] + list(torch.tensor([d * d for d in d_list]).cumsum(0)),
                                   dtype=torch.int32)
    elif layout == "full":
        mask = torch.cat(full_parts)
        mask_indptr = torch.tensor([0] + list(torch.tensor(
            [d * (c + d) for d, c in zip(d_list, ctx)]).cumsum(0)), dtype=torch.int32)
    else:
        mask, mask_indptr = None, None
    k_ext = torch.randn(T, 1, 576, generator=g).to(torch.bfloat16)
    case = dict(
        q=torch.randn(T, H, 576, generator=g).to(torch.bfloat16),
        k_ext=k_ext, v_ext=k_ext[..., :512], kv_pool=pool, qo_indptr=qo, kv_indptr=kvp,
        kv_indices=ids.long(), mask=mask, mask_layout=layout, mask_indptr=mask_indptr,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def check(case, d_max, max_bs=None, op=None, atol_rel=1e-2, backend="triton"):
    """Run kernel and reference; assert relative error and that every output row was written."""
    from moeplace_kernels.mla_verify_ref import mla_verify_ref

    H = case["q"].shape[1]
    bs = case["qo_indptr"].shape[0] - 1
    op = op or make_op(H, d_max, max_bs or bs, backend, device=case["q"].device)
    out = torch.full((case["q"].shape[0], H, 512), float("nan"), dtype=torch.bfloat16,
                     device=case["q"].device)
    lse = torch.full(out.shape[:2], float("nan"), device=out.device)
    op.forward(**case, out=out, lse=lse)
    ref, ref_lse = mla_verify_ref(**case, sm_scale=op.sm_scale, d_max=d_max)
    assert not out.isnan().any(), "NaN in output (unwritten row or stray pool read)"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < atol_rel, f"relative error {err:.2e}"
    assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=1e-3)
    return err


# --- GPU: shapes ------------------------------------------------------------------------
SHORT_CTX = [1, 63, 64, 4096]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [1, 3, 8, 32])
@pytest.mark.parametrize("D", [1, 4, 9, 16])
@pytest.mark.parametrize("H", [8, 16, 128])
def test_shapes_ragged_contexts(bs, D, H, backend):
    ctx = [SHORT_CTX[(b * 7 + D) % len(SHORT_CTX)] for b in range(bs)]
    check(make_case(bs, [D] * bs, H, ctx, seed=bs * 100 + D * 10 + H), D, backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ctx", [1, 63, 64, 4096, 65536, 185000])
@pytest.mark.parametrize("tree", ["chain", "binary", "random"])
def test_contexts_and_trees(ctx, tree, backend):
    check(make_case(1, [9], 8, [ctx], tree=tree, seed=ctx), 9, backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["qlen_only", "full", "causal"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_layouts(layout, shuffle, backend):
    tree = "chain" if layout == "causal" else "random"
    check(make_case(3, [9, 9, 9], 8, [100, 5000, 70], tree=tree, layout=layout,
                    shuffle=shuffle), 9, backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_context_many_heads(backend):
    check(make_case(2, [9, 9], 128, [65536, 3000], seed=5), 9, backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_drafts_and_batch_of_long_contexts(backend):
    check(make_case(3, [9, 4, 1], 16, [185000, 1, 65536], seed=9), 9, backend=backend)
    check(make_case(8, [9] * 8, 8, [4096 * (1 + 4 * b) for b in range(8)], seed=3), 9,
          backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_mixed_draft_counts_random_trees(backend, seed):
    """Ragged batches with 1..16 drafts per request, random trees, empty prefixes, NaN pool."""
    rng = random.Random(seed)
    bs = rng.choice([2, 5, 11])
    d_list = [rng.randint(1, 16) for _ in range(bs)]
    ctx = [rng.choice([0, 1, 65, 1000, 9000, 70000]) for _ in range(bs)]
    layout = ["qlen_only", "full"][seed % 2]
    check(make_case(bs, d_list, 8, ctx, tree="random", layout=layout, seed=seed), max(d_list),
          backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("growth", [1.0, 3.0, 30.0])
def test_scores_that_jump_mid_prefix(backend, growth):
    """Keys that grow along the prefix (and a few far larger ones late in it) move every row's running
    maximum again and again, far past the first tiles' maximum: the online softmax must rescale what
    it summed before, wherever in a split the jump falls."""
    case = make_case(3, [9, 9, 5], 8, [9000, 700, 40000], seed=int(growth))
    pool, ids, kvp = case["kv_pool"], case["kv_indices"], case["kv_indptr"].tolist()
    for b in range(3):
        slots = ids[kvp[b]:kvp[b + 1]]
        ramp = torch.linspace(1.0, growth, slots.numel(), device=pool.device)
        pool[slots] = (pool[slots].float() * ramp[:, None, None]).to(pool.dtype)
        late = slots[int(0.8 * slots.numel()):][::997]
        pool[late] = (pool[late].float() * 8).to(pool.dtype)
    check(case, 9, backend=backend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("min_tiles,slices", [(1, 0), (4, 0), (1, 1), (1, 2), (1, 4)])
@pytest.mark.parametrize("pdl", [False, True])
def test_sm90_launch_settings(min_tiles, slices, pdl):
    """The split plan, the combine kernel's slices per row and the dependent launch: other
    settings give the same result."""
    from moeplace_kernels.mla_verify_api import Sm90Config

    cfg = Sm90Config(min_tiles=min_tiles, pdl=pdl, combine_slices=slices)
    op = make_op(8, 9, 8, "sm90", sm90_config=cfg)
    check(make_case(8, [9, 9, 4, 1, 9, 9, 2, 9], 8, [1, 63, 64, 4097, 70001, 300, 31, 20000],
                    seed=min_tiles), 9, op=op)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("ctx", [[1000, 63, 2500, 0], [4000, 1, 3500, 90]])
def test_sm90_short_batch_layout(heads, short, ctx):
    """Batches with at most a tile per CTA run in row blocks of 48 (the kernel decides from the
    lengths; the second batch has 121 tiles: short for 8 heads on 132 SMs, not for 16), ragged
    drafts included; the same result with the layout turned off."""
    from moeplace_kernels.mla_verify_api import Sm90Config

    op = make_op(heads, 9, 4, "sm90", sm90_config=Sm90Config(short_batches=short))
    check(make_case(4, [9, 4, 9, 1], heads, ctx, tree="random", seed=heads), 9, op=op)


@pytest.mark.gpu
@gpu
def test_sm90_plan_charges_request_boundaries():
    """Long ragged batches count each boundary between requests as tiles of the split plan, so CTA
    ranges start and end in the gaps before requests' tiles, empty prefixes among them; every
    request's tiles are still computed once and merged from the right partials."""
    ctx = [70000, 0, 65, 30000, 1, 12345, 64, 50000, 129, 0, 40000, 9000]
    check(make_case(12, [9, 4, 9, 9, 1, 9, 9, 2, 9, 9, 9, 5], 8, ctx, tree="random", seed=12), 9,
          op=make_op(8, 9, 12, "sm90"))


def relayout_slots(case, ids: torch.Tensor) -> dict:
    """``case`` with its KV rows moved to slot ids ``ids`` (one per prefix token) of a new pool
    whose other slots hold NaN."""
    old = case["kv_pool"]
    pool = torch.full((int(ids.max()) + 65, 1, 576), float("nan"), dtype=old.dtype, device=old.device)
    pool[ids.long().to(old.device)] = old[case["kv_indices"].long()]
    return {**case, "kv_pool": pool, "kv_indices": ids.to(old.device)}


def paged_ids(ctx: list[int], total_pages: int, gen: torch.Generator):
    """Slot ids of requests laid out in shuffled 64-token pages: (ids int64, pages per request)."""
    perm = torch.randperm(total_pages, generator=gen).tolist()
    ids, pages_of = [], []
    for n in ctx:
        mine = [perm.pop() for _ in range((n + 63) // 64)]
        pages_of.append(mine)
        ids += [mine[t // 64] * 64 + t % 64 for t in range(n)]
    return torch.tensor(ids, dtype=torch.int64), pages_of


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("layout", ["pages", "broken_runs"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sm90_tiles_of_consecutive_slots(tma, layout, index_dtype):
    """16 tokens whose slot ids run on are copied by TMA, the others gathered: a pool in shuffled
    64-token pages (NaN in the unused part of each request's last page), and consecutive slots
    with a swap every 700 tokens (runs that start anywhere, groups that are not runs, partial
    tiles); the same result with TMA copies turned off."""
    from moeplace_kernels.mla_verify_api import Sm90Config

    ctx = [63, 64, 65, 4097, 1, 20000, 130, 9000]
    case = make_case(8, [9, 9, 4, 9, 1, 9, 9, 2], 8, ctx, seed=11)
    if layout == "pages":
        ids, _ = paged_ids(ctx, sum((n + 63) // 64 for n in ctx) + 3, torch.Generator().manual_seed(3))
    else:
        ids = torch.arange(sum(ctx)) + 5
        for i in range(100, len(ids) - 1, 700):  # breaks a run every 700 tokens
            ids[[i, i + 1]] = ids[[i + 1, i]]
    case = relayout_slots(case, ids.to(index_dtype))
    op = make_op(8, 9, 8, "sm90", sm90_config=Sm90Config(tma_runs=tma))
    check(case, 9, op=op)


@pytest.mark.gpu
@gpu
def test_sm90_refuses_out_rows_not_8_byte_aligned():
    """The combine kernel stores four output values at a time: an out view one value into its
    storage is refused before any launch."""
    case = make_case(2, [9, 9], 8, [100, 2000], seed=4)
    op = make_op(8, 9, 2, "sm90")
    out = torch.empty(18 * 8 * 512 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(18, 8, 512)
    with pytest.raises(ValueError, match="8-byte aligned"):
        op.forward(case["q"], case["k_ext"], case["v_ext"], case["kv_pool"], case["qo_indptr"],
                   case["kv_indptr"], case["kv_indices"], mask=case["mask"], mask_layout="qlen_only",
                   mask_indptr=case["mask_indptr"], out=out)


@pytest.mark.gpu
@gpu
def test_sm90_layout_probe():
    """One tile through the kernel's own descriptors and swizzle: S^T = K Q^T, O^T = V^T P^T."""
    from moeplace_kernels import mla_verify_sm90

    need_backend("sm90")
    lib = mla_verify_sm90.load()
    lib.setup(torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 576, generator=g).to(torch.bfloat16).cuda()
    q = torch.randn(40, 576, generator=g).to(torch.bfloat16).cuda()
    pm = torch.rand(64, 40, generator=g).to(torch.bfloat16).cuda()
    s_out = torch.full((64, 40), float("nan"), device="cuda")
    o_out = torch.full((512, 40), float("nan"), device="cuda")
    lib.probe(k.data_ptr(), q.data_ptr(), pm.data_ptr(), s_out.data_ptr(), o_out.data_ptr(),
              torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())
    torch.cuda.synchronize()
    s_ref = k.double() @ q.double().T
    o_ref = k[:, :512].double().T @ pm.double()
    assert torch.allclose(s_out.double(), s_ref, rtol=1e-3, atol=1e-2), (s_out - s_ref).abs().max()
    assert torch.allclose(o_out.double(), o_ref, rtol=1e-3, atol=1e-2), (o_out - o_ref).abs().max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_with_new_lengths(backend):
    """Capture once at one set of lengths; replay with others written into the same buffers."""
    bs, D, H, cap = 4, 9, 8, 70000
    op = make_op(H, D, bs, backend)

    def forward(static, out):
        op.forward(static["q"], static["k_ext"], static["v_ext"], static["kv_pool"],
                   static["qo_indptr"], static["kv_indptr"], static["kv_indices"],
                   mask=static["mask"], mask_layout="qlen_only",
                   mask_indptr=static["mask_indptr"], out=out)

    # Masks of other trees have the same size under QLEN_ONLY; copied in place. The sm90 kernel takes
    # its short-batch layout for the first and last (at most 132 tiles) and its usual one between.
    cases = ((ctx, make_case(bs, [D] * bs, H, ctx, seed=seed + 10, nan_pool=False))
             for seed, ctx in enumerate([[64, 4096, 1, 300], [cap, 1, 63, 20000], [5, 5, 65536, 64],
                                         [900, 30, 1000, 2]]))
    check_graph_replay(forward, make_case(bs, [D] * bs, H, [64, 4096, 1, 300], seed=1), cases,
                       pool_rows=bs * cap + 64, index_rows=bs * cap, sm_scale=op.sm_scale)


def check_graph_replay(forward, first: dict, cases, pool_rows: int, index_rows: int, sm_scale: float) -> None:
    """Capture ``forward(static, out)`` once on buffers big enough for every case, filled from ``first``;
    then, for each (label, case) of ``cases``, write the case into the same buffers, replay, and compare
    with the oracle (``mla_verify_ref``): no NaN, relative error under 1e-2."""
    from moeplace_kernels.mla_verify_ref import mla_verify_ref

    static = dict(q=first["q"].clone(), k_ext=first["k_ext"].clone(),
                  kv_pool=torch.zeros(pool_rows, 1, 576, dtype=torch.bfloat16, device="cuda"),
                  qo_indptr=first["qo_indptr"].clone(), kv_indptr=first["kv_indptr"].clone(),
                  kv_indices=torch.zeros(index_rows, dtype=torch.long, device="cuda"),
                  mask=first["mask"].clone(), mask_indptr=first["mask_indptr"].clone())
    static["v_ext"] = static["k_ext"][..., :512]
    out = torch.empty(first["q"].shape[0], first["q"].shape[1], 512, dtype=torch.bfloat16, device="cuda")

    def load(case):
        n = case["kv_indices"].numel()
        static["kv_pool"].zero_()
        static["kv_pool"][:case["kv_pool"].shape[0]].copy_(case["kv_pool"].nan_to_num(0.0))
        static["kv_indices"][:n].copy_(case["kv_indices"])
        for k in ("q", "k_ext", "qo_indptr", "kv_indptr", "mask", "mask_indptr"):
            static[k].copy_(case[k])

    load(first)
    forward(static, out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(static, out)
    for label, case in cases:
        load(case)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = mla_verify_ref(static["q"], static["k_ext"], static["v_ext"], static["kv_pool"],
                                static["qo_indptr"], static["kv_indptr"], static["kv_indices"],
                                sm_scale, static["mask"], "qlen_only", static["mask_indptr"])
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (label, err)


def _candidate_tags() -> list[str]:
    from moeplace_kernels.mla_verify_api import hopper_candidates
    return [c.tag().replace(" ", "_") for c in hopper_candidates()]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("idx", range(len(_candidate_tags())),
                         ids=lambda i: _candidate_tags()[i])
def test_hopper_candidates(idx):
    """Every config the benchmark sweeps (any may become the default): ragged batch + long."""
    from moeplace_kernels.mla_verify_api import MlaVerify, hopper_candidates

    cfg = hopper_candidates()[idx]
    op = MlaVerify(8, 9, 8, device="cuda", config=cfg)
    check(make_case(8, [9, 9, 4, 1, 9, 9, 2, 9], 8, [1, 63, 64, 4097, 70001, 300, 31, 20000],
                    seed=idx), 9, op=op)
    check(make_case(1, [9], 8, [185000], tree="binary", seed=100 + idx), 9, op=op)
    check(make_case(2, [9, 9], 8, [33, 9000], tree="chain", layout="causal", seed=200 + idx), 9,
          op=op)


@pytest.mark.gpu
@gpu
def test_bad_inputs_raise():
    from moeplace_kernels.mla_verify_api import MlaVerify

    case = make_case(1, [4], 8, [64])
    op = MlaVerify(8, 4, 1, device="cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        op.forward(**{**case, "q": case["q"].float()})
    with pytest.raises(ValueError, match="mask_indptr"):
        op.forward(**{**case, "mask_layout": "full", "mask_indptr": None})


# --- CPU: interpreter and sm_120 compile -----------------------------------------------
_INTERP_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_mla_verify import make_case, check
    from moeplace_kernels.mla_verify_api import MlaVerify, TileConfig
    for layout, tree, dvs in (("qlen_only", "binary", 1), ("full", "random", 2),
                              ("causal", "chain", 1)):
        case = make_case(2, [3, 2], 2, [5, 40], tree=tree, layout=layout, device="cpu")
        op = MlaVerify(2, 3, 2, device="cpu", split_slots=8,
                       config=TileConfig(16, 0, 1, block_n=16, min_chunk=16, dv_split=dvs))
        check(case, 3, op=op)
    # 8 heads x 3 drafts = 24 rows: a 16-row tile plus a 16-row tail in its own program
    case = make_case(2, [3, 2], 8, [5, 40], tree="random", device="cpu", seed=2)
    op = MlaVerify(8, 3, 2, device="cpu", split_slots=8,
                   config=TileConfig(16, 16, 1, block_n=16, min_chunk=16, tail_block_n=32))
    check(case, 3, op=op)
    for tail_m in (0, 16):  # slot ids carried across steps: 2 steps per split, ragged end
        case = make_case(2, [3, 2], 8, [5, 75], tree="random", device="cpu", seed=7 + tail_m)
        op = MlaVerify(8, 3, 2, device="cpu", split_slots=8,
                       config=TileConfig(16, tail_m, 2 if tail_m == 0 else 1, block_n=16,
                                         min_chunk=32, idx_prefetch=True, tail_block_n=16))
        check(case, 3, op=op)
    print("ok")
""")


def test_default_config_prefetches_slot_ids_only_without_a_tail():
    from moeplace_kernels.mla_verify_api import default_config

    for heads, drafts in ((8, 8), (16, 4), (8, 1)):
        cfg = default_config(heads, drafts)
        assert cfg.tail_m == 0 and cfg.idx_prefetch, (heads, drafts)
    cfg = default_config(8, 9)
    assert (cfg.block_m, cfg.tail_m) == (64, 16) and not cfg.idx_prefetch


def test_interpreter_small_case():
    """The kernel itself, in Triton's CPU interpreter: 2 requests, 4 splits, all 3 layouts."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _INTERP_SCRIPT.format(tests=os.path.dirname(__file__))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_choose_rows_pads_little():
    from moeplace_kernels.mla_verify_api import choose_rows

    assert choose_rows(72) == (64, 16, 1)  # 9 drafts x 8 heads: 80 rows, not 128
    assert choose_rows(8) == (16, 0, 1)
    assert choose_rows(128) == (64, 0, 2)
    m, t, n = choose_rows(16 * 128)
    assert n * (m + t) >= 16 * 128


def test_sm120_config_compiles_within_shared_memory():
    """Ahead-of-time compile of the sm_120 tile config; its shared memory fits ~99 KB."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    from moeplace_kernels.mla_verify import _verify_split_kernel
    from moeplace_kernels.mla_verify_api import default_config

    cfg = default_config(8, 9, arch_major=12)
    names = ["Q", "K_ext", "V_ext", "KV", "kv_indptr", "kv_indices", "qo_indptr", "Mask",
             "mask_indptr", "O_part", "L_part", "B", "H", "MAX_SPLITS", "TARGET_PROGRAMS",
             "R_PAD", "qk_scale", "stride_qt", "stride_qh", "stride_kvs", "stride_ket",
             "stride_vet"]
    types = ["*bf16"] * 4 + ["*i32", "*i64", "*i32", "*u8", "*i32", "*bf16", "*fp32"] + \
        ["i32"] * 5 + ["fp32"] + ["i32"] * 5
    const = dict(D_MAX=9, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m, BLOCK_N=cfg.block_n,
                 BLOCK_D=16, MIN_CHUNK=cfg.min_chunk, MASK_MODE=1, HAS_MASK_INDPTR=True,
                 DN=512, DP=64, UPCAST=False, DV_SPLIT=cfg.dv_split,
                 TAIL_BLOCK_N=cfg.tail_block_n or cfg.block_n, IDX_PREFETCH=cfg.idx_prefetch)
    sig = dict(zip(names, types)) | {k: "constexpr" for k in const}
    # The JIT's specialisation: 16-byte aligned pointers and strides. Without it Triton cannot
    # vectorise the loads, pipelines nothing and reports far less shared memory than it uses.
    aligned = [i for i, n in enumerate(names) if types[i].startswith("*") or n.startswith("stride")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    try:
        kernel = triton.compile(ASTSource(_verify_split_kernel, sig, constexprs=const, attrs=attrs),
                                target=GPUTarget("cuda", 120, 32),
                                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    except Exception as exc:  # no ptxas for sm_120 in this Triton build
        pytest.skip(f"Triton cannot compile for sm_120 here: {exc!r:.200}")
    assert kernel.metadata.shared <= 99 * 1024, kernel.metadata.shared
