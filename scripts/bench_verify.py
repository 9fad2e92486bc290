"""Benchmark MLA tree-verify: moeplace's kernels vs FlashMLA and SGLang 0.5.23's, on one GPU.

Question: How fast is moeplace's MLA tree-verify attention against FlashMLA and SGLang's kernels?
Baseline: FlashMLA's SM90 dense decode on the same KV (a causal chain over the drafts) and SGLang's kernels, timed
    in the same process, and the copy bandwidth measured in the same run.
Output: --out FILE.md (default bench_verify.md), markdown tables.

Peers timed in the same process at the same contexts (8 heads x 9-token binary tree unless
--heads/--drafts say otherwise; the KV in shuffled 64-token pages, so every peer reads the same
pool, and the composed path can):
  moeplace composed FlashMLA's decode for the prefix (no mask, with its lse) + our tree/merge
                   kernel; timed per layer (its per-batch plan outside the graph, timed apart);
                   batches on FlashMLA's own split and combine ("composed-batch-chunks":
                   as balanced chunk requests, MergeConfig.batch_chunks)
  moeplace sm90    the Hopper CUDA kernel (sm_90 only), tree mask, partials merged in L2
                   ("sm90 page 1": the same KV one token per shuffled slot, SGLang's page size 1;
                   "sm90 page 1 runs": one token per slot, each request's slots one run, as a
                   sorted free list leaves them)
  moeplace triton  the Triton kernel (the default elsewhere)
  FlashMLA         sgl-flash-mla's SM90 dense decode (``flash_mla_with_kvcache(..., causal=True,
                   use_legacy=True)``): the same KV copied into 64-token pages, a causal chain
                   over the drafts (it has no tree mask), its 72 rows padded to 2 x 64
  SGLang           extend_attention_fwd / verify_shared_kv_fwd from the installed sglang, an
                   unpacked one (--sglang-root) or the wheel (--sglang-wheel)
Effective KV bandwidth = sum over requests of context_len * 576 * 2 bytes / time.
Copy bandwidth is measured in the same run (device-to-device copy, bytes read + written).
Times are CUDA-graph replays of one call, median of many (torch.cuda.Event); --rounds R
repeats that for every peer R times round-robin and takes the median; --layers N also times N
calls in one graph, per call (as a server replays the layers of a step). Every moeplace result
is checked against the fp32 reference before it is timed.

    pip install --no-deps --target /tmp/site .whl/sgl_flash_mla-*.whl; export PYTHONPATH=/tmp/site
    python scripts/bench_verify.py --out bench.md                # peers table
    python scripts/bench_verify.py --sweep-sm90 --out sweep.md   # + Sm90Config variants
    python scripts/bench_verify.py --kernels sm90,flashmla --sm90-config min_tiles=2   # + one variant
    python scripts/bench_verify.py --rounds 3 --layers 8 --sglang-root /tmp/sgl   # every peer
    python scripts/bench_verify.py --grid --extra-cases --rounds 3 --layers 8   # + batches x contexts
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
from pathlib import Path

import torch

from cuda_timing import graph_time_us  # scripts/ is on sys.path when run as a script
from sglang_wheel import register_packages, stub, unpack
from moeplace_kernels.mla_verify_api import MlaVerify, Sm90Config, hopper_candidates
from moeplace_kernels.mla_verify_composed import MergeConfig
from moeplace_kernels.mla_verify_ref import mla_verify_ref

KV_BYTES = 576 * 2


def load_sglang_kernels(wheel: str | None, root: str | None = None):
    """(extend_attention module, verify_mla module) from the installed sglang, an unpacked
    sglang folder (``root``, the folder holding the ``sglang`` package) or its wheel.

    The kernel modules need only ``sglang.srt.environ`` (stdlib) and four platform predicates of
    ``sglang.srt.utils`` (``sglang_wheel`` says how the rest of the package is kept out).
    """
    if root is None:
        try:
            from sglang.kernels.ops.attention import extend_attention, verify_mla
            return extend_attention, verify_mla
        except Exception:
            pass
    root = Path(root) if root is not None else unpack(wheel)[0]
    if not (root / "sglang" / "kernels").is_dir():
        raise FileNotFoundError(f"no sglang package with kernels under {root}")
    register_packages(root, ["sglang", "sglang.kernels", "sglang.kernels.ops",
                             "sglang.kernels.ops.attention", "sglang.srt"])
    stub("sglang.srt.utils", is_cuda=lambda: True, is_hip=lambda: False, is_gfx95_supported=lambda: False,
         is_gfx1250_supported=lambda: False,
         get_device_core_count=lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count)
    ext = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
    ver = importlib.import_module("sglang.kernels.ops.attention.verify_mla")
    return ext, ver


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read plus written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), reps=20)
    return 2 * n / us / 1e3


def binary_tree_mask(D: int) -> torch.Tensor:
    m = torch.zeros(D, D, dtype=torch.bool)
    for i in range(D):
        j = i
        while j >= 0:
            m[i, j] = True
            j = (j - 1) // 2 if j > 0 else -1
    return m


def paged_slots(ctx: list[int], shuffle: bool) -> tuple[torch.Tensor, int]:
    """(slot ids, pool slots): each request in whole 64-token pages, pages shuffled if asked."""
    pages = [(n + 63) // 64 for n in ctx]
    n_pages = sum(pages) + 16
    order = (torch.randperm(n_pages, device="cuda") if shuffle
             else torch.arange(n_pages, device="cuda"))
    ids, first = [], 0
    within = torch.arange(64, device="cuda")
    for n, k in zip(ctx, pages):
        ids.append((order[first:first + k, None] * 64 + within).reshape(-1)[:n])
        first += k
    return torch.cat(ids), n_pages * 64


def make_problem(ctx: list[int], H: int, D: int, shuffle: bool, tree: bool = True):
    """Tensors of one verify step; the pool holds exactly the used pages (+ slack)."""
    bs = len(ctx)
    ids, slots = paged_slots(ctx, shuffle)
    pool = torch.randn(slots, 1, 576, device="cuda").to(torch.bfloat16)
    m = binary_tree_mask(D) if tree else torch.ones(D, D, dtype=torch.bool).tril()
    qlen = m.reshape(-1).repeat(bs).to(torch.uint8).cuda()
    full = torch.cat([torch.cat([torch.ones(D, c, dtype=torch.bool), m], 1).reshape(-1)
                      for c in ctx]).cuda()
    k_ext = torch.randn(bs * D, 1, 576, device="cuda").to(torch.bfloat16)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    return dict(
        q=torch.randn(bs * D, H, 576, device="cuda").to(torch.bfloat16), k_ext=k_ext,
        v_ext=k_ext[..., :512], pool=pool, kv_indices=ids.long(),
        qo_indptr=torch.arange(0, (bs + 1) * D, D, dtype=torch.int32, device="cuda"),
        kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), ctx_t.cumsum(0)]).int().cuda(),
        mask_qlen=qlen, mask_full=full,
        mask_indptr=torch.cat([torch.zeros(1, dtype=torch.int64),
                               (D * (ctx_t + D)).long().cumsum(0)]).cuda(),
        D=D, H=H, bs=bs,
    )


def run_ours(p, op: MlaVerify, out, plan=None):
    return lambda: op.forward(p["q"], p["k_ext"], p["v_ext"], p["pool"], p["qo_indptr"],
                              p["kv_indptr"], p["kv_indices"], mask=p["mask_qlen"],
                              mask_layout="qlen_only", out=out, plan=plan)


def run_plan(p, op: MlaVerify):
    return lambda: op.plan(p["qo_indptr"], p["kv_indptr"], p["kv_indices"])


def run_sglang_extend(ext, p, out):
    v_buf = p["pool"][..., :512]
    return lambda: ext.extend_attention_fwd(
        p["q"], p["k_ext"], p["v_ext"], out, p["pool"], v_buf, p["qo_indptr"], p["kv_indptr"],
        p["kv_indices"], p["mask_full"], False, p["mask_indptr"], p["D"], 1.0, 1.0,
        sm_scale=576 ** -0.5)


def run_sglang_verify_mla(ver, p, out):
    """SGLang's chain-only split-KV kernel (is_causal, no mask: it refuses trees)."""
    v_buf = p["pool"][..., :512]
    ok = ver.verify_shared_kv_fwd(
        p["q"], p["k_ext"], p["v_ext"], out, p["pool"], v_buf, p["qo_indptr"], p["kv_indptr"],
        p["kv_indices"], None, True, p["mask_indptr"], p["D"], 1.0, 1.0,
        sm_scale=576 ** -0.5, max_bs=p["bs"])
    if not ok:
        return None
    return lambda: ver.verify_shared_kv_fwd(
        p["q"], p["k_ext"], p["v_ext"], out, p["pool"], v_buf, p["qo_indptr"], p["kv_indptr"],
        p["kv_indices"], None, True, p["mask_indptr"], p["D"], 1.0, 1.0,
        sm_scale=576 ** -0.5, max_bs=p["bs"])


def _compile_one(args) -> str:
    """Worker: compile (by running on tiny inputs) one config for batch 1 and batch 8."""
    cfg, H, D = args
    try:
        op = MlaVerify(H, D, 8, config=cfg)
        for ctx in ([64], [64] * 8):
            p = make_problem(ctx, H, D, shuffle=True)
            out = torch.empty(len(ctx) * D, H, 512, dtype=torch.bfloat16, device="cuda")
            run_ours(p, op, out)()
        torch.cuda.synchronize()
        return f"compiled {cfg.tag()}"
    except Exception as exc:
        return f"compile failed {cfg.tag()}: {exc!r:.300}"


def precompile(configs, H: int, D: int, procs: int) -> None:
    """Fill Triton's on-disk cache for every config in parallel processes (same specialisation
    as the timed runs: batch 1 and batch 8 of the same MlaVerify shape)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(min(procs, len(configs))) as pool:
        for line in pool.imap_unordered(_compile_one, [(c, H, D) for c in configs]):
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-wheel", default=None,
                    help="time SGLang's Triton kernels too, loaded from this wheel (a glob)")
    ap.add_argument("--sglang-root", default=None,
                    help="time SGLang's Triton kernels too, from this folder holding the sglang "
                         "package (an unpacked wheel or install target)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every peer this many times, interleaved, and take the median "
                         "(the peers then see the same drift of clocks and neighbours)")
    ap.add_argument("--layers", type=int, default=0,
                    help="also time N calls captured in one graph, per call (back to back as "
                         "in a server's graph of N layers: the graph's own launch is spread "
                         "over N calls and every kernel follows another)")
    ap.add_argument("--out", default="bench_verify.md")
    ap.add_argument("--contexts", default="4096,16384,65536,185000")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs at 64k")
    ap.add_argument("--no-baseline", action="store_true", help="skip the SGLang kernels")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--heads", type=int, default=8, help="query heads per rank (8: Kimi K2 at TP8)")
    ap.add_argument("--drafts", type=int, default=9, help="draft tokens verified per request")
    ap.add_argument("--precompile", type=int, default=0,
                    help="compile the sweep configs first in this many processes")
    ap.add_argument("--kernels", default="composed,composed-batch-chunks,sm90,sm90-page1,"
                                         "sm90-page1-runs,triton,flashmla",
                    help="peers to time, comma-separated (composed, composed-batch-chunks: "
                         "batches as balanced chunk requests, sm90, sm90-page1: the "
                         "same KV one token per shuffled slot, sm90-page1-runs: one token per "
                         "slot, a run of slots per request, triton, flashmla)")
    ap.add_argument("--grid", action="store_true",
                    help="also time batches 1-16 x contexts 1k-185k (composed, sm90 at page "
                         "1, FlashMLA; one round, one call per graph)")
    ap.add_argument("--extra-cases", action="store_true",
                    help="also 1k and batch 8 x 4k (the shapes the path rule is read from)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the composed path's pieces apart (FlashMLA, merge, plan)")
    ap.add_argument("--sweep-composed", action="store_true",
                    help="also time the composed path's merge-kernel settings (MergeConfig)")
    ap.add_argument("--sweep-batch", action="store_true",
                    help="also time the batch chunk merge settings (MergeConfig.batch_chunk_*) "
                         "and the dependent launch (pdl)")
    ap.add_argument("--sweep-split", action="store_true",
                    help="also time the merge settings of batches on FlashMLA's own split (the "
                         "default path: pdl, dv_split x num_warps)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed (the pages' shuffle: run two to see the layout's effect)")
    ap.add_argument("--sweep-sm90", action="store_true",
                    help="also time the Hopper kernel's launch settings (Sm90Config variants)")
    ap.add_argument("--sm90-config", action="append", default=[], metavar="FIELD=VALUE[,...]",
                    help="also time the Hopper kernel with these Sm90Config fields (repeat for more "
                         "variants), e.g. tma_runs=0 or min_tiles=2,pdl=0")
    args = ap.parse_args()
    try:
        sm90_variants = [sm90_config(text) for text in args.sm90_config]
    except ValueError as exc:
        ap.error(str(exc))
    torch.manual_seed(args.seed)
    ext = ver = None
    if (args.sglang_wheel or args.sglang_root) and not args.no_baseline:
        try:
            ext, ver = load_sglang_kernels(args.sglang_wheel, args.sglang_root)
        except Exception as exc:  # report our kernel even when the baseline cannot load
            print(f"SGLang baseline unavailable: {exc!r}", flush=True)
    copy_gbs = copy_bandwidth()
    name = torch.cuda.get_device_name()
    rows = []

    def record(kernel, case, ctx_label, kv_bytes, us):
        gbs = kv_bytes / us / 1e3
        rows.append((kernel, case, ctx_label, us, gbs, 100 * gbs / copy_gbs))
        print(f"{kernel:34s} {case:22s} {ctx_label:>10s} {us:10.1f} us {gbs:8.0f} GB/s "
              f"{100 * gbs / copy_gbs:5.1f}%", flush=True)

    H, D = args.heads, args.drafts
    if args.sweep:
        sweep = hopper_candidates(H, D)
        if args.precompile > 1:
            precompile(sweep, H, D, args.precompile)
        gen = torch.Generator().manual_seed(1)
        mixed = [int(x) for x in torch.randint(4096, 131072, (8,), generator=gen)]
        problems = [(str(c), [c]) for c in (4096, 16384, 65536, 185000)]
        problems.append(("b8 mixed", mixed))
        problems = [(lab, ctx, make_problem(ctx, H, D, shuffle=True)) for lab, ctx in problems]
        table = {}
        for c in sweep:
            tag = "sweep " + c.tag()
            table[c.tag()] = entry = {"err": "not run"}
            try:
                op = MlaVerify(H, D, 8, config=c)
                for lab, ctx, p in problems:
                    out = torch.empty(len(ctx) * D, H, 512, dtype=torch.bfloat16, device="cuda")
                    if lab == "65536":  # correctness of this config before timing it
                        run_ours(p, op, out)()
                        ref, _ = mla_verify_ref(p["q"], p["k_ext"], p["v_ext"], p["pool"],
                                                p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                                                op.sm_scale, p["mask_qlen"], "qlen_only")
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        k = op.last_split_kernel
                        print(f"{tag}: rel err {err:.1e} regs {k.n_regs} spills {k.n_spills} "
                              f"smem {k.metadata.shared}", flush=True)
                        entry["err"] = f"{err:.1e}" + ("" if err < 1e-2 else " FAIL")
                        entry["kernel"] = f"{k.n_regs} / {k.n_spills} / {k.metadata.shared // 1024}"
                    us = graph_time_us(run_ours(p, op, out))
                    record(tag, "tree shuffled", lab, sum(ctx) * KV_BYTES, us)
                    entry[lab] = f"{us:.1f} / {sum(ctx) * KV_BYTES / us / 1e3:.0f}"
            except Exception as exc:
                print("sweep", tag, "failed", repr(exc)[:300], flush=True)
                entry["err"] = "failed"
        del problems
        labs = ["4096", "16384", "65536", "185000", "b8 mixed"]
        sweep_md = [f"Sweep on {name}, copy {copy_gbs:.0f} GB/s; µs / GB/s, shuffled slots; "
                    "kernel = registers / spilled values / shared KB (Triton's report).", "",
                    "| config | rel err @64k | kernel | " + " | ".join(labs) + " |",
                    "| --- | --- | --- | " + " | ".join("---:" for _ in labs) + " |"]
        sweep_md += [f"| {t} | {e['err']} | {e.get('kernel', '')} | "
                     + " | ".join(e.get(lab, "") for lab in labs) + " |" for t, e in table.items()]
        print("\n".join(sweep_md), flush=True)
        if args.sweep_only:
            Path(args.out).write_text("\n".join(sweep_md) + "\n")
            return

    contexts = [int(c) for c in args.contexts.split(",")]
    gen = torch.Generator().manual_seed(1)
    mixed = [int(x) for x in torch.randint(4096, 131072, (8,), generator=gen)]  # 56k..131k
    cases = [(f"b1 {c}", [c]) for c in contexts] + [("b8 mixed", mixed),
                                                     ("b5 ragged", RAGGED_5),
                                                     ("b8 mixed 4k-185k", MIXED_8_WIDE),
                                                     ("b5 ragged 3k-150k", RAGGED_5_WIDE)]
    if args.extra_cases:
        cases = [("b1 1024", [1024])] + cases + [("b8 4096", [4096] * 8),
                                                 ("b8 16384", [16384] * 8)]
    kernels = args.kernels.split(",")
    flash = load_flash_mla() if "flashmla" in kernels else None
    ops = {}
    max_bs = max(max(len(ctx) for _, ctx in cases), *GRID_BATCHES) if args.grid else \
        max(len(ctx) for _, ctx in cases)
    for backend in [k for k in ("composed", "sm90", "triton") if k in kernels]:
        try:
            ops[backend] = MlaVerify(H, D, max_bs, backend=backend, page_size=64)
        except (ValueError, RuntimeError) as exc:
            print(f"moeplace {backend} unavailable: {exc}", flush=True)
    if "composed" in ops and "composed-batch-chunks" in kernels:  # batches as chunk requests
        ops["composed-batch-chunks"] = MlaVerify(H, D, max_bs, backend="composed", page_size=64,
                                                 merge_config=MergeConfig(batch_chunks=True))
    page1 = {k: MlaVerify(H, D, max_bs, backend=k, page_size=1)
             for k in ("sm90",) if k in ops and any(n.startswith(f"{k}-page1") for n in kernels)}
    page1_layouts = {name: lay for kernel, name, lay in (("sm90-page1", "page 1", token_slots),
                                                         ("sm90-page1-runs", "page 1 runs", run_slots))
                     if kernel in kernels}
    if args.sweep_composed and "composed" in ops:
        for cfg in COMPOSED_SWEEP:
            ops[f"composed {merge_tag(cfg)}"] = MlaVerify(H, D, 8, backend="composed",
                                                          page_size=64, merge_config=cfg)
    if args.sweep_split and "composed" in ops:
        for cfg in SPLIT_SWEEP:
            ops[f"composed {merge_tag(cfg)}"] = MlaVerify(H, D, max_bs, backend="composed",
                                                          page_size=64, merge_config=cfg)
    if args.sweep_batch and "composed" in ops:
        for cfg in BATCH_SWEEP:
            ops[f"composed {merge_tag(cfg)}"] = MlaVerify(H, D, max_bs, backend="composed",
                                                          page_size=64, merge_config=cfg)
    if "sm90" in ops:
        for cfg in (SM90_SWEEP if args.sweep_sm90 else []) + sm90_variants:
            ops[f"sm90 {sm90_tag(cfg)}"] = MlaVerify(H, D, 8, backend="sm90", sm90_config=cfg)
    peers = []  # (kernel, case, ctx list, µs)
    layered = []  # the same, per call of --layers calls in one graph
    for label, ctx in cases:
        p = make_problem(ctx, H, D, shuffle=True)
        out = torch.empty(len(ctx) * D, H, 512, dtype=torch.bfloat16, device="cuda")
        ref, _ = mla_verify_ref(p["q"], p["k_ext"], p["v_ext"], p["pool"], p["qo_indptr"],
                                p["kv_indptr"], p["kv_indices"], 576 ** -0.5, p["mask_qlen"],
                                "qlen_only")
        timed = {}  # peer -> (callable, recorded label, graph replays per timing)
        for (kernel, op), (layout, relayout) in itertools.product(page1.items(),
                                                                   page1_layouts.items()):
            p1 = relayout(p)  # the same KV, one token per slot
            run_ours(p1, op, out)()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if err < 1e-2:
                timed[f"moeplace {kernel} {layout}"] = (run_ours(p1, op, out), f"{label} (err "
                                                        f"{err:.0e})", 50)
            else:
                print(f"moeplace {kernel} {layout} {label}: relative error {err:.1e}, not timed",
                      flush=True)
        for kernel, op in ops.items():
            plan = op.plan(p["qo_indptr"], p["kv_indptr"], p["kv_indices"])
            run_ours(p, op, out, plan)()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"moeplace {kernel} {label}: relative error {err:.1e}, not timed",
                      flush=True)
                continue
            if plan is not None:  # the per-batch part, once per step (not per layer)
                record(f"moeplace {kernel} plan", label, str(sum(ctx)), sum(ctx) * KV_BYTES,
                       graph_time_us(run_plan(p, op)))
                if args.breakdown and kernel in ("composed", "composed-batch-chunks"):
                    for piece, fn in composed_pieces(p, op, plan, out).items():
                        record(f"{kernel} piece: {piece}", label, str(sum(ctx)),
                               sum(ctx) * KV_BYTES, graph_time_us(fn))
            timed[f"moeplace {kernel}"] = (run_ours(p, op, out, plan), f"{label} (err {err:.0e})",
                                           50)
        del ref
        if flash is not None:
            timed["FlashMLA"] = (run_flash_mla(flash, p), label, 50)
        reps = 5 if sum(ctx) > 20000 else 20
        if ext is not None:
            timed["SGLang extend_attention"] = (run_sglang_extend(ext, p, out), label, reps)
        for peer, us in time_peers(timed, args.rounds).items():
            peers.append((peer, label, ctx, us))
            record(peer if peer != "FlashMLA" else "FlashMLA (chain, page 64)", timed[peer][1],
                   str(sum(ctx)), sum(ctx) * KV_BYTES, us)
        if args.layers > 1:
            n = args.layers
            many = {peer: (lambda fn=fn: [fn() for _ in range(n)], lab, r)
                    for peer, (fn, lab, r) in timed.items() if not peer.startswith("SGLang")}
            for peer, us in time_peers(many, args.rounds, per=n).items():
                layered.append((peer, label, ctx, us))
                record(f"{peer} [per call of {n} in a graph]", label, str(sum(ctx)),
                       sum(ctx) * KV_BYTES, us)
        if ext is not None:
            fn = run_sglang_verify_mla(ver, make_problem(ctx, H, D, True, tree=False), out)
            if fn is not None:
                record("sglang verify_shared_kv (chain)", label, str(sum(ctx)),
                       sum(ctx) * KV_BYTES, graph_time_us(fn, reps))
        del p, out, timed
        torch.cuda.empty_cache()

    grid_lines = run_grid(ops, page1, flash, H, D, copy_gbs) if args.grid else []
    lines = [f"Device: {name}; copy bandwidth measured in this run: {copy_gbs:.0f} GB/s "
             f"(read + write). H={H} heads, D={D}-token binary tree, KV in shuffled 64-token "
             f"pages (FlashMLA: a causal chain over its own copy in 64-token pages). Batch-8 "
             f"contexts: {mixed}; ragged batch 5: {RAGGED_5}.", ""]
    lines += [f"One call per graph replay (median of 50 replays"
              + (f", then the median of {args.rounds} interleaved rounds" if args.rounds > 1
                 else "") + "):", ""]
    lines += peers_table(peers, copy_gbs)
    if layered:
        lines += ["", f"Per call, {args.layers} calls captured in one graph (back to back, as "
                  f"the layers of a server's graph):", ""]
        lines += peers_table(layered, copy_gbs)
    lines += grid_lines
    lines += ["", "| kernel | case | tokens | µs | GB/s | % of copy |",
              "| --- | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {c} | {x} | {us:.1f} | {g:.0f} | {pc:.1f}% |"
              for k, c, x, us, g, pc in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


SM90_SWEEP = [Sm90Config(pdl=False), Sm90Config(min_tiles=2), Sm90Config(min_tiles=4),
              Sm90Config(evict_first=False), Sm90Config(combine_slices=1),
              Sm90Config(combine_slices=2), Sm90Config(combine_slices=4),
              Sm90Config(short_batches=False), Sm90Config(tma_runs=False)]


COMPOSED_SWEEP = [MergeConfig(chunks=0), MergeConfig(chunk_num_warps=4),
                  MergeConfig(chunk_dv_split=32, chunk_block=4, chunk_num_warps=4),
                  MergeConfig(chunk_block=4), MergeConfig(chunk_dv_split=32),
                  MergeConfig(pdl=True), MergeConfig(side_stream=True)]


BATCH_SWEEP = [MergeConfig(batch_chunks=True, batch_chunk_unroll=0),
               MergeConfig(batch_chunks=True, batch_chunk_unroll=8),
               MergeConfig(batch_chunks=True, batch_chunk_dv_split=8, batch_chunk_block=4,
                           batch_chunk_num_warps=4, batch_chunk_unroll=4),
               MergeConfig(batch_chunks=True, batch_chunk_dv_split=16, batch_chunk_block=2,
                           batch_chunk_num_warps=1, batch_chunk_unroll=4),
               MergeConfig(batch_chunks=True, pdl=True),
               MergeConfig(pdl=True)]

SPLIT_SWEEP = [MergeConfig(pdl=True), MergeConfig(dv_split=2), MergeConfig(dv_split=8),
               MergeConfig(dv_split=8, num_warps=2), MergeConfig(dv_split=2, num_warps=8)]


def merge_tag(cfg: MergeConfig) -> str:
    chunks = "auto" if cfg.chunks is None else cfg.chunks
    return (f"dv{cfg.dv_split} w{cfg.num_warps} pdl{int(cfg.pdl)} u{int(cfg.uniform)}"
            + (" side" if cfg.side_stream else "")
            + f" ch{chunks} cdv{cfg.chunk_dv_split} cb{cfg.chunk_block} cw{cfg.chunk_num_warps}"
            + (f" bdv{cfg.batch_chunk_dv_split} bcb{cfg.batch_chunk_block} "
               f"bw{cfg.batch_chunk_num_warps} bu{cfg.batch_chunk_unroll}" if cfg.batch_chunks
               else " bc0"))


def sm90_config(text: str) -> Sm90Config:
    """Sm90Config from 'field=value,...' (booleans as 0/1); ValueError naming what is wrong."""
    types = {f.name: f.type for f in dataclasses.fields(Sm90Config)}
    values = {}
    for item in text.split(","):
        field, eq, value = item.partition("=")
        field = field.strip()
        if not eq or field not in types:
            raise ValueError(f"--sm90-config: '{item}' is not FIELD=VALUE with FIELD one of "
                             + ", ".join(types))
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--sm90-config: {field} must be an integer, got '{value}'") from None
        flag = types[field] in (bool, "bool")
        if flag and number not in (0, 1):
            raise ValueError(f"--sm90-config: {field} must be 0 or 1, got {number}")
        values[field] = bool(number) if flag else number
    return Sm90Config(**values)


def sm90_tag(cfg: Sm90Config) -> str:
    return (f"mt{cfg.min_tiles} pdl{int(cfg.pdl)} ef{int(cfg.evict_first)} cs{cfg.combine_slices}"
            f" sb{int(cfg.short_batches)} tma{int(cfg.tma_runs)}")


RAGGED_5 = [1500, 9000, 31000, 77000, 120000]
MIXED_8_WIDE = [4096, 9000, 23000, 40000, 65536, 100000, 150000, 185000]
RAGGED_5_WIDE = [3000, 12000, 40000, 90000, 150000]
GRID_BATCHES = [1, 2, 4, 8, 16]
GRID_CONTEXTS = [1024, 4096, 16384, 65536, 185000]


def run_grid(ops: dict, page1: dict, flash, H: int, D: int, copy_gbs: float) -> list[str]:
    """Markdown: batches x contexts (every request of the batch that long), µs and TB/s of the
    composed path (and with batches as chunk requests), the own kernel at page 1 and FlashMLA
    (chain, page 64), each checked against the fp32 reference first; one call per graph replay."""
    peers = [k for k in ("composed", "composed-batch-chunks") if k in ops]
    head = ["composed", "composed-batch-chunks", "sm90 page 1", "FlashMLA"]
    lines = ["", f"Batches x contexts (every request of a batch the same length; one call per "
             f"graph replay, median of 20; µs (TB/s, % of copy {copy_gbs / 1e3:.2f} TB/s)):", "",
             "| batch | context | " + " | ".join(head) + " | composed / FlashMLA | "
             "sm90 page 1 / FlashMLA |", "| ---: | ---: |" + " ---: |" * (len(head) + 2)]
    for bs in GRID_BATCHES:
        for ctx in GRID_CONTEXTS:
            p = make_problem([ctx] * bs, H, D, shuffle=True)
            out = torch.empty(bs * D, H, 512, dtype=torch.bfloat16, device="cuda")
            ref, _ = mla_verify_ref(p["q"], p["k_ext"], p["v_ext"], p["pool"], p["qo_indptr"],
                                    p["kv_indptr"], p["kv_indices"], 576 ** -0.5,
                                    p["mask_qlen"], "qlen_only")
            fns = {}
            for k in peers:
                plan = ops[k].plan(p["qo_indptr"], p["kv_indptr"], p["kv_indices"])
                fns[k] = run_ours(p, ops[k], out, plan)
            if "sm90" in page1:
                p1 = token_slots(p)
                fns["sm90 page 1"] = run_ours(p1, page1["sm90"], out)
            ok = {}
            for k, fn in fns.items():
                fn()
                ok[k] = ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
            del ref
            if flash is not None:
                fns["FlashMLA"] = run_flash_mla(flash, p)
                ok["FlashMLA"] = True
            us = {}
            for k, fn in fns.items():
                try:
                    us[k] = graph_time_us(fn, 20) if ok[k] else None
                except Exception as exc:
                    print(f"grid {k} b{bs} {ctx}: not timed ({exc!r:.200})", flush=True)
                    us[k] = None
            gb = bs * ctx * KV_BYTES / 1e3
            cells = [f"{us[k]:.1f} ({gb / us[k] / 1e3:.2f}, {100 * gb / us[k] / copy_gbs:.0f}%)"
                     if us.get(k) else ("FAIL" if k in ok and not ok[k] else "") for k in head]
            ratio = [f"{us[k] / us['FlashMLA']:.2f}" if us.get(k) and us.get("FlashMLA") else ""
                     for k in ("composed", "sm90 page 1")]
            lines.append(f"| {bs} | {ctx} | " + " | ".join(cells + ratio) + " |")
            print(lines[-1], flush=True)
            del p, out, fns
            torch.cuda.empty_cache()
    return lines


def token_slots(p):
    """``p`` with its KV moved to one token per slot, slots shuffled (a page-size-1 pool):
    the same values, so the same reference."""
    n = p["kv_indices"].numel()
    slots = torch.randperm(p["pool"].shape[0] + n, device="cuda")[:n]
    pool = torch.zeros(p["pool"].shape[0] + n, 1, 576, dtype=p["pool"].dtype, device="cuda")
    pool[slots] = p["pool"][p["kv_indices"]]
    return dict(p, pool=pool, kv_indices=slots)


def run_slots(p):
    """``p`` with its KV moved to one token per slot, each request's tokens one run of
    consecutive slots (a page-size-1 pool from a sorted free list): the same reference."""
    n = p["kv_indices"].numel()
    slots = torch.arange(n, device="cuda") + 5  # runs that start off any 16-token boundary
    pool = torch.zeros(n + 5, 1, 576, dtype=p["pool"].dtype, device="cuda")
    pool[slots] = p["pool"][p["kv_indices"]]
    return dict(p, pool=pool, kv_indices=slots)


def time_peers(timed: dict, rounds: int, per: int = 1) -> dict:
    """{peer: µs per call}: each peer's graph timed ``rounds`` times, round-robin (so a drift of
    clocks or of the machine's other work falls on every peer alike), median over the rounds."""
    import statistics

    times = {peer: [] for peer in timed}
    for _ in range(max(1, rounds)):
        for peer, (fn, _label, reps) in timed.items():
            if times[peer] is None:
                continue
            try:
                times[peer].append(graph_time_us(fn, reps) / per)
            except Exception as exc:  # one peer failing to capture must not lose the others
                print(f"{peer}: not timed ({exc!r:.300})", flush=True)
                times[peer] = None
    return {peer: statistics.median(ts) for peer, ts in times.items() if ts}


def peers_table(peers, copy_gbs: float) -> list[str]:
    """Markdown: one row per case, µs and TB/s of each kernel, then each moeplace kernel's time
    over FlashMLA's (the goal: composed <= 1.05 from 16k, <= 1.15 at 4k)."""
    kernels = list(dict.fromkeys(k for k, _, _, _ in peers))
    labels = list(dict.fromkeys(c for _, c, _, _ in peers))
    times = {(k, c): (us, ctx) for k, c, ctx, us in peers}
    head = "| case | " + " | ".join(f"{k} µs (TB/s)" for k in kernels)
    mine = [k for k in kernels if k.startswith("moeplace")]
    head += "".join(f" | {k[len('moeplace '):]} / FlashMLA" for k in mine) + " |"
    lines = [head, "| --- |" + " ---: |" * (len(kernels) + len(mine))]
    for c in labels:
        cells = []
        for k in kernels:
            if (k, c) in times:
                us, ctx = times[(k, c)]
                cells.append(f"{us:.1f} ({sum(ctx) * KV_BYTES / us / 1e6:.2f})")
            else:
                cells.append("")
        for k in mine:
            ours, theirs = times.get((k, c)), times.get(("FlashMLA", c))
            cells.append(f"{ours[0] / theirs[0]:.2f}" if ours and theirs else "")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append(f"(copy bandwidth of this run: {copy_gbs / 1e3:.2f} TB/s)")
    return lines


def composed_pieces(p, op: MlaVerify, plan, out) -> dict:
    """Callables of each launch of the composed path, to time apart (same tensors as forward).
    A graph of one short launch times the replay's floor (10-18 µs on the H200), not the launch;
    the launches in sequence show what each adds (their difference from the decode alone)."""
    from moeplace_kernels.mla_verify_composed import PAGE, gather_chunk_queries, tree_merge

    cv = op.composed
    bs, D, H = p["bs"], p["D"], p["H"]
    q4 = p["q"].view(bs, D, H, 576)
    if plan.chunks and bs == 1:
        q4 = q4.expand(plan.chunks, D, H, 576)
    elif plan.chunks:  # gathered by the forward that checked this plan
        q4 = cv.q_chunks[:plan.chunks]
    pages = p["pool"].shape[0] // PAGE
    k_cache = p["pool"][:pages * PAGE].unflatten(0, (pages, PAGE))

    def flash():
        return cv.flash.flash_mla_with_kvcache(q4, k_cache, plan.block_table, plan.seqlens, 512,
                                               plan.meta, softmax_scale=op.sm_scale,
                                               causal=False, use_legacy=True)

    o_pre, lse_pre = flash()

    def merge():
        tree_merge(p["q"], p["k_ext"], p["v_ext"], p["mask_qlen"], 1, None, p["qo_indptr"],
                   p["kv_indptr"], o_pre, lse_pre, out, None, op.sm_scale, D, cv.config,
                   uniform=True, chunks=plan.chunks, chunk_start=plan.chunk_start,
                   chunk_tail=plan.chunk_tail)

    def gather():
        gather_chunk_queries(p["q"], q4, plan.owner, p["qo_indptr"], D, True)

    def table():
        cv.write_table(p["kv_indptr"], p["kv_indices"], bs, plan.chunks)

    def metadata():
        cv.flash.get_mla_decoding_metadata(plan.seqlens, D * H, 1, H, False, None,
                                           use_legacy=True)

    pieces = {"FlashMLA decode (prefix, no mask)": flash, "tree/merge kernel": merge,
              "block table kernel": table, "FlashMLA metadata": metadata,
              "FlashMLA decode, then tree/merge (in sequence)": lambda: (flash(), merge())}
    if plan.chunks and bs > 1:
        pieces["chunk queries gather"] = gather
        pieces["gather, then FlashMLA decode (in sequence)"] = lambda: (gather(), flash())
    return pieces


def load_flash_mla():
    """The flash_mla module (sgl-flash-mla wheel, installed beside torch), or None."""
    try:
        import flash_mla
        return flash_mla
    except Exception as exc:  # the peer is optional: report ours without it
        print(f"FlashMLA unavailable: {exc!r:.300}", flush=True)
        return None


def run_flash_mla(flash, p):
    """FlashMLA dense decode over the same KV copied into 64-token pages (prefix + drafts)."""
    bs, D, H = p["bs"], p["D"], p["H"]
    lens = (p["kv_indptr"][1:] - p["kv_indptr"][:-1]).tolist()
    seqlens = [n + D for n in lens]
    pages = [(n + 63) // 64 for n in seqlens]
    k_cache = torch.zeros(sum(pages), 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(bs, max(pages), dtype=torch.int32, device="cuda")
    first = 0
    for b, n in enumerate(lens):
        ids = p["kv_indices"][int(p["kv_indptr"][b]):int(p["kv_indptr"][b + 1])]
        rows = torch.cat([p["pool"][ids, 0], p["k_ext"][b * D:(b + 1) * D, 0]])
        flat = k_cache[first:first + pages[b]].view(-1, 576)
        flat[:n + D] = rows
        table[b, :pages[b]] = torch.arange(first, first + pages[b], dtype=torch.int32)
        first += pages[b]
    q = p["q"].view(bs, D, H, 576)
    seq_t = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    meta, _ = flash.get_mla_metadata()
    return lambda: flash.flash_mla_with_kvcache(q, k_cache, table, seq_t, 512, meta,
                                                causal=True, use_legacy=True)


if __name__ == "__main__":
    main()
