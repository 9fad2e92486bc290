// Balanced dispatch among expert replicas: moeplace's fast rule (moeplace/balanced.py) on the GPU.
//
// One warp, one CTA, one launch per MoE layer and step. The rule is sequential (a greedy pass over the
// active multi-replica experts in id order, then breadth-first augmenting paths over <= 32 ranks), and
// its input is small (N*K <= 1024 entries), so the whole problem lives in one warp:
//
//   * lane r holds rank r's state: distinct experts (load) and tokens (tok), packed into one word
//     (load << 16 | tok << 5 | r) whose unsigned order is the rule's tie order (fewest experts, then
//     fewest tokens, then lowest rank); tok <= N*K <= 1024 < 2^11, load <= 1024, so fields never overlap;
//   * an expert's choice among its replica ranks is one __reduce_min_sync over the candidate lanes;
//   * the list of active multi-replica experts is built in id order with ballots, so the greedy pass and
//     every "lowest expert id" tie-break read it front to back;
//   * the augmenting-path search keeps, per lane b, the bit set of ranks a with an edge a -> b (an
//     expert on a that has a replica on b): a BFS level is one ballot, a parent is the lowest set bit.
//
// Shared memory: counts [E] (reused for the multi experts' chosen rank), masks [E], the ids [N*K] as
// int16, and the multi list (expert, mask, count, rank) of at most min(E, N*K) entries:
// 8E + 13 min(E, N*K) + 2 N*K bytes, < 48 KB for E <= 4096 and N*K <= 1024. No global scratch, no host
// synchronisation: the launch is CUDA-graph safe. All ids are copied to shared memory before any output
// is written, so ``out`` may alias ``ids``.
//
// Cost on an H200 (BENCHMARKS.md, "Balanced dispatch kernel"): 6.1 us per call at 72 ids under graph
// replay, of which 0.95 us is the launch; the rule itself (greedy, augmenting paths) is a small part,
// the one-warp data movement around it the large one.
//
// Benchmark builds only (scripts/bench_dispatch.py --phases): BD_STOP_AFTER=n ends the kernel after
// phase n below (-1: at once), writing a value that depends on it so that nothing is optimised away;
// BD_CLOCK=1 makes that value (or, for the whole kernel, out[0]) the SM cycles since the kernel began.

#include <cuda_runtime.h>
#include <climits>
#include <cstdint>

#ifndef BD_STOP_AFTER
#define BD_STOP_AFTER 0
#endif
#ifndef BD_CLOCK
#define BD_CLOCK 0
#endif

namespace {

constexpr unsigned kFull = 0xffffffffu;

struct Params {
  const void* ids;        // [N * K] int32 or int64 logical ids, -1 = none
  void* out;              // [N * K] same type: physical slot ids
  const int* masks;       // [E] bit r: a replica on rank r
  const int* slots;       // [E, R] slot of e's replica on rank r, -1 where none
  const void* num_rows;   // device scalar (int32 or int64) or null: rows >= it are padding
  int num_rows_is_64;
  int rows, k, experts, ranks, max_augment;
};

constexpr int kBatch = 16;  // global loads a lane issues before it waits for the first

__device__ __forceinline__ short known_id(long long id, int experts) {
  return id >= 0 && id < experts ? static_cast<short>(id) : static_cast<short>(-1);
}

template <typename Id>
__device__ __forceinline__ bool stop_here(int phase, Id* out, int entries, int value, long long start) {
  if (BD_STOP_AFTER != phase) return false;
  __syncwarp();
  if (BD_CLOCK) value = static_cast<int>(clock64() - start);
  if (static_cast<int>(threadIdx.x) < entries) out[threadIdx.x] = static_cast<Id>(value);
  return true;
}

template <typename Id>
__global__ void __launch_bounds__(32, 1) balanced_dispatch_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int single_load[32], single_tok[32];
  const int E = p.experts, R = p.ranks, entries = p.rows * p.k;
  const int cap = min(E, entries);
  int* cnt = reinterpret_cast<int*>(smem);                // [E] tokens; later the multi experts' rank
  unsigned* msk = reinterpret_cast<unsigned*>(cnt + E);   // [E]
  int* list_e = reinterpret_cast<int*>(msk + E);          // [cap] active multi experts, id order
  unsigned* list_m = reinterpret_cast<unsigned*>(list_e + cap);
  int* list_c = reinterpret_cast<int*>(list_m + cap);
  short* sid = reinterpret_cast<short*>(list_c + cap);    // [entries] id, -1 if none or out of range
  unsigned char* list_r = reinterpret_cast<unsigned char*>(sid + entries);
  const int lane = threadIdx.x;
  const unsigned rank_bits = R >= 32 ? kFull : (1u << R) - 1u;
  const Id* ids = static_cast<const Id*>(p.ids);
  Id* out = static_cast<Id*>(p.out);
  const long long start = BD_CLOCK ? clock64() : 0;
  if (stop_here(-1, out, entries, lane, start)) return;

  // 1. tokens per expert over the valid entries. The first batch of ids, the masks and the row count
  // are all requested before any of them is used: one memory latency, not three.
  long long num_rows = p.rows;
  if (p.num_rows != nullptr)
    num_rows = p.num_rows_is_64 ? *static_cast<const long long*>(p.num_rows)
                                : *static_cast<const int*>(p.num_rows);
  long long first[kBatch];
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int i = lane + 32 * j;
    first[j] = i < entries ? static_cast<long long>(ids[i]) : -1;
  }
  single_load[lane] = 0;
  single_tok[lane] = 0;
  for (int base = 0; base < E; base += 32 * kBatch) {
    unsigned m[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = base + lane + 32 * j;
      m[j] = e < E ? static_cast<unsigned>(__ldg(p.masks + e)) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = base + lane + 32 * j;
      if (e < E) {
        msk[e] = m[j] & rank_bits;
        cnt[e] = 0;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int i = lane + 32 * j;
    if (i < entries) sid[i] = known_id(first[j], E);
  }
  for (int i = lane + 32 * kBatch; i < entries; i += 32) sid[i] = known_id(static_cast<long long>(ids[i]), E);
  const int valid = static_cast<int>(num_rows < 0 ? 0 : (num_rows > p.rows ? p.rows : num_rows)) * p.k;
  __syncwarp();
  for (int i = lane; i < valid; i += 32) {
    const int id = sid[i];
    if (id >= 0) atomicAdd(&cnt[id], 1);
  }
  __syncwarp();
  if (stop_here(1, out, entries, cnt[lane % E], start)) return;

  // 2. one-replica experts go to their rank; the others join the list in id order
  int listed = 0;
  for (int base = 0; base < E; base += 32) {
    const int e = base + lane;
    int c = 0;
    unsigned m = 0;
    if (e < E) {
      c = cnt[e];
      m = msk[e];
    }
    const bool active = c > 0 && m != 0;
    const bool multi = active && (m & (m - 1)) != 0;
    if (active && !multi) {
      const int r = __ffs(m) - 1;
      atomicAdd(&single_load[r], 1);
      atomicAdd(&single_tok[r], c);
    }
    const unsigned ballot = __ballot_sync(kFull, multi);
    if (multi) {
      const int pos = listed + __popc(ballot & ((1u << lane) - 1u));
      list_e[pos] = e;
      list_m[pos] = m;
      list_c[pos] = c;
    }
    listed += __popc(ballot);
  }
  __syncwarp();
  if (stop_here(2, out, entries, listed + single_tok[lane], start)) return;

  // 3. greedy, in expert id order: the candidate rank with the smallest (load, tok, rank)
  unsigned state = (static_cast<unsigned>(single_load[lane]) << 16) |
                   (static_cast<unsigned>(single_tok[lane]) << 5) | lane;
#pragma unroll 4
  for (int i = 0; i < listed; ++i) {
    const unsigned m = list_m[i];
    const unsigned c = static_cast<unsigned>(list_c[i]);
    const unsigned best = __reduce_min_sync(kFull, (m >> lane) & 1u ? state : kFull);
    if (best == state) state += (1u << 16) + (c << 5);
    if (lane == 0) list_r[i] = static_cast<unsigned char>(best & 31u);
  }
  int load = static_cast<int>(state >> 16);
  int tok = static_cast<int>((state >> 5) & 0x7ffu);
  __syncwarp();
  if (stop_here(3, out, entries, static_cast<int>(state), start)) return;

  // 4. augmenting paths from the ranks of maximum load to a rank of load <= max - 2
  for (int done = 0; done < p.max_augment; ++done) {
    const int top = __reduce_max_sync(kFull, lane < R ? load : 0);
    const int low = __reduce_min_sync(kFull, lane < R ? load : INT_MAX);
    if (low > top - 2) break;
    unsigned from = 0;  // ranks with an expert that has a replica on this lane's rank
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

  if (stop_here(4, out, entries, load + tok, start)) return;

  // 5. slots: valid rows by the rule, padding rows the lowest replica rank, ids out of range -1
  for (int i = lane; i < listed; i += 32) cnt[list_e[i]] = list_r[i];
  __syncwarp();
  for (int base = 0; base < entries; base += 32 * kBatch) {
    int slot[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + lane + 32 * j;
      const int id = i < entries ? sid[i] : -1;
      const unsigned m = id >= 0 ? msk[id] : 0u;
      slot[j] = -1;
      if (m != 0) {
        const int r = (i < valid && (m & (m - 1)) != 0) ? cnt[id] : __ffs(m) - 1;
        slot[j] = __ldg(p.slots + id * R + r);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + lane + 32 * j;
      if (i < entries) out[i] = static_cast<Id>(slot[j]);
    }
  }
  if (BD_CLOCK) {
    __syncwarp();
    if (lane == 0) out[0] = static_cast<Id>(clock64() - start);
  }
}

}  // namespace

extern "C" {

// Bytes of dynamic shared memory a launch needs.
int moeplace_balanced_dispatch_smem(int experts, int entries) {
  const int cap = experts < entries ? experts : entries;
  return 8 * experts + 13 * cap + 2 * entries;
}

// Launch on ``stream``; returns a cudaError_t (0 on success). ids_are_64: int64 ids and out.
int moeplace_balanced_dispatch(const void* ids, void* out, const int* masks, const int* slots,
                               const void* num_rows, int num_rows_is_64, int ids_are_64, int rows,
                               int k, int experts, int ranks, int max_augment, void* stream) {
  Params p{ids, out, masks, slots, num_rows, num_rows_is_64, rows, k, experts, ranks, max_augment};
  const int smem = moeplace_balanced_dispatch_smem(experts, rows * k);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (ids_are_64)
    balanced_dispatch_kernel<long long><<<1, 32, smem, s>>>(p);
  else
    balanced_dispatch_kernel<int><<<1, 32, smem, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

const char* moeplace_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // extern "C"
