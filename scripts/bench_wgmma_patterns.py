"""Time the tensor-core products of one verify tile alone, in the splits the Hopper kernel could use.

Question: How many cycles do a 64-token tile's products (S^T = K Q^T over 576 values, O^T += V^T P^T
    over 512) take for 72 query rows when nothing else runs, as the sm90 kernel splits them between
    its two consumer warpgroups and as other splits would?
Baseline: the kernel's own split (QK at 40 and 32 rows, each warpgroup P.V over all 8 latent blocks),
    timed in the same process.
Output: a markdown table on stdout: cycles per tile (the slowest warpgroup, mean over the CTAs), the
    ratio to the baseline, and the shared-memory operand bytes the split reads per tile. A second table
    asks whether a warpgroup's own work (a dependent FMA chain, standing in for the softmax) runs while
    its QK products are in flight, with one warpgroup and with two sharing the tensor pipe. A third
    times QK issued as the kernel's loop does, a 64-value block at a time with a wgmma fence, an
    mbarrier wait (on a completed barrier) and a proxy fence before each block, against 36 products
    back to back. A fourth times whole tiles of the consumer loop in three schedules, the softmax stood
    in for by a dependent FMA chain that reads the scores and P^T stored as the kernel stores it: the
    kernel's, in turns at the tensor pipe, and the tiles shared out between the warpgroups (each QK and
    softmax of every other tile for all 72 rows, P.V of every tile for half the values, P^T handed over
    on mbarriers; in two loop orders, the second the one an 18-block ring allows); each against the
    kernel's at the same stand-in.

Every program runs on one CTA per SM with its operands in shared memory (wgmma m64nNk16, bf16, fp32
accumulators, the kernel's 128-byte swizzled layouts); in the first three tables its warpgroups run
free (no barriers between them): what a tile costs the tensor pipe, without the softmax, the waits
and the loads that the kernel adds (docs/verify-kernel.md, "Where the time goes").

    python3 scripts/bench_wgmma_patterns.py          # needs nvcc and an sm_90 GPU
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from moeplace_kernels import mla_verify_sm90

# (name, per-warpgroup programs); a program is phases (N rows, accumulators, k steps, kind: 0 QK, 1 P.V, below):
# QK is 36 k steps of 16 values on one accumulator, P.V 4 k steps (64 tokens) per 64-value block.
QK = lambda n, ks=36: (n, 1, ks, 0)  # noqa: E731
PV = lambda n, blocks: (n, blocks, 4, 1)  # noqa: E731
FMA = lambda steps: (0, steps, 0, -1)  # noqa: E731  # a dependent FMA chain, under the previous phase's products
# QK in the kernel's block loop: a wgmma fence per block, + an mbarrier wait (wait=1), + a proxy fence (fence=1)
QKB = lambda n, wait, fence: (n, 1, 36, 2 + wait + 2 * fence)  # noqa: E731
PATTERNS = [
    ("kernel: QK 40 | 32 rows, P.V 8 blocks each", [[QK(40), PV(40, 8)], [QK(32), PV(32, 8)]]),
    ("QK alone, 40 | 32 rows", [[QK(40)], [QK(32)]]),
    ("P.V alone, 8 blocks at 40 | 32 rows", [[PV(40, 8)], [PV(32, 8)]]),
    ("QK own rows 40 | 32, P.V 4 blocks at 72 rows each", [[QK(40), PV(72, 4)], [QK(32), PV(72, 4)]]),
    ("QK 72 rows by one, P.V 4 blocks at 72 rows each", [[QK(72), PV(72, 4)], [PV(72, 4)]]),
    ("QK 72 rows, half the k steps each, P.V 4 blocks at 72", [[QK(72, 18), PV(72, 4)], [QK(72, 18), PV(72, 4)]]),
    ("three warpgroups of 24 rows", [[QK(24), PV(24, 8)]] * 3),
]
BESIDE = [(f"{what}, {w} warpgroup{'s' * (w > 1)}", [prog] * w) for w in (1, 2) for what, prog in [
    ("QK 40 alone", [QK(40)]), ("FMA chain of 200 alone", [FMA(200)]), ("FMA chain of 800 alone", [FMA(800)]),
    ("QK 40, FMA chain of 200 under it", [QK(40), FMA(200)]), ("QK 40, FMA chain of 800 under it", [QK(40), FMA(800)])]]
STRUCTURE = [(what, [[prog(40)], [prog(32)]]) for what, prog in [
    ("36 products back to back", QK), ("9 blocks, a wgmma fence each", lambda n: QKB(n, 0, 0)),
    ("9 blocks, a wgmma fence and a barrier wait each", lambda n: QKB(n, 1, 0)),
    ("9 blocks, a wgmma fence and a proxy fence each", lambda n: QKB(n, 0, 1)),
    ("9 blocks, all three each (the kernel's loop)", lambda n: QKB(n, 1, 1))]]
# Whole tiles of the consumer loop without loads, the softmax stood in for by a dependent chain of C FMAs per 8 rows
# (SCHEDULE_SOURCE): (name, kernel, tiles a warpgroup's repetition covers, C).
SCHEDULE_KINDS = [
    ("the kernel's: own rows 40 | 32; QK, softmax, P.V over 8 blocks", "sched_own<{c}, false>", 1),
    ("in turns: own rows; P.V(t - 1) and QK(t) in a warpgroup's turn", "sched_own<{c}, true>", 1),
    ("tiles shared: QK and softmax of every other tile at 72 rows; P.V over 4 blocks", "sched_shared<{c}, false>", 2),
    ("tiles shared, in the order an 18-block ring allows", "sched_shared<{c}, true>", 2)]
SCHEDULES = [(what, kernel.format(c=c), tiles, c) for c in (0, 40, 80) for what, kernel, tiles in SCHEDULE_KINDS]

PRELUDE = r"""
#include <cstdio>
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
template <int N> struct Wgmma;
__device__ __forceinline__ uint64_t desc(uint32_t addr) {  // 128-byte swizzle, 8-row groups 1024 B apart
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
template <int K> __device__ __forceinline__ void pin(float (&r)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
constexpr int A_OFF = 0, Q_OFF = 9 * 8192, P_OFF = Q_OFF + 9 * 72 * 128, BAR_OFF = P_OFF + 72 * 128;
constexpr int SMEM = BAR_OFF + 16 + 1024;  // + an mbarrier, + the 1024-byte alignment
// k steps k0 .. k0 + KS - 1 (QK's block b: k0 = 4 b); P.V reads V blocks v0 + 1 .. v0 + NACC and P^T at p_off
template <int N, int NACC, int KS, int TA>
__device__ __forceinline__ void phase(float (&acc)[NACC][N / 2], uint32_t base, int row0, int k0 = 0, int v0 = 0,
                                      int p_off = P_OFF) {
  asm volatile("" : "+r"(base));  // descriptors made in the loop, as the kernel's: hoisted, they spill the accumulators
#pragma unroll
  for (int i = 0; i < NACC; ++i)
#pragma unroll
    for (int ks = k0; ks < k0 + KS; ++ks) {
      const uint32_t a = TA ? base + A_OFF + (1 + v0 + i) * 8192 + ks * 2048 : base + A_OFF + (ks / 4) * 8192 + (ks % 4) * 32;
      const uint32_t b = TA ? base + p_off + row0 * 128 + ks * 32 : base + Q_OFF + (ks / 4) * 9216 + row0 * 128 + (ks % 4) * 32;
      Wgmma<N>::template mma<TA>(acc[i], desc(a), desc(b));
    }
}
template <int N, int FLAGS>
__device__ __forceinline__ void qk_blocks(float (&acc)[1][N / 2], uint32_t base, int row0, uint32_t bar) {
  // as the kernel's loop: a block's barrier, fences, then its 4 products (unrolled: rolled inside a warpgroup's
  // branch, ptxas serialises these wgmma, C7520, which it does not in the kernel)
#pragma unroll
  for (int blk = 0; blk < 9; ++blk) {
    if (FLAGS & 1) mbar_wait(bar, 0);
    if (FLAGS & 2) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    phase<N, 1, 4, 0>(acc, base, row0, 4 * blk);
  }
}
__device__ __forceinline__ void fill(uint8_t* smem) {
  for (int i = threadIdx.x; i < (SMEM - 1024) / 2; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    reinterpret_cast<uint16_t*>(smem)[i] = 0x3c00 ^ (h & 0x80ff);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
}
__device__ __forceinline__ uint32_t operands(uint8_t* raw) {  // the operands, 1024-byte aligned and filled: their address
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  fill(smem);
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}
"""

SCHEDULE_SOURCE = r"""
constexpr int P2_OFF = BAR_OFF + 1024;      // a second P^T buffer (72 rows x 128 B)
constexpr int HANDOFF = P2_OFF + 72 * 128;  // the shared schedule's mbarriers: P^T of tile t written, by t & 1
constexpr int SCHED_SMEM = HANDOFF + 16 + 1024;
#define FENCE() asm volatile("wgmma.fence.sync.aligned;" ::: "memory")
#define COMMIT() asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory")
#define WAIT(n) asm volatile("wgmma.wait_group.sync.aligned " #n ";" ::: "memory")
__device__ __forceinline__ uint32_t trans_addr(uint32_t rows_base) {  // the kernel's stmatrix address of a lane
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, k = lane & 7, h = (lane >> 3) & 1;
  return rows_base + k * 128 + ((((2 * warp + h) ^ k) & 7) << 4);
}
// The softmax's stand-in: a dependent FMA chain of C steps per 8 rows through the scores, P^T stored by stmatrix
// as the kernel does, a proxy fence and the warpgroup's barrier (the kernel's barrier C).
template <int N, int C>
__device__ __forceinline__ void softmax(float (&s)[N / 2], uint32_t pt, int bar_id) {
  float x = 0.f;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int k = 0; k < C; ++k) x = fmaf(x, 0.999f, s[4 * j + (k & 3)]);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(s[4 * j] + x, s[4 * j + 1]);
    __nv_bfloat162 hi = __floats2bfloat162_rn(s[4 * j + 2], s[4 * j + 3]);
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(pt + j * 1024),
                 "r"(*reinterpret_cast<uint32_t*>(&lo)), "r"(*reinterpret_cast<uint32_t*>(&hi)) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
}
// Each warpgroup its own rows (40 | 32), as the kernel: QK, softmax, P.V over the 8 latent blocks; or (TURNS) in
// turns at the tensor pipe, FlashAttention-3's ping-pong: P.V(t - 1) and QK(t) issued in the warpgroup's turn (named
// barriers 3 + w), the turn handed over, then softmax(t) while the other's products run.
template <int C, bool TURNS>
__global__ void __launch_bounds__(256, 1) sched_own(int reps, long long* cyc, float* sink) {
  extern __shared__ __align__(1024) uint8_t raw[];
  const uint32_t base = operands(raw);
  const int wg = threadIdx.x / 128;
  auto run = [&](auto n_tag) {
    constexpr int N = decltype(n_tag)::value;
    const int row0 = wg ? 40 : 0;
    float s[1][N / 2] = {}, o[8][N / 2] = {};
    const uint32_t pt = trans_addr(base + P_OFF + row0 * 128);
    if (TURNS && wg == 1) asm volatile("bar.arrive 3, 256;" ::: "memory");  // warpgroup 0 takes the first turn
    const long long t0 = clock64();
    for (int r = 0; r < reps; ++r) {
      pin(s[0]);
      for (auto& v : o) pin(v);
      if (TURNS) {
        asm volatile("bar.sync %0, 256;" ::"r"(3 + wg) : "memory");
        FENCE();
        phase<N, 8, 4, 1>(o, base, row0);
        phase<N, 1, 36, 0>(s, base, row0);
        COMMIT();
        asm volatile("bar.arrive %0, 256;" ::"r"(4 - wg) : "memory");
        WAIT(0);
        pin(s[0]);
        for (auto& v : o) pin(v);
        softmax<N, C>(s[0], pt, 1 + wg);
      } else {
        FENCE();
        phase<N, 1, 36, 0>(s, base, row0);
        COMMIT();
        WAIT(0);
        pin(s[0]);
        softmax<N, C>(s[0], pt, 1 + wg);
        FENCE();
        phase<N, 8, 4, 1>(o, base, row0);
        COMMIT();
        WAIT(0);
      }
    }
    for (auto& v : o) pin(v);
    const long long t1 = clock64();
    if (TURNS && wg == 0) asm volatile("bar.sync 3, 256;" ::: "memory");  // the last hand-over: no arrival left
    if ((threadIdx.x & 127) == 0) cyc[blockIdx.x * 4 + wg] = t1 - t0;
    float acc = s[0][0];
    for (int d = 0; d < 8; ++d) acc += o[d][0] + o[d][N / 2 - 1];
    if (acc == 12345.f) sink[threadIdx.x] = 1.f;
  };
  if (wg == 0) run(std::integral_constant<int, 40>{});
  else run(std::integral_constant<int, 32>{});
}
// Tiles shared out: warpgroup w computes QK (N = 72) and the softmax of tiles t = w, w + 2, ..., and P.V of every
// tile over its 4 latent blocks (4 w + 1 .. 4 w + 4) at N = 72. Tile t's P^T (buffer t & 1) is handed over on an
// mbarrier; softmax(t) waits for softmax(t - 1), as the reference maxima would. No branch among the products: at
// t = 0 a spare P.V(t - 1), and (!IN_ORDER) at the end a spare QK.
// !IN_ORDER: after softmax(t), P.V(t - 1), P.V(t) and QK(t + 2) issued together; the other warpgroup waited for its
//   P.V(t - 2) before softmax(t - 1), so buffer t & 1 is free. (A ring would have to hold tiles t to t + 2.)
// IN_ORDER, the loop an 18-block ring allows: QK(t); P.V(t - 1) as soon as P^T(t - 1) is handed over; softmax(t)
//   while P.V(t - 1) runs; P.V(t - 1) waited for before P^T(t) is handed over; P.V(t) issued and waited for (its
//   half of tile t freed before QK(t + 2)). QK(t) is issued in the iteration that reads its scores: read one
//   iteration later, with a group in flight, ptxas issues every wgmma one at a time (C7514).
template <int C, bool IN_ORDER>
__global__ void __launch_bounds__(256, 1) sched_shared(int reps, long long* cyc, float* sink) {
  extern __shared__ __align__(1024) uint8_t raw[];
  const uint32_t base = operands(raw);
  if (threadIdx.x < 2) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(base + HANDOFF + 8 * threadIdx.x));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  float s[1][36] = {}, o[4][36] = {};
  auto p_off = [](int t) { return (t & 1) ? P2_OFF : P_OFF; };
  auto hand_over = [&](int t) {
    if ((threadIdx.x & 127) == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(base + HANDOFF + 8 * (t & 1)) : "memory");
  };
  auto wait_for_handoff = [&](int t) {  // of P^T(t - 1)
    if (t >= 1) mbar_wait(base + HANDOFF + 8 * ((t - 1) & 1), ((t - 1) >> 1) & 1);
  };
  pin(s[0]);
  for (auto& v : o) pin(v);
  const long long t0 = clock64();
  int t = wg;
  if (!IN_ORDER) {
    FENCE();
    phase<72, 1, 36, 0>(s, base, 0);
    COMMIT();
  }
  for (int k = 0; k < reps; ++k, t += 2) {
    if (IN_ORDER) {
      FENCE();
      phase<72, 1, 36, 0>(s, base, 0);
      COMMIT();
      wait_for_handoff(t);
      FENCE();
      phase<72, 4, 4, 1>(o, base, 0, 0, 4 * wg, p_off(t + 1));
      COMMIT();
      WAIT(1);
      pin(s[0]);
      softmax<72, C>(s[0], trans_addr(base + p_off(t)), 1 + wg);
      WAIT(0);
      for (auto& v : o) pin(v);
      hand_over(t);
      FENCE();
      phase<72, 4, 4, 1>(o, base, 0, 0, 4 * wg, p_off(t));
      COMMIT();
      WAIT(0);
      for (auto& v : o) pin(v);
    } else {
      WAIT(0);
      pin(s[0]);
      for (auto& v : o) pin(v);
      wait_for_handoff(t);
      softmax<72, C>(s[0], trans_addr(base + p_off(t)), 1 + wg);
      hand_over(t);
      FENCE();
      phase<72, 4, 4, 1>(o, base, 0, 0, 4 * wg, p_off(t + 1));
      phase<72, 4, 4, 1>(o, base, 0, 0, 4 * wg, p_off(t));
      phase<72, 1, 36, 0>(s, base, 0);
      COMMIT();
    }
  }
  WAIT(0);
  for (auto& v : o) pin(v);
  const long long t1 = clock64();
  if ((threadIdx.x & 127) == 0) cyc[blockIdx.x * 4 + wg] = t1 - t0;
  float acc = s[0][0];
  for (int d = 0; d < 4; ++d) acc += o[d][0] + o[d][35];
  if (acc == 12345.f) sink[threadIdx.x] = 1.f;
}
"""

WGMMA = r"""template <> struct Wgmma<{n}> {{
  template <int TA> static __device__ __forceinline__ void mma(float (&d)[{r}], uint64_t a, uint64_t b) {{
    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{r}, %{r1}, 1, 1, 1, %{r2}, 0;\n"
                 : {outs} : "l"(a), "l"(b), "n"(TA));
  }}
}};
"""


def wgmma_specialisation(n: int) -> str:
    """Wgmma<n>: the PTX instruction spells its n / 2 accumulator registers out one by one."""
    r = n // 2
    return WGMMA.format(n=n, r=r, r1=r + 1, r2=r + 2, regs=",".join(f"%{i}" for i in range(r)),
                        outs=", ".join(f'"+f"(d[{i}])' for i in range(r)))


def program_source(k: int, wgs: list) -> str:
    """A kernel running one program per warpgroup `reps` times; each warpgroup's cycles to cyc."""
    branches = []
    for w, phases in enumerate(wgs):
        mma = [(i, ph) for i, ph in enumerate(phases) if ph[3] >= 0]
        decl = "".join(f"    float a{i}[{acc}][{n // 2}] = {{}};\n" for i, (n, acc, _, _) in mma)
        decl += "    float x = threadIdx.x * 1e-3f;\n"
        pins = "".join(f"      for (auto& v : a{i}) pin(v);\n" for i, _ in mma)
        body = pins
        for i, (n, acc, ks, kind) in enumerate(phases):
            if kind < 0:  # the chain runs while the previous phase's products are in flight, then they are waited for
                body += (f"      for (int i = 0; i < {acc}; ++i)\n"
                         '        asm volatile("fma.rn.f32 %0, %0, 0f3F800347, 0f33D6BF95;" : "+f"(x));\n')
            else:
                row0 = 40 * w if 40 * w + n <= 72 else 0  # the query rows' buffer holds 72
                if kind < 2:  # kind is phase's TA: P.V reads V^T transposed
                    body += ('      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");\n'
                             f"      phase<{n}, {acc}, {ks}, {kind}>(a{i}, base, {row0});\n")
                else:  # its own fences, block by block
                    body += f"      qk_blocks<{n}, {kind - 2}>(a{i}, base, {row0}, bar);\n"
                body += '      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");\n'
            chain_next = i + 1 < len(phases) and phases[i + 1][3] < 0
            if (kind >= 0 and not chain_next) or (kind < 0 and i > 0):  # products are waited for after any chain
                body += '      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");\n' + pins
        # every accumulator feeds the sink: ptxas drops the products of one whose values are never read
        sink = " + ".join([f"a{i}[{b}][0]" for i, (_, acc, _, _) in mma for b in range(acc)] + ["x"])
        branches.append(f"  if (wg == {w}) {{\n{decl}    const long long t0 = clock64();\n"
                        f"    for (int r = 0; r < reps; ++r) {{\n{body}    }}\n"
                        f"    const long long t1 = clock64();\n"
                        f"    if ((threadIdx.x & 127) == 0) cyc[blockIdx.x * 4 + wg] = t1 - t0;\n"
                        f"    if ({sink} == 12345.f) sink[threadIdx.x] = 1.f;\n  }}\n")
    return (f"__global__ void __launch_bounds__({128 * len(wgs)}, 1) k{k}(int reps, long long* cyc, float* sink) {{\n"
            "  extern __shared__ __align__(1024) uint8_t raw[];\n"
            "  const uint32_t base = operands(raw);\n"
            "  const uint32_t bar = base + BAR_OFF;\n"
            "  if (threadIdx.x == 0) {  // an mbarrier whose phase 0 has completed: its waits return at once\n"
            '    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));\n'
            '    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");\n'
            "  }\n  __syncthreads();\n"
            "  const int wg = threadIdx.x / 128;\n" + "".join(branches) + "}\n")


MAIN = r"""
template <class K> double run(K kernel, int wgs, int sms, int smem = SMEM, int tiles = 1) {  // cycles per tile
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  long long* cyc; float* sink;
  cudaMalloc(&cyc, sms * 4 * sizeof(long long)); cudaMalloc(&sink, 4096);
  const int reps = 400;
  kernel<<<sms, 128 * wgs, smem>>>(10, cyc, sink);
  kernel<<<sms, 128 * wgs, smem>>>(reps, cyc, sink);
  if (cudaDeviceSynchronize() != cudaSuccess) { std::printf("error %s\n", cudaGetErrorString(cudaGetLastError())); return -1; }
  long long h[4 * 1024];
  cudaMemcpy(h, cyc, sms * 4 * sizeof(long long), cudaMemcpyDeviceToHost);
  double worst = 0;
  for (int w = 0; w < wgs; ++w) {
    double s = 0;
    for (int b = 0; b < sms; ++b) s += h[b * 4 + w];
    if (s / sms / reps / tiles > worst) worst = s / sms / reps / tiles;
  }
  cudaFree(cyc); cudaFree(sink);
  return worst;
}
int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
"""


def operand_bytes(wgs: list) -> int:
    """Shared-memory bytes a tile's products read: 2 KB of A and N x 32 B of B per wgmma."""
    return sum(acc * ks * (2048 + n * 32) for phases in wgs for n, acc, ks, _ in phases)


PROGRAMS = PATTERNS + BESIDE + STRUCTURE  # one generated binary times these three tables and the schedules


def parse_cycles(stdout: str, returncode: int) -> list[float] | None:
    """One positive cycle count per program and schedule from the binary's output, else None (a failed run)."""
    try:
        cycles = [float(v) for v in stdout.split()] if returncode == 0 else []
    except ValueError:  # the program printed a CUDA error
        return None
    return cycles if len(cycles) == len(PROGRAMS) + len(SCHEDULES) and min(cycles) > 0 else None


def table(cycles: list[float]) -> list[str]:
    """The markdown tables: a row per pattern (its name's '|' escaped), cycles against the first pattern's; then
    the cycles of the programs of a warpgroup's work beside its products, of QK issued block by block, and of
    whole tiles in each schedule against the kernel's at the same softmax stand-in."""
    rows = ["| products of one 64-token tile, 72 rows | warpgroups | cycles | ratio to the kernel's | operand KB |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for (name, wgs), c in zip(PATTERNS, cycles):
        cell = name.replace("|", r"\|")
        rows.append(f"| {cell} | {len(wgs)} | {c:.0f} | {c / cycles[0]:.2f} | {operand_bytes(wgs) / 1024:.0f} |")
    rows += ["", "| a warpgroup's own work beside its products | cycles |", "| --- | ---: |"]
    rows += [f"| {name} | {c:.0f} |" for (name, _), c in zip(BESIDE, cycles[len(PATTERNS):])]
    rows += ["", "| QK of a tile, 40 \\| 32 rows, as issued | cycles |", "| --- | ---: |"]
    rows += [f"| {name} | {c:.0f} |" for (name, _), c in zip(STRUCTURE, cycles[len(PATTERNS) + len(BESIDE):])]
    rows += ["", "| schedule of a tile, no loads | FMAs per 8 rows | cycles per tile | ratio to the kernel's |",
             "| --- | ---: | ---: | ---: |"]
    timed = cycles[len(PROGRAMS):]
    for k, ((name, _, _, c), cyc) in enumerate(zip(SCHEDULES, timed)):
        kernel_cyc = timed[k - k % len(SCHEDULE_KINDS)]  # the kernel's schedule at the same stand-in
        cell = name.replace("|", r"\|")
        rows.append(f"| {cell} | {c} | {cyc:.0f} | {cyc / kernel_cyc:.2f} |")
    return rows


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    nvcc = mla_verify_sm90.find_nvcc()
    if nvcc is None:
        print("bench_wgmma_patterns: no nvcc found (set CUDA_HOME)", file=sys.stderr)
        return 2
    sizes = sorted({n for _, wgs in PROGRAMS for phases in wgs for n, *_ in phases if n})
    src = PRELUDE + "".join(wgmma_specialisation(n) for n in sizes)
    src += "".join(program_source(k, wgs) for k, (_, wgs) in enumerate(PROGRAMS)) + SCHEDULE_SOURCE
    src += MAIN + "".join(f'  std::printf("%.1f\\n", run(k{k}, {len(wgs)}, sms));\n'
                          for k, (_, wgs) in enumerate(PROGRAMS))
    src += "".join(f'  std::printf("%.1f\\n", run({kernel}, 2, sms, SCHED_SMEM, {tiles}));\n'
                   for _, kernel, tiles, _ in SCHEDULES) + "  return 0;\n}\n"
    with tempfile.TemporaryDirectory() as tmp:
        cu, exe = Path(tmp) / "patterns.cu", Path(tmp) / "patterns"
        cu.write_text(src)
        res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(exe),
                              str(cu)], capture_output=True, text=True)
        if res.returncode != 0:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[-300:])
            print(f"bench_wgmma_patterns: nvcc failed: {first}", file=sys.stderr)
            return 2
        run = subprocess.run([str(exe)], capture_output=True, text=True)
        cycles = parse_cycles(run.stdout, run.returncode)
        if cycles is None:
            print(f"bench_wgmma_patterns: the run failed ({(run.stdout + run.stderr).strip()[:200]}); "
                  "needs an sm_90 GPU", file=sys.stderr)
            return 2
    print("\n".join(table(cycles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
