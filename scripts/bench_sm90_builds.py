"""Time builds of the own sm90 MLA verify kernel side by side, FlashMLA as the reference.

Question: How much faster (or slower) is one build of the Hopper verify kernel than another?
Baseline: FlashMLA's SM90 dense decode on the same KV, and every build, timed in one process.
Output: a markdown table on stdout, a row per case as it is timed.

Each BUILD is a git revision or a path to a .cu file (its wgmma_ops.inc beside it, else this
tree's), optionally followed by :SLICES, the combine kernel's CTAs per query row: 'rule' (this
tree's combine_slices, the default), 'one-wave' (the most of 4, 2, 1 whose grid fits one wave
of 9 CTAs per SM, as combine_slices chose before four slices were kept for one request),
'lean-wave' (4 for a grid of at most 3 CTAs per SM, else 2 while it fits 9 per SM, else 1: the
rule of 2ff9045), or 1, 2 or 4. Every build
is compiled with nvcc into the kernel's own build cache, loaded beside the others, checked
against the first build's output and timed with them on the same problems in interleaved rounds
(CUDA-graph replay of one call, median), so drift between runs does not enter the comparison.
Builds must share this tree's parameter structs (the loader refuses others in one line).

    python3 scripts/bench_sm90_builds.py 46cd08d:one-wave 916773f HEAD
    python3 scripts/bench_sm90_builds.py HEAD /tmp/experiment.cu --cases "b1 16k,b8 1k"
    python3 scripts/bench_sm90_builds.py HEAD --composed   # the own kernel against the composed path
    python3 scripts/bench_sm90_builds.py HEAD --held 3 --cases "b8 4k-185k"   # clock and power too

With --held SECONDS each column's graph of 20 calls is replayed without a pause for that long while
nvidia-smi samples the SM clock and the board power: what a busy server sees, where the card can sit
at its power limit and the clock gives way, unlike the one-call replays at the idle card's boost clock.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_verify import MIXED_8_WIDE, RAGGED_5_WIDE, load_flash_mla, make_problem, run_flash_mla, run_ours
from cuda_timing import graph_time_us, held_us  # scripts/ is on sys.path when run as a script
from moeplace_kernels import mla_verify_sm90
from moeplace_kernels.mla_verify_api import MlaVerify, Sm90Config

ROOT = Path(__file__).resolve().parent.parent
SOURCE, INCLUDE = mla_verify_sm90.SOURCES
CASES = {"b1 1k": [1024], "b1 16k": [16384], "b1 185k": [185000], "b2 1k": [1024] * 2,
         "b4 1k": [1024] * 4, "b8 1k": [1024] * 8, "b16 1k": [1024] * 16, "b2 4k": [4096] * 2,
         "b4 4k": [4096] * 4, "b8 4k": [4096] * 8, "b16 4k": [4096] * 16, "b4 16k": [16384] * 4,
         "b8 16k": [16384] * 8, "b4 64k": [65536] * 4,
         # between half and all of the grid's tiles on 132 SMs, from 96 tiles a request to 16
         "b1 6k": [6144], "b2 3k": [3072] * 2, "b3 2k": [2048] * 3, "b4 2k": [2048] * 4,
         "b6 1k": [1024] * 6,
         # the mixed batches of bench_verify, where a CTA's range can cross requests
         "b8 4k-185k": MIXED_8_WIDE, "b5 3k-150k": RAGGED_5_WIDE}


# The lean combine instance's CTAs per SM (56 registers), which the earlier slice rules fitted a wave to.
LEAN_CTAS_PER_SM = 9


class Refusal(Exception):
    """A bad argument or an unusable build: one line, exit 2."""


def sources(build: str) -> tuple[str, str]:
    """(kernel source, its wgmma_ops.inc) of a .cu path or a git revision."""
    path = Path(build)
    if build.endswith(".cu"):
        if not path.is_file():
            raise Refusal(f"{build}: no such file")
        inc = path.parent / INCLUDE
        return path.read_text(), (inc if inc.is_file() else ROOT / "kernels" / "csrc" / INCLUDE).read_text()
    texts = []
    for name in (SOURCE, INCLUDE):
        res = subprocess.run(["git", "-C", str(ROOT), "show", f"{build}:kernels/csrc/{name}"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise Refusal(f"{build}: not a revision with kernels/csrc/{name} "
                          f"({res.stderr.strip().splitlines()[0] if res.stderr.strip() else 'git failed'})")
        texts.append(res.stdout)
    return texts[0], texts[1]


def build_library(build: str, nvcc: str) -> Path:
    """Compile one build into the kernel's cache (``mla_verify_sm90.build``); its path."""
    source, include = sources(build)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SOURCE).write_text(source)
        (Path(tmp) / INCLUDE).write_text(include)
        try:
            return mla_verify_sm90.build(nvcc, Path(tmp))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            raise Refusal(f"{build}: build failed: {str(exc).splitlines()[0]}") from None


def slices_for(setting: str, batch: int, rows_per_request: int, num_sms: int) -> int:
    """The combine_slices value a column runs with for a batch (0: this tree's rule)."""
    if setting == "rule":
        return 0
    rows = batch * rows_per_request
    if setting == "one-wave":
        return next((s for s in (4, 2) if rows * s <= LEAN_CTAS_PER_SM * num_sms), 1)
    if setting == "lean-wave":
        return 4 if rows * 4 <= 3 * num_sms else 2 if rows * 2 <= LEAN_CTAS_PER_SM * num_sms else 1
    return int(setting)


def parse_build(arg: str) -> tuple[str, str]:
    """'REV[:SLICES]' -> (build, slice setting)."""
    build, _, setting = arg.partition(":")
    setting = setting or "rule"
    if setting not in ("rule", "one-wave", "lean-wave", "1", "2", "4"):
        raise Refusal(f"{arg}: SLICES must be rule, one-wave, lean-wave, 1, 2 or 4")
    return build, setting


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", metavar="BUILD[:SLICES]")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of: {', '.join(CASES)} (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is shown")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--drafts", type=int, default=9)
    ap.add_argument("--composed", action="store_true",
                    help="also time the composed path (FlashMLA over the prefix, then our tree merge): "
                         "what 'auto' weighs the own kernel against at page 64")
    ap.add_argument("--held", type=float, default=0.0, metavar="SECONDS",
                    help="time each column held at it for SECONDS (a graph of 20 calls replayed without a "
                         "pause) and show the SM clock and power nvidia-smi samples meanwhile (default: off, "
                         "one-call replays)")
    args = ap.parse_args()
    try:
        columns = [parse_build(b) for b in args.builds]
        if len(set(columns)) < len(columns):
            raise Refusal("give each BUILD:SLICES once")
        cases = [c.strip() for c in args.cases.split(",")]
        unknown = [c for c in cases if c not in CASES]
        if unknown:
            raise Refusal(f"unknown case {unknown[0]!r}; known: {', '.join(CASES)}")
        if args.rounds < 1:
            raise Refusal("--rounds must be at least 1")
        if args.held < 0:
            raise Refusal("--held must be 0 (off) or a number of seconds")
        if 0 < args.held < 1:
            raise Refusal("--held needs at least 1 second (nvidia-smi samples every 100 ms)")
        if args.held and shutil.which("nvidia-smi") is None:
            raise Refusal("--held needs nvidia-smi on the PATH (it samples the clock and power)")
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            raise Refusal("needs an sm_90 GPU (H100 / H200)")
        nvcc = mla_verify_sm90.find_nvcc()
        if nvcc is None:
            raise Refusal("no nvcc found (set CUDA_HOME)")
        flash = load_flash_mla()
        if args.composed and flash is None:
            raise Refusal("--composed needs FlashMLA (the sgl-flash-mla wheel)")
        libs = {}
        for build, _ in columns:
            if build not in libs:
                print(f"building {build} ...", file=sys.stderr, flush=True)
                try:
                    libs[build] = mla_verify_sm90.Sm90Library(build_library(build, nvcc))
                except OSError as exc:
                    raise Refusal(f"{build}: {str(exc).splitlines()[0]}") from None
    except Refusal as exc:
        print(f"bench_sm90_builds: {exc}", file=sys.stderr)
        return 2
    device = torch.cuda.current_device()
    for lib in libs.values():
        lib.setup(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    names = [f"{b}:{s}" for b, s in columns] + (["composed"] if args.composed else [])
    timing = (f"held {args.held:g} s: µs a call (ratio to FlashMLA), SM MHz, W" if args.held
              else "µs (ratio to FlashMLA)")
    print(f"{torch.cuda.get_device_name()}; {args.heads} heads x {args.drafts}-token binary tree, "
          f"KV one token per shuffled 64-token page; {timing}, median of {args.rounds} rounds\n")
    print("| case | FlashMLA | " + " | ".join(names) + " | max diff to the first |")
    print("| --- | ---: |" + " ---: |" * (len(names) + 1))
    for case in cases:
        ctx = CASES[case]
        p = make_problem(ctx, args.heads, args.drafts, shuffle=True)
        fns, outs = {}, []
        for name, (build, setting) in zip(names, columns):
            cfg = Sm90Config(combine_slices=slices_for(setting, len(ctx), args.heads * args.drafts, num_sms))
            op = MlaVerify(args.heads, args.drafts, len(ctx), backend="sm90", sm90_config=cfg)
            op.sm90 = libs[build]  # the same op, this build's library
            out = torch.empty(p["q"].shape[0], args.heads, 512, dtype=torch.bfloat16, device="cuda")
            fns[name] = run_ours(p, op, out)
            outs.append(out)
        if args.composed:
            op = MlaVerify(args.heads, args.drafts, len(ctx), backend="composed", page_size=64)
            out = torch.empty_like(outs[0])
            fns["composed"] = run_ours(p, op, out, op.plan(p["qo_indptr"], p["kv_indptr"], p["kv_indices"]))
            outs.append(out)
        if flash is not None:
            fns["FlashMLA"] = run_flash_mla(flash, p)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        diff = max((o.float() - outs[0].float()).abs().max().item() for o in outs)
        times = {k: [] for k in fns}
        try:
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(held_us(fn, args.held) if args.held else (graph_time_us(fn, 30),))
        except RuntimeError as exc:  # nvidia-smi gave no samples (an unknown GPU name, a sampler that failed)
            print(f"bench_sm90_builds: {case}: {exc}", file=sys.stderr)
            return 2
        med = {k: [statistics.median(r[i] for r in v) for i in range(len(v[0]))] for k, v in times.items()}
        ref = med["FlashMLA"][0] if "FlashMLA" in med else None

        def cell(k: str) -> str:
            text = f"{med[k][0]:.1f}" + (f" ({med[k][0] / ref:.2f})" if ref else "")
            return text + (f", {med[k][1]:.0f} MHz, {med[k][2]:.0f} W" if args.held else "")

        print(f"| {case} | {cell('FlashMLA') if ref else '-'} | " + " | ".join(cell(n) for n in names)
              + f" | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
