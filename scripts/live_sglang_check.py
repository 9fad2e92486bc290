"""Prove every moeplace plugin feature inside live SGLang servers on this GPU machine.

Question: Does every plugin feature work inside a live SGLang server, and what does it cost or gain there?
Baseline: the same server and requests with the feature's variable unset (SGLang's own Triton attention backend for
    verify).
Output: --out FILE.json (default result.json), one check per feature with its figures.

Starts real SGLang 0.5.23 servers as subprocesses (DeepSeek-V3-shaped dummy model, TP 1, CUDA graphs,
NGRAM speculative decoding with 9-token drafts), drives them with requests, stops them the way
operators do (SIGTERM, SIGINT) and checks, in the servers themselves:

  trace     MOEPLACE_TRACE=1: shards whole after SIGTERM and after SIGINT (no .part); `trace merge`
            and `report --mode verify` read them; recorded verify passes = the server's own count
            (the responses' spec_verify_ct), none dropped
  capture   `moeplace capture` against the same server's recorder (per_token) gives the tracer's steps
  verify    MOEPLACE_VERIFY_KERNEL=1 with NGRAM trees (page size 1: the own kernel) and with chains
            (--page-size 64: the composed path, FlashMLA's decode plus our tree/merge kernel; SGLang
            refuses NGRAM trees on paged Triton attention): starts with CUDA graphs and serves; greedy outputs against the same requests with the variable unset (share of equal
            tokens); verify-attention GPU time per step in the server (SGLang's profiler) against
            SGLang's Triton backend; the kernels' outputs on the same inputs against fp32
  kv_sort   MOEPLACE_KV_SORT=1 under churn: healthy after it; KV allocation runs (MOEPLACE_KV_STATS)
            beside the same churn without it
  stale     `moeplace report CAPTURE --placement P --json` on the capture, P fitted by `optimize` on its first
            half (8 ranks, balanced dispatch, a spare slot a rank): exit 0 and the staleness verdict
            (keep, or re-place with the share to gain), recorded as the check's detail
  launch    `moeplace launch --placement` starts the server, SGLang's --init-expert-location loading
            the map (the tracer's shard header records the map in force); another model's placement
            is refused before SGLang starts
  dispatch  MOEPLACE_DISPATCH=balanced on one GPU (EP 1: no replica to choose) stops the server with
            one line
  hooks     a feature whose hook SGLang cannot apply stops the server with one line naming it
  replace   MOEPLACE_ONLINE=1 (launched with the reversed map, so SGLang remaps): under NGRAM verify traffic
            switched between two prompt sets, two re-placements asked for through `moeplace online request`
            move real weights between slots; no request fails; greedy outputs equal a server without
            re-placement; the stall per re-placement and tokens per second before, during and after; the
            tracer's shards carry the maps in turn; one decision run to its end (`request --dry-run`) against
            the same batch with none in flight; SGLang's /metrics shows the gauges (--enable-metrics)
  stops     every server with a moeplace feature on exits, for SIGTERM and for SIGINT (each signal stops a
            server with the verify kernel and one without), with the code SGLang alone gives for that signal
            (a server launched with no moeplace feature on, and a plain SGLang server)

With ``--gpus 2`` (two GPUs of one host, the Kimi-expert-shaped model): expert parallelism (TP 2, EP 2,
``--moe-a2a-backend none``, NGRAM) with DeepSeek EPLB, stepaware and balanced-with-spares placements
fitted on SYNTHETIC routing, started through ``moeplace launch``, and TP-MoE beside them, two servers at a
time: the map SGLang loaded equals the file on both ranks; both ranks' recorded slot choices are equal on
every pass (the tracer keeps physical ids); the dispatch kernel runs in the replayed graphs (a placement made
with ``--dispatch cost``: `launch` announces MOEPLACE_DISPATCH=cost with its q, the rule-by-cost kernel runs); decode tokens
per second and MoE time per pass against the cost model's prediction; `launch` refuses another EP size,
another model and DP attention with balanced dispatch, and the server itself refuses the latter.

Run on the GPU machine from the project root, SGLang installed as ../shared/device-sglang says:

    source .sgl-device/install.sh && python3 -m pip install --no-deps --no-build-isolation .
    python3 -m pip install --no-index --no-deps --target /tmp/sgl .whl/sgl_flash_mla-*.whl   # FlashMLA
    python3 scripts/live_sglang_check.py --out result.json
    python3 scripts/live_sglang_check.py --gpus 2 --model .sgl-device/models/kimi-k2-shaped-2moe --out ep2.json

The servers that serve run side by side on the one GPU (each capped by --max-total-tokens); the GPU
timings run while the others are idle. Writes ``--out`` as JSON: {"project_head", "sglang_version",
"sgl_kernel_version", "gpu", "checks": [{"name", "ok", "detail", "figures"}]}; exit code 0 when every
check is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = 9
PROFILE_STEPS = 40
CHAIN_PAGE = 64   # the chain pair runs on 64-token pages: there moeplace's composed path (FlashMLA) serves
ATTENTION_KERNELS = {  # kernel name prefixes of verify attention, per backend
    "triton": ("_fwd_kernel",),
    # own kernels (sm90, triton); the composed path: FlashMLA's decode and combine, its per-batch plan
    # (block table, scheduler metadata), our tree/merge kernel
    "moeplace": ("split_kernel", "combine_kernel", "_verify_split_kernel", "_verify_merge_kernel",
                 "flash_fwd_splitkv_mla_kernel", "flash_fwd_mla_combine_kernel", "get_mla_metadata",
                 "_block_table_kernel", "_pad_queries_kernel", "_tree_merge_kernel"),
}
MAIN_KERNEL = {"triton": ("_fwd_kernel",),   # one per layer and pass
               "moeplace": ("split_kernel", "_verify_split_kernel", "_tree_merge_kernel")}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    figures: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- servers

class Server:
    """One SGLang server process (its own process group), its log and its requests' answers."""

    def __init__(self, name: str, port: int, argv: list[str], env: dict[str, str], work: Path) -> None:
        self.name, self.port, self.argv, self.work = name, port, argv, work
        self.env = {**os.environ, "SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS": "8", **env}
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.answers: list[dict] = []
        self.greedy: list[dict] = []   # the answers to the requests every server gets
        self.solo: list[dict] = []     # the chain pair's answers to requests sent one at a time
        self.overlap = "--disable-overlap-schedule" not in argv
        self.page_size = int(argv[argv.index("--page-size") + 1]) if "--page-size" in argv else 1
        self.exit_s: float | None = None
        self.started = 0.0
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        self.started = time.monotonic()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.work, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200; RuntimeError (with the log's tail) if the process ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving: "
                                   + tail(self.log()))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: " + tail(self.log()))

    def wait_exit(self, timeout: float) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.exit_s is None:
            self.exit_s = time.monotonic() - self.started
        return rc

    def stop(self, sig: int, timeout: float = 120.0) -> tuple[int | None, float]:
        """Send ``sig`` to the launcher (as `kill` or a process manager does); (exit code, seconds)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.wait_exit(timeout)
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def post(self, path: str, body: dict | None, timeout: float = 600.0) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict:
        """One greedy request; keeps its answer (output ids and SGLang's meta_info)."""
        answer = self.post("/generate", {"input_ids": input_ids, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
        self.answers.append(answer)
        return answer

    def generate_all(self, prompts: list[list[int]], max_new_tokens: list[int], workers: int = 8) -> list[dict]:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.generate, prompts, max_new_tokens))

    def verify_passes_served(self) -> int:
        """The server's own count: every answer's spec_verify_ct (verify passes it took part in)."""
        return sum(int(a["meta_info"].get("spec_verify_ct", 0)) for a in self.answers)


def tail(text: str, lines: int = 25) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def sglang_args(model: Path, port: int, extra: list[str], speculative: bool = True) -> list[str]:
    """``sglang.launch_server`` flags that serve here (dummy weights, CUDA graphs, NGRAM 9-token drafts)."""
    spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(DRAFTS)] if speculative else []
    return ["--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "20000", "--context-length", "4096",
            "--disable-radix-cache", "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", "8",
            "--max-running-requests", "8", "--skip-server-warmup", *spec, "--port", str(port), *extra]


def server_argv(model: Path, port: int, extra: list[str], launch: list[str] | None = None,
                speculative: bool = True) -> list[str]:
    """The server's command: ``python -m sglang.launch_server`` or ``moeplace launch ... --``."""
    common = sglang_args(model, port, extra, speculative)
    if launch is not None:
        return [*MOEPLACE, "launch", *launch, "--", *common]
    return [sys.executable, "-m", "sglang.launch_server", *common]


MOEPLACE = [sys.executable, "-c", "from moeplace.cli import main; main()"]


def moeplace(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*MOEPLACE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------------------- traffic

def prompts(rng: random.Random, n: int, lo: int, hi: int, vocab: int = 32000) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def equal_token_share(a: list[dict], b: list[dict]) -> tuple[float, list[int]]:
    """Share of equal output tokens position by position, and each request's first difference (-1: none)."""
    same = total = 0
    first = []
    for x, y in zip(a, b):
        xs, ys = x["output_ids"], y["output_ids"]
        n = max(len(xs), len(ys))
        eq = [i < len(xs) and i < len(ys) and xs[i] == ys[i] for i in range(n)]
        same += sum(eq)
        total += n
        first.append(next((i for i, e in enumerate(eq) if not e), -1))
    return (same / total if total else 0.0), first


def profile_attention(server: Server, backend: str, layers: int, work: Path, rng: random.Random) -> dict:
    """GPU time of verify attention per verify pass, from SGLang's own profiler over steady verify traffic.

    The profile is asked for before the requests, by stage: SGLang starts its decode-stage profile at
    the first decode batch of all 8 requests (SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS, set on the
    servers), so no prefill is in it.
    """
    out = work / f"profile-{server.name}"
    out.mkdir(exist_ok=True)
    server.post("/start_profile", {"output_dir": str(out), "num_steps": PROFILE_STEPS, "activities": ["GPU"],
                                   "profile_by_stage": True})
    server.generate_all(prompts(rng, 8, 24, 40), [1500] * 8)
    files: list[Path] = []
    deadline = time.monotonic() + 60
    while not files and time.monotonic() < deadline:
        files = sorted(out.glob("*-DECODE.trace.json.gz"))
        time.sleep(0.5)
    if not files:
        raise RuntimeError(f"no decode-stage profile written to {out}: {sorted(p.name for p in out.iterdir())}")
    time.sleep(1.0)
    with gzip.open(files[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    attn = [e for e in kernels if bare_name(e["name"]).startswith(ATTENTION_KERNELS[backend])]
    main = [e for e in attn if bare_name(e["name"]).startswith(MAIN_KERNEL[backend])]
    passes = len(main) / layers
    if not passes:
        raise RuntimeError(f"no {backend} verify-attention kernel in the profile "
                           f"(kernels seen: {sorted({e['name'][:40] for e in kernels})[:12]})")
    total = sum(e["dur"] for e in attn)
    return {"attention_us_per_pass": round(total / passes, 2), "passes_profiled": passes,
            "kernels": sorted({e["name"][:60] for e in attn})}


def bare_name(kernel: str) -> str:
    """A profiler's kernel name without namespace, template and arguments: 'void mlav::split_kernel<40, 32>(...)'
    -> 'split_kernel'."""
    return kernel.split("(", 1)[0].split("<", 1)[0].rsplit("::", 1)[-1]


def attention_outputs_agree(heads: int, ctx: list[int]) -> dict:
    """Our kernel and SGLang's Triton extend kernel on the same verify inputs, both against fp32."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_verify import make_problem, run_ours, run_sglang_extend
    from sglang.kernels.ops.attention import extend_attention

    from moeplace_kernels.mla_verify_api import MlaVerify
    from moeplace_kernels.mla_verify_ref import mla_verify_ref

    torch.manual_seed(0)
    p = make_problem(ctx, heads, DRAFTS, shuffle=True)
    op = MlaVerify(heads, DRAFTS, len(ctx))                       # page size 1: the own kernel
    paged = MlaVerify(heads, DRAFTS, len(ctx), page_size=CHAIN_PAGE)  # the composed path
    ours = torch.empty(len(ctx) * DRAFTS, heads, 512, dtype=torch.bfloat16, device="cuda")
    composed, theirs = torch.empty_like(ours), torch.empty_like(ours)
    run_ours(p, op, ours)()   # the problem's pool is in shuffled 64-token pages: both paths can read it
    run_ours(p, paged, composed)()
    run_sglang_extend(extend_attention, p, theirs)()
    ref, _ = mla_verify_ref(p["q"], p["k_ext"], p["v_ext"], p["pool"], p["qo_indptr"], p["kv_indptr"],
                            p["kv_indices"], 576 ** -0.5, p["mask_qlen"], "qlen_only")
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    return {"backend": op.backend, "paged_backend": paged.backend, "heads": heads, "contexts": ctx,
            "moeplace_vs_fp32": rel(ours, ref), "composed_vs_fp32": rel(composed, ref),
            "sglang_triton_vs_fp32": rel(theirs, ref), "moeplace_vs_sglang_triton": rel(ours, theirs)}


# ----------------------------------------------------------------------------------------- checks

def read_steps(path: Path):
    from moeplace.trace.load import open_trace
    from moeplace.trace.steps import concat_steps

    trace = open_trace(path)
    return concat_steps(list(trace.chunks())), trace.header


def check_trace(servers: list[tuple[Server, str, dict]], work: Path) -> Check:
    """servers: (server, how it was stopped, its stop figures)."""
    from moeplace.trace import modes as M

    figures, problems = {}, []
    for server, how, stop in servers:
        folder = server.work / f"traces-{server.name}"
        parts = sorted(p.name for p in folder.glob("*.part"))
        whole = sorted(p.name for p in folder.glob("*.mptrace"))
        merged = work / f"{server.name}-merged.mptrace"
        merge = moeplace("trace", "merge", str(folder), "-o", str(merged), cwd=work)
        report = moeplace("report", str(merged), "--ranks", "1", "--mode", "verify", cwd=work)
        fig = {"stopped_by": how, **stop, "shards": len(whole), "part_files": parts,
               "merge_rc": merge.returncode, "report_rc": report.returncode}
        if merge.returncode == 0:
            steps, _ = read_steps(merged)
            verify = M.mode_mask(steps.modes, "verify")
            fig["verify_passes_recorded"] = int(verify.sum())
            recorded = fig["request_passes_recorded"] = int(steps.num_tokens[verify].sum() // DRAFTS)
            served = fig["request_passes_served"] = server.verify_passes_served()
            fig["requests"] = len(server.answers)
            fig["prefill_passes_recorded"] = int(M.mode_mask(steps.modes, "prefill").sum())
            fig["overlap_schedule"] = server.overlap
            # With the overlap scheduler the next batch is formed before this one's results: a request
            # that just finished rides one more verify pass, which SGLang does not count in its
            # spec_verify_ct. So: exact without overlap; with it, none missing and at most one extra
            # pass per request.
            if not server.overlap and recorded != served:
                problems.append(f"{server.name}: {recorded} request-verify passes recorded, the server served "
                                f"{served}")
            if server.overlap and not served <= recorded <= served + len(server.answers):
                problems.append(f"{server.name}: {recorded} request-verify passes recorded, the server counted "
                                f"{served} for {len(server.answers)} requests")
        else:
            problems.append(f"{server.name}: trace merge failed: {merge.stderr.strip()[-300:]}")
        if report.returncode != 0:
            problems.append(f"{server.name}: report --mode verify failed: {report.stderr.strip()[-300:]}")
        if parts or not whole:
            problems.append(f"{server.name}: after {how} {len(whole)} whole shard(s), .part left: {parts}")
        if stop.get("exit_code") is None:
            problems.append(f"{server.name}: did not exit within the stop timeout after {how}")
        figures[server.name] = fig
    ok = not problems
    detail = "; ".join(problems) if problems else (
        "shards whole after SIGTERM and SIGINT; merge and report read them; every verify pass the servers "
        "counted is in the trace (exactly so without the overlap scheduler)")
    return Check("trace", ok, detail, figures)


def check_capture(server: Server, captured: Path, cap: subprocess.CompletedProcess, work: Path) -> Check:
    from moeplace.trace import modes as M

    if cap.returncode != 0:
        return Check("capture", False, f"moeplace capture failed (exit {cap.returncode}): "
                                       f"{cap.stderr.strip()[-400:]}")
    cap_steps, _ = read_steps(captured)
    traced, _ = read_steps(work / f"{server.name}-merged.mptrace")
    pick = lambda s: np.flatnonzero(M.mode_mask(s.modes, "verify"))  # noqa: E731
    c_idx, t_idx = pick(cap_steps), pick(traced)
    if not len(c_idx):
        return Check("capture", False, "the capture holds no verify step", {"capture_steps": cap_steps.num_steps})
    key = lambda s, i: s.topk_ids[s.token_offsets[i]:s.token_offsets[i + 1]].tobytes()  # noqa: E731
    traced_keys = [key(traced, i) for i in t_idx]
    captured_keys = [key(cap_steps, i) for i in c_idx]
    start = next((j for j, k in enumerate(traced_keys) if k == captured_keys[0]), None)
    if start is None:
        return Check("capture", False, "the capture's first verify step is not among the tracer's",
                     {"capture_verify_steps": len(c_idx)})
    in_place = [start + n < len(traced_keys) and k == traced_keys[start + n] for n, k in enumerate(captured_keys)]
    equal = sum(in_place)
    figures = {"capture_verify_steps": len(c_idx), "equal_to_tracer_steps": equal,
               "tracer_verify_steps": len(t_idx), "aligned_at_tracer_step": start}
    ok = equal == len(c_idx)
    if not ok:   # where it went wrong: the first captured step out of place, and an in-order walk
        figures["first_unequal_capture_step"] = in_place.index(False)
        j, matched, skipped = start, 0, []
        for n, k in enumerate(captured_keys):
            found = next((t for t in range(j, len(traced_keys)) if traced_keys[t] == k), None)
            if found is not None:
                skipped += [(n, t) for t in range(j, found)]
                j, matched = found + 1, matched + 1
        figures["in_order_subsequence"] = matched           # captured steps found in order, tracer steps between
        figures["tracer_steps_between"] = j - start - matched
        # the tracer's steps the capture lacks (the first 8): what they were, so a rare failure explains itself
        rows = lambda s, i: int(s.token_offsets[i + 1] - s.token_offsets[i])  # noqa: E731
        figures["tracer_steps_skipped"] = [
            {"before_capture_step": n, "tracer_verify_step": t, "rows": rows(traced, t_idx[t]),
             "same_ids_as_previous": t > 0 and traced_keys[t] == traced_keys[t - 1],
             "trace_step": int(t_idx[t]), "capture_rows_there": rows(cap_steps, c_idx[n])}
            for n, t in skipped[:8]]
    return Check("capture", ok, f"{equal} of {len(c_idx)} captured verify steps equal the tracer's, in order",
                 figures)


STALE_RANKS = 8   # the stale check's placement: one node of 8 GPUs, one spare slot a rank, balanced dispatch
STALE_VERDICT = re.compile(r"^(keep: |re-place: \d+% to gain)")


def check_stale(captured: Path, work: Path, max_steps: int | None = None) -> Check:
    """The stale-placement check on a capture: a placement fitted by `optimize` on the capture's first half
    (``--holdout 0.5``), then `report CAPTURE --placement P --json`, which must exit 0 with a staleness
    verdict (keep, or re-place and the share to gain). max_steps: both commands' --max-steps."""
    spec = ["--ranks", str(STALE_RANKS), "--mode", "verify", "--dispatch", "balanced"]
    limit = ["--max-steps", str(max_steps)] if max_steps else []
    placement = work / "stale-placement.json"
    t0 = time.monotonic()
    fit = moeplace("optimize", str(captured), *spec, "--redundant", str(STALE_RANKS), "--holdout", "0.5", *limit,
                   "-o", str(placement), cwd=work)
    fit_s = time.monotonic() - t0
    figures: dict[str, Any] = {"optimize_rc": fit.returncode, "optimize_s": round(fit_s, 1)}
    if fit.returncode != 0:
        return Check("stale", False, f"optimize on the capture's first half failed (exit {fit.returncode}): "
                                     f"{fit.stderr.strip()[-400:]}", figures)
    t0 = time.monotonic()
    rep = moeplace("report", str(captured), *spec, "--placement", str(placement), *limit, "--json", cwd=work)
    figures.update(report_rc=rep.returncode, report_s=round(time.monotonic() - t0, 1))
    if rep.returncode != 0:
        return Check("stale", False, f"report --placement failed (exit {rep.returncode}): {rep.stderr.strip()[-400:]}",
                     figures)
    stale = json.loads(rep.stdout).get("staleness")
    if not stale:
        return Check("stale", False, "report --placement --json has no staleness verdict (a capture under "
                                     "20 verify steps?)", figures)
    figures.update({k: stale[k] for k in ("current", "refit", "naive", "to_gain", "fit_steps", "scored_steps")})
    figures["verdict"] = stale["line"]
    ok = bool(STALE_VERDICT.match(stale["line"]))
    return Check("stale", ok, stale["line"] if ok else f"no keep / re-place verdict: {stale['line']}", figures)


def check_verify(pairs: list[tuple[str, Server, Server]], timings: dict, agree: dict) -> Check:
    figures, problems = {"attention_outputs_same_inputs": agree}, []
    for label, base, ours in pairs:
        share, first = equal_token_share(base.greedy, ours.greedy)
        t_base, t_ours = timings.get(base.name, {}), timings.get(ours.name, {})
        fig = {"equal_token_share": round(share, 4), "first_difference_per_request": first,
               "ready_s": {"triton": round(base.ready_s or 0, 1), "moeplace": round(ours.ready_s or 0, 1)},
               "triton": t_base, "moeplace": t_ours}
        if t_base.get("attention_us_per_pass") and t_ours.get("attention_us_per_pass"):
            fig["speedup_vs_triton"] = round(t_base["attention_us_per_pass"] / t_ours["attention_us_per_pass"], 3)
        figures[label] = fig
        said = re.search(r"moeplace verify kernel on: (\w+) backend", ours.log())
        fig["moeplace_backend"] = said.group(1) if said else None
        fig["page_size"] = ours.page_size
        if not said:
            problems.append(f"{label}: the server never said the kernel was on")
        elif ours.page_size % 64 == 0 and said.group(1) != "composed":
            problems.append(f"{label}: page size {ours.page_size} but the {said.group(1)} backend serves, "
                            "not the composed path")
        if share < 0.99:
            problems.append(f"{label}: {share:.1%} of greedy tokens equal (under 99%)")
        if base.solo:   # batches of one request: the composed path runs FlashMLA over chunk requests
            solo_share, solo_first = equal_token_share(base.solo, ours.solo)
            chunks = re.search(r"one-request batches as (\d+) FlashMLA chunk requests", ours.log())
            fig["one_request"] = {"equal_token_share": round(solo_share, 4),
                                  "first_difference_per_request": solo_first,
                                  "chunk_requests": int(chunks.group(1)) if chunks else None}
            if ours.page_size % 64 == 0 and not chunks:
                problems.append(f"{label}: the server never said one-request batches run as chunk requests")
            if solo_share < 0.99:
                problems.append(f"{label}: one request at a time, {solo_share:.1%} of greedy tokens equal "
                                "(under 99%)")
        if "speedup_vs_triton" not in fig:
            problems.append(f"{label}: no in-server attention time ({t_base.get('error') or t_ours.get('error')})")
    close = max(agree["moeplace_vs_fp32"], agree["composed_vs_fp32"]) <= 1.5 * agree["sglang_triton_vs_fp32"] + 1e-3
    if not close:
        problems.append(f"on the same inputs our paths are further from fp32 than SGLang's kernel ({agree})")
    # Outputs differ only where the kernels' outputs differ: the same-input comparison says how much.
    if problems and all("under 99%" in p for p in problems) and close:
        detail = ("; ".join(problems) + f": on the same inputs both kernels are as close to fp32 "
                  f"(moeplace {agree['moeplace_vs_fp32']:.1e}, SGLang {agree['sglang_triton_vs_fp32']:.1e}); "
                  "the random-weight model's near-ties turn rounding into other tokens")
        return Check("verify", True, detail, figures)
    return Check("verify", not problems, "; ".join(problems) or
                 "starts with CUDA graphs and serves trees and chains; greedy outputs equal SGLang's Triton "
                 "backend's", figures)


def kv_stats(server: Server) -> dict | None:
    path = server.work / f"kv-{server.name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def churn_only(before: dict | None, after: dict | None) -> dict | None:
    """The churn's own allocations: the stats after it less those before it (both servers saw the churn)."""
    if after is None:
        return None
    out = dict(after)
    for key in ("allocations", "tokens", "runs", "single_run"):
        out[key] = after[key] - (before or {}).get(key, 0)
    out["tokens_per_run"] = out["tokens"] / out["runs"] if out["runs"] else None
    out["single_run_share"] = out["single_run"] / out["allocations"] if out["allocations"] else None
    return out


def check_kv_sort(plain: Server, sorted_: Server, healthy: bool, before: dict) -> Check:
    stats = {name: churn_only(before.get(server.name), kv_stats(server))
             for name, server in (("without_sort", plain), ("with_sort", sorted_))}
    problems = []
    if not healthy:
        problems.append("the server with the sort did not answer after the churn")
    if not stats["with_sort"] or not stats["with_sort"].get("need_sort"):
        problems.append("the sorted server's allocator did not report need_sort")
    if not stats["without_sort"] or stats["without_sort"].get("need_sort"):
        problems.append("the baseline server's allocator stats are missing or sorted")
    return Check("kv_sort", not problems, "; ".join(problems) or
                 "healthy after the churn; KV allocation runs of the same churn with and without the sort",
                 stats)


def check_launch(server: Server, placement: Path, refusal: subprocess.CompletedProcess, refusal_s: float) -> Check:
    from moeplace.files.placement import load_placement

    placement_map = np.asarray(load_placement(placement).phy2log)
    shard = next(iter(sorted((server.work / f"traces-{server.name}").glob("*.mptrace"))), None)
    problems, figures = [], {"refusal_rc": refusal.returncode, "refusal_s": round(refusal_s, 1),
                             "refusal_stderr": refusal.stderr.strip()[-400:]}
    if shard is None:
        problems.append("no trace shard to read the map in force from")
    else:
        from moeplace.trace.store import TraceReader

        header = TraceReader(shard).headers[0]
        in_force = np.asarray(header.physical_to_logical_map) if header.physical_to_logical_map else None
        figures["map_in_force_equals_file"] = bool(in_force is not None and np.array_equal(in_force, placement_map))
        figures["identity_map"] = bool(np.array_equal(placement_map, np.tile(np.arange(placement_map.shape[1]),
                                                                              (placement_map.shape[0], 1))))
        if not figures["map_in_force_equals_file"]:
            problems.append("the map SGLang used is not the placement's")
    lines = [x for x in refusal.stderr.strip().splitlines() if x.strip()]
    if refusal.returncode != 2 or len(lines) != 1 or "Traceback" in refusal.stderr:
        problems.append(f"another model's placement: exit {refusal.returncode}, {len(lines)} stderr line(s)")
    return Check("launch", not problems, "; ".join(problems) or
                 "SGLang started with the placement's map in force (reversed slot order, as written); "
                 "another model's placement refused in one line before SGLang started", figures)


def check_refused_start(name: str, server: Server, rc: int | None, needle: str) -> Check:
    log = server.log()
    ours = [line for line in log.splitlines() if line.startswith("moeplace:")]
    figures = {"exit_code": rc, "exit_s": round(server.exit_s, 1) if server.exit_s else None, "lines": ours[:3]}
    ok = rc not in (None, 0) and len(ours) == 1 and needle in ours[0]
    detail = ours[0] if ours else f"no moeplace line; log tail: {tail(log, 8)}"
    return Check(name, ok, detail if ok else f"exit {rc}: {detail}", figures)


REPLACE_BATCH = 8             # requests of a timed batch (the CUDA-graph batch size)
REPLACE_TOKENS = 256          # new tokens each
REPLACE_WINDOW = 3000         # passes the server's window holds: a decision on it takes seconds, not a blink (--replace-window)
IDLE_BATCHES = 5              # batches timed with no decision in flight, around the one timed with it
STALL_LINE = re.compile(r"moeplace online: re-placed (\d+) layers.*moved (\d+) expert replicas \(([\d.]+) GB\), "
                        r"stall ([\d.]+) ms")


def replace_placements(work: Path) -> list[Path]:
    """Two other maps of ``placement.json``'s experts to move to: slots reversed back, then shuffled per layer."""
    data = json.loads((work / "placement.json").read_text())
    rng = np.random.default_rng(0)
    moves = [[row[::-1] for row in data["physical_to_logical_map"]],
             [list(map(int, rng.permutation(row))) for row in data["physical_to_logical_map"]]]
    paths = []
    for i, rows in enumerate(moves):
        paths.append(work / f"replace-{i}.json")
        paths[-1].write_text(json.dumps({**data, "physical_to_logical_map": rows}))
    return paths


def timed_batch(server: Server, batch: list[list[int]]) -> tuple[float, list[dict]]:
    """(seconds, answers) of one greedy batch, all at once."""
    t0 = time.monotonic()
    answers = server.generate_all(batch, [REPLACE_TOKENS] * len(batch), workers=len(batch))
    return time.monotonic() - t0, answers


def exercise_replace(server: Server, work: Path, rng: random.Random, window: int = REPLACE_WINDOW) -> dict:
    """Traffic switched between two prompt sets on the server with online re-placement, two re-placements asked for
    through ``moeplace online request`` while a batch runs, a dry run timed against the same batch without one."""
    folder = work / "online"
    sets = {"A": prompts(rng, REPLACE_BATCH, 48, 96, vocab=8000), "B": prompts(rng, REPLACE_BATCH, 200, 400)}
    out: dict[str, Any] = {"answers": [], "tokens_per_s": {}, "requests": []}
    for batch in sets.values():   # each set's first batch compiles kernels for its lengths: not timed
        out["answers"] += timed_batch(server, batch)[1]

    def tps(label: str, batch: list[list[int]]) -> float:
        seconds, answers = timed_batch(server, batch)
        out["answers"] += answers
        out["tokens_per_s"][label] = round(REPLACE_TOKENS * len(batch) / seconds, 1)
        return seconds

    def ask(*args: str) -> subprocess.CompletedProcess:
        answer = moeplace("online", "request", str(folder), *args, "--wait", "300", cwd=work)
        out["requests"].append({"args": list(args), "rc": answer.returncode, "out": answer.stdout.strip()[-300:],
                                "err": answer.stderr.strip()[-300:]})
        return answer

    tps("before (A)", sets["A"])
    for label, placement, batch in (("during 1st (A)", 0, sets["A"]), ("during 2nd (B)", 1, sets["B"])):
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(ask, "--placement", str(work / f"replace-{placement}.json"))
            tps(label, batch)
            asked.result()
        tps(label.replace("during", "after"), batch)
    # a decision run to its end on a full window, against the same batch run with none in flight
    deadline = time.monotonic() + 180
    while json.loads((folder / "status-r000.json").read_text())["window_passes"] < window \
            and time.monotonic() < deadline:   # the worker rewrites its status every few seconds
        out["answers"] += timed_batch(server, sets["A" if len(out["answers"]) % 2 else "B"])[1]
    idle, during = [timed_batch(server, sets["B"])[0] for _ in range(IDLE_BATCHES)], []
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        decided = pool.submit(ask, "--dry-run", "--json")
        while not decided.done():
            during.append(timed_batch(server, sets["B"])[0])
        out["decision_wall_s"] = round(time.monotonic() - t0, 1)
        answer = decided.result()
    idle += [timed_batch(server, sets["B"])[0] for _ in range(IDLE_BATCHES)]
    out["dry_run"] = json.loads(answer.stdout) if answer.returncode == 0 else {"error": answer.stderr[-300:]}
    out["batch_s_idle"] = [round(x, 3) for x in idle]
    out["batch_s_deciding"] = [round(x, 3) for x in during]
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            out["metrics"] = [line for line in r.read().decode().splitlines() if line.startswith("moeplace:")]
    except (urllib.error.URLError, OSError) as e:
        out["metrics"] = [f"error: {e}"]
    return out


def check_replace(server: Server, baseline: Server, exercise: dict, stop: tuple[int | None, float],
                  work: Path) -> Check:
    """Two re-placements while serving, no request failed, greedy outputs those of the server that never
    re-placed, the stall and tokens per second around each, the tracer's shards in the maps applied in turn, a
    decision's cost to the passes that ran beside it, the /metrics gauges."""
    from moeplace.files.placement import load_placement
    from moeplace.trace.store import TraceReader

    problems = []
    figures: dict[str, Any] = {k: exercise[k] for k in ("tokens_per_s", "requests", "batch_s_idle",
                                                        "batch_s_deciding", "metrics") if k in exercise}
    figures["stop_exit_code"], figures["stop_s"] = stop[0], round(stop[1], 1)
    applied = [m.groups() for m in STALL_LINE.finditer(server.log())]
    figures["re_placements"] = [{"layers": int(a), "moved": int(b), "gb": float(c), "stall_ms": float(d)}
                                for a, b, c, d in applied]
    if len(applied) < 2:
        problems.append(f"{len(applied)} re-placements logged, not 2")
    if any(r["rc"] != 0 for r in exercise["requests"]):
        problems.append("a control request failed: " + "; ".join(r["err"] for r in exercise["requests"] if r["rc"]))
    failed = [a for a in exercise["answers"] + server.greedy if not a.get("output_ids")]
    if failed:
        problems.append(f"{len(failed)} requests answered without output")
    share, first = equal_token_share(server.greedy, baseline.greedy)
    figures["greedy_equal_share_after"] = share
    if share < 1.0:
        problems.append(f"greedy outputs after the re-placements equal the server without them on {share:.1%} "
                        f"of tokens (first differences {first})")
    dry = exercise.get("dry_run", {})
    figures["decision"] = {k: dry.get(k) for k in ("line", "seconds", "steps", "replace")}
    if "line" not in dry:
        problems.append(f"the dry run gave no decision: {dry}")
    idle, busy = exercise["batch_s_idle"], exercise["batch_s_deciding"]
    if busy and idle:
        figures["pass_time_while_deciding"] = round(float(np.median(busy)) / float(np.median(idle)), 3)
    maps = []
    for shard in sorted((work / "traces-replace").glob("*.mptrace")):
        header = TraceReader(shard).headers[0]
        if header.physical_to_logical_map and (not maps or maps[-1] != header.physical_to_logical_map):
            maps.append(header.physical_to_logical_map)
    wanted = [load_placement(work / name).phy2log.tolist()
              for name in ("placement.json", "replace-0.json", "replace-1.json")]
    figures["shard_maps_in_turn"] = [next((i for i, w in enumerate(wanted) if w == m), -1) for m in maps]
    if figures["shard_maps_in_turn"] != [0, 1, 2]:
        problems.append(f"the shards' maps are {figures['shard_maps_in_turn']} of (start, 1st, 2nd), not in turn")
    if not any(line.startswith("moeplace:replacements ") and line.split()[-1] in ("2", "2.0")
               for line in exercise.get("metrics", [])):
        problems.append("/metrics has no moeplace:replacements 2")
    stalls = ", ".join(f"{a['stall_ms']:.0f} ms ({a['moved']} replicas, {a['gb']:.2f} GB)"
                       for a in figures["re_placements"])
    return Check("replace", not problems, "; ".join(problems) or
                 f"re-placed twice while serving (stalls {stalls}); greedy outputs equal the server without "
                 f"re-placement on every token; tokens/s {figures['tokens_per_s']}; a decision "
                 f"({dry.get('seconds', 0):.1f} s) left the passes beside it at "
                 f"{figures.get('pass_time_while_deciding', float('nan')):.3f}x their time; shards in the maps "
                 f"applied, in turn", figures)


# ----------------------------------------------------------------------------------------- run

def versions(head: str | None) -> dict:
    out = {}
    for mod, key in (("sglang", "sglang_version"), ("sgl_kernel", "sgl_kernel_version")):
        try:
            out[key] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[key] = f"not importable: {e}"
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = "unknown"
    if head is None:
        try:
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            head = None
    out["project_head"] = head or "unknown"
    return out


def guarded(checks: list[Check], name: str, fn: Callable[[], Check]) -> None:
    try:
        checks.append(fn())
    except Exception as e:  # noqa: BLE001 (one broken check must not hide the others)
        checks.append(Check(name, False, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()[-2000:]}))
    c = checks[-1]
    print(f"check {c.name}: {'ok' if c.ok else 'FAIL'}: {c.detail[:400]}", flush=True)


def make_placement(model: Path, work: Path) -> None:
    """``placement.json`` for `launch`: this model's, its slot order reversed so that SGLang's map is visibly the
    file's."""
    if (work / "placement.json").exists():
        return
    synth = moeplace("trace", "synth", "--model", str(model / "config.json"), "--steps", "2000",
                     "-o", "synth.mptrace", cwd=work)
    assert synth.returncode == 0, synth.stderr
    fit = moeplace("optimize", "synth.mptrace", "--ranks", "1", "--mode", "verify", "-o", "fitted.json", cwd=work)
    assert fit.returncode == 0, fit.stderr
    data = json.loads((work / "fitted.json").read_text())
    data["physical_to_logical_map"] = [row[::-1] for row in data["physical_to_logical_map"]]
    (work / "placement.json").write_text(json.dumps(data))


def run_replace(model: Path, work: Path, port: int, startup: float, window: int = REPLACE_WINDOW,
                earlier_stops: list[tuple[str, str, int | None]] = ()) -> list[Check]:
    """Online re-placement at EP 1: a server launched with the reversed map and MOEPLACE_ONLINE (a decision only
    when asked, so that the timed batches meet none by chance; tracer on, /metrics on) beside the same server
    without online re-placement; and SGLang alone (no moeplace feature on: the baseline, and a plain server not
    started by `launch`), stopped with SIGINT and SIGTERM, whose exit codes the servers with moeplace's features
    (``earlier_stops``: name, signal, exit code) must give for the same signal."""
    rng = random.Random(1)
    make_placement(model, work)
    replace_placements(work)
    trees = ["--speculative-ngram-max-bfs-breadth", "4"]
    launch = ["--placement", "placement.json"]
    baseline = Server("replace-baseline", port, server_argv(model, port, trees, launch=launch), {}, work)
    plain = Server("plain-sglang", port + 2, server_argv(model, port + 2, trees), {}, work)
    server = Server("replace", port + 1, server_argv(model, port + 1, trees + ["--enable-metrics"], launch=launch),
                    {"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_DIR": str(work / "online"),
                     "MOEPLACE_ONLINE_PERIOD": "1000000", "MOEPLACE_ONLINE_WINDOW": str(window),
                     "MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_DIR": str(work / "traces-replace")}, work)
    checks: list[Check] = []
    try:
        for s in (baseline, server, plain):
            s.start()
            time.sleep(2.0)
        for s in (baseline, server, plain):
            s.wait_ready(startup)
        print(f"servers ready: {[(s.name, round(s.ready_s, 1)) for s in (baseline, server, plain)]}", flush=True)
        greedy_prompts = prompts(rng, 8, 64, 256)
        baseline.greedy = baseline.generate_all(greedy_prompts, [128] * 8)
        exercise = exercise_replace(server, work, rng, window)
        server.greedy = server.generate_all(greedy_prompts, [128] * 8)
        print(f"re-placement traffic done: {json.dumps({k: exercise[k] for k in ('tokens_per_s', 'requests')})[:800]}",
              flush=True)
        how = ((server, signal.SIGTERM), (baseline, signal.SIGINT), (plain, signal.SIGTERM))
        with ThreadPoolExecutor(len(how)) as pool:
            stopped = list(pool.map(lambda x: x[0].stop(x[1]), how))
        stop = stopped[0]
        guarded(checks, "replace", lambda: check_replace(server, baseline, exercise, stop, work))
        codes = [(s.name, signal.Signals(sig).name, rc) for (s, sig), (rc, _) in zip(how, stopped)]
        guarded(checks, "stops", lambda: check_stops(list(earlier_stops) + codes[:1], codes[1:]))
    finally:
        for s in (baseline, server, plain):
            s.kill()
    return checks


def check_stops(ours: list[tuple[str, str, int | None]], sglang: list[tuple[str, str, int | None]]) -> Check:
    """Every server with a moeplace feature on exits, for each signal, with the code SGLang alone gave for it."""
    own = {sig: rc for _, sig, rc in sglang}
    differ = [f"{name} {sig}: {rc} (SGLang alone: {own[sig]})" for name, sig, rc in ours if own.get(sig) != rc]
    figures = {"sglang_alone": {f"{name} {sig}": rc for name, sig, rc in sglang},
               "with_moeplace": {f"{name} {sig}": rc for name, sig, rc in ours}}
    detail = "; ".join(f"{sig} -> {rc}" for sig, rc in sorted(own.items()))
    return Check("stops", not differ and len(own) == 2,
                 f"exit codes as SGLang alone gives them: {detail}" if not differ else "; ".join(differ), figures)


def run(model: Path, work: Path, port: int, startup: float) -> list[Check]:
    rng = random.Random(0)
    config = json.loads((model / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    checks: list[Check] = []

    # The kernel is built once here (the servers then load it from the cache), and checked on the
    # verify step's own shapes against SGLang's Triton kernel and fp32.
    agree = attention_outputs_agree(heads, [300, 517, 64, 1200, 900, 33, 410, 250])

    make_placement(model, work)
    other = moeplace("trace", "synth", "--shape", "gpt-oss-20b", "--steps", "300", "-o", "other.mptrace", cwd=work)
    assert other.returncode == 0, other.stderr
    assert moeplace("optimize", "other.mptrace", "--ranks", "1", "-o", "other.json", cwd=work).returncode == 0

    block = work / "blocked"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(
        "import sys\nsys.modules['sglang.srt.model_executor.model_runner'] = None  # an ImportError inside SGLang\n")

    def traced(name: str) -> dict:
        return {"MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_DIR": str(work / f"traces-{name}"),
                "MOEPLACE_KV_STATS": str(work / f"kv-{name}.json")}

    recorder = ["--expert-distribution-recorder-mode", "per_token", "--expert-distribution-recorder-buffer-size", "-1"]
    trees = ["--speculative-ngram-max-bfs-breadth", "4"]
    chain = ["--speculative-ngram-max-bfs-breadth", "1"]
    s_trees = Server("trees-triton", port + 1, server_argv(model, port + 1, trees + recorder,
                                                           launch=["--placement", "placement.json"]),
                     {**traced("trees-triton"), "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(work / "dumps")}, work)
    s_trees_k = Server("trees-moeplace", port + 2, server_argv(model, port + 2, trees),
                       {**traced("trees-moeplace"), "MOEPLACE_VERIFY_KERNEL": "1", "MOEPLACE_KV_SORT": "1"}, work)
    no_overlap = ["--disable-overlap-schedule"]
    paged = ["--page-size", str(CHAIN_PAGE)]
    s_chain = Server("chain-triton", port + 3, server_argv(model, port + 3, chain + no_overlap + paged),
                     traced("chain-triton"), work)
    s_chain_k = Server("chain-moeplace", port + 4, server_argv(model, port + 4, chain + no_overlap + paged),
                       {**traced("chain-moeplace"), "MOEPLACE_VERIFY_KERNEL": "1"}, work)
    s_hooks = Server("hooks", port + 5, server_argv(model, port + 5, []),
                     {"MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_DIR": str(work / "traces-hooks"),
                      "PYTHONPATH": f"{block}:{os.environ.get('PYTHONPATH', '')}"}, work)
    s_dispatch = Server("dispatch-ep1", port + 6, server_argv(model, port + 6, []),
                        {"MOEPLACE_DISPATCH": "balanced"}, work)
    serving = [s_trees, s_trees_k, s_chain, s_chain_k]
    everyone = serving + [s_hooks, s_dispatch]
    (work / "dumps").mkdir(exist_ok=True)
    try:
        for s in everyone:
            s.start()
            time.sleep(2.0)   # stagger the starts: each sizes its memory against what the others took
        t0 = time.monotonic()
        refusal = moeplace("launch", "--placement", "other.json", "--", *sglang_args(model, port + 7, []), cwd=work)
        refusal_s = time.monotonic() - t0
        guarded(checks, "hooks", lambda: check_refused_start(
            "hooks", s_hooks, s_hooks.wait_exit(startup), "MOEPLACE_TRACE is set but"))
        for s in serving:
            s.wait_ready(startup)
        print(f"servers ready: {[(s.name, round(s.ready_s, 1)) for s in serving]}", flush=True)

        greedy_prompts = prompts(rng, 8, 64, 256)
        with ThreadPoolExecutor(4) as pool:   # the same 8 requests at once on each server
            for s, answers in zip(serving, pool.map(lambda s: s.generate_all(greedy_prompts, [128] * 8), serving)):
                s.greedy = answers
        solo_prompts = prompts(rng, 2, 64, 256)
        for s in (s_chain, s_chain_k):   # one request at a time: verify batches of one request
            s.solo = [s.generate(p, 128) for p in solo_prompts]
        print("greedy requests done", flush=True)

        # capture: SGLang's recorder over a window of traffic on the launched server
        cap_path = work / "capture.mptrace"
        cap = subprocess.Popen([*MOEPLACE, "capture", "--url", s_trees.url,
                                "--seconds", "4", "--dump-dir", str(work / "dumps"), "-o", str(cap_path)],
                               cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while cap.poll() is None:   # traffic all through the recording window, whenever it opens
            s_trees.generate_all(prompts(rng, 4, 32, 64), [48] * 4)
        cap_out, cap_err = cap.communicate(timeout=300)
        captured = subprocess.CompletedProcess(cap.args, cap.returncode, cap_out, cap_err)
        print(f"capture done (exit {cap.returncode}): {cap_out.strip()[-300:]} {cap_err.strip()[-1500:]}", flush=True)

        # churn: many short requests of mixed length, the same on the servers with and without the sort
        churn = prompts(rng, 160, 16, 1024)
        churn_new = [rng.randint(4, 48) for _ in churn]
        time.sleep(2.5)   # the KV stats of the traffic so far are on disk
        kv_before = {s.name: kv_stats(s) for s in (s_trees, s_trees_k)}
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.generate_all(churn, churn_new), (s_trees, s_trees_k)))
        healthy = bool(s_trees_k.generate(prompts(rng, 1, 16, 16)[0], 16)["output_ids"])
        time.sleep(3.0)   # the KV stats and the tracers' idle flush are on disk
        print("churn done", flush=True)

        timings = {}
        for s, backend in ((s_trees, "triton"), (s_trees_k, "moeplace"), (s_chain, "triton"),
                           (s_chain_k, "moeplace")):
            try:
                timings[s.name] = profile_attention(s, backend, layers, work, rng)
            except Exception as e:  # noqa: BLE001
                timings[s.name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"profiles: {json.dumps(timings)[:600]}", flush=True)

        # each signal stops a server with moeplace's verify kernel and one without (tracer on in all four), so
        # that the exit codes say whether the signal or the kernel decides them
        how = ((s_trees, signal.SIGINT), (s_trees_k, signal.SIGTERM), (s_chain, signal.SIGTERM),
               (s_chain_k, signal.SIGINT))
        with ThreadPoolExecutor(len(how)) as pool:   # as a process manager stops a node's servers
            stopped = list(pool.map(lambda x: x[0].stop(x[1]), how))
        stops = {s.name: {"exit_code": rc, "stop_s": round(secs, 1)} for (s, _), (rc, secs) in zip(how, stopped)}
        print(f"stopped: {stops}", flush=True)
        dispatch_rc = s_dispatch.wait_exit(max(1.0, startup - (time.monotonic() - s_dispatch.started)))

        guarded(checks, "trace", lambda: check_trace([(s, signal.Signals(sig).name, stops[s.name])
                                                      for s, sig in how], work))
        guarded(checks, "capture", lambda: check_capture(s_trees, cap_path, captured, work))
        guarded(checks, "stale", lambda: check_stale(cap_path, work))
        guarded(checks, "verify", lambda: check_verify([("trees", s_trees, s_trees_k),
                                                        ("chains", s_chain, s_chain_k)], timings, agree))
        guarded(checks, "kv_sort", lambda: check_kv_sort(s_trees, s_trees_k, healthy, kv_before))
        guarded(checks, "launch", lambda: check_launch(s_trees, work / "placement.json", refusal, refusal_s))
        guarded(checks, "dispatch", lambda: check_refused_start(
            "dispatch", s_dispatch, dispatch_rc, "MOEPLACE_DISPATCH=balanced cannot run here"))
    finally:
        for s in everyone:
            s.kill()
    stopped_here = [(s.name, signal.Signals(sig).name, stops[s.name]["exit_code"]) for s, sig in how]
    return checks + run_replace(model, work, port + 8, startup, earlier_stops=stopped_here)


# ----------------------------------------------------------------------------------------- 2 GPUs (EP)

EP_LAYOUTS = ("deepseek", "stepaware", "balanced", "tp-moe", "cost")


def rank_choices(folder: Path) -> dict[int, list[bytes]]:
    """Per rank, each recorded pass's physical ids as bytes (the replicas that rank's router chose)."""
    from moeplace.trace.store import TraceReader

    by_rank: dict[int, list[bytes]] = {}
    for _, raw in TraceReader(folder).raw_chunks():
        rank = int(raw["ranks"][0]) if len(raw["ranks"]) else 0
        offsets, ids = raw["token_offsets"], raw["topk_ids"]
        by_rank.setdefault(rank, []).extend(ids[offsets[i]:offsets[i + 1]].tobytes()
                                            for i in range(len(raw["modes"])))
    return by_rank


def moe_us_per_pass(server: Server, layers: int, work: Path, rng: random.Random) -> dict:
    """SGLang's fused-MoE kernel time per decode-stage pass on the slowest rank (its profiler, all ranks)."""
    out = work / f"profile-{server.name}"
    out.mkdir(exist_ok=True)
    server.post("/start_profile", {"output_dir": str(out), "num_steps": PROFILE_STEPS, "activities": ["GPU"],
                                   "profile_by_stage": True})
    t0 = time.monotonic()
    answers = server.generate_all(prompts(rng, 8, 24, 40), [512] * 8)
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 60
    files: list[Path] = []
    while len(files) < 2 and time.monotonic() < deadline:
        files = sorted(out.glob("*-DECODE.trace.json.gz"))
        time.sleep(0.5)
    per_rank, dispatch_kernels, cost_kernels = [], 0, 0
    for f in files:
        with gzip.open(f, "rt") as fh:
            kernels = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel"]
        moe = [e for e in kernels if bare_name(e["name"]).startswith("fused_moe_kernel")]
        dispatch_kernels += sum(bare_name(e["name"]).startswith("balanced_dispatch_kernel") for e in kernels)
        cost_kernels += sum(is_cost_kernel(e["name"]) for e in kernels)
        per_rank.append(sum(e["dur"] for e in moe) / PROFILE_STEPS)
    tokens = sum(len(a["output_ids"]) for a in answers)
    return {"tokens_per_s": round(tokens / wall, 1), "moe_us_per_pass_slowest_rank": round(max(per_rank), 1)
            if per_rank else None, "moe_us_per_pass_per_rank": [round(x, 1) for x in per_rank],
            "ranks_profiled": len(files), "balanced_dispatch_kernels": dispatch_kernels,
            "cost_dispatch_kernels": cost_kernels}


def is_cost_kernel(kernel: str) -> bool:
    """The rule-by-cost instantiation of the dispatch kernel (``balanced_dispatch_kernel<Id, true>``), demangled
    or not."""
    return "balanced_dispatch_kernel" in kernel and (", true>" in kernel or "Lb1E" in kernel)


def predicted_moe_us(work: Path, model: Path) -> dict:
    """The cost model's MoE µs per step of each layout on the synthetic trace (optimize/advise JSON)."""
    out = {}
    for name, placement, dispatch in (("deepseek", "deepseek.json", "dynamic"),
                                      ("stepaware", "stepaware.json", "dynamic"),
                                      ("balanced", "balanced.json", "balanced")):
        res = moeplace("report", "ep-synth.mptrace", "--placement", placement, "--ranks", "2", "--mode", "verify",
                       "--dispatch", dispatch, "--model", str(model), "--json", cwd=work)
        if res.returncode == 0:
            out[name] = json.loads(res.stdout)["metrics"]["moe_us_per_step"]
    advise = moeplace("advise", "ep-synth.mptrace", "--ranks", "2", "--mode", "verify", "--model", str(model),
                      "--json", cwd=work)
    if advise.returncode == 0:
        at = json.loads(advise.stdout)["at_trace"]
        out["tp-moe"] = at["tp_us"]
        out["advise_winner"] = at["winner"]
    return out


def prepare_ep_placements(model: Path, work: Path, experts: int, steps: int = 4000) -> None:
    """Placements for 2 ranks from SYNTHETIC routing of this model's shape (random weights route like no
    real model either): DeepSeek EPLB, stepaware, balanced with E/4 spare slots; and two `launch` must
    refuse: one for 4 ranks, one for another model."""
    def ok(*args: str) -> None:
        res = moeplace(*args, cwd=work, timeout=900)
        assert res.returncode == 0, f"moeplace {' '.join(args)}: {res.stderr.strip()[-500:]}"

    ok("trace", "synth", "--model", str(model / "config.json"), "--steps", str(steps), "-o", "ep-synth.mptrace")
    fits = {"deepseek.json": ["--algorithm", "deepseek"], "stepaware.json": [],
            "balanced.json": ["--dispatch", "balanced", "--redundant", str(experts // 4)],
            "cost.json": ["--dispatch", "cost", "--redundant", str(experts // 4)]}
    for out, extra in fits.items():
        ok("optimize", "ep-synth.mptrace", "--ranks", "2", "--mode", "verify", "--model", str(model), *extra, "-o", out)
    ok("optimize", "ep-synth.mptrace", "--ranks", "4", "-o", "ep4.json")
    ok("trace", "synth", "--shape", "gpt-oss-20b", "--steps", "300", "-o", "other.mptrace")
    ok("optimize", "other.mptrace", "--ranks", "2", "-o", "other.json")


def ep_launch_refusals(model: Path, work: Path, port: int, experts: int) -> dict[str, subprocess.CompletedProcess]:
    """`moeplace launch` with what it must refuse before SGLang starts."""
    ep = ["--tp", "2", "--ep-size", "2", "--moe-a2a-backend", "none"]
    spares = ["--ep-num-redundant-experts", str(experts // 4)]
    return {what: moeplace("launch", "--placement", placement, "--", *sglang_args(model, port, ep + extra),
                           cwd=work)
            for what, placement, extra in (("another EP size", "ep4.json", []),
                                           ("another model", "other.json", []),
                                           ("DP attention", "balanced.json",
                                            spares + ["--enable-dp-attention", "--dp", "2"]))}


def run_two_gpus(model: Path, work: Path, port: int, startup: float) -> list[Check]:
    """Expert parallelism on 2 GPUs (TP 2, EP 2, --moe-a2a-backend none): placements through `launch`,
    balanced dispatch inside the captured graphs on both ranks, tokens/s and MoE time per layout."""
    rng = random.Random(1)
    config = json.loads((model / "config.json").read_text())
    layers, experts = int(config["num_hidden_layers"]), int(config["n_routed_experts"])
    checks: list[Check] = []
    prepare_ep_placements(model, work, experts)
    ep = ["--tp", "2", "--ep-size", "2", "--moe-a2a-backend", "none"]
    spares = ["--ep-num-redundant-experts", str(experts // 4)]
    argv = {
        "deepseek": server_argv(model, port + 1, ep, launch=["--placement", "deepseek.json"]),
        "stepaware": server_argv(model, port + 2, ep, launch=["--placement", "stepaware.json"]),
        "balanced": server_argv(model, port + 3, ep + spares, launch=["--placement", "balanced.json", "--sglang-out",
                                        str(work / "balanced.sglang.json")]),
        "tp-moe": server_argv(model, port + 4, ["--tp", "2"]),
        # the rule by cost: `launch` sets MOEPLACE_DISPATCH=cost and its weights (MOEPLACE_DISPATCH_Q or _WEIGHTS)
        # from the placement
        "cost": server_argv(model, port + 7, ep + spares, launch=["--placement", "cost.json", "--sglang-out",
                                                                 str(work / "cost.sglang.json")]),
    }
    ports = {"deepseek": port + 1, "stepaware": port + 2, "balanced": port + 3, "tp-moe": port + 4, "cost": port + 7}
    servers = {name: Server(f"ep2-{name}", ports[name], argv[name],
                            {"MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_DIR": str(work / f"traces-ep2-{name}")}, work)
               for name in EP_LAYOUTS}
    figures: dict[str, dict] = {}
    refusals = ep_launch_refusals(model, work, port + 6, experts)
    # The server's own refusal, started without `launch` (which refuses first): the map `launch` wrote
    # for the balanced server, MOEPLACE_DISPATCH set by hand. NGRAM refuses DP attention itself, so
    # this one runs without speculative decoding.
    dp = Server("ep2-dp-attention", port + 5, server_argv(
        model, port + 5, ep + spares + ["--enable-dp-attention", "--dp", "2", "--init-expert-location",
                                        str(work / "balanced.sglang.json")],
        speculative=False), {"MOEPLACE_DISPATCH": "balanced"}, work)
    try:
        for wave in (("deepseek", "stepaware"), ("balanced", "tp-moe"), ("cost",)):   # two at once fit in memory
            for name in wave:
                servers[name].start()
                time.sleep(2.0)
            for name in wave:
                servers[name].wait_ready(startup)
            for name in wave:   # one at a time: the timings see an idle GPU pair
                figures[name] = {"ready_s": round(servers[name].ready_s, 1),
                                 **moe_us_per_pass(servers[name], layers, work, rng)}
                servers[name].generate_all(prompts(rng, 8, 64, 256), [128] * 8)
            for name in wave:
                figures[name]["stop"] = servers[name].stop(signal.SIGTERM)
        dp.start()   # balanced dispatch with DP attention: each rank would route its own tokens
        dp_rc = dp.wait_exit(startup)
    finally:
        for srv in [*servers.values(), dp]:
            srv.kill()

    from moeplace.files.placement import load_placement
    from moeplace.trace.store import TraceReader

    problems = []
    for name in ("deepseek", "stepaware", "balanced", "cost"):
        folder = work / f"traces-ep2-{name}"
        expected = np.asarray(load_placement(work / f"{name}.json").phy2log)
        maps = {tuple(h.ranks): np.asarray(h.physical_to_logical_map) for h in TraceReader(folder).headers}
        figures[name]["map_equals_file_on_ranks"] = sorted(r for r, m in maps.items() if np.array_equal(m, expected))
        if len(figures[name]["map_equals_file_on_ranks"]) != 2:
            problems.append(f"{name}: SGLang's map differs from the file on some rank")
        choices = rank_choices(folder)
        agree = len(choices) == 2 and choices[0] == choices[1]
        figures[name]["ranks_chose_the_same_slots_every_step"] = agree
        figures[name]["passes_compared"] = min(len(v) for v in choices.values()) if choices else 0
        if not agree:
            problems.append(f"{name}: the two ranks' recorded slot choices differ")
    if not figures["balanced"].get("balanced_dispatch_kernels"):
        problems.append("balanced: no balanced_dispatch_kernel in the decode-stage profile (graph replays)")
    cost_log = servers["cost"].log()
    figures["cost"]["announced"] = [line.strip()[:200] for line in cost_log.splitlines()
                                    if "MOEPLACE_DISPATCH=cost" in line or "cost dispatch on" in line][:3]
    if not any(f"MOEPLACE_DISPATCH=cost MOEPLACE_DISPATCH_{name}=" in cost_log for name in ("Q", "WEIGHTS")):
        problems.append("cost: launch did not start the server with MOEPLACE_DISPATCH=cost and its weights")
    if not figures["cost"].get("cost_dispatch_kernels"):
        problems.append("cost: no rule-by-cost dispatch kernel in the decode-stage profile (graph replays)")
    checks.append(Check("ep_launch_and_dispatch", not problems, "; ".join(problems) or
                        "placements loaded as written on both ranks; both ranks chose the same slots on every "
                        "recorded pass; the dispatch kernels (balanced, by cost) ran in the replayed graphs", figures))
    predicted = predicted_moe_us(work, model)
    order_measured = sorted(EP_LAYOUTS, key=lambda n: figures[n].get("moe_us_per_pass_slowest_rank") or 1e18)
    checks.append(Check("ep_throughput", all(figures[n].get("tokens_per_s") for n in EP_LAYOUTS),
                        f"fastest MoE per pass, measured: {' < '.join(order_measured)}",
                        {"measured": {n: {k: figures[n].get(k) for k in ("tokens_per_s",
                                                                        "moe_us_per_pass_slowest_rank")}
                                      for n in EP_LAYOUTS}, "predicted_moe_us_per_step": predicted}))
    lines = {k: (r.returncode, r.stderr.strip()[-300:]) for k, r in refusals.items()}
    ok = all(rc == 2 for rc, _ in lines.values()) and dp_rc not in (None, 0) and \
        "DP attention" in dp.log()
    checks.append(Check("ep_refusals", ok, "; ".join(f"{k}: exit {rc}" for k, (rc, _) in lines.items())
                        + f"; DP attention with balanced dispatch: exit {dp_rc}",
                        {"launch": lines, "dp_attention_log": tail(dp.log(), 5)}))
    return checks



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".sgl-device" / "models" / "dsv3-384e-small",
                    help="a DeepSeek-V3-architecture model folder (config.json; weights are dummy)")
    ap.add_argument("--out", type=Path, default=Path("result.json"), help="where to write the JSON result")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temp folder)")
    ap.add_argument("--port", type=int, default=31000, help="first of the 11 ports the servers take")
    ap.add_argument("--startup-timeout", type=float, default=360.0, help="seconds a server may take to start")
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                    help="1: every feature on one GPU; 2: expert parallelism on two (--model: the Kimi-expert-shaped "
                         "model, .sgl-device/models/kimi-k2-shaped-2moe)")
    ap.add_argument("--only", choices=("replace",), default=None,
                    help="run one check alone: replace (online re-placement, two servers)")
    ap.add_argument("--replace-window", type=int, default=REPLACE_WINDOW,
                    help="passes the replace server's window holds (the timed decision runs on them)")
    ap.add_argument("--head", default=None,
                    help="the project's commit, where the copy has no .git (default: git rev-parse)")
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"error: {args.model}: no config.json (build .sgl-device with ../shared/device-sglang/build.sh)",
              file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="moeplace-live-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        model, folder = args.model.resolve(), work.resolve()
        if args.only == "replace":
            checks = run_replace(model, folder, args.port, args.startup_timeout, args.replace_window)
        else:
            checks = (run if args.gpus == 1 else run_two_gpus)(model, folder, args.port, args.startup_timeout)
    except Exception as e:  # noqa: BLE001 (the result says what broke)
        checks = [Check("setup", False, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()[-3000:]})]
    result = {**versions(args.head), "model": str(args.model), "seconds": round(time.monotonic() - started, 1),
              "checks": [asdict(c) for c in checks]}
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, args.out)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.name:{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail[:300]}")
    return 0 if checks and all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
