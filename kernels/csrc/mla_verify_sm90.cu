// MLA tree-verify attention for Hopper (sm_90a): split-KV kernel with the KV tokens on the MMA's
// M dimension, and a combine kernel that adds the draft-token (tree) part and merges the splits.
//
// Dimension letters as in mla_verify.py: B requests, D draft tokens of a request, H heads,
// N prefix tokens of a request, R = D * H query rows of a request (row r = draft r / H, head
// r % H), C = 576 values per KV token (V = the first 512).
//
// Split kernel, one CTA per (KV range, row block); the ranges balance the batch's 64-token
// tiles over the grid and may span requests (each piece is a "segment" with its own partial).
// The CTA's 384 threads are three warpgroups:
//   WG2, producer: gathers KV rows by slot id with cp.async into a ring of 8 KB blocks
//        (64 tokens x 64 values, 128-byte swizzled), rope block first, then 8 latent blocks.
//        Completion reaches the consumers through mbarriers (cp.async.mbarrier.arrive.noinc).
//        A producer warp's 16 tokens of a tile whose slot ids are consecutive (in every full tile of
//        a pool in 64-token pages, in runs of a page-1 pool) are copied by TMA instead: one 2D box
//        per block from one lane, no gather.
//   WG0, WG1, consumers: each owns a slice of the row block's query rows (N0 + N1 <= 72), loads
//        them itself, and runs the whole flash-attention loop for them, transposed so no row is padded:
//          S^T [64 tokens, N] = K [64, 576] Q^T        (wgmma m64nNk16, both from shared memory)
//          O^T [512, N]      += V^T [512, 64] P^T [64, N]   (V^T read from the same K blocks)
//        The softmax runs over the token (M) dimension: a shuffle within each warp and a shared
//        max across the warpgroup's 4 warps.
// The prefix needs no mask (every draft row sees every prefix token), so the loop has none; the
// D x D tree part is computed by the combine kernel and merged by log-sum-exp.
//
// Combine kernel, one CTA per (query row, slice of the 512 output values): the tree scores of
// the row (q . k_ext, masked), then out = sum_s w_s * O_s + sum_j w_j * v_ext_j over the row's
// splits s and visible draft tokens j. Launched as a programmatic dependent of the split kernel
// unless Sm90Config says otherwise (it then computes the tree scores while the last split CTAs run).

#include <cuda.h>  // CUtensorMap (the encoder is reached through the runtime: no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace mlav {

constexpr int KV_DIM = 576;
constexpr int V_DIM = 512;
constexpr int TILE = 64;                 // KV tokens per tile: the wgmma M dimension
constexpr int BLOCKS_PER_TILE = 9;       // 64-value column blocks per tile (rope + 8 latent)
constexpr int BLOCK_BYTES = TILE * 128;  // one block: 64 rows of 128 bytes
constexpr int RUN_TOKENS = 16;           // tokens of a tile a producer warp copies (by TMA when their slots run on)
constexpr int THREADS = 384;
constexpr int SMEM_PER_BLOCK = 232448;   // sm_90: 227 KB of dynamic shared memory per CTA
constexpr int MAX_COMBINE_SPLITS = 1024;
constexpr int MAX_COMBINE_DRAFTS = 64;
// What a CTA's second segment (its query rows and epilogue) costs, in 64-token tiles of one CTA's loop.
constexpr int BOUNDARY_TILES = 3;
// Registers after setmaxnreg: the first consumer warpgroup holds the most rows (N0 >= N1), so it gets
// more: 232 each spilled 248 bytes in the 40-row warpgroup's loop, 240 + 224 spill 40 (4 since P^T is
// written by stmatrix). The producer's TMA path needs 48 (at 40 it spilled 20 bytes, and short calls
// took 0.6-1 µs more); the 32-row warpgroup fits in 216. 240 + 216 + 48: nothing spills.
constexpr int CONSUMER0_REGS = 240;
constexpr int CONSUMER1_REGS = 216;
constexpr int PRODUCER_REGS = 48;
// A column's reference maximum moves once its running maximum passes it by this much (log2 units):
// exponentials up to 2^RESCALE_GAP stay far inside bf16's and fp32's range.
constexpr float RESCALE_GAP = 8.f;
// setmaxnreg only moves registers within the CTA (launched with 384 x 168): what the two
// consumer warpgroups take must not exceed what the producer gives back, or they wait forever.
static_assert(CONSUMER0_REGS + CONSUMER1_REGS - 2 * 168 <= 168 - PRODUCER_REGS, "register budget");

struct SplitParams {
  const __nv_bfloat16* q;     // [T, H, 576]
  const __nv_bfloat16* kv;    // [slots, 1, 576]
  const void* kv_indices;     // [>= kv_indptr[B]] int32 or int64
  const void* kv_indptr;      // [B + 1]
  const void* qo_indptr;      // [B + 1]
  __nv_bfloat16* o_part;      // [slots_ws, rows_pad, 512] normalised partial outputs
  float* l_part;              // [slots_ws, rows_pad] log2-sum-exp of each partial row
  long long q_stride_t, q_stride_h, kv_stride;  // in elements
  int idx64, kvp64, qop64;    // 1 where the index tensor is int64
  int batch, heads;
  int row_blocks, rows_pad;   // rows_pad = row_blocks * (N0 + N1)
  int grid_x;                 // CTAs along the KV tiles (per row block)
  int min_tiles;              // fewest tiles per CTA
  int evict_first;            // KV loads may leave L2 first (one row block: nobody re-reads)
  float scale_log2;           // softmax scale * log2(e)
  int short_blocks;           // row blocks of SHORT_ROWS for a short batch (0: never; see Layout)
  int tma_runs;               // copy runs of RUN_TOKENS consecutive slot ids by TMA (1) or always gather (0)
  long long kv_rows;          // slots in the pool (the TMA map's extent)
};

// What the split kernel is launched with: the KV pool's TMA map (encoded by the host per call)
// beside the parameters.
struct SplitArgs {
  CUtensorMap kv_map;  // [kv_rows, 576] bf16, boxes of 64 values x RUN_TOKENS slots, 128-byte swizzle
  SplitParams p;
};

struct CombineParams {
  const __nv_bfloat16* q;      // [T, H, 576]
  const __nv_bfloat16* k_ext;  // [T, 1, 576]
  const __nv_bfloat16* v_ext;  // [T, 1, >= 512]
  const uint8_t* mask;         // tree mask (layout by mask_mode), unused when causal
  const void* mask_indptr;     // [B + 1] or null
  const void* kv_indptr;
  const void* qo_indptr;
  const __nv_bfloat16* o_part;
  const float* l_part;
  __nv_bfloat16* out;          // [T, H, 512]
  float* lse;                  // [T, H] natural log, or null
  long long q_stride_t, q_stride_h, ke_stride, ve_stride;
  long long out_stride_t, out_stride_h, lse_stride_t, lse_stride_h;
  int mip64, kvp64, qop64;
  int mask_mode;               // 0 causal, 1 D x D per request (qlen_only), 2 SGLang FULL_MASK
  int batch, heads, d_max, rows_pad, grid_x, min_tiles;
  float scale_log2;
  int slices;                  // CTAs per query row, each for 512 / slices values: 1, 2 or 4
  int short_blocks, grid_size; // the split kernel's short layout (0: never) and its CTAs
};

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// The mbarrier receives one arrival once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// The mbarrier expects `bytes` more from asynchronous copies in its current phase.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// `count` arrivals at once (the lane that issued its warp's TMA copy of a block arrives for all 32).
__device__ __forceinline__ void mbar_arrive_count(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// One 2D TMA box (64 values x RUN_TOKENS slots from value column c0, slot row c1) into shared memory;
// its bytes complete on the mbarrier.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                             uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}

// 16-byte global -> shared copy; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes,
                                           uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst),
               "l"(src), "r"(src_bytes), "l"(policy)
               : "memory");
}

__device__ __forceinline__ uint64_t l2_policy(bool evict_first) {
  uint64_t policy;
  if (evict_first) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  }
  return policy;
}

// Order this thread's generic-proxy view of shared memory before its later wgmma reads.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Pin registers written by asynchronous wgmma: the compiler may not move their uses across.
template <int K>
__device__ __forceinline__ void fence_regs(float (&r)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
struct Wgmma;  // D[64, N] (+)= A[64, 16] B[16, N], bf16 in, fp32 accumulate

#include "wgmma_ops.inc"

// Shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart (SBO).
// K-major operands step 32 bytes per k16; the MN-major V^T steps 2048 bytes (16 token rows).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Byte offset of value `col` (0..63) of row `row` in a stack of 128-byte rows, 128-byte swizzle
// (16-byte chunk index XOR row % 8). The atoms (8 rows, 1024 bytes) start 1024-byte aligned.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + ((col & 7) << 1);
}

__device__ __forceinline__ long long load_index(const void* p, int is64, long long i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<const int*>(p)[i];
}

__device__ __forceinline__ int float_order(float f) {  // int order == float order
  int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7FFFFFFF;
}
__device__ __forceinline__ float order_float(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7FFFFFFF); }

// ---------------------------------------------------------------------------------------------
// Work plan: the batch's tiles (ceil(N_b / 64) per request) split into equal chunks of at least
// min_tiles, one chunk per CTA along x. A chunk that crosses requests is processed as segments,
// one per request, each writing its own partial slot x + b (unique: a boundary adds one slot).
// A segment costs its CTA the query rows and an epilogue, so each boundary between requests
// counts as `cost` tiles of the plan (a gap before the request's tiles that no CTA computes): a
// CTA whose chunk crosses a boundary gets that many fewer tiles.
// Every warp computes the plan itself (no shared memory, no host): a few loads per 32 requests.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int request_tiles(const void* kv_indptr, int kvp64, int b) {
  long long n = load_index(kv_indptr, kvp64, b + 1) - load_index(kv_indptr, kvp64, b);
  return static_cast<int>((n + TILE - 1) / TILE);
}

__device__ int warp_total_tiles(const void* kv_indptr, int kvp64, int batch) {
  const int lane = threadIdx.x & 31;
  int total = 0;
  for (int base = 0; base < batch; base += 32) {
    int b = base + lane;
    total += __reduce_add_sync(0xffffffffu, b < batch ? request_tiles(kv_indptr, kvp64, b) : 0);
  }
  return total;
}

__device__ __forceinline__ int plan_chunk(int total, int grid_x, int min_tiles) {
  int chunk = (total + grid_x - 1) / grid_x;
  return chunk > min_tiles ? chunk : min_tiles;
}

// Tiles a boundary between requests counts in the plan: BOUNDARY_TILES, unless that lengthens every
// chunk by more than a sixteenth (short calls: one more tile a CTA costs more than the boundaries
// save) or the short layout spreads single tiles (docs/verify-kernel-log.md#segment-cost-in-the-split-plan).
__device__ __forceinline__ int boundary_cost(int total, int batch, int grid_x, int min_tiles, bool is_short) {
  if (is_short) return 0;
  const int plain = plan_chunk(total, grid_x, min_tiles);
  const int costed = plan_chunk(total + BOUNDARY_TILES * (batch - 1), grid_x, min_tiles);
  return 16 * (costed - plain) <= plain ? BOUNDARY_TILES : 0;
}

// First request whose tiles end after plan position g, where request b's tiles start at its global
// first tile + b * cost: (b, that start, its tile count).
__device__ void warp_find_request(const void* kv_indptr, int kvp64, int batch, int cost, int g, int& b_out,
                                  int& first_out, int& count_out) {
  const int lane = threadIdx.x & 31;
  int carry = 0;
  for (int base = 0; base < batch; base += 32) {
    int b = base + lane;
    int t = b < batch ? request_tiles(kv_indptr, kvp64, b) : 0;
    int u = b < batch ? t + cost : 0;  // its tiles and the gap after them
    int incl = u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    unsigned hit = __ballot_sync(0xffffffffu, b < batch && carry + incl - cost > g);
    if (hit) {
      int src = __ffs(hit) - 1;
      b_out = base + src;
      count_out = __shfl_sync(0xffffffffu, t, src);
      first_out = carry + __shfl_sync(0xffffffffu, incl, src) - count_out - cost;
      return;
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  b_out = batch;
  first_out = carry;
  count_out = 0;
}

struct Segment {
  int b;            // request
  int t0, t1;       // its local tiles [t0, t1)
  long long kv0;    // kv_indptr[b]
  int n;            // prefix tokens of the request
  int q0;           // first draft row of the request
  int rows;         // valid query rows of the request, D * H
};

// The 64-value column block of the KV (and of the query rows) that ring block `blk` of a tile holds:
// the rope block (8) first, so the QK products can start before the latent blocks land.
__device__ __forceinline__ int block_column(int blk) { return blk == 0 ? 8 : blk - 1; }

// Rows of a row block in the short layout: both consumer warpgroups take SHORT_ROWS / 2.
constexpr int SHORT_ROWS = 48;

// The split grid's shape for a batch of `total` tiles. A short batch (no more tiles than CTAs
// along x, so each would get at most one) is spread over short_blocks row blocks of SHORT_ROWS
// instead: twice the CTAs for 72 rows, each computing fewer rows, which shortens a one-tile
// call (docs/verify-kernel-log.md#the-own-sm90-kernel-page-size-1). The combine kernel takes the same
// decision from the same total, so it finds the partials where this layout put them.
struct Layout {
  bool is_short;
  int row_blocks, grid_x, rows_per_block;
  __device__ Layout(int total, int row_blocks_, int grid_x_, int short_blocks, int grid_size, int rows_per_block_) {
    is_short = short_blocks > 0 && total <= grid_x_;
    row_blocks = is_short ? short_blocks : row_blocks_;
    grid_x = is_short ? grid_size / short_blocks : grid_x_;
    rows_per_block = is_short ? SHORT_ROWS : rows_per_block_;
  }
};

// The plan of a batch of `total` tiles in `lay`, the same in the split and the combine kernel:
// the boundaries' cost, the plan positions (tiles and gaps) and each CTA's chunk of them.
struct PlanShape {
  int cost, span, chunk;
  __device__ PlanShape(int total, int batch, const Layout& lay, int min_tiles) {
    cost = boundary_cost(total, batch, lay.grid_x, min_tiles, lay.is_short);
    span = total + cost * (batch - 1);
    chunk = plan_chunk(span, lay.grid_x, min_tiles);
  }
};

// Iterates the segments of one CTA; every warp of the CTA walks the same sequence.
struct SegmentWalk {
  const SplitParams& p;
  int g, end, cost;  // plan positions: tiles and the boundaries' cost
  __device__ SegmentWalk(const SplitParams& params, int total, const Layout& lay, int x) : p(params) {
    const PlanShape plan(total, p.batch, lay, p.min_tiles);
    cost = plan.cost;
    long long lo = static_cast<long long>(x) * plan.chunk;
    g = lo < plan.span ? static_cast<int>(lo) : plan.span;
    end = g + plan.chunk < plan.span ? g + plan.chunk : plan.span;
  }
  // Next segment with work for row block y; false when the CTA's range is done.
  __device__ bool next(int y, int rows_per_block, Segment& s) {
    while (g < end) {
      int first, count;
      warp_find_request(p.kv_indptr, p.kvp64, p.batch, cost, g, s.b, first, count);
      if (s.b >= p.batch) return false;
      s.t0 = g > first ? g - first : 0;  // g may lie in the boundary's gap
      s.t1 = (end < first + count ? end : first + count) - first;
      g = first + count;
      if (s.t1 <= s.t0) continue;  // the range ends in the gap before this request's tiles
      s.kv0 = load_index(p.kv_indptr, p.kvp64, s.b);
      s.n = static_cast<int>(load_index(p.kv_indptr, p.kvp64, s.b + 1) - s.kv0);
      s.q0 = static_cast<int>(load_index(p.qo_indptr, p.qop64, s.b));
      s.rows = (static_cast<int>(load_index(p.qo_indptr, p.qop64, s.b + 1)) - s.q0) * p.heads;
      if (s.rows > y * rows_per_block) return true;  // else: no query row of this row block
    }
    return false;
  }
};

// ---------------------------------------------------------------------------------------------
// Shared memory plan of the split kernel (offsets from a 1024-aligned base)
// ---------------------------------------------------------------------------------------------

template <int N0, int N1>
struct SmemPlan {
  static constexpr int NR = N0 + N1;
  static constexpr int Q = 0;                                  // 9 blocks of NR rows x 128 B
  static constexpr int Q_BYTES = BLOCKS_PER_TILE * NR * 128;
  static constexpr int P = Q + Q_BYTES;                        // P^T: NR rows x 128 B
  static constexpr int RING = P + NR * 128;
  static constexpr int BAR_BYTES = 1024;                       // mbarriers and row maxima
  static constexpr int RING_BLOCKS_FIT = (SMEM_PER_BLOCK - RING - BAR_BYTES) / BLOCK_BYTES;
  static constexpr int RING_BLOCKS = RING_BLOCKS_FIT > 32 ? 32 : RING_BLOCKS_FIT;
  static constexpr int BARS = RING + RING_BLOCKS * BLOCK_BYTES;
  static constexpr int FULL = BARS;                            // RING_BLOCKS x 8 B
  static constexpr int EMPTY = FULL + 8 * RING_BLOCKS;
  static constexpr int Q_FULL = EMPTY + 8 * RING_BLOCKS;      // one per consumer warpgroup
  static constexpr int ROW_MAX = Q_FULL + 16;                  // [2 tiles][NR] ordered ints
  static constexpr int BYTES = ROW_MAX + 2 * NR * 4;
  // Tile t + 1 reuses the slots of tile t - 1's latent blocks and of tile t's rope block, which
  // are free before tile t + 1's QK is issued; with fewer blocks the loop would deadlock.
  static_assert(RING_BLOCKS >= 2 * BLOCKS_PER_TILE - 1, "KV ring too small");
  static_assert(BYTES <= SMEM_PER_BLOCK, "shared memory plan too large");
  static_assert(BYTES - BARS <= BAR_BYTES, "barrier area too small");
  static_assert(N0 % 8 == 0 && N1 % 8 == 0 && N0 <= 40 && N1 <= N0, "row split");
};

// The ring position of block number seq (a running count over the CTA's whole loop).
template <int RING>
struct RingPos {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == RING) {
      slot = 0;
      phase ^= 1;
    }
  }
  __device__ __forceinline__ RingPos plus(int k) const {
    RingPos r = *this;
    for (int i = 0; i < k; ++i) r.advance();
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// Producer warpgroup
// ---------------------------------------------------------------------------------------------

template <int N0, int N1>
__device__ void produce(const SplitParams& p, const CUtensorMap* kv_map, uint8_t* smem, int total, const Layout& lay,
                        int x, int y) {
  using L = SmemPlan<N0, N1>;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int chunk16 = lane & 7;                   // 16-byte piece of a 128-byte block row
  const int row0 = RUN_TOKENS * warp + (lane >> 3);  // this thread's token rows: row0 + 4 k, k < 4
  const uint32_t base = smem_addr(smem);
  const uint64_t policy = l2_policy(p.evict_first != 0 && !lay.is_short);  // short: two row blocks re-read
  RingPos<L::RING_BLOCKS> pos;
  SegmentWalk walk(p, total, lay, x);
  Segment s;
  while (walk.next(y, lay.rows_per_block, s)) {
    // Slot ids of this thread's 4 token rows (-1 past the prefix), one tile ahead.
    auto load_ids = [&](int tile, int (&out)[4]) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int tok = tile * TILE + row0 + 4 * k;
        out[k] = tok < s.n ? static_cast<int>(load_index(p.kv_indices, p.idx64, s.kv0 + tok)) : -1;
      }
    };
    // The first slot id of this warp's 16 tokens of a tile when they lie in the prefix and their
    // ids run on from it (the warp then copies them by TMA), else -1.
    auto warp_run = [&](int tile, const int (&in)[4]) {
      if (!p.tma_runs) return -1;
      const int first = __shfl_sync(0xffffffffu, in[0], 0);
      bool mine = tile * TILE + RUN_TOKENS * (warp + 1) <= s.n;
#pragma unroll
      for (int k = 0; k < 4; ++k) mine = mine && in[k] == first + (lane >> 3) + 4 * k;
      return __all_sync(0xffffffffu, mine) ? first : -1;
    };
    int ids[4];
    load_ids(s.t0, ids);
    int run = warp_run(s.t0, ids);
    for (int tile = s.t0; tile < s.t1; ++tile) {
      const bool has_next = tile + 1 < s.t1;
      int next_ids[4] = {-1, -1, -1, -1};
      if (has_next) load_ids(tile + 1, next_ids);
      if (run >= 0) {  // one lane copies the warp's 16 rows of each block and arrives for all 32
        if (lane == 0) {
          RingPos<L::RING_BLOCKS> at = pos;
#pragma unroll 1
          for (int blk = 0; blk < BLOCKS_PER_TILE; ++blk) {
            const uint32_t full = base + L::FULL + 8 * at.slot;
            mbar_wait(base + L::EMPTY + 8 * at.slot, at.phase ^ 1);
            mbar_expect_tx(full, RUN_TOKENS * 128);
            tma_load_box(base + L::RING + at.slot * BLOCK_BYTES + warp * (RUN_TOKENS * 128), kv_map,
                         block_column(blk) * 64, run, full, policy);
            mbar_arrive_count(full, 32);
            at.advance();
          }
        }
        __syncwarp();
        pos = pos.plus(BLOCKS_PER_TILE);
      } else {  // gathered: the loop of a warp whose control flow is uniform (its barrier addresses too)
#pragma unroll 1
        for (int blk = 0; blk < BLOCKS_PER_TILE; ++blk) {
          const int col0 = block_column(blk) * 64 + chunk16 * 8;
          mbar_wait(base + L::EMPTY + 8 * pos.slot, pos.phase ^ 1);
          const uint32_t dst = base + L::RING + pos.slot * BLOCK_BYTES;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const __nv_bfloat16* src = p.kv + static_cast<long long>(ids[k] < 0 ? 0 : ids[k]) * p.kv_stride + col0;
            cp_async16(dst + sw128_offset(row0 + 4 * k, chunk16 * 8), src, ids[k] < 0 ? 0 : 16, policy);
          }
          cp_async_arrive(base + L::FULL + 8 * pos.slot);
          pos.advance();
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) ids[k] = next_ids[k];
      run = has_next ? warp_run(tile + 1, ids) : -1;
    }
  }
}

// exp2(min(s - m, 64)): a score's exponential against the reference maximum m (log2 units). The clamp
// keeps a first pass against a stale reference finite; a tile whose scores pass the reference by more
// than RESCALE_GAP is computed again anyway.
__device__ __forceinline__ float clamped_exp(float s, float m) { return exp2f(fminf(s - m, 64.f)); }

// A thread's two terms of a column's sum of exponentials (its tokens 16 warp + lane / 4 (+ 8)).
__device__ __forceinline__ float tile_exp(float s_lo, float s_hi, float m) { return clamped_exp(s_lo, m) + clamped_exp(s_hi, m); }

// A warp's 16 x 8 piece of an accumulator (rows 8h + lane / 4, columns 2 (lane % 4) + e; a0 a1 for
// h = 0, b0 b1 for h = 1) stored transposed as bf16 by stmatrix: column k becomes 16 bytes at the
// address lane 8h + k gives (trans_row_addr), half h of them.
__device__ __forceinline__ void store_piece_trans(uint32_t addr, float a0, float a1, float b0, float b1) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a0, a1), hi = __floats2bfloat162_rn(b0, b1);
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr),
               "r"(*reinterpret_cast<uint32_t*>(&lo)), "r"(*reinterpret_cast<uint32_t*>(&hi))
               : "memory");
}

// This lane's stmatrix address in a stack of 128-byte rows with the 128-byte swizzle (rows_base 8-row
// aligned): lane 8h + k names row k, values 16 warp + 8 h + [0, 8). Row 8 j + k: add 1024 j.
__device__ __forceinline__ uint32_t trans_row_addr(uint32_t rows_base, int warp, int lane) {
  const int k = lane & 7, h = (lane >> 3) & 1;
  return rows_base + k * 128 + ((((2 * warp + h) ^ k) & 7) << 4);
}

// A tile's exponentials against the reference maxima m_use [NJ][2] for this thread's tokens (rows of
// S^T) 16 warp + lane / 4 (+ 8) of columns 8j + 2(lane % 4) + e: into P^T (K-major, 128-byte swizzle;
// pt_addr = trans_row_addr of its first row) and added to l_run.
template <int NJ>
__device__ __forceinline__ void exp_tile(const float* s_acc, const float (&m_use)[NJ][2], float (&l_run)[NJ][2],
                                         uint32_t pt_addr) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float p[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      p[0][e] = clamped_exp(s_acc[4 * j + e], m_use[j][e]);
      p[1][e] = clamped_exp(s_acc[4 * j + 2 + e], m_use[j][e]);
      l_run[j][e] += p[0][e] + p[1][e];
    }
    store_piece_trans(pt_addr + j * 1024, p[0][0], p[0][1], p[1][0], p[1][1]);
  }
}

// ---------------------------------------------------------------------------------------------
// Consumer warpgroup: N query rows (columns of S^T and O^T) starting at row0 of the row block.
// Accumulator layout of wgmma m64nN (per warp w, lane l): value 4j + 2h + e sits at row
// 16w + l/4 + 8h, column 8j + 2(l%4) + e.
// ---------------------------------------------------------------------------------------------

template <int N0, int N1, int N>
__device__ void consume(const SplitParams& p, uint8_t* smem, int total, const Layout& lay, int x, int y, int wg,
                        int row0) {
  using L = SmemPlan<N0, N1>;
  constexpr int NR = L::NR;
  constexpr int NJ = N / 8;
  constexpr int NV = N / 2;  // accumulator registers per 64-row block
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31;
  const int bar_id = 1 + wg;  // named barrier of this warpgroup
  const uint32_t base = smem_addr(smem);
  const uint32_t q_base = base + L::Q + row0 * 128;
  const uint32_t p_base = base + L::P + row0 * 128;
  int* row_max = reinterpret_cast<int*>(smem + L::ROW_MAX) + row0;  // [2][NR], this WG's columns
  float* scratch = reinterpret_cast<float*>(smem + L::P + row0 * 128);  // [4][N] in P^T's space
  const uint32_t pt_addr = trans_row_addr(p_base, warp, lane);  // P^T of this WG, as exp_tile stores it

  float s_acc[NV];
  float o_acc[8][NV];
  // m_use: the reference maximum of the exponentials (log2 units), moved only when a tile's
  // scores pass it by more than RESCALE_GAP; l_run: this thread's sum of exp2(s - m_use).
  float m_use[NJ][2], l_run[NJ][2];
  RingPos<L::RING_BLOCKS> pos;  // first block of the tile whose S is computed next
  const uint64_t q_policy = l2_policy(false);
  uint32_t q_phase = 0;
  int tile_count = 0;           // tiles done by this CTA: parity picks the row-max buffer

  auto issue_qk = [&](RingPos<L::RING_BLOCKS> at) {
#pragma unroll 1
    for (int blk = 0; blk < BLOCKS_PER_TILE; ++blk) {
      mbar_wait(base + L::FULL + 8 * at.slot, at.phase);
      fence_async_shared();
      wgmma_fence();  // after every wait: ptxas serialises wgmma issued past a divergent path
      const uint32_t k_addr = base + L::RING + at.slot * BLOCK_BYTES;
      const uint32_t q_addr = q_base + block_column(blk) * (NR * 128);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        Wgmma<N>::template mma<0, 0>(s_acc, sw128_desc(k_addr + ks * 32), sw128_desc(q_addr + ks * 32),
                                     blk > 0 || ks > 0);
      }
      at.advance();
    }
    wgmma_commit();
  };
  auto release = [&](RingPos<L::RING_BLOCKS> at, int first, int count) {
    at = at.plus(first);
    for (int i = 0; i < count; ++i) {
      if (lane == 0) mbar_arrive(base + L::EMPTY + 8 * at.slot);
      at.advance();
    }
  };

  SegmentWalk walk(p, total, lay, x);
  Segment s;
  while (walk.next(y, lay.rows_per_block, s)) {
    // This warpgroup's query rows (zeros past the request's rows), loaded by itself while the producer
    // starts on the KV: a warp per row, a lane per 16 bytes. (Loaded by the producer, with its 40
    // registers, they took a third of a one-tile call: docs/verify-kernel.md.)
    for (int r = warp; r < N; r += 4) {
      const int qrow = y * lay.rows_per_block + row0 + r;
      const bool ok = qrow < s.rows;
      const __nv_bfloat16* src = ok ? p.q + (s.q0 + qrow / p.heads) * p.q_stride_t + (qrow % p.heads) * p.q_stride_h : p.q;
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const int c = lane + 32 * k;
        if (c < KV_DIM / 8)
          cp_async16(base + L::Q + (c >> 3) * (NR * 128) + sw128_offset(row0 + r, (c & 7) * 8), src + c * 8,
                     ok ? 16 : 0, q_policy);
      }
    }
    cp_async_arrive(base + L::Q_FULL + 8 * wg);
    mbar_wait(base + L::Q_FULL + 8 * wg, q_phase);  // every warp's rows have landed (a named barrier
    q_phase ^= 1;                                   // here makes ptxas serialise the wgmma)
    fence_async_shared();
#pragma unroll
    for (int d = 0; d < 8; ++d)
#pragma unroll
      for (int i = 0; i < NV; ++i) o_acc[d][i] = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        m_use[j][e] = -1e30f;
        l_run[j][e] = 0.f;
      }
    fence_regs(s_acc);
    issue_qk(pos);
    wgmma_wait<0>();
    fence_regs(s_acc);

    for (int tile = s.t0; tile < s.t1; ++tile) {
      release(pos, 0, 1);  // rope block: read by the QK just waited for
      const int valid = s.n - tile * TILE;  // tokens of this tile (>= 1)
      const int r_lo = 16 * warp + (lane >> 2);
      const bool ok_lo = r_lo < valid, ok_hi = r_lo + 8 < valid;
      // Each column's maximum: tile t's warps push max(their tile maximum, m_use) into buffer t & 1
      // (reset only between segments: it may also hold tile t - 2's, which m_use passed then), read
      // back after barrier C. Buffer t & 1 was last read after barrier C of tile t - 2, before any
      // warp passed barrier C of tile t - 1, which comes before these atomics.
      int* mx = row_max + (tile_count & 1) * NR;
      // Scaled scores (log2 units), masked past the prefix, and this warp's column maxima: every
      // column's shuffles side by side, then one branch for the atomics (a branch per column kept
      // each column's shuffles waiting for the previous column's atomic).
      float wmax[NJ][2];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float lo = ok_lo ? s_acc[4 * j + e] * p.scale_log2 : -INFINITY;
          float hi = ok_hi ? s_acc[4 * j + 2 + e] * p.scale_log2 : -INFINITY;
          s_acc[4 * j + e] = lo;
          s_acc[4 * j + 2 + e] = hi;
          wmax[j][e] = fmaxf(lo, hi);
        }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) wmax[j][e] = fmaxf(wmax[j][e], __shfl_xor_sync(0xffffffffu, wmax[j][e], o));
      if (lane < 4) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) atomicMax(mx + 8 * j + 2 * lane + e, float_order(fmaxf(wmax[j][e], m_use[j][e])));
      }
      // P^T against the reference maxima m_use, without waiting for the other warps' maxima: the
      // reference moves (the accumulators rescaled, P^T written again) only when a tile's scores
      // pass it by more than RESCALE_GAP, which after a segment's first tile is rare, so most tiles
      // take one barrier and no rescale of the 8 x NV accumulators.
      if (tile == s.t0) {  // a segment's first tile: its maxima first, so that it never takes the slow path
        named_barrier(bar_id, 128);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) m_use[j][e] = order_float(mx[8 * j + 2 * (lane & 3) + e]);
      }
      exp_tile<NJ>(s_acc, m_use, l_run, pt_addr);
      fence_async_shared();
      named_barrier(bar_id, 128);  // C: P^T and every warp's maxima complete
      bool moved = false;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) moved |= order_float(mx[8 * j + 2 * (lane & 3) + e]) > m_use[j][e] + RESCALE_GAP;
      // A warp holds every column (for its 16 tokens) and reads the same maxima as the others, so
      // the whole warpgroup takes this branch or none of it.
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float m_new = order_float(mx[8 * j + 2 * (lane & 3) + e]);
            const float alpha = exp2f(m_use[j][e] - m_new);
            // take back what the first pass added (the same two terms), then rescale
            l_run[j][e] = (l_run[j][e] - tile_exp(s_acc[4 * j + e], s_acc[4 * j + 2 + e], m_use[j][e])) * alpha;
            m_use[j][e] = m_new;
#pragma unroll
            for (int d = 0; d < 8; ++d) {
              o_acc[d][4 * j + e] *= alpha;
              o_acc[d][4 * j + 2 + e] *= alpha;
            }
          }
        exp_tile<NJ>(s_acc, m_use, l_run, pt_addr);
        fence_async_shared();
        named_barrier(bar_id, 128);  // P^T rewritten against the new maxima
      }
#pragma unroll
      for (int d = 0; d < 8; ++d) fence_regs(o_acc[d]);
      wgmma_fence();
      // O^T += V^T P^T: V^T rows 64d.. come from latent block d (ring position pos + 1 + d).
      // (Issuing the 8 independent accumulators k step by k step instead measured no faster.)
      RingPos<L::RING_BLOCKS> at = pos;
#pragma unroll
      for (int d = 0; d < 8; ++d) {
        at.advance();
        const uint32_t v_addr = base + L::RING + at.slot * BLOCK_BYTES;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          Wgmma<N>::template mma<1, 0>(o_acc[d], sw128_desc(v_addr + ks * 2048), sw128_desc(p_base + ks * 32), 1);
        }
      }
      wgmma_commit();
      ++tile_count;
      // Free this tile's latent blocks as soon as its PV is done, before waiting for the next
      // tile's data, so tile t + 2 loads into them while tile t + 1 is computed. (Issuing
      // QK(t + 1) first, which holds them until all of tile t + 1 has arrived, measured the
      // same: the loop is not bound by its loads; BENCHMARKS.md.)
      wgmma_wait<0>();
#pragma unroll
      for (int d = 0; d < 8; ++d) fence_regs(o_acc[d]);
      release(pos, 1, 8);
      const RingPos<L::RING_BLOCKS> next = pos.plus(BLOCKS_PER_TILE);
      if (tile + 1 < s.t1) {
        fence_regs(s_acc);
        issue_qk(next);
        wgmma_wait<0>();
        fence_regs(s_acc);
      }
      pos = next;
    }

    // Epilogue: row sums across the warpgroup, normalise, stage rows in this WG's part of the
    // query buffer (free: its QK are done), copy out 16 bytes per thread.
    named_barrier(bar_id, 128);  // every warp's PV done: P^T space is free for the row sums
    if (tid < N) {  // the running maxima start again with the next segment (read before this barrier)
      row_max[tid] = INT_MIN;
      row_max[NR + tid] = INT_MIN;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = l_run[j][e];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < 4) scratch[warp * N + 8 * j + 2 * lane + e] = v;
      }
    named_barrier(bar_id, 128);
    const int slot = x + s.b;
    const long long part_row0 = static_cast<long long>(slot) * p.rows_pad + y * lay.rows_per_block + row0;
    float inv_l[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * j + 2 * (lane & 3) + e;
        const float l = scratch[c] + scratch[N + c] + scratch[2 * N + c] + scratch[3 * N + c];
        inv_l[j][e] = 1.f / l;
        if (warp == 0 && lane < 4) p.l_part[part_row0 + c] = m_use[j][e] + log2f(l);
      }
    // Stage the normalised rows (512 values each, in 128-byte swizzled blocks of 64) in this WG's rows
    // of the query buffer: value 64 d + r of row c is O^T's row r of block d, column c.
    const uint32_t stage = trans_row_addr(base + L::Q + row0 * 128, warp, lane);
#pragma unroll
    for (int d = 0; d < 8; ++d)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        store_piece_trans(stage + d * (NR * 128) + j * 1024, o_acc[d][4 * j] * inv_l[j][0], o_acc[d][4 * j + 1] * inv_l[j][1],
                          o_acc[d][4 * j + 2] * inv_l[j][0], o_acc[d][4 * j + 3] * inv_l[j][1]);
    named_barrier(bar_id, 128);
    for (int i = tid; i < N * 64; i += 128) {
      const int c = i >> 6, piece = i & 63;  // row c, values 8 piece ..
      const uint4 v = *reinterpret_cast<const uint4*>(
          smem + L::Q + (piece >> 3) * (NR * 128) + (row0 + c) * 128 + ((((piece & 7) ^ c) & 7) << 4));
      *reinterpret_cast<uint4*>(p.o_part + (part_row0 + c) * V_DIM + piece * 8) = v;
    }
    named_barrier(bar_id, 128);  // the staged rows are read: the next segment's query rows may land there
  }
}

// Consumer warpgroup wg: its N rows from row0, or in the short layout (the 64- and 72-row variants)
// SHORT_ROWS / 2 rows from wg * SHORT_ROWS / 2.
template <int N0, int N1, int N>
__device__ __forceinline__ void consume_rows(const SplitParams& p, uint8_t* smem, int total, const Layout& lay, int x,
                                             int y, int wg, int row0) {
  if constexpr (N0 + N1 > SHORT_ROWS) {
    if (lay.is_short) {
      consume<N0, N1, SHORT_ROWS / 2>(p, smem, total, lay, x, y, wg, wg * (SHORT_ROWS / 2));
      return;
    }
  }
  consume<N0, N1, N>(p, smem, total, lay, x, y, wg, row0);
}

template <int N0, int N1>
__global__ void __launch_bounds__(THREADS, 1) split_kernel(const __grid_constant__ SplitArgs a) {
  using L = SmemPlan<N0, N1>;
  const SplitParams& p = a.p;
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_addr(smem) & 1023) __trap();  // the swizzle assumes 1024-byte aligned atoms
  const int total = warp_total_tiles(p.kv_indptr, p.kvp64, p.batch);
  const Layout lay(total, p.row_blocks, p.grid_x, N0 + N1 > SHORT_ROWS ? p.short_blocks : 0, p.grid_x * p.row_blocks,
                   N0 + N1);
  const int x = blockIdx.x / lay.row_blocks, y = blockIdx.x % lay.row_blocks;
  const uint32_t base = smem_addr(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < L::RING_BLOCKS; ++i) {
      mbar_init(base + L::FULL + 8 * i, 128);  // one cp.async arrival per producer thread (TMA: 32 at once)
      mbar_init(base + L::EMPTY + 8 * i, 8);   // one arrival per consumer warp
    }
    mbar_init(base + L::Q_FULL, 128);          // one cp.async arrival per consumer thread
    mbar_init(base + L::Q_FULL + 8, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < 2 * L::NR) reinterpret_cast<int*>(smem + L::ROW_MAX)[threadIdx.x] = INT_MIN;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    produce<N0, N1>(p, &a.kv_map, smem, total, lay, x, y);
  } else if (wg == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER0_REGS));
    consume_rows<N0, N1, N0>(p, smem, total, lay, x, y, 0, 0);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER1_REGS));
    consume_rows<N0, N1, N1>(p, smem, total, lay, x, y, 1, N0);
  }
  // The combine kernel (a programmatic dependent) may start once every CTA is this far.
  asm volatile("griddepcontrol.launch_dependents;");
}

// ---------------------------------------------------------------------------------------------
// Combine kernel: 128 threads per (query row, slice of 512 / slices values)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int i = 1; i < 4; ++i) v = is_max ? fmaxf(v, red[i]) : v + red[i];
  return v;
}

// Where the mask keeps whether draft i of request b sees draft j (mask modes 1 and 2; `base` is
// the request's offset, read before the drafts' rows so both loads are in flight together).
__device__ __forceinline__ long long mask_base(const CombineParams& p, int b) {
  if (p.mask_mode == 0) return 0;
  if (p.mask_mode == 1 && p.mask_indptr == nullptr) return static_cast<long long>(b) * p.d_max * p.d_max;
  return load_index(p.mask_indptr, p.mip64, b);
}

__device__ __forceinline__ long long mask_index(const CombineParams& p, long long base, int i, int j, int D,
                                                long long n) {
  return p.mask_mode == 1 ? base + static_cast<long long>(i) * D + j
                          : base + static_cast<long long>(i) * (n + D) + n + j;
}

// Request b's place in the plan in one pass over kv_indptr: the batch's total tiles, the tiles
// before b and b's own (every lane gets all three).
__device__ void warp_plan(const void* kv_indptr, int kvp64, int batch, int b, int& total, int& first,
                          int& count) {
  const int lane = threadIdx.x & 31;
  total = first = 0;
  for (int base = 0; base < batch; base += 32) {
    const int r = base + lane;
    const int t = r < batch ? request_tiles(kv_indptr, kvp64, r) : 0;
    total += __reduce_add_sync(0xffffffffu, t);
    first += __reduce_add_sync(0xffffffffu, r < b ? t : 0);
  }
  count = request_tiles(kv_indptr, kvp64, b);
}

__device__ __forceinline__ void add_scaled(float (&acc)[8], const uint4& v, float w) {
  const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 f = __bfloat1622float2(v2[k]);
    acc[2 * k] += w * f.x;
    acc[2 * k + 1] += w * f.y;
  }
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
  float d = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 x = __bfloat1622float2(a2[k]), y = __bfloat1622float2(b2[k]);
    d += x.x * y.x + x.y * y.y;
  }
  return d;
}

// Its CTAs start only as the split kernel's leave their SMs, so what runs before the dependency
// wait is on the call's critical path too: no load there waits on another that need not. The
// split plan (warp 3) and the mask offset are read with the request's indices, and the mask by
// thread j while the warps compute the tree scores (read after each draft's score by lane 0, they
// cost about 1 µs a call at batches of 8-16: docs/verify-kernel-log.md#the-own-sm90-kernel-page-size-1).
//
// Three instances, picked at launch by the grid's CTAs per SM (mlav_forward): PASS drafts' keys are
// loaded at a time (one round trip for a warp's drafts at 9 drafts where PASS = 3), and with
// EARLY > 0 each thread also holds its first EARLY partial rows and draft values in registers from
// before their weights are known. <4, 3> (four slices: one request's rows, a split per SM) takes
// 111 registers, 4 CTAs per SM; <0, 3> 96, 5 per SM; <0, 1> 56, 9 per SM, for larger grids.
template <int EARLY, int PASS>
__global__ void __launch_bounds__(128, EARLY > 0 ? 4 : PASS > 1 ? 5 : 9)
    combine_kernel(const __grid_constant__ CombineParams p) {
  __shared__ float weights[MAX_COMBINE_SPLITS];
  __shared__ float tree[MAX_COMBINE_DRAFTS];
  __shared__ float red[8][128];
  __shared__ float red4[4];
  __shared__ int plan[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Grid (head, draft, request x slice): no integer division (the kernel is short of issue slots).
  const int lg = __ffs(p.slices) - 1;  // slices = 1 << lg
  const int h = blockIdx.x, i = blockIdx.y, b = blockIdx.z >> lg, slice = blockIdx.z & (p.slices - 1);
  const int q0 = static_cast<int>(load_index(p.qo_indptr, p.qop64, b));
  const int D = static_cast<int>(load_index(p.qo_indptr, p.qop64, b + 1)) - q0;
  const long long n = load_index(p.kv_indptr, p.kvp64, b + 1) - load_index(p.kv_indptr, p.kvp64, b);
  const long long mbase = mask_base(p, b);
  if (warp == 3) {  // the split plan: its loads go out with the ones above
    int total, first, count;
    warp_plan(p.kv_indptr, p.kvp64, p.batch, b, total, first, count);
    if (lane == 0) {
      const Layout lay(total, 1, p.grid_x, p.short_blocks, p.grid_size, 0);
      const PlanShape shape(total, p.batch, lay, p.min_tiles);
      const int start = first + shape.cost * b;  // b's first tile in the plan
      plan[0] = count > 0 ? (start + count - 1) / shape.chunk - start / shape.chunk + 1 : 0;
      plan[1] = start / shape.chunk + b;
    }
  }
  if (i >= D) return;
  const int r = i * p.heads + h;  // row of the request = row of its partials

  // Thread (sg, dg): 8 values at col of every split_groups-th split and draft. One slice per row
  // takes every value in one CTA (batches: one wave of CTAs); four take a quarter each (one
  // request, whose rows have the most splits).
  const int width = V_DIM >> lg;
  const int split_groups = 2 << lg;  // 128 threads / (width / 8)
  const int dg = tid & ((64 >> lg) - 1), sg = tid >> (6 - lg);
  const int col = slice * width + dg * 8;

  // Tree scores (independent of the split kernel): warp w takes drafts w, w + 4, ..., each lane 8
  // of the 576 values at 3 places; draft j's visibility read by thread j meanwhile.
  const __nv_bfloat16* qrow = p.q + (q0 + i) * p.q_stride_t + h * p.q_stride_h;
  uint4 qv[3];
#pragma unroll
  for (int m = 0; m < 3; ++m)
    if (lane + 32 * m < KV_DIM / 8) qv[m] = *reinterpret_cast<const uint4*>(qrow + (lane + 32 * m) * 8);
  bool visible = tid <= i;
  if (p.mask_mode != 0 && tid < D) visible = p.mask[mask_index(p, mbase, i, tid, D, n)] != 0;
  for (int j0 = warp; j0 < D; j0 += 4 * PASS) {
    uint4 kv[PASS][3];
#pragma unroll
    for (int t = 0; t < PASS; ++t)
#pragma unroll
      for (int m = 0; m < 3; ++m)
        if (j0 + 4 * t < D && lane + 32 * m < KV_DIM / 8)
          kv[t][m] = *reinterpret_cast<const uint4*>(p.k_ext + (q0 + j0 + 4 * t) * p.ke_stride +
                                                     (lane + 32 * m) * 8);
#pragma unroll
    for (int t = 0; t < PASS; ++t) {
      float dot = 0.f;
#pragma unroll
      for (int m = 0; m < 3; ++m)
        if (lane + 32 * m < KV_DIM / 8) dot += dot8(qv[m], kv[t][m]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0 && j0 + 4 * t < D) tree[j0 + 4 * t] = dot * p.scale_log2;
    }
  }
  uint4 v_early[EARLY > 0 ? EARLY : 1];
#pragma unroll
  for (int k = 0; k < EARLY; ++k) {
    const int j = sg + split_groups * k;
    if (j < D) v_early[k] = *reinterpret_cast<const uint4*>(p.v_ext + (q0 + j) * p.ve_stride + col);
  }
  __syncthreads();
  if (tid < D && !visible) tree[tid] = -INFINITY;
  const int n_splits = plan[0];
  const int slot0 = plan[1];
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the split kernel's partials are written

  // Partial s of this row at part + s * part_step: pointer steps, not a 64-bit product per load.
  const long long part_step = static_cast<long long>(p.rows_pad) * V_DIM;
  const __nv_bfloat16* part = p.o_part + (static_cast<long long>(slot0) * p.rows_pad + r) * V_DIM + col;
  const long long group_step = split_groups * part_step;
  uint4 o_early[EARLY > 0 ? EARLY : 1];
#pragma unroll
  for (int k = 0; k < EARLY; ++k)
    if (sg + split_groups * k < n_splits) o_early[k] = *reinterpret_cast<const uint4*>(part + (sg + split_groups * k) * part_step);
  float mx = -INFINITY;
  for (int s = tid; s < n_splits; s += 128) {
    float v = p.l_part[static_cast<long long>(slot0 + s) * p.rows_pad + r];
    weights[s] = v;
    mx = fmaxf(mx, v);
  }
  __syncthreads();  // tree[] masked
  for (int j = tid; j < D; j += 128) mx = fmaxf(mx, tree[j]);
  mx = block_reduce(mx, red4, true);
  if (mx == -INFINITY) mx = 0.f;  // nothing visible: the sums below are 0
  float sum = 0.f;
  for (int s = tid; s < n_splits; s += 128) {
    float w = exp2f(weights[s] - mx);
    weights[s] = w;
    sum += w;
  }
  for (int j = tid; j < D; j += 128) sum += exp2f(tree[j] - mx);
  sum = block_reduce(sum, red4, false);  // its barriers also publish weights[]

  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < EARLY; ++k) {
    const int s = sg + split_groups * k;
    if (s < n_splits) add_scaled(acc, o_early[k], weights[s]);
  }
  int s = sg + split_groups * EARLY;
  const __nv_bfloat16* src = part + s * part_step;
  for (; s + 3 * split_groups < n_splits; s += 4 * split_groups, src += 4 * group_step) {  // four loads in flight
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = *reinterpret_cast<const uint4*>(src + k * group_step);
#pragma unroll
    for (int k = 0; k < 4; ++k) add_scaled(acc, v[k], weights[s + split_groups * k]);
  }
  for (; s < n_splits; s += split_groups, src += group_step)
    add_scaled(acc, *reinterpret_cast<const uint4*>(src), weights[s]);
#pragma unroll
  for (int k = 0; k < EARLY; ++k) {
    const int j = sg + split_groups * k;
    if (j < D) add_scaled(acc, v_early[k], exp2f(tree[j] - mx));
  }
  for (int j = sg + split_groups * EARLY; j < D; j += split_groups) {
    const float w = exp2f(tree[j] - mx);
    if (w > 0.f) add_scaled(acc, *reinterpret_cast<const uint4*>(p.v_ext + (q0 + j) * p.ve_stride + col), w);
  }
  // The split groups' sums through shared memory, 16 bytes a store and a load; each thread of the
  // first width / 4 writes 4 output values.
  float4* red4v = reinterpret_cast<float4*>(&red[0][0]);  // [split_groups][width / 4]
  red4v[(sg * width + dg * 8) / 4] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  red4v[(sg * width + dg * 8) / 4 + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  __syncthreads();
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (tid < width / 4) {
    float4 o = red4v[tid];
    for (int g = 1; g < split_groups; ++g) {
      const float4 w = red4v[g * (width / 4) + tid];
      o.x += w.x, o.y += w.y, o.z += w.z, o.w += w.w;
    }
    __nv_bfloat162 lo = __floats2bfloat162_rn(o.x * inv, o.y * inv), hi = __floats2bfloat162_rn(o.z * inv, o.w * inv);
    uint2 packed = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
    *reinterpret_cast<uint2*>(p.out + (q0 + i) * p.out_stride_t + h * p.out_stride_h + slice * width + 4 * tid) = packed;
  }
  if (p.lse != nullptr && slice == 0 && tid == 0) {
    p.lse[(q0 + i) * p.lse_stride_t + h * p.lse_stride_h] =
        sum > 0.f ? (mx + log2f(sum)) * 0.6931471805599453f : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Layout probe: one tile through the same descriptors, swizzle and P^T store as the split
// kernel (the GPU tests compare it with torch): S^T = K Q^T and O^T = V^T P^T for 40 rows.
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(128) probe_kernel(const __nv_bfloat16* k, const __nv_bfloat16* q,
                                                    const __nv_bfloat16* pm, float* s_out, float* o_out) {
  constexpr int N = 40, NV = N / 2;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* k_s = smem;                                   // 9 blocks of 64 rows
  uint8_t* q_s = smem + BLOCKS_PER_TILE * BLOCK_BYTES;   // 9 blocks of N rows
  uint8_t* p_s = q_s + BLOCKS_PER_TILE * N * 128;        // P^T: N rows of 64 tokens
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < TILE * KV_DIM; i += 128) {
    int r = i / KV_DIM, c = i % KV_DIM;
    *reinterpret_cast<__nv_bfloat16*>(k_s + (c / 64) * BLOCK_BYTES + sw128_offset(r, c % 64)) = k[i];
  }
  for (int i = tid; i < N * KV_DIM; i += 128) {
    int r = i / KV_DIM, c = i % KV_DIM;
    *reinterpret_cast<__nv_bfloat16*>(q_s + (c / 64) * (N * 128) + sw128_offset(r, c % 64)) = q[i];
  }
  for (int i = tid; i < TILE * N; i += 128) {  // pm [64 tokens, N rows] -> P^T
    int tok = i / N, c = i % N;
    *reinterpret_cast<__nv_bfloat16*>(p_s + sw128_offset(c, tok)) = pm[i];
  }
  fence_async_shared();
  __syncthreads();
  float s_acc[NV];
  float o_acc[8][NV];
#pragma unroll
  for (int d = 0; d < 8; ++d)
#pragma unroll
    for (int v = 0; v < NV; ++v) o_acc[d][v] = 0.f;
  wgmma_fence();
  for (int blk = 0; blk < BLOCKS_PER_TILE; ++blk)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      Wgmma<N>::mma<0, 0>(s_acc, sw128_desc(smem_addr(k_s + blk * BLOCK_BYTES) + ks * 32),
                          sw128_desc(smem_addr(q_s + blk * (N * 128)) + ks * 32), blk > 0 || ks > 0);
#pragma unroll
  for (int d = 0; d < 8; ++d)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      Wgmma<N>::mma<1, 0>(o_acc[d], sw128_desc(smem_addr(k_s + d * BLOCK_BYTES) + ks * 2048),
                          sw128_desc(smem_addr(p_s) + ks * 32), 1);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s_acc);
#pragma unroll
  for (int d = 0; d < 8; ++d) fence_regs(o_acc[d]);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 16 * warp + (lane >> 2) + 8 * h, c = 8 * j + 2 * (lane & 3) + e;
        s_out[r * N + c] = s_acc[4 * j + 2 * h + e];
#pragma unroll
        for (int d = 0; d < 8; ++d) o_out[(64 * d + r) * N + c] = o_acc[d][4 * j + 2 * h + e];
      }
}

}  // namespace mlav

// ---------------------------------------------------------------------------------------------
// Host entry points (C ABI, loaded with ctypes by mla_verify_sm90.py)
// ---------------------------------------------------------------------------------------------

namespace {

// Row splits between the two consumer warpgroups; the loader picks the smallest that holds
// a row block: 16, 32, 48, 64 or 72 rows.
#define MLAV_VARIANTS(X) X(0, 8, 8) X(1, 16, 16) X(2, 24, 24) X(3, 32, 32) X(4, 40, 32)

// Per device, from mlav_setup: SMs, and CTAs of the combine kernel's <0, 3> instance resident per SM.
constexpr int MAX_DEVICES = 64;
int g_num_sms[MAX_DEVICES];
int g_keys3_per_sm[MAX_DEVICES];
// The driver's TMA map encoder, found once by mlav_setup.
PFN_cuTensorMapEncodeTiled_v12000 g_encode_tiled = nullptr;

template <int N0, int N1>
cudaError_t set_split_attributes() {
  return cudaFuncSetAttribute(mlav::split_kernel<N0, N1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              mlav::SmemPlan<N0, N1>::BYTES);
}

template <int N0, int N1>
cudaError_t launch_split(const mlav::SplitParams& p, cudaStream_t stream) {
  mlav::SplitArgs a = {};
  a.p = p;
  if (p.tma_runs) {
    if (g_encode_tiled == nullptr) return cudaErrorInitializationError;
    const cuuint64_t dims[2] = {mlav::KV_DIM, static_cast<cuuint64_t>(p.kv_rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.kv_stride) * sizeof(__nv_bfloat16)};
    const cuuint32_t box[2] = {64, mlav::RUN_TOKENS}, steps[2] = {1, 1};
    if (g_encode_tiled(&a.kv_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.kv), dims, strides,
                       box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  const int smem = mlav::SmemPlan<N0, N1>::BYTES;
  mlav::split_kernel<N0, N1><<<p.grid_x * p.row_blocks, mlav::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int mlav_rows_per_block(int variant) {
  switch (variant) {
#define X(v, a, b) \
  case v:          \
    return a + b;
    MLAV_VARIANTS(X)
#undef X
  }
  return -1;
}

// Rows of a row block in the split kernel's short layout (the workspace must hold its row blocks).
int mlav_short_rows() { return mlav::SHORT_ROWS; }

// KV ring depth (8 KB blocks) of a variant, for the documentation and the benchmark.
int mlav_ring_blocks(int variant) {
  switch (variant) {
#define X(v, a, b) \
  case v:          \
    return mlav::SmemPlan<a, b>::RING_BLOCKS;
    MLAV_VARIANTS(X)
#undef X
  }
  return -1;
}

void mlav_struct_sizes(int* split, int* combine) {
  *split = static_cast<int>(sizeof(mlav::SplitParams));
  *combine = static_cast<int>(sizeof(mlav::CombineParams));
}

// Once per process and device, outside graph capture: shared-memory limits of every variant.
// This library links its own CUDA runtime, so every entry point selects the caller's device.
int mlav_setup(int device) {
  if (device < 0 || device >= MAX_DEVICES) return static_cast<int>(cudaErrorInvalidDevice);
  cudaError_t err = cudaSetDevice(device);
#define X(v, a, b) \
  if (err == cudaSuccess) err = set_split_attributes<a, b>();
  MLAV_VARIANTS(X)
#undef X
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(mlav::probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&g_num_sms[device], cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_keys3_per_sm[device], mlav::combine_kernel<0, 3>, 128, 0);
  if (err == cudaSuccess && g_encode_tiled == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (err == cudaSuccess && found != cudaDriverEntryPointSuccess) err = cudaErrorSymbolNotFound;
    if (err == cudaSuccess) g_encode_tiled = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return static_cast<int>(err);
}

const char* mlav_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

// Split kernel then combine kernel on `stream`; no allocation, no synchronisation.
int mlav_forward(int variant, const mlav::SplitParams* sp, const mlav::CombineParams* cp,
                 void* stream_ptr, int pdl, int device) {
  if (device < 0 || device >= MAX_DEVICES) return static_cast<int>(cudaErrorInvalidDevice);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaErrorInvalidValue;
  switch (variant) {
#define X(v, a, b)                          \
  case v:                                   \
    err = launch_split<a, b>(*sp, stream); \
    break;
    MLAV_VARIANTS(X)
#undef X
  }
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaLaunchConfig_t cfg = {};
  if (cp->slices != 1 && cp->slices != 2 && cp->slices != 4) return static_cast<int>(cudaErrorInvalidValue);
  cfg.gridDim = dim3(cp->heads, cp->d_max, cp->batch * cp->slices);  // (head, draft, request x slice)
  cfg.blockDim = dim3(128, 1, 1);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  // Four slices (by combine_slices, only grids of at most 3 CTAs per SM): the wide instance; else <0, 3>
  // while its CTAs fit one wave, else the lean one (docs/verify-kernel-log.md#the-own-sm90-kernel-page-size-1).
  const long long ctas = static_cast<long long>(cfg.gridDim.x) * cfg.gridDim.y * cfg.gridDim.z;
  if (cp->slices == 4)
    err = cudaLaunchKernelEx(&cfg, mlav::combine_kernel<4, 3>, *cp);
  else if (ctas <= static_cast<long long>(g_keys3_per_sm[device]) * g_num_sms[device])
    err = cudaLaunchKernelEx(&cfg, mlav::combine_kernel<0, 3>, *cp);
  else
    err = cudaLaunchKernelEx(&cfg, mlav::combine_kernel<0, 1>, *cp);
  return static_cast<int>(err);
}

int mlav_probe(const void* k, const void* q, const void* pm, float* s_out, float* o_out, void* stream_ptr,
               int device) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int smem = mlav::BLOCKS_PER_TILE * mlav::BLOCK_BYTES + mlav::BLOCKS_PER_TILE * 40 * 128 + 40 * 128;
  mlav::probe_kernel<<<1, 128, smem, static_cast<cudaStream_t>(stream_ptr)>>>(
      static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(q),
      static_cast<const __nv_bfloat16*>(pm), s_out, o_out);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
