// Balanced dispatch among expert replicas: moeplace's fast rule (moeplace/dispatch/balanced.py) on the GPU, and the
// rule by cost (moeplace/dispatch/by_cost.py), which starts from it.
//
// One CTA of kThreads threads per MoE layer and step. The rule itself is sequential (a greedy pass over
// the active multi-replica experts in id order, then breadth-first augmenting paths over <= 32 ranks)
// and runs in warp 0; the data-parallel work around it (loads, tokens per expert, the list of experts,
// the output) is spread over all threads, one barrier per phase:
//
//   1. loads: ids, masks and (when they fit) the whole slot table are copied to shared memory with
//      cp.async, all requested at once: one memory round trip, no registers held. The slots are a second
//      copy group, waited for only before the output, so they arrive while the rule runs;
//   2. tokens per expert: one shared-memory atomic per valid entry (the result does not depend on order);
//   3. the experts, one per thread: a one-replica expert adds to its rank's (load, tok) with shared
//      atomics; the active multi-replica experts form a list in id order (ballot per warp, then each
//      warp's offset from the counts of the warps before it);
//   4. greedy (warp 0): lane r holds rank r's state packed in one word, load << 19 | tok << 5 | r, whose
//      unsigned order is the rule's tie order (fewest experts, fewest tokens, lowest rank); tok <=
//      N*K <= 8192 < 2^14 and load <= min(E, N*K) <= 4096 < 2^13, so fields never overlap. An expert's
//      choice among its replica ranks is one __reduce_min_sync over the candidate lanes;
//   5. augmenting paths (warp 0): per lane b the bit set of ranks a with an edge a -> b (an expert on a
//      that has a replica on b); a BFS level is one ballot, a parent the lowest set bit;
//   6. output: valid rows by the rule, padding rows the lowest replica rank, ids out of range -1.
//
// The rule by cost (moeplace_weighted_cost_dispatch; the kernel's kCost instantiation) adds, when the step has
// at least read / pair valid (token, expert) pairs or, with the row-block term, an expert past its first block
// (phase 3's barriers tell every thread; any other step takes the balanced rule's path, barrier for barrier):
//   5b. moves, up to max_rounds <= kMaxSplit, on all threads: warp 0 leaves each rank's (load, tok) in shared
//      memory, and (with the row-block term) all threads add each rank's row blocks beyond its experts' first
//      (the one-replica experts' were counted in phase 3); a rank costs read * load + pair * tok + block *
//      blocks. A round is one search and at most one move: each warp finds the maximum cost and the ranks at it
//      (a ballot) and ends the moves where no move can win (the cheapest rank plus one pair, and one read unless
//      an expert is split, reaches the maximum: on most steps the last round ends there, before any barrier);
//      each thread takes one list expert (an expert with no tokens on a rank at the maximum is
//      skipped at once) and scores its moves of cost_rule_step (all of its tokens on a rank at the maximum to
//      another replica, the share that levels the two, or the tokens past its last full row block) as 64-bit
//      keys whose order is the rule's (the two ranks' higher cost, the kind of move, list position = expert id
//      order, source, target). Warp minima go to shared memory; after a barrier every warp reduces them itself, so
//      all threads know the move without another broadcast, and the one thread that found it makes it (rank
//      state, the expert's row, its list rank); a second barrier ends the round. A moved expert gets a row of
//      a small table of its tokens per rank (its list rank becomes 32 + row; the row is the round of its first
//      move, so no counter is shared), so memory stays fixed whatever the layout. Warp 0 then keeps each row's
//      ranks with tokens as a bit mask; a moved expert whose tokens all end on one rank (nearly every moved
//      expert on the benchmark's steps: the whole move that sheds a read) is written as an unmoved expert on
//      that rank;
//   6b. output, only when an expert's tokens are split (otherwise 6 as in the balanced rule): its valid
//      entries go to its ranks in increasing rank order, in entry order (moeplace.dispatch.by_cost.pair_slots).
//      Each warp takes a contiguous segment of the entries and writes every other entry at once, counting
//      the split experts' entries (shared atomics) and noting which chunks of 32 hold one; after one barrier
//      it numbers those entries from the counts of the warps before it (a ballot per split expert in such
//      a chunk; the other chunks are not read again) and walks the row's ranks with tokens to its rank.
//
// Loops are rolled: the kernel runs once per SM and pays an instruction fetch for each new line of
// code, which made the earlier one-warp, 16-way unrolled kernel (~2,100 instructions) slow.
//
// Shared memory (bytes): the staged slot table 4ER (only when the total stays <= kStageLimit), the ids
// N*K*sizeof(id), masks and counts 8E (counts are reused for the multi experts' chosen rank), and the
// list (mask, expert, count, rank) 9 min(E, N*K). No global scratch, no host synchronisation: the launch
// is CUDA-graph safe. All ids are in shared memory before any output is written, so ``out`` may alias
// ``ids``.
//
// Cost on an H200 (BENCHMARKS.md, "Balanced dispatch kernel"): 2.9 us per call at 72 ids under graph replay,
// 0.95 us of it the launch; after the loads (one round trip), each phase costs 600-800 cycles and the greedy
// pass ~90 cycles per multi-replica expert. The rule by cost (bench_dispatch, 384 experts, 8 ranks, 96 spare
// slots, q = 281): 5.35 / 7.30 / 8.09 / 9.50 / 11.50 us at 36 / 72 / 144 / 288 / 576 tokens against 5.13 / 7.58 /
// 8.72 / 10.89 / 13.78 for the search in warp 0 before it, same process; the balanced kernel 4.11 / 5.31 / 5.98 /
// 7.01 / 8.38. The moves (5b, phase builds) cost ~800 cycles even with no round (the barrier that starts
// them, warp 0's pass over the list after them) and ~1,100 (36 tokens) to ~1,800 (576) a round, two
// barriers and two block minima each: the warp-0 search (~1,000 a round at 36 tokens, ~2,500 at 576) had
// less fixed cost, so it stays ahead at 36 tokens. Most of the output's extra time is gone: almost every
// move is whole, and such an expert is written by the balanced loop.
//
// Benchmark builds only (scripts/bench_dispatch.py --phases, --variant): BD_STOP_AFTER=n ends the
// kernel after phase n above (-1: at once; 6: after 5b, the moves; 4 and 5 skip them), writing a value
// that depends on it so that nothing is optimised away; BD_CLOCK=1 makes that value (or, for the whole
// kernel, out[0]) the SM cycles since the kernel began. BD_THREADS sets kThreads, BD_STAGE_SLOTS=0 turns the
// slot staging off.

#include <cuda_runtime.h>
#include <climits>
#include <cstdint>

#ifndef BD_STOP_AFTER
#define BD_STOP_AFTER 0
#endif
#ifndef BD_CLOCK
#define BD_CLOCK 0
#endif
#ifndef BD_THREADS
#define BD_THREADS 512
#endif
#ifndef BD_STAGE_SLOTS
#define BD_STAGE_SLOTS 1
#endif

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = BD_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kStageLimit = 40 * 1024;    // dynamic shared memory with the slot table staged
constexpr int kDefaultLimit = 47 * 1024;  // above this (E = 4096, or many int64 ids), opt in to more
constexpr int kMaxSplit = 32;             // rule by cost: moves per step, so experts it may split
constexpr int kLoadShift = 19;            // rank key: load << 19 | tok << 5 | rank
static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024, "BD_THREADS: whole warps");

struct Params {
  const void* ids;        // [N * K] int32 or int64 logical ids, -1 = none
  void* out;              // [N * K] same type: physical slot ids
  const int* masks;       // [E] bit r: a replica on rank r
  const int* slots;       // [E, R] slot of e's replica on rank r, -1 where none
  const void* num_rows;   // device scalar (int32 or int64) or null: rows >= it are padding
  int num_rows_is_64;
  int rows, k, experts, ranks, max_augment;
  int stage_slots;        // 1: the slot table is copied to shared memory
  // rule by cost (kCost only): a rank costs read * load + pair * tok + block * (row blocks beyond each expert's
  // first, of block_m rows; block_m >= 1)
  int read, pair, block, block_m;
  int max_rounds;         // rule by cost: moves per step, <= kMaxSplit (kCost only)
};

// Row blocks beyond the first of an expert with ``tokens`` on one rank.
__device__ __forceinline__ int extra_blocks_of(int tokens, int block_m) {
  return tokens > 0 ? (tokens - 1) / block_m : 0;
}

// Byte offsets of the dynamic shared memory, 16-byte aligned; the same function sizes the launch.
struct SmemLayout {
  int slots, ids, masks, counts, list_m, list_e, list_c, list_r, bytes;
};

__host__ __device__ inline int align16(int bytes) { return (bytes + 15) & ~15; }

__host__ __device__ inline SmemLayout smem_layout(int experts, int ranks, int entries, int id_bytes,
                                                  bool stage_slots) {
  const int cap = experts < entries ? experts : entries;
  SmemLayout s;
  s.slots = 0;
  s.ids = s.slots + (stage_slots ? align16(4 * experts * ranks) : 0);
  s.masks = s.ids + align16(id_bytes * entries);
  s.counts = s.masks + align16(4 * experts);
  s.list_m = s.counts + align16(4 * experts);
  s.list_e = s.list_m + align16(4 * cap);
  s.list_c = s.list_e + align16(2 * cap);
  s.list_r = s.list_c + align16(2 * cap);
  s.bytes = s.list_r + align16(cap);
  return s;
}

// A rank's greedy key: (load, tok, rank) compared as one unsigned.
__device__ __forceinline__ unsigned rank_key_of(int load, int tok, int rank) {
  return (static_cast<unsigned>(load) << kLoadShift) | (static_cast<unsigned>(tok) << 5) | static_cast<unsigned>(rank);
}

__device__ __forceinline__ int known_id(long long id, int experts) {
  return id >= 0 && id < experts ? static_cast<int>(id) : -1;
}

template <int kBytes>
__device__ __forceinline__ void copy_async(void* smem_dst, const void* src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(kBytes) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Copy ``bytes`` (a multiple of 4) from global ``src`` to 16-byte aligned shared ``dst``, split over the
// CTA: 16-byte pieces when ``src`` is 16-byte aligned, 4-byte pieces for the rest.
__device__ __forceinline__ void stage(unsigned char* dst, const void* src, int bytes) {
  const unsigned char* from = static_cast<const unsigned char*>(src);
  const int head = (reinterpret_cast<uintptr_t>(from) & 15u) == 0 ? bytes & ~15 : 0;
#pragma unroll 1
  for (int o = 16 * static_cast<int>(threadIdx.x); o < head; o += 16 * kThreads) copy_async<16>(dst + o, from + o);
#pragma unroll 1
  for (int o = head + 4 * static_cast<int>(threadIdx.x); o < bytes; o += 4 * kThreads)
    copy_async<4>(dst + o, from + o);
}

template <typename Id>
__device__ __forceinline__ bool stop_here(int phase, Id* out, int entries, int value, long long start) {
  if (BD_STOP_AFTER != phase) return false;
  __syncthreads();
  if (BD_CLOCK) value = static_cast<int>(clock64() - start);
  if (static_cast<int>(threadIdx.x) < entries) out[threadIdx.x] = static_cast<Id>(value);
  return true;
}

// Slot of entry i (id known or -1) where no moved expert is involved: valid rows of a multi-replica expert
// the rule's rank (cnt[id]), padding rows the lowest replica rank, ids with no replica -1.
__device__ __forceinline__ int plain_slot(int i, int id, unsigned m, const int* cnt, const int* sslots,
                                          const Params& p, int valid) {
  if (m == 0) return -1;
  const int r = (i < valid && (m & (m - 1)) != 0) ? cnt[id] : __ffs(m) - 1;
  return p.stage_slots ? sslots[id * p.ranks + r] : __ldg(p.slots + id * p.ranks + r);
}

// Phase 6b, only when a move left an expert's tokens on two ranks or more: the valid entries of split expert
// j (cnt[id] = 32 + j) go to its ranks in increasing rank order, split_alloc[j][r] of them to rank r, in
// entry order. Each warp takes a contiguous segment of the entries. Pass 1 writes every other entry at once
// and counts the split experts' entries (few: shared atomics), noting which chunks of 32 hold one; after one
// barrier, pass 2 numbers those entries from the counts of the warps before it, one ballot per split expert
// in a chunk, and walks the expert's ranks with tokens (split_nz[j]) to the entry's.
template <typename Id, int kSplit>
__device__ __forceinline__ void write_with_splits(const Id* sids, Id* out, const unsigned* msk, const int* cnt,
                                                  const int* sslots, const Params& p, int valid, int entries,
                                                  int (*split_alloc)[32], const unsigned* split_nz,
                                                  int (*split_count)[kSplit]) {
  const int E = p.experts, R = p.ranks, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned rank_bits = R >= 32 ? kFull : (1u << R) - 1u;
  const int segment = (entries + 32 * kWarps - 1) / (32 * kWarps) * 32;   // whole chunks of 32 per warp
  const int first = warp * segment, last = min(first + segment, entries);
  // (id, moved expert or -1) of entry i; only valid rows of a multi-replica expert can be moved
  auto entry = [&](int i, int& id, unsigned& m) {
    id = i < last ? known_id(static_cast<long long>(sids[i]), E) : -1;
    m = id >= 0 ? msk[id] & rank_bits : 0u;
    return i < valid && (m & (m - 1)) != 0 && cnt[id] >= 32 ? cnt[id] - 32 : -1;
  };
  split_count[warp][lane] = 0;
  __syncwarp();
  unsigned long long marked = 0;   // bit c: chunk c of the segment holds a moved expert's entry
#pragma unroll 1
  for (int base = first, c = 0; base < last; base += 32, ++c) {
    int id;
    unsigned m;
    const int i = base + lane, j = entry(i, id, m);
    if (j >= 0) atomicAdd(&split_count[warp][j], 1);
    else if (i < last) out[i] = static_cast<Id>(plain_slot(i, id, m, cnt, sslots, p, valid));
    if (__ballot_sync(kFull, j >= 0) != 0 && c < 64) marked |= 1ull << c;
  }
  __syncthreads();
  int before = 0;   // lane j: moved expert j's entries ahead of this point in entry order
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    if (w < warp) before += split_count[w][lane];
#pragma unroll 1
  for (int base = first, c = 0; base < last; base += 32, ++c) {
    if (c < 64 && !((marked >> c) & 1ull)) continue;   // uniform over the warp
    int id;
    unsigned m;
    const int i = base + lane, j = entry(i, id, m);
    unsigned pending = __ballot_sync(kFull, j >= 0);
    while (pending != 0) {
      const int jj = __shfl_sync(kFull, j, __ffs(pending) - 1);
      const unsigned group = __ballot_sync(kFull, j == jj);
      const int ahead = __shfl_sync(kFull, before, jj);
      pending &= ~group;
      if (j == jj) {
        const int position = ahead + __popc(group & ((1u << lane) - 1u));
        unsigned ranks = split_nz[jj];                // its ranks with tokens, in increasing order
        int r = __ffs(ranks) - 1, end = split_alloc[jj][r];
        while (position >= end) {
          ranks &= ranks - 1;
          r = __ffs(ranks) - 1;
          end += split_alloc[jj][r];
        }
        out[i] = static_cast<Id>(p.stage_slots ? sslots[id * R + r] : __ldg(p.slots + id * R + r));
      }
      if (lane == jj) before += __popc(group);
    }
  }
}

// The least of the warp's 64-bit values (two reductions: the high words, then the low words beside the least).
__device__ __forceinline__ unsigned long long warp_min(unsigned long long v) {
  const unsigned high = static_cast<unsigned>(v >> 32), least = __reduce_min_sync(kFull, high);
  const unsigned low = __reduce_min_sync(kFull, high == least ? static_cast<unsigned>(v) : kFull);
  return (static_cast<unsigned long long>(least) << 32) | low;
}

// Phase 5b, every thread: the rule by cost's moves (moeplace.dispatch.by_cost.cost_rule_step), each a round of
// the search and one winner; returns the moves made. Rank r's state is (rank_load[r], rank_tok[r],
// rank_blk[r]); list expert i's home is list_r[i], or 32 + its row of split_alloc (its tokens per rank) once
// moved.
__device__ int move_by_cost(const Params& p, int listed, const unsigned* list_m, const short* list_c,
                            unsigned char* list_r, int* rank_load, int* rank_tok, int* rank_blk,
                            int (*split_alloc)[32], unsigned long long* warp_best) {
  const int R = p.ranks, A = p.read, B = p.pair, W = p.block, BM = p.block_m;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pairs =
      static_cast<int>(__reduce_add_sync(kFull, lane < R ? static_cast<unsigned>(rank_tok[lane]) : 0u));
  const int blocks =
      static_cast<int>(__reduce_add_sync(kFull, lane < R ? static_cast<unsigned>(rank_blk[lane]) : 0u));
  const bool search = B * pairs >= A || (W > 0 && blocks > 0);   // step 2 of cost_rule_step
  bool split = false;   // an expert's tokens on two ranks: a move of kind 1 or 2 was made
  int round = 0;
#pragma unroll 1
  for (; BD_STOP_AFTER != 4 && BD_STOP_AFTER != 5 && search && round < p.max_rounds; ++round) {
    const int cost = lane < R ? A * rank_load[lane] + B * rank_tok[lane] + W * rank_blk[lane] : -1;
    const int top = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(cost + 1))) - 1;
    // No move can win when the cheapest rank plus one pair (and one read, unless some expert is split, so that
    // a target may hold it already) reaches the maximum: every move's target ends at least there. Every
    // thread computes this alike, so the loop ends everywhere before the round's first barrier.
    const int low = static_cast<int>(__reduce_min_sync(kFull, lane < R ? static_cast<unsigned>(cost) : ~0u));
    if (low + B + (split ? 0 : A) >= top) break;
    const unsigned at_top = __ballot_sync(kFull, lane < R && cost == top);   // the ranks a move leaves
    unsigned long long best = ~0ull;
    int best_i = 0, best_home = 0, best_moved = 0, best_here = 0, best_there = 0;
#pragma unroll 1
    for (int i = tid; i < listed; i += kThreads) {   // one list expert per thread, more past kThreads
      const unsigned m = list_m[i];
      const int home = list_r[i];
      const int j = home - 32;                       // >= 0: moved before, tokens in split_alloc[j]
      unsigned sources = (j >= 0 ? m : (1u << home)) & at_top;
      if (sources == 0) continue;
      const int c = list_c[i];
#pragma unroll 1
      while (sources != 0) {
        const int src = __ffs(sources) - 1;
        sources &= sources - 1;
        const int here = j >= 0 ? split_alloc[j][src] : c;
        if (here <= 0) continue;
        const int here_blk = W ? extra_blocks_of(here, BM) : 0;
        unsigned targets = m & ~(1u << src);
#pragma unroll 1
        while (targets != 0) {
          const int r = __ffs(targets) - 1;
          targets &= targets - 1;
          const int there = j >= 0 ? split_alloc[j][r] : 0;
          const int dest = A * rank_load[r] + B * rank_tok[r] + W * rank_blk[r] + (there == 0 ? A : 0);
          const int there_blk = W ? extra_blocks_of(there, BM) : 0;
          // the two ranks' higher cost after moving mv tokens (kinds: 0 whole, 1 levelling share, 2 the
          // tokens past the last full row block)
          auto after = [&](int mv) {
            const int left = top - (mv == here ? A : 0) - B * mv -
                             (W ? W * (here_blk - extra_blocks_of(here - mv, BM)) : 0);
            const int arrived = dest + B * mv + (W ? W * (extra_blocks_of(there + mv, BM) - there_blk) : 0);
            return max(left, arrived);
          };
          int value = after(here), kind = 0, moved = here;
          if (B > 0 && here >= 2) {
            const int share = min(max((top - dest) / 2, 1), here - 1);   // C and Python agree from 1 up
            const int level = after(share);
            if (level < value) value = level, kind = 1, moved = share;
          }
          if (W > 0 && here > BM) {
            const int past = here - BM * ((here - 1) / BM);
            const int shed = after(past);
            if (shed < value) value = shed, kind = 2, moved = past;
          }
          // the rule's order: the two ranks' higher cost, the kind, expert (list order is id order), source,
          // target
          const unsigned long long key = (static_cast<unsigned long long>(value) << 24) |
                                         (static_cast<unsigned long long>(kind) << 22) |
                                         (static_cast<unsigned long long>(i) << 10) |
                                         static_cast<unsigned long long>(src << 5 | r);
          if (key < best) best = key, best_i = i, best_home = home, best_moved = moved, best_here = here,
                          best_there = there;
        }
      }
    }
    // the block's minimum: each warp's, then every warp reduces the warps' minima itself (no broadcast)
    unsigned long long chosen = warp_min(best);
    if (lane == 0) warp_best[warp] = chosen;
    __syncthreads();
    chosen = warp_min(lane < kWarps ? warp_best[lane] : ~0ull);
    if (chosen == ~0ull || static_cast<int>(chosen >> 24) >= top) break;
    split = split || ((chosen >> 22) & 3) != 0;
    if (best == chosen) {   // the one thread that found the move makes it
      const int src = static_cast<int>(chosen >> 5) & 31, r = static_cast<int>(chosen) & 31;
      const int j = best_home >= 32 ? best_home - 32 : round;   // a first move: row `round`, still zeros
      const int left = best_here - best_moved, arrived = best_there + best_moved;
      split_alloc[j][src] = left;
      split_alloc[j][r] = arrived;
      list_r[best_i] = static_cast<unsigned char>(32 + j);
      rank_tok[src] -= best_moved;
      rank_load[src] -= left == 0;
      rank_tok[r] += best_moved;
      rank_load[r] += best_there == 0;
      if (W) {
        rank_blk[src] += extra_blocks_of(left, BM) - extra_blocks_of(best_here, BM);
        rank_blk[r] += extra_blocks_of(arrived, BM) - extra_blocks_of(best_there, BM);
      }
    }
    __syncthreads();
  }
  return round;
}

template <typename Id, bool kCost>
__global__ void __launch_bounds__(kThreads, 1) balanced_dispatch_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int single_load[32], single_tok[32], warp_multi[kWarps];
  __shared__ unsigned rank_key[32];
  __shared__ int valid_entries;
  // rule by cost only (one element each in the balanced instantiation)
  constexpr int kSplit = kCost ? kMaxSplit : 1, kSplitWarps = kCost ? kWarps : 1;
  __shared__ int split_alloc[kSplit][32];        // tokens of moved expert j on rank r
  __shared__ unsigned split_nz[kSplit];          // its ranks with tokens
  __shared__ int split_count[kSplitWarps][kSplit];
  __shared__ int rank_load[kCost ? 32 : 1], rank_tok[kCost ? 32 : 1], rank_blk[kCost ? 32 : 1];
  __shared__ int single_blk[kCost ? 32 : 1];     // row blocks past the first of the rank's one-replica experts
  __shared__ unsigned long long warp_best[kSplitWarps];
  __shared__ int split_used;
  const int E = p.experts, R = p.ranks, entries = p.rows * p.k;
  const SmemLayout at = smem_layout(E, R, entries, sizeof(Id), p.stage_slots != 0);
  const int* sslots = reinterpret_cast<const int*>(smem + at.slots);   // [E, R] when staged
  const Id* sids = reinterpret_cast<const Id*>(smem + at.ids);          // [entries]
  const unsigned* msk = reinterpret_cast<const unsigned*>(smem + at.masks);
  int* cnt = reinterpret_cast<int*>(smem + at.counts);          // [E] tokens; later the multi experts' rank
  unsigned* list_m = reinterpret_cast<unsigned*>(smem + at.list_m);   // [cap] active multi experts, id order
  short* list_e = reinterpret_cast<short*>(smem + at.list_e);
  short* list_c = reinterpret_cast<short*>(smem + at.list_c);
  unsigned char* list_r = reinterpret_cast<unsigned char*>(smem + at.list_r);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned rank_bits = R >= 32 ? kFull : (1u << R) - 1u;
  Id* out = static_cast<Id*>(p.out);
  const long long start = BD_CLOCK ? clock64() : 0;
  if (stop_here(-1, out, entries, tid, start)) return;

  // 1. loads: the row count, ids and masks in one copy group, the slot table in a second
  long long num_rows = p.rows;
  if (tid == 0 && p.num_rows != nullptr)
    num_rows = p.num_rows_is_64 ? *static_cast<const long long*>(p.num_rows)
                                : *static_cast<const int*>(p.num_rows);
  stage(smem + at.ids, p.ids, entries * static_cast<int>(sizeof(Id)));
  stage(smem + at.masks, p.masks, 4 * E);
  commit_copies();
  if (p.stage_slots) stage(smem + at.slots, p.slots, 4 * E * R);
  commit_copies();
#pragma unroll 1
  for (int e = tid; e < E; e += kThreads) cnt[e] = 0;
  if (tid < 32) {
    single_load[tid] = 0;
    single_tok[tid] = 0;
    if constexpr (kCost) single_blk[tid] = 0;
  }
  if constexpr (kCost) {   // a move's row starts at zero
#pragma unroll 1
    for (int o = tid; o < kSplit * 32; o += kThreads) split_alloc[o >> 5][o & 31] = 0;
  }
  if (tid == 0)
    valid_entries = static_cast<int>(num_rows < 0 ? 0 : (num_rows > p.rows ? p.rows : num_rows)) * p.k;
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();
  const int valid = valid_entries;
  if (stop_here(1, out, entries, static_cast<int>(msk[tid % E]) + valid, start)) return;

  // 2. tokens per expert over the valid entries
#pragma unroll 1
  for (int i = tid; i < valid; i += kThreads) {
    const int id = known_id(static_cast<long long>(sids[i]), E);
    if (id >= 0) atomicAdd(&cnt[id], 1);
  }
  __syncthreads();
  if (stop_here(2, out, entries, cnt[tid % E], start)) return;

  // 3. one-replica experts go to their rank; the others join the list in id order
  int listed = 0;
  bool past_block = false;   // rule by cost: some active expert runs past its first row block
#pragma unroll 1
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + tid;
    int c = 0;
    unsigned m = 0;
    if (e < E) {
      c = cnt[e];
      m = msk[e] & rank_bits;
    }
    const bool active = c > 0 && m != 0;
    const bool multi = active && (m & (m - 1)) != 0;
    if constexpr (kCost) past_block = past_block || (p.block > 0 && active && c > p.block_m);
    if (active && !multi) {
      const int r = __ffs(m) - 1;
      atomicAdd(&single_load[r], 1);
      atomicAdd(&single_tok[r], c);
      if constexpr (kCost) {
        if (p.block > 0 && c > p.block_m) atomicAdd(&single_blk[r], extra_blocks_of(c, p.block_m));
      }
    }
    const unsigned ballot = __ballot_sync(kFull, multi);
    if (lane == 0) warp_multi[warp] = __popc(ballot);
    __syncthreads();
    const unsigned n = lane < kWarps ? static_cast<unsigned>(warp_multi[lane]) : 0u;  // lane w: warp w's
    const int before = listed + static_cast<int>(__reduce_add_sync(kFull, lane < warp ? n : 0u));
    listed += static_cast<int>(__reduce_add_sync(kFull, n));
    if (multi) {
      const int pos = before + __popc(ballot & ((1u << lane) - 1u));
      list_m[pos] = m;
      list_e[pos] = static_cast<short>(e);
      list_c[pos] = static_cast<short>(c);
    }
    if constexpr (kCost) past_block = __syncthreads_or(past_block);   // the same on every thread
    else __syncthreads();
  }
  // Rule by cost: whether a move may be searched at all (the pairs bounded by the valid entries); where not,
  // the step takes the balanced rule's path, without the moves' barriers.
  const bool may_move = kCost && (past_block || p.pair * valid >= p.read);
  if (stop_here(3, out, entries, listed + single_tok[lane], start)) return;

  if (warp == 0) {
    // 4. greedy, in expert id order: the candidate rank with the smallest (load, tok, rank)
    unsigned state = rank_key_of(single_load[lane], single_tok[lane], lane);
    // The next expert's mask and count are read while this one's reduction runs (one entry past the
    // list is still inside the shared memory: the next array follows).
    unsigned m = list_m[0], c = static_cast<unsigned>(list_c[0]);
#pragma unroll 1
    for (int i = 0; i < listed; ++i) {
      const unsigned m_next = list_m[i + 1], c_next = static_cast<unsigned>(list_c[i + 1]);
      const unsigned best = __reduce_min_sync(kFull, (m >> lane) & 1u ? state : kFull);
      if (best == state) state += (1u << kLoadShift) + (c << 5);
      if (lane == 0) list_r[i] = static_cast<unsigned char>(best & 31u);
      m = m_next;
      c = c_next;
    }
    int load = static_cast<int>(state >> kLoadShift);
    int tok = static_cast<int>((state >> 5) & 0x3fffu);
    __syncwarp();

    // 5. augmenting paths from the ranks of maximum load to a rank of load <= max - 2
    for (int done = 0; BD_STOP_AFTER != 4 && done < p.max_augment; ++done) {
      const int top = __reduce_max_sync(kFull, lane < R ? load : 0);
      const int low = __reduce_min_sync(kFull, lane < R ? load : INT_MAX);
      if (low > top - 2) break;
      unsigned from = 0;  // ranks with an expert that has a replica on this lane's rank
#pragma unroll 4
      for (int i = 0; i < listed; ++i) from |= ((list_m[i] >> lane) & 1u) << list_r[i];
      const unsigned roots = __ballot_sync(kFull, lane < R && load == top);
      unsigned seen = roots, level = roots;
      int parent = -1, target = -1;
      while (level != 0 && target < 0) {
        const unsigned edges = from & level;
        const bool reached = lane < R && !((seen >> lane) & 1u) && edges != 0;
        if (reached) parent = __ffs(edges) - 1;  // the lowest rank of the level
        const unsigned next = __ballot_sync(kFull, reached);
        const bool hit = reached && load <= top - 2;
        if (__ballot_sync(kFull, hit) != 0)
          target = static_cast<int>(
              __reduce_min_sync(kFull, hit ? (static_cast<unsigned>(load) << 5) | lane : kFull) & 31u);
        seen |= next;
        level = next;
      }
      if (target < 0) break;
      int b = target;
      while (!((roots >> b) & 1u)) {  // move one expert along each edge, from the target back
        const int a = __shfl_sync(kFull, parent, b);
        int moved = -1;
        for (int base = 0; base < listed && moved < 0; base += 32) {
          const int j = base + lane;
          const bool ok = j < listed && list_r[j] == a && ((list_m[j] >> b) & 1u);
          const unsigned ballot = __ballot_sync(kFull, ok);
          if (ballot != 0) moved = base + __ffs(ballot) - 1;  // the lowest expert id
        }
        const int c = list_c[moved];
        __syncwarp();
        if (lane == 0) list_r[moved] = static_cast<unsigned char>(b);
        if (lane == a) tok -= c;
        if (lane == b) tok += c;
        __syncwarp();
        b = a;
      }
      if (lane == b) load -= 1;
      if (lane == target) load += 1;
    }
    if (may_move) {   // the moves' start
      rank_load[lane] = load;
      rank_tok[lane] = tok;
      rank_blk[lane] = single_blk[lane];
    } else {
      rank_key[lane] = rank_key_of(load, tok, lane);
#pragma unroll 1
      for (int i = lane; i < listed; i += 32) cnt[list_e[i]] = list_r[i];
      if (kCost && lane == 0) split_used = 0;
    }
  }
  if constexpr (kCost) {
    if (may_move) {
      __syncthreads();
      if (p.block > 0) {   // the list experts' row blocks on the rank the balanced rule gave them
#pragma unroll 1
        for (int i = tid; i < listed; i += kThreads)
          if (list_c[i] > p.block_m) atomicAdd(&rank_blk[list_r[i]], extra_blocks_of(list_c[i], p.block_m));
        __syncthreads();
      }
      const int moves = move_by_cost(p, listed, list_m, list_c, list_r, rank_load, rank_tok, rank_blk, split_alloc,
                                     warp_best);
      if (warp == 0) {
        int split = 0;                                  // experts whose tokens stay on two ranks or more
#pragma unroll 1
        for (int j = 0; j < moves; ++j) {               // each row's ranks with tokens (rows no move opened: 0)
          const unsigned ranks = __ballot_sync(kFull, lane < R && split_alloc[j][lane] > 0);
          if (lane == 0) split_nz[j] = ranks;
          split += (ranks & (ranks - 1)) != 0;
        }
        if (lane == 0) split_used = split;
        __syncwarp();
#pragma unroll 1
        for (int i = lane; i < listed; i += 32) {   // a moved expert all on one rank is written as an unmoved one
          int r = list_r[i];
          if (r >= 32 && (split_nz[r - 32] & (split_nz[r - 32] - 1)) == 0) r = __ffs(split_nz[r - 32]) - 1;
          cnt[list_e[i]] = r;
        }
        rank_key[lane] = rank_key_of(rank_load[lane], rank_tok[lane], lane);
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  if (stop_here(4, out, entries, static_cast<int>(rank_key[lane]), start)) return;
  if (stop_here(5, out, entries, static_cast<int>(rank_key[lane]), start)) return;
  if (stop_here(6, out, entries, static_cast<int>(rank_key[lane]), start)) return;

  // 6. slots: valid rows by the rule, padding rows the lowest replica rank, ids out of range -1
  if (!kCost || split_used == 0) {
#pragma unroll 1
    for (int i = tid; i < entries; i += kThreads) {
      const int id = known_id(static_cast<long long>(sids[i]), E);
      const unsigned m = id >= 0 ? msk[id] & rank_bits : 0u;
      out[i] = static_cast<Id>(plain_slot(i, id, m, cnt, sslots, p, valid));
    }
  } else if constexpr (kCost) {
    write_with_splits(sids, out, msk, cnt, sslots, p, valid, entries, split_alloc, split_nz, split_count);
  }
  if (BD_CLOCK) {
    __syncthreads();
    if (tid == 0) out[0] = static_cast<Id>(clock64() - start);
  }
}

template <typename Id, bool kCost>
int launch(const Params& p, int smem, cudaStream_t stream) {
  if (smem > kDefaultLimit) {
    const cudaError_t err = cudaFuncSetAttribute(balanced_dispatch_kernel<Id, kCost>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  balanced_dispatch_kernel<Id, kCost><<<1, kThreads, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Bytes of dynamic shared memory a launch needs; *stage_slots: whether the slot table is staged.
int moeplace_balanced_dispatch_smem(int experts, int ranks, int entries, int id_bytes, int* stage_slots) {
  const SmemLayout staged = smem_layout(experts, ranks, entries, id_bytes, true);
  *stage_slots = BD_STAGE_SLOTS && staged.bytes <= kStageLimit;
  return *stage_slots ? staged.bytes : smem_layout(experts, ranks, entries, id_bytes, false).bytes;
}

// Launch on ``stream``; returns a cudaError_t (0 on success). ids_are_64: int64 ids and out.
int moeplace_balanced_dispatch(const void* ids, void* out, const int* masks, const int* slots,
                               const void* num_rows, int num_rows_is_64, int ids_are_64, int rows,
                               int k, int experts, int ranks, int max_augment, void* stream) {
  Params p{ids, out, masks, slots, num_rows, num_rows_is_64, rows, k, experts, ranks, max_augment, 0, 0, 0, 0, 1, 0};
  const int smem = moeplace_balanced_dispatch_smem(experts, ranks, rows * k, ids_are_64 ? 8 : 4,
                                                   &p.stage_slots);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return ids_are_64 ? launch<long long, false>(p, smem, s) : launch<int, false>(p, smem, s);
}

// The rule by cost: a rank costs read * load + pair * tok + block * extra row blocks of block_m rows (read >= 1,
// pair and block >= 0, block_m >= 1 where block > 0), max_rounds in [0, 32] moves; otherwise as above.
int moeplace_weighted_cost_dispatch(const void* ids, void* out, const int* masks, const int* slots,
                                    const void* num_rows, int num_rows_is_64, int ids_are_64, int rows, int k,
                                    int experts, int ranks, int max_augment, int read, int pair, int block,
                                    int block_m, int max_rounds, void* stream) {
  if (read < 1 || pair < 0 || block < 0 || (block > 0 && block_m < 1) || max_rounds < 0 || max_rounds > kMaxSplit)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p{ids, out, masks, slots, num_rows, num_rows_is_64, rows, k, experts, ranks, max_augment, 0,
           read, pair, block, block > 0 ? block_m : 1, max_rounds};
  const int smem = moeplace_balanced_dispatch_smem(experts, ranks, rows * k, ids_are_64 ? 8 : 4,
                                                   &p.stage_slots);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return ids_are_64 ? launch<long long, true>(p, smem, s) : launch<int, true>(p, smem, s);
}

const char* moeplace_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // extern "C"
