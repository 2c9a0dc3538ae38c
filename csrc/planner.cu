// GPU planner: the `static` and `topoep` policies of topoep/planners/reference.py and `topoep_plus` of
// topoep/planners/plus.py, bit for bit.
//
// Every decision is integer and breaks ties by the lowest index, exactly as the reference (its module
// docstring is the spec). No host synchronisation: sizes come from the tensor shapes, data never leaves
// the device.
//
// `topoep` is one kernel (a launch costs more than most phases at these sizes), cooperative when it has
// more than one block. Its phases are separated by grid barriers (a block barrier when the grid is one
// block, as at EP 8):
//   1 demand     D[m, e] = sum of omega over domain m's ranks (grid-stride, coalesced over e)
//   2 placement  per domain (a block each): static rank loads L0; stage 1's positive-benefit candidates
//                ranked by counting (D desc, e asc), round robin over the domain's ranks by static load
//   3 instances  position and count of every instance of the stage-1 placement (main first, p order)
//   4 split      stage 2: U0[p], the even split with same-domain preference summed over sources. An
//                expert with one instance takes the short path (its total demand, a thread per instance);
//                the rest a lane group per instance and a shuffle reduction (see ListState)
//   5 refine     stage 3 per domain: one warp, no block barrier in the loop. Lanes are target ranks; a
//                target's best "existing instance" candidate is one of at most 2N shared experts, its best
//                "new replica" candidate the first of the busiest rank's instances in (load desc, expert
//                asc) order not hosted on it, found by warp argmax rounds. Domains of <= 32 ranks with 1-4
//                slots and a total load below 2^26 keep the ranks' loads and slots in registers and compare
//                32-bit keys (refine_warp_fast); the rest keep the state in shared memory (refine_warp)
//   6 route      the never-worse-than-static guard (every block reduces it), empty replicas dropped, and
//                per instance the interval mapping of its (expert, domain) group's sources. Static plans,
//                empty slots and experts that keep one loaded instance take the short path (omega's column,
//                a thread per instance and run of sources); the rest a lane group per instance, a shuffle scan
// `topoep_plus` runs phases 1-5 and the guard as above, then instead of phase 6's route (when the guard did not
// fire):
//   7 moves      the free load moves of plus.py (the busiest rank; candidate pairs filtered on the slot table
//                in shared memory; the best move by a block reduction), until none is left. Every block makes
//                the same moves on its own copy of the loads in shared memory, so no grid barrier follows
//   8-9 route    common.hierarchical_route in two passes and one grid barrier: A per (expert, domain) group
//                (a lane per source of the domain and shuffle scans; own-rank loads, the domain's sources, the
//                group's matched amount m and its instances), B a thread per (source, instance), which adds
//                the prefixes across domains only where a cross-domain share can be nonzero
// Block 0 records a %globaltimer stamp after every phase in the workspace (see phase_ns_offset); the route's
// end, with no grid barrier after it, is the latest block's. topoep_plus stamps its own phases after the
// refinement (plus_moves_offset).
//
// Layout (plan.py): P = E + R*N instances; p < E is expert p's main on rank p / (E / R); p = E + r*N + j
// is slot j of rank r. Default placement main(e) = e / (E / R) only.

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include "planner.h"

namespace topoep {

namespace cg = cooperative_groups;
using i64 = int64_t;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

struct Dims {
  int R, E, M, rpd, N, P, Eloc, G;  // G: instances a rank can hold (its mains, then its slots)
  int gw;                            // lanes per instance in phases 4 and 6 (a power of two <= 32)
  int rw;                            // lanes per (expert, domain) group in topoep_plus's route: the power of two
                                     // >= rpd, or 0 for rpd > 32 (a thread per group)
  int plus_smem;                     // 1: topoep_plus's moves on a copy of the loads per block (Loads)
  int local;                         // 1: one block, omega and the whole state in shared memory
  int skip;                          // kSkip* bits: stages left out, for latency measurements only
  unsigned long long inv_eloc, inv_rpd;  // ceil(2^32 / x): exact x-division of indices < 2^20 for x < 4096
  i64 W, S;
};

// The planner's state between phases: in the global workspace, or (d.local) in shared memory, where a
// single block reaches it without global-memory latency.
struct Work {
  const i64* om;  // omega (the input, or its shared-memory copy)
  i64 *D, *L0, *U, *L, *slot0, *slot1, *T;  // T[e]: total demand of an expert with one instance in stage 1
  int *pos_all0, *pos_dom0, *cnt_all0, *cnt_dom0;
  i64* stamps;  // always global: kNumStamps
};

// i64 elements of the state (D[M*E], L0[R], U[P], L[R], slot0[R*N], slot1[R*N], T[E], then the int
// arrays pos_all0[P], pos_dom0[P], cnt_all0[E], cnt_dom0[M*E], two per i64)
__host__ __device__ inline size_t state_elems(const Dims& d) {
  const size_t i64s = (size_t)d.M * d.E + 2 * (size_t)d.R + d.P + 2 * (size_t)d.R * d.N + d.E;
  const size_t i32s = 2 * (size_t)d.P + d.E + (size_t)d.M * d.E;
  return i64s + (i32s + 1) / 2;
}

__host__ __device__ inline void carve(Work& w, i64* base, const Dims& d) {
  w.D = base;
  w.L0 = w.D + (size_t)d.M * d.E;
  w.U = w.L0 + d.R;
  w.L = w.U + d.P;
  w.slot0 = w.L + d.R;
  w.slot1 = w.slot0 + (size_t)d.R * d.N;
  w.T = w.slot1 + (size_t)d.R * d.N;
  w.pos_all0 = (int*)(w.T + d.E);
  w.pos_dom0 = w.pos_all0 + d.P;
  w.cnt_all0 = w.pos_dom0 + d.P;
  w.cnt_dom0 = w.cnt_all0 + d.E;
}

// i64 elements of the per-phase shared scratch: placement's keys, the slot tables of phases 3-6 and the
// list of instances that take the general path in phases 4 and 6, a domain's refinement state
__host__ __device__ inline size_t scratch_elems(const Dims& d) {
  const size_t rpd = d.rpd, G = d.G;
  const size_t placement = (size_t)d.E + rpd;
  const size_t slots = (size_t)d.R * d.N + ((size_t)d.P + 1) / 2;  // two int tables, an int list
  const size_t refine = rpd * G + rpd + (rpd <= 32 ? rpd * rpd : 0) + (rpd * d.N + 1) / 2;
  return max(placement, max(slots, refine));
}

__device__ __forceinline__ int main_rank_of(int e, const Dims& d) { return (int)(((unsigned long long)e * d.inv_eloc) >> 32); }
__device__ __forceinline__ int dom_of_rank(int r, const Dims& d) { return (int)(((unsigned long long)r * d.inv_rpd) >> 32); }
__device__ __forceinline__ int floor_mod(int a, int n) { int m = a % n; return m < 0 ? m + n : m; }

// q = x / n, r = x % n for x >= 0, n >= 1 (exact; 32-bit division when x fits, 64-bit otherwise)
__device__ __forceinline__ void divmod(i64 x, int n, i64* q, i64* r) {
  if ((unsigned long long)x <= 0xffffffffull) {
    const unsigned xu = (unsigned)x, qu = xu / (unsigned)n;
    *q = qu;
    *r = xu - qu * (unsigned)n;
  } else {
    *q = x / n;
    *r = x - *q * n;
  }
}

__device__ __forceinline__ void grid_sync() {
  if (gridDim.x == 1) __syncthreads();
  else cg::this_grid().sync();
}

__device__ __forceinline__ void stamp(const Work& w, int i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    w.stamps[i] = (i64)t;
  }
}

// ---------------------------------------------------------------------------------------------------
// phase 2: stage-1 placement of domain `dom` (one block). slot0 of the domain is written in full.
__device__ void placement(int dom, const Dims& d, const Work& w, i64* smem) {
  __shared__ int num_pos;
  __shared__ int rank_order[kMaxRanksPerDomain];  // domain ranks sorted by (static load, id)
  i64* keys = smem;                               // [E] compacted positive keys
  i64* l0 = smem + d.E;                           // [rpd] static loads of the domain's ranks
  const int r0 = dom * d.rpd, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) num_pos = 0;
  for (int q = threadIdx.x; q < d.rpd * d.N; q += blockDim.x) w.slot0[(i64)r0 * d.N + q] = -1;
  // static load of rank r = sum over its main experts of their total demand (a warp per rank)
  for (int a = warp; a < d.rpd; a += kWarps) {
    const int r = r0 + a;
    i64 acc = 0;
    for (int j = lane; j < d.Eloc * d.M; j += 32) acc += w.D[(i64)(j / d.Eloc) * d.E + r * d.Eloc + j % d.Eloc];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(kFull, acc, off);
    if (lane == 0) { l0[a] = acc; w.L0[r] = acc; }
  }
  __syncthreads();
  if (d.M == 1 || d.N == 0) return;  // no remote experts / no slots: nothing to place
  // compact the positive-benefit candidates (order is irrelevant: they are ranked by counting next)
  for (int e = threadIdx.x; e < d.E; e += blockDim.x) {
    const i64 De = w.D[(i64)dom * d.E + e];
    if (dom_of_rank(main_rank_of(e, d), d) != dom && 2 * De * d.S > d.W) {
      const int i = atomicAdd(&num_pos, 1);
      keys[i] = De * d.E + (d.E - 1 - e);  // descending key == (D desc, e asc); all keys distinct
    }
  }
  for (int a = threadIdx.x; a < d.rpd; a += blockDim.x) {
    int pos = 0;
    for (int b = 0; b < d.rpd; ++b) pos += (l0[b] < l0[a]) || (l0[b] == l0[a] && b < a);
    rank_order[pos] = r0 + a;
  }
  __syncthreads();
  const int n = num_pos, cap = d.rpd * d.N;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const i64 k = keys[i];
    int rank = 0;  // candidates with a larger key come first
    for (int j = 0; j < n; ++j) rank += keys[j] > k;
    if (rank < cap) w.slot0[(i64)rank_order[rank % d.rpd] * d.N + rank / d.rpd] = d.E - 1 - (int)(k % d.E);
  }
  __syncthreads();
}

// phase 3: for every replica slot p of the stage-1 placement, pos_all0[p] / pos_dom0[p] (position among
// its expert's instances / among those in its domain; the main is first), and the replica counts added to
// cnt_all0[e] / cnt_dom0[m*E+e] (phase 1 counted the mains; integer atomics, so the result is exact).
// `se` is the slot table staged in shared memory.
__device__ void instances(const Dims& d, const Work& w, const int* se) {
  const int RN = d.R * d.N;
  // block-cyclic: few items with long loops, spread over every block of the grid
  for (int q = threadIdx.x * gridDim.x + blockIdx.x; q < RN; q += gridDim.x * blockDim.x) {
    const int e = se[q], p = d.E + q;
    if (e < 0) { w.pos_all0[p] = 0; w.pos_dom0[p] = 0; continue; }
    const int md = dom_of_rank(q / d.N, d), q_dom = md * d.rpd * d.N;  // the domain's slots start at q_dom
    int before = 0, before_dom = 0;
    for (int q2 = 0; q2 < q; ++q2) {
      const bool same = se[q2] == e;
      before += same;
      before_dom += same && q2 >= q_dom;
    }
    w.pos_all0[p] = 1 + before;
    w.pos_dom0[p] = (dom_of_rank(main_rank_of(e, d), d) == md) + before_dom;
    atomicAdd(&w.cnt_all0[e], 1);
    atomicAdd(&w.cnt_dom0[(i64)md * d.E + e], 1);
  }
}

// expert and rank of instance p under slot table se (int, R*N); e < 0 for an empty slot
__device__ __forceinline__ void instance_of(int p, const int* se, const Dims& d, int* e, int* rank) {
  if (p < d.E) { *e = p; *rank = main_rank_of(p, d); }
  else { *e = se[p - d.E]; *rank = (p - d.E) / d.N; }
}

// Phases 4 and 6 give most instances their result on a short path, a thread per instance (or per
// (source, instance) pair), and append the rest to a block-local list in shared memory, which the block
// then works through with a group of d.gw lanes per listed instance (a shuffle reduction or scan over
// sources). The list's order depends on atomics but every listed instance is computed on its own, so the
// outputs do not. On the short path runs of 32 instances go to the grid's warps block-cyclically
// (warp_cyclic), so that a warp's accesses stay contiguous; the listed instances go to the blocks one by one
// (instance p to block p mod grid, list_first), so that the slots, which all take the long path and sit at
// the end of the instance order, spread evenly over every block.
__device__ __forceinline__ int warp_cyclic() {
  return ((threadIdx.x >> 5) * gridDim.x + blockIdx.x) * 32 + (threadIdx.x & 31);
}

__device__ __forceinline__ int list_first() { return threadIdx.x * gridDim.x + blockIdx.x; }

struct ListState {
  int* items;  // the listed instances (at most P)
  int* count;  // in shared memory
};

// Calls f(p, lane in group) for every listed instance of this block, then one more round for lanes past
// the end (p = d.P), so that every lane of a warp runs the same rounds (shuffles need the whole warp).
template <class F>
__device__ __forceinline__ void for_listed(const Dims& d, const ListState& ls, F f) {
  const int n = *ls.count, gpw = 32 / d.gw, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / d.gw, lig = lane & (d.gw - 1);
  for (int base = warp * gpw; base < n; base += kWarps * gpw) {  // uniform per warp
    const int i = base + sub;
    f(i < n ? ls.items[i] : d.P, lig);
  }
}

// phase 4: U0[p] = sum over sources of the stage-2 split. An expert with one instance (its main) gets its
// whole demand: the sum of D over domains, also kept in T[e] for phase 6.
__device__ void split_listed(const Dims& d, const Work& w, const int* se, int p, int lig) {
  int e = -1, r = 0;
  if (p < d.P) instance_of(p, se, d, &e, &r);
  i64 acc = 0;
  if (e >= 0) {
    // share of omega[s, e] the stage-2 split gives p: even over e's instances in s's domain if it has
    // any (p must be one of them), else over all of e's instances; the remainder rotated by s
    const int pdom = dom_of_rank(r, d), pos_dom = w.pos_dom0[p], pos_all = w.pos_all0[p], n_all = w.cnt_all0[e];
#pragma unroll 4
    for (int s = lig; s < d.R; s += d.gw) {
      const i64 x = w.om[(i64)s * d.E + e];
      const int sd = dom_of_rank(s, d), nloc = w.cnt_dom0[(i64)sd * d.E + e];
      if (nloc > 0 && pdom != sd) continue;
      const int n = nloc > 0 ? nloc : n_all, pos = nloc > 0 ? pos_dom : pos_all;
      i64 q, rem;
      divmod(x, n, &q, &rem);
      acc += q + (floor_mod(pos - s, n) < rem ? 1 : 0);
    }
  }
  for (int off = d.gw >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(kFull, acc, off, d.gw);
  if (p < d.P && lig == 0) w.U[p] = acc;
}

__device__ void split(const Dims& d, const Work& w, const int* se, const ListState& ls) {
  if (threadIdx.x == 0) *ls.count = 0;
  __syncthreads();
  for (int p = warp_cyclic(); p < d.P; p += gridDim.x * blockDim.x) {
    int e, r;
    instance_of(p, se, d, &e, &r);
    if (e < 0) { w.U[p] = 0; continue; }
    if (w.cnt_all0[e] == 1) {  // p is e's main and e's only instance
      i64 t = 0;
      for (int m = 0; m < d.M; ++m) t += w.D[(i64)m * d.E + e];
      w.U[p] = t;
      w.T[e] = t;
    }
  }
  for (int p = list_first(); p < d.P; p += gridDim.x * blockDim.x) {  // the rest: the general path
    int e, r;
    instance_of(p, se, d, &e, &r);
    if (e >= 0 && w.cnt_all0[e] > 1) ls.items[atomicAdd(ls.count, 1)] = p;
  }
  __syncthreads();
  for_listed(d, ls, [&](int p, int lig) { split_listed(d, w, se, p, lig); });
}

// ---------------------------------------------------------------------------------------------------
// phase 5: refinement of one domain by one warp. Candidate key, compared lexicographically as in the
// reference: (-delta, L[rt], cost[rb][rt], new replica, -U[p], rt, e); a = rt's index in the domain.
// Every lane keeps its best candidate; the warp then picks the best lane field by field with 32-bit
// warp reductions (__reduce_*_sync), stopping as soon as one lane is left.
struct Key {
  i64 delta, lt, cost, u;
  int a, e, gs, gt;  // gs / gt: local index of the source instance on rb / of the target instance on a
                     // (gt = -1 - j: a new replica in a's free slot j)
};

__device__ __forceinline__ bool better(const Key& x, const Key& y) {
  if (x.delta != y.delta) return x.delta > y.delta;
  if (x.lt != y.lt) return x.lt < y.lt;
  if (x.cost != y.cost) return x.cost < y.cost;
  if ((x.gt < 0) != (y.gt < 0)) return x.gt >= 0;  // an existing instance before a new replica
  if (x.u != y.u) return x.u > y.u;
  if (x.a != y.a) return x.a < y.a;
  return x.e < y.e;
}

__device__ __forceinline__ Key no_key() {
  Key k;
  k.delta = 0; k.lt = 0; k.cost = 0; k.u = 0; k.a = INT_MAX; k.e = INT_MAX; k.gs = -1; k.gt = 0;
  return k;  // every real candidate has delta >= 1, so this loses against all of them
}

// Among the lanes in `tied`, keep those whose v is largest (v >= 0 as unsigned 64-bit); exact.
__device__ __forceinline__ unsigned keep_max(unsigned tied, unsigned long long v) {
  const int lane = threadIdx.x & 31;
  const bool in = tied >> lane & 1;
  const unsigned hi = in ? (unsigned)(v >> 32) : 0u;
  const unsigned mh = __reduce_max_sync(kFull, hi);
  const unsigned lo = (in && hi == mh) ? (unsigned)v : 0u;
  const unsigned ml = __reduce_max_sync(kFull, lo);
  return __ballot_sync(kFull, in && hi == mh && (unsigned)v == ml);
}

// shared-memory state of one domain's refinement
struct DomState {
  i64* su;          // [rpd][G] instance loads
  i64* sl;          // [rpd] rank loads
  const i64* cost;  // [rpd][rpd] cost_fs of the domain (shared memory when rpd <= 32), row stride cs
  int cs;
  int* se;          // [rpd][N] slot experts
};

__device__ __forceinline__ int expert_at(const DomState& st, int a, int g, int r0, const Dims& d) {
  return g < d.Eloc ? (r0 + a) * d.Eloc + g : st.se[a * d.N + g - d.Eloc];
}

// Slot loops run to NT, the compile-time slot count (1-4), or to d.N when NT == 0 (any count).
template <int NT>
__device__ __forceinline__ int num_slots(const Dims& d) { return NT > 0 ? NT : d.N; }

// slot of expert e on the domain's rank a, or -1
template <int NT>
__device__ __forceinline__ int slot_of(const DomState& st, int a, int e, const Dims& d) {
  const int N = num_slots<NT>(d);
  int found = -1;
#pragma unroll
  for (int j = N - 1; j >= 0; --j) if (st.se[a * N + j] == e) found = j;
  return found;
}

template <int NT>
__device__ __forceinline__ int first_free(const DomState& st, int a, const Dims& d) {
  return slot_of<NT>(st, a, -1, d);
}

// local index of expert e's instance on the domain's rank a (global rank r0 + a), or -1
template <int NT>
__device__ __forceinline__ int find_on(const DomState& st, int a, int e, int r0, const Dims& d) {
  if (main_rank_of(e, d) == r0 + a) return e - (r0 + a) * d.Eloc;
  const int j = slot_of<NT>(st, a, e, d);
  return j < 0 ? -1 : d.Eloc + j;
}

__device__ __forceinline__ void consider(Key& best, i64 u, i64 half, i64 lt, i64 cost, int a, int e, int gs,
                                         int gt) {
  Key k;
  k.delta = u < half ? u : half;
  k.lt = lt; k.cost = cost; k.u = u; k.a = a; k.e = e; k.gs = gs; k.gt = gt;
  if (better(k, best)) best = k;
}

// The refinement's SM cycles per step, counted by lane 0 of domain 0 and written after the stamps (prof =
// w.stamps + 7; see planner.h), only when kProfile is set: the clock reads order the loop's instructions
// and cost time of their own. Both refinement loops (refine_warp, refine_warp_fast) use it.
struct RefineClock {
  enum Step { kBusiest, kExisting, kRounds, kReduce, kMove, kSteps };
  bool on;
  long long begin, last, cycles[kSteps] = {0, 0, 0, 0, 0}, rounds = 0, iters = 0;
  __device__ explicit RefineClock(const Dims& d) : on((d.skip & kProfile) != 0) { begin = last = on ? clock64() : 0; }
  __device__ __forceinline__ void step(Step s) {  // the time since the previous step goes to s
    if (on) { const long long t = clock64(); cycles[s] += t - last; last = t; }
  }
  __device__ void write(i64* prof, int dom) const {
    if (!on || prof == nullptr || dom != 0 || (threadIdx.x & 31) != 0) return;
    prof[0] = iters; prof[1] = cycles[kBusiest]; prof[2] = cycles[kExisting]; prof[3] = cycles[kRounds];
    prof[4] = rounds; prof[5] = cycles[kReduce]; prof[6] = cycles[kMove]; prof[7] = clock64() - begin;
  }
};

template <int NT>
__device__ void refine_warp(int dom, const DomState& st, const Dims& d, i64* prof) {
  const int lane = threadIdx.x & 31, r0 = dom * d.rpd, N = num_slots<NT>(d);
  RefineClock clk(d);
  while (true) {
    // rb = busiest rank of the domain, ties -> lowest id
    i64 bl = -1;
    int b = INT_MAX;
    if (d.rpd <= 32) {  // a lane per rank: the lowest of the lanes with the largest load
      const i64 mine = lane < d.rpd ? st.sl[lane] : -1;
      b = __ffs(keep_max(kFull, (unsigned long long)(mine + 1))) - 1;
      bl = __shfl_sync(kFull, mine, b);
    } else {
      for (int a = lane; a < d.rpd; a += 32) if (st.sl[a] > bl) { bl = st.sl[a]; b = a; }
      const unsigned tied = keep_max(kFull, (unsigned long long)(bl + 1));
      b = (int)__reduce_min_sync(kFull, (tied >> lane & 1) ? (unsigned)b : 0xffffffffu);
      bl = st.sl[b];
    }
    clk.step(RefineClock::kBusiest);
    const i64* cost_row = st.cost + (i64)b * st.cs;
    // existing-instance candidates; `need`: this lane's targets that still want a new-replica candidate
    Key best = no_key();
    unsigned need = 0;
    for (int a = lane, k = 0; a < d.rpd; a += 32, ++k) {
      const i64 lt = st.sl[a], c = cost_row[a];
      const i64 half = (bl - lt) / 2;
      if (a == b || half <= 0) continue;
      i64 ex = 0;  // best existing delta for this target
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int x = st.se[a * N + j];  // an expert in a's slots that rb also hosts
        const int g = x < 0 ? -1 : find_on<NT>(st, b, x, r0, d);
        const i64 u = g < 0 ? 0 : st.su[b * d.G + g];
        if (u > 0) { consider(best, u, half, lt, c, a, x, g, d.Eloc + j); ex = max(ex, u < half ? u : half); }
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int y = st.se[b * N + j];  // an expert in rb's slots whose main is a
        const i64 u = (y >= 0 && main_rank_of(y, d) == r0 + a) ? st.su[b * d.G + d.Eloc + j] : 0;
        if (u > 0) { consider(best, u, half, lt, c, a, y, d.Eloc + j, y - (r0 + a) * d.Eloc); ex = max(ex, u < half ? u : half); }
      }
      // a new replica can only win with a larger delta (an existing instance wins ties)
      if (ex < half && first_free<NT>(st, a, d) >= 0) need |= 1u << k;
    }
    clk.step(RefineClock::kExisting);
    // new-replica candidates: rb's instances in (load desc, expert asc) order, one warp argmax per round;
    // a target takes the first one it does not host
    i64 pu = LLONG_MAX;
    int pe = -1;
    while (__any_sync(kFull, need != 0)) {
      i64 u = -1;
      int e = INT_MAX, g = -1;
      for (int gg = lane; gg < d.G; gg += 32) {
        const i64 uu = st.su[b * d.G + gg];
        const int ee = expert_at(st, b, gg, r0, d);
        if (uu <= 0 || ee < 0 || !(uu < pu || (uu == pu && ee > pe))) continue;
        if (uu > u || (uu == u && ee < e)) { u = uu; e = ee; g = gg; }
      }
      ++clk.rounds;
      unsigned top = keep_max(kFull, (unsigned long long)(u + 1));
      const int emin = (int)__reduce_min_sync(kFull, (top >> lane & 1) ? (unsigned)e : 0xffffffffu);
      const int src = __ffs(__ballot_sync(kFull, (top >> lane & 1) && e == emin)) - 1;
      u = __shfl_sync(kFull, u, src);
      g = __shfl_sync(kFull, g, src);
      e = emin;
      if (u < 0) break;  // rb has no further instance with load
      pu = u;
      pe = e;
      for (int a = lane, k = 0; a < d.rpd; a += 32, ++k) {
        if (!(need >> k & 1)) continue;
        if (find_on<NT>(st, a, e, r0, d) >= 0) continue;
        consider(best, u, (bl - st.sl[a]) / 2, st.sl[a], cost_row[a], a, e, g, -1 - first_free<NT>(st, a, d));
        need &= ~(1u << k);
      }
    }
    clk.step(RefineClock::kRounds);
    // the best lane, field by field
    unsigned tied = __ballot_sync(kFull, best.gs >= 0);
    if (tied == 0) break;  // no move helps
    tied = keep_max(tied, (unsigned long long)best.delta);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)best.lt);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)best.cost);
    if (__popc(tied) > 1) tied = keep_max(tied, best.gt >= 0 ? 1ull : 0ull);
    if (__popc(tied) > 1) tied = keep_max(tied, (unsigned long long)best.u);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)(unsigned)best.a);
    // a lane's candidates have distinct targets from other lanes', so one lane is left here
    const int win = __ffs(tied) - 1;
    clk.step(RefineClock::kReduce);
    if (lane == win) {
      const int a = best.a;
      int gt = best.gt;
      if (gt < 0) {  // new replica in a's free slot
        const int j = -1 - gt;
        st.se[a * N + j] = best.e;
        gt = d.Eloc + j;
      }
      st.su[b * d.G + best.gs] -= best.delta;
      st.su[a * d.G + gt] += best.delta;
      st.sl[b] -= best.delta;
      st.sl[a] += best.delta;
    }
    __syncwarp();
    ++clk.iters;
    clk.step(RefineClock::kMove);
  }
  clk.write(prof, dom);
}

// The refinement of a domain of <= 32 ranks with 1-4 slots whose loads fit in 26 bits (the domain's total
// load is below 2^26; refinement keeps it, and every instance and rank load is at most that): the same
// moves as refine_warp with its state in registers. Lane a is the domain's rank a and holds its load, its
// slot experts, their main ranks and their loads; main-instance loads stay in shared memory. Per
// iteration: the busiest rank rb (one 32-bit max and a ballot); rb's slots by shuffles; every lane's best
// existing-instance candidate without branches (at most 2N: experts in its slots that rb hosts, experts
// in rb's slots whose main it is); new-replica rounds only while some lane wants one (the first round's
// loads are issued early, beside the existing candidates); the best lane field by field.
template <int NT>
__device__ void refine_warp_fast(int dom, const DomState& st, const Dims& d, i64* prof) {
  const int lane = threadIdx.x & 31, rpd = d.rpd, r0 = dom * rpd, me = r0 + lane, G = d.G, Eloc = d.Eloc;
  const bool valid = lane < rpd;
  RefineClock clk(d);
  i64* su = st.su;  // [rpd][G]; the main instances' loads are read and written here, the slots' in registers
  const i64* cost_s = st.sl + rpd;  // refine() stages the domain's cost rows here when rpd <= 32
  int la = valid ? (int)st.sl[lane] : 0, se[NT], sm[NT], us[NT];  // sm: the main rank of se (-1: empty)
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    se[j] = valid ? st.se[lane * NT + j] : -1;
    sm[j] = se[j] >= 0 ? main_rank_of(se[j], d) : -1;
    us[j] = valid ? (int)su[lane * G + Eloc + j] : 0;
  }
  while (true) {
    // rb = busiest rank, ties -> lowest id: one max over (load + 1) << 5 | (31 - lane) (lanes past the
    // domain send 0 and never win; loads are below 2^26)
    const unsigned top = __reduce_max_sync(kFull, valid ? ((unsigned)la + 1u) << 5 | (31u - lane) : 0u);
    const int b = 31 - (int)(top & 31u);
    const int bl = (int)(top >> 5) - 1, rb = r0 + b, bmain = rb * Eloc;
    const i64* sub = su + b * G;
    int sb[NT], sbm[NT], ub[NT];  // rb's slot experts, their main ranks and loads
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      sb[j] = __shfl_sync(kFull, se[j], b);
      sbm[j] = __shfl_sync(kFull, sm[j], b);
      ub[j] = __shfl_sync(kFull, us[j], b);
    }
    const i64 cost = cost_s[b * rpd + (valid ? lane : 0)];
    // the first new-replica round's loads (rb's best main instance on this lane's share), issued early
    int cu = 0, cg = INT_MAX;
    for (int g = lane; g < Eloc; g += 32) {  // g ascending: expert ascending, so ties keep the lowest
      const int u = (int)sub[g];
      if (u > cu) { cu = u; cg = g; }
    }
    clk.step(RefineClock::kBusiest);
    // this lane's best existing-instance candidate. Within a target L, cost and rank are the same for every
    // candidate and delta = min(u, half) grows with u, so (delta desc, load desc, expert asc) is (load desc,
    // expert asc): one 64-bit key per candidate, u << 32 | (2^29 - 1 - e) << 3 | index, maxed as a tree
    // (independent candidates, a short dependency chain)
    const int half = valid ? (bl - la) >> 1 : 0;  // 0 on rb itself
    const auto pack = [](int u, int e, int i) {
      return (unsigned long long)(unsigned)u << 32 | (unsigned long long)(0x1fffffffu - (unsigned)e) << 3 | (unsigned)i;
    };
    unsigned long long key[2 * NT];
    int gsj[NT];  // rb's instance of the expert in this rank's slot j
#pragma unroll
    for (int j = 0; j < NT; ++j) {  // an expert in this rank's slots that rb also hosts: as a main or in a slot
      const int x = se[j];
      const bool on_main = sm[j] == rb;
      int u = on_main ? (int)sub[x - bmain] : 0;
      gsj[j] = x - bmain;
#pragma unroll
      for (int k = 0; k < NT; ++k) {
        const bool hit = x >= 0 && sb[k] == x;
        u = hit ? ub[k] : u;
        gsj[j] = hit ? Eloc + k : gsj[j];
      }
      key[j] = u > 0 ? pack(u, x, j) : 0ull;
    }
#pragma unroll
    for (int k = 0; k < NT; ++k)  // an expert in rb's slots whose main is this rank
      key[NT + k] = (sbm[k] == me && ub[k] > 0) ? pack(ub[k], sb[k], NT + k) : 0ull;
#pragma unroll
    for (int w = 1; w < 2 * NT; w <<= 1)
#pragma unroll
      for (int i = 0; i + w < 2 * NT; i += 2 * w) key[i] = key[i] > key[i + w] ? key[i] : key[i + w];
    const unsigned long long kb = half > 0 ? key[0] : 0ull;
    int bu = (int)(kb >> 32), bd = min(bu, half), be = (int)(0x1fffffffu - (unsigned)(kb >> 3 & 0x1fffffffu));
    int bgs = -1, bgt = 0, bm = -1;  // bgt < 0: a new replica in slot -1 - bgt
    const int bi = (int)(kb & 7);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (bi == j) { bgs = gsj[j]; bgt = Eloc + j; }
      if (bi == NT + j) { bgs = Eloc + j; bgt = sb[j] - me * Eloc; }
    }
    int free_slot = -1;
#pragma unroll
    for (int j = NT - 1; j >= 0; --j) if (se[j] < 0) free_slot = j;
    // a new replica can only win with a larger delta (an existing instance wins ties)
    bool need = free_slot >= 0 && bd < half;
    clk.step(RefineClock::kExisting);
    // new-replica candidates: rb's instances in (load desc, expert asc) order, one round each; a lane takes
    // the first one its rank does not host; rounds run while some lane still wants one (the first round's
    // loads were issued above). (pu, pe): the last round's instance
    int pu = INT_MAX, pe = -1;
    for (bool first = true;; first = false) {
      if (!__any_sync(kFull, need)) break;
      if (!first) {
        cu = 0;
        cg = INT_MAX;
        for (int g = lane; g < Eloc; g += 32) {
          const int u = (int)sub[g], e = bmain + g;
          if (u > cu && (u < pu || (u == pu && e > pe))) { cu = u; cg = g; }
        }
      }
      ++clk.rounds;
      int su_ = 0, se_ = INT_MAX, sk = -1;  // rb's best slot after (pu, pe), the same on every lane
#pragma unroll
      for (int k = 0; k < NT; ++k) {
        const int u = ub[k], e = sb[k];
        const bool after = e >= 0 && u > 0 && (u < pu || (u == pu && e > pe));
        if (after && (u > su_ || (u == su_ && e < se_))) { su_ = u; se_ = e; sk = k; }
      }
      int wu = (int)__reduce_max_sync(kFull, (unsigned)cu);
      int wg = (int)__reduce_min_sync(kFull, cu == wu ? (unsigned)cg : 0xffffffffu), we = INT_MAX, wm = rb;
      if (wu > 0) we = bmain + wg;
      else wg = -1;
      if (sk >= 0 && (su_ > wu || (su_ == wu && se_ < we))) {
        wu = su_;
        we = se_;
        wg = Eloc + sk;
#pragma unroll
        for (int k = 0; k < NT; ++k) wm = k == sk ? sbm[k] : wm;
      }
      if (wg < 0) break;  // rb has no further instance with load
      pu = wu;
      pe = we;
      bool hosted = wm == me;
#pragma unroll
      for (int j = 0; j < NT; ++j) hosted |= se[j] == we;
      if (need && !hosted) {
        const int dl = min(wu, half);
        if (dl > bd) { bd = dl; bu = wu; be = we; bgs = wg; bgt = -1 - free_slot; bm = wm; }
        need = false;
      }
    }
    clk.step(RefineClock::kRounds);
    // the best lane: (delta desc, L asc, cost asc, existing first, load desc, rank asc)
    const unsigned md = __reduce_max_sync(kFull, (unsigned)bd);
    if (md == 0) break;  // no move helps
    const auto in = [&](unsigned t) { return (t >> lane & 1) != 0; };
    unsigned tied = __ballot_sync(kFull, (unsigned)bd == md);
    if (__popc(tied) > 1) {
      const unsigned ml = __reduce_min_sync(kFull, in(tied) ? (unsigned)la : 0xffffffffu);
      tied = __ballot_sync(kFull, in(tied) && (unsigned)la == ml);
    }
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)cost);
    if (__popc(tied) > 1) {
      const unsigned ex = __ballot_sync(kFull, in(tied) && bgt >= 0);
      if (ex != 0) tied = ex;
    }
    if (__popc(tied) > 1) {
      const unsigned mu = __reduce_max_sync(kFull, in(tied) ? (unsigned)bu : 0u);
      tied = __ballot_sync(kFull, in(tied) && (unsigned)bu == mu);
    }
    const int win = __ffs(tied) - 1;
    clk.step(RefineClock::kReduce);
    // the move, by selects on rb's lane and the winner's (a new replica's slot held no load)
    const int dl = (int)md, gs = __shfl_sync(kFull, bgs, win);
    const bool is_b = lane == b, is_w = lane == win;
    la += is_w ? dl : is_b ? -dl : 0;
    if (is_b && gs < Eloc) su[b * G + gs] -= dl;
    if (is_w && bgt >= 0 && bgt < Eloc) su[lane * G + bgt] += dl;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const bool nw = is_w && bgt == -1 - j;
      se[j] = nw ? be : se[j];
      sm[j] = nw ? bm : sm[j];
      us[j] += (is_b && gs == Eloc + j) ? -dl : (is_w && (bgt == Eloc + j || nw)) ? dl : 0;
    }
    __syncwarp();
    ++clk.iters;
    clk.step(RefineClock::kMove);
  }
  if (valid) {  // the registers back to the shared state
    st.sl[lane] = la;
#pragma unroll
    for (int j = 0; j < NT; ++j) { st.se[lane * NT + j] = se[j]; su[lane * G + Eloc + j] = us[j]; }
  }
  clk.write(prof, dom);
}

template <int NT>
__device__ void refine(int dom, const i64* cost_fs, const Dims& d, const Work& w, i64* smem) {
  const int rpd = d.rpd, G = d.G, r0 = dom * rpd;
  DomState st;
  st.su = smem;
  st.sl = st.su + (i64)rpd * G;
  i64* cost = st.sl + rpd;
  if (rpd <= 32) {
    for (int i = threadIdx.x; i < rpd * rpd; i += blockDim.x) cost[i] = cost_fs[(i64)(r0 + i / rpd) * d.R + r0 + i % rpd];
    st.cost = cost;
    st.cs = rpd;
    cost += rpd * rpd;
  } else {
    st.cost = cost_fs + (i64)r0 * d.R + r0;
    st.cs = d.R;
  }
  st.se = (int*)cost;
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    const int a = i / G, g = i % G, r = r0 + a;
    st.su[i] = g < d.Eloc ? w.U[r * d.Eloc + g] : w.U[d.E + (i64)r * d.N + (g - d.Eloc)];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) st.se[i] = (int)w.slot0[(i64)r0 * d.N + i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int a = warp; a < rpd; a += kWarps) {
    i64 acc = 0;
    for (int g = lane; g < G; g += 32) acc += st.su[a * G + g];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(kFull, acc, off);
    if (lane == 0) st.sl[a] = acc;
  }
  __syncthreads();
  if (warp == 0 && !(d.skip & kSkipRefine)) {
    i64* prof = blockIdx.x == 0 ? w.stamps + 7 : nullptr;
    // the register path when every load fits in 26 bits: the domain's total (refinement keeps it) is below 2^26
    i64 total = lane < rpd ? st.sl[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(kFull, total, off);
    bool done = false;
    if constexpr (NT > 0) {
      if (rpd <= 32 && total < (1 << 26)) { refine_warp_fast<NT>(dom, st, d, prof); done = true; }
    }
    if (!done) refine_warp<NT>(dom, st, d, prof);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    const int a = i / G, g = i % G, r = r0 + a;
    if (g < d.Eloc) w.U[r * d.Eloc + g] = st.su[i];
    else w.U[d.E + (i64)r * d.N + (g - d.Eloc)] = st.su[i];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) w.slot1[(i64)r0 * d.N + i] = st.se[i];
  for (int a = threadIdx.x; a < rpd; a += blockDim.x) w.L[r0 + a] = st.sl[a];
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------
// phase 6: the guard (max refined load > max static load -> the static plan), then the final slots and
// the route. Instance p's group is (expert e, domain of p's rank); the group's sources send A[s] (what
// stage 2 sent to the group's initial instances), filled in source order into the group's instances in
// p order (cu = load of the group's instances before p). se0 / se1: slot tables before / after refinement.
__device__ bool guard_fires(const Dims& d, const Work& w) {
  __shared__ i64 red_l[kWarps], red_s[kWarps];
  __shared__ int fb;
  i64 ml = 0, ms = 0;
  for (int r = threadIdx.x; r < d.R; r += blockDim.x) { ml = max(ml, w.L[r]); ms = max(ms, w.L0[r]); }
  for (int off = 16; off > 0; off >>= 1) {
    ml = max(ml, __shfl_xor_sync(kFull, ml, off));
    ms = max(ms, __shfl_xor_sync(kFull, ms, off));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { red_l[warp] = ml; red_s[warp] = ms; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < kWarps; ++i) { ml = max(ml, red_l[i]); ms = max(ms, red_s[i]); }
    fb = ml > ms;
  }
  __syncthreads();
  return fb;
}

// The route of a listed instance p (lanes of its group split the sources)
__device__ void route_listed(const Dims& d, const Work& w, const int* se0, const int* se1, i64* __restrict__ route,
                             int p, int lig) {
  int e = -1, r = 0;
  if (p < d.P) instance_of(p, se1, d, &e, &r);
  const int gd = e >= 0 ? dom_of_rank(r, d) : 0;
  const bool main_in_group = e >= 0 && dom_of_rank(main_rank_of(e, d), d) == gd;
  const i64 up = e >= 0 ? w.U[p] : 0;
  i64 cu = 0;  // the group's load before p: the main (if in the group and p is a slot), then slots
  if (e >= 0 && p >= d.E) {
    if (main_in_group) cu += w.U[e];
    for (int q = gd * d.rpd * d.N; q < p - d.E; ++q) if (se1[q] == e) cu += w.U[d.E + q];
  }
  const int n_all = e >= 0 ? w.cnt_all0[e] : 1;
  // what source s sends the group (0 past the sources or for an empty slot)
  const auto source_amount = [&](int s) -> i64 {
    if (e < 0 || s >= d.R) return 0;
    const int sd = dom_of_rank(s, d);
    const i64 x = w.om[(i64)s * d.E + e];
    if (sd == gd) return x;
    i64 amount = 0;
    if (w.cnt_dom0[(i64)sd * d.E + e] == 0 && x > 0) {  // orphan: its share of the group's initial instances
      i64 xq, xr;
      divmod(x, n_all, &xq, &xr);
      if (main_in_group) amount += xq + (floor_mod(0 - s, n_all) < xr ? 1 : 0);
      for (int q = gd * d.rpd * d.N; q < (gd + 1) * d.rpd * d.N; ++q)
        if (se0[q] == e) amount += xq + (floor_mod(w.pos_all0[d.E + q] - s, n_all) < xr ? 1 : 0);
    }
    return amount;
  };
  // the route of the sources s0 + lane in group: an inclusive scan over the group's lanes, then the overlap
  // of each source's interval with p's
  i64 carry = 0;
  const auto scan_and_write = [&](i64 amount, int s0) {
    const int s = s0 + lig;
    i64 incl = amount;
    for (int off = 1; off < d.gw; off <<= 1) {
      const i64 v = __shfl_up_sync(kFull, incl, off, d.gw);
      if (lig >= off) incl += v;
    }
    const i64 lo = carry + incl - amount, hi = lo + amount;
    if (p < d.P && s < d.R) {
      const i64 ov = e >= 0 ? min(hi, cu + up) - max(lo, cu) : 0;
      route[(i64)s * d.P + p] = ov > 0 ? ov : 0;
    }
    carry += __shfl_sync(kFull, incl, d.gw - 1, d.gw);
  };
  // the first kPrefetch runs of sources are read before any scan, so that their loads are in flight
  // together (the scans' shuffles would otherwise order them); runs past them one by one
  constexpr int kPrefetch = 4;
  i64 amounts[kPrefetch];
#pragma unroll
  for (int c = 0; c < kPrefetch; ++c) amounts[c] = source_amount(c * d.gw + lig);
#pragma unroll
  for (int c = 0; c < kPrefetch; ++c)
    if (c * d.gw < d.R) scan_and_write(amounts[c], c * d.gw);  // uniform over the warp
  for (int s0 = kPrefetch * d.gw; s0 < d.R; s0 += d.gw) scan_and_write(source_amount(s0 + lig), s0);
}

// Instance p's route takes the short path when the guard fired (the static plan), when its slot is empty,
// or when p is the main of an expert that had no stage-1 replica and keeps its whole demand (any replica
// refinement gave it is empty): then every source sends p all it has (0 for an empty slot).
__device__ __forceinline__ bool route_short(const Dims& d, const Work& w, const int* se1, bool fb, int p, int* e) {
  *e = p < d.E ? p : se1[p - d.E];
  return fb || *e < 0 || (p < d.E && w.cnt_all0[p] == 1 && w.U[p] == w.T[p]);
}

__device__ void route_phase(const Dims& d, const Work& w, const int* se0, const int* se1, bool fb,
                            i64* __restrict__ slot_expert, i64* __restrict__ route, const ListState& ls) {
  if (threadIdx.x == 0) *ls.count = 0;
  __syncthreads();
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < d.R * d.N; q += gridDim.x * blockDim.x)
    slot_expert[q] = (fb || w.U[d.E + q] <= 0) ? -1 : se1[q];
  // the short path: a thread per (instance, run of sources), as many runs as the grid has threads for
  const int threads = gridDim.x * blockDim.x;
  const int runs = max(1, min(d.R, threads / d.P)), run_len = (d.R + runs - 1) / runs;
  const int items = runs * d.P;  // <= max(threads, P)
  for (int i = warp_cyclic(); i < items; i += threads) {
    const int c = (int)((unsigned)i / (unsigned)d.P), p = i - c * d.P;
    int e;
    if (!route_short(d, w, se1, fb, p, &e)) continue;  // listed below
    const bool zero = fb ? p >= d.E : e < 0;
    const int col = zero ? 0 : fb ? p : e;  // the static plan routes to the mains only
    const int s1 = min(d.R, (c + 1) * run_len);
#pragma unroll 4
    for (int s = c * run_len; s < s1; ++s) route[(i64)s * d.P + p] = zero ? 0 : w.om[(i64)s * d.E + col];
  }
  for (int p = list_first(); p < d.P; p += gridDim.x * blockDim.x) {
    int e;
    if (!route_short(d, w, se1, fb, p, &e)) ls.items[atomicAdd(ls.count, 1)] = p;
  }
  __syncthreads();
  for_listed(d, ls, [&](int p, int lig) { route_listed(d, w, se0, se1, route, p, lig); });
}

// ---------------------------------------------------------------------------------------------------
// `topoep_plus` (topoep/planners/plus.py): after the refinement, free load moves across the EP group
// (phase 7), then the own-rank-first route of common.hierarchical_route (phases 8-9) instead of phase 6's
// interval route. Its state follows the topoep state in the workspace (plus_elems).
struct Plus {
  int on;                   // 0: the `topoep` policy (phase 6's route)
  int max_moves;            // the loop's bound, 4 R (E / R + N)
  i64 a2, bb;               // 2 S_tok a and 2 S_tok (b - a) in fs per assignment (common.two_level_costs)
  i64 *w2tot, *u2tot, *Mg;  // [M*E] per (domain, expert) group: its w2 total, its slots' u2 total, its m
  i64 *loc, *u1, *c, *cumc, *u2, *cumu2;  // [P] per instance (see route_plus)
  i64* host;                // [P] 1: the instance takes part in the moves (a main, or a replica with load)
  i64 *A, *acum, *w2, *w2cum;             // [R*E] per (source, expert)
  i64* pst;                 // [kPlusStamps] %globaltimer stamps (planner.h), 0 until reached
  i64* moves;               // [1] the number of moves made (info["global_moves"])
};

__host__ __device__ inline size_t plus_elems(const Dims& d) {
  return 3 * (size_t)d.M * d.E + 7 * (size_t)d.P + 4 * (size_t)d.R * d.E + kPlusStamps + 1;
}

__host__ __device__ inline void carve_plus(Plus& pl, i64* base, const Dims& d) {
  const size_t ME = (size_t)d.M * d.E, RE = (size_t)d.R * d.E;
  pl.w2tot = base; pl.u2tot = pl.w2tot + ME; pl.Mg = pl.u2tot + ME;
  pl.loc = pl.Mg + ME; pl.u1 = pl.loc + d.P; pl.c = pl.u1 + d.P; pl.cumc = pl.c + d.P; pl.u2 = pl.cumc + d.P;
  pl.cumu2 = pl.u2 + d.P; pl.host = pl.cumu2 + d.P;
  pl.A = pl.host + d.P; pl.acum = pl.A + RE; pl.w2 = pl.acum + RE; pl.w2cum = pl.w2 + RE;
  pl.pst = pl.w2cum + RE;
  pl.moves = pl.pst + kPlusStamps;
}

__device__ __forceinline__ void plus_stamp(const Plus& pl, int i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    pl.pst[i] = (i64)t;
  }
}

// The largest delta in [0, cap] with Delta(delta) <= 0 (plus.py free_amount): the breakpoints in ascending
// order, then the crossing segment solved in integers.
__device__ i64 free_amount(i64 cap, i64 f1, i64 g2, i64 F1, i64 G2, i64 a2, i64 bb) {
  const auto cost = [&](i64 x) {
    return a2 * (max(x - f1, (i64)0) - min(x, g2)) + bb * (max(x - F1, (i64)0) - min(x, G2));
  };
  i64 lo = 0;
  while (true) {
    i64 hi = cap;  // the smallest breakpoint in (lo, cap), else cap
    if (f1 > lo && f1 < hi) hi = f1;
    if (g2 > lo && g2 < hi) hi = g2;
    if (F1 > lo && F1 < hi) hi = F1;
    if (G2 > lo && G2 < hi) hi = G2;
    if (cost(hi) <= 0) {
      lo = hi;
      if (hi == cap) return cap;
      continue;
    }
    const i64 s = a2 * ((lo >= f1) - (lo < g2)) + bb * ((lo >= F1) - (lo < G2));  // > 0 here
    return lo + (-cost(lo)) / s;
  }
}

// topoep_plus's instance loads U[P] and rank loads L[R] from the refinement on, and host[P] (1: the instance
// takes part in the moves). With d.plus_smem every block keeps its own copy in shared memory and makes the
// same moves (deterministic, so the copies agree), and the route's first pass follows with no grid barrier;
// otherwise (a plan too large for it) block 0 moves the global state and a grid barrier publishes it.
struct Loads {
  i64 *U, *L, *host;
};

// instance p of the refined plan: expert (-1 for none) and rank; a replica counts only with load (the
// reference drops replicas that serve nothing before the moves)
__device__ __forceinline__ int plus_instance(int p, const int* se1, const Dims& d, const i64* U, int* rank) {
  int e;
  instance_of(p, se1, d, &e, rank);
  return (e >= 0 && (p < d.E || U[p] > 0)) ? e : -1;
}

// whether slot q holds an instance of e that counts (plus_instance: a replica with load)
__device__ __forceinline__ bool slot_holds(int q, int e, const int* se1, const Dims& d, const i64* U) {
  return se1[q] == e && U[d.E + q] > 0;
}

struct Move {
  i64 delta, lt;
  int rt, e, ps, pt;
};

__device__ __forceinline__ bool better_move(const Move& x, const Move& y) {
  if (x.delta != y.delta) return x.delta > y.delta;
  if (x.lt != y.lt) return x.lt < y.lt;
  if (x.rt != y.rt) return x.rt < y.rt;
  return x.e < y.e;
}

__device__ __forceinline__ Move shfl_move(const Move& m, int src) {
  Move o;
  o.delta = __shfl_xor_sync(kFull, m.delta, src);
  o.lt = __shfl_xor_sync(kFull, m.lt, src);
  o.rt = __shfl_xor_sync(kFull, m.rt, src);
  o.e = __shfl_xor_sync(kFull, m.e, src);
  o.ps = __shfl_xor_sync(kFull, m.ps, src);
  o.pt = __shfl_xor_sync(kFull, m.pt, src);
  return o;
}

// The block's best move (every thread gets it); delta 0: none
__device__ Move block_best_move(Move m) {
  __shared__ Move part[kWarps];
  for (int off = 16; off > 0; off >>= 1) {
    const Move o = shfl_move(m, off);
    if (better_move(o, m)) m = o;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // part[] may still be read from the previous call
  if (lane == 0) part[warp] = m;
  __syncthreads();
  m = part[0];
  for (int i = 1; i < kWarps; ++i) if (better_move(part[i], m)) m = part[i];
  return m;
}

// The busiest rank (ties: the lowest id), every thread gets it
__device__ int block_busiest(const Dims& d, const i64* L) {
  __shared__ i64 pl_[kWarps];
  __shared__ int pr_[kWarps];
  i64 bl = -1;
  int br = INT_MAX;
  for (int r = threadIdx.x; r < d.R; r += blockDim.x) if (L[r] > bl) { bl = L[r]; br = r; }
  for (int off = 16; off > 0; off >>= 1) {
    const i64 ol = __shfl_xor_sync(kFull, bl, off);
    const int orr = __shfl_xor_sync(kFull, br, off);
    if (ol > bl || (ol == bl && orr < br)) { bl = ol; br = orr; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { pl_[warp] = bl; pr_[warp] = br; }
  __syncthreads();
  bl = pl_[0]; br = pr_[0];
  for (int i = 1; i < kWarps; ++i) if (pl_[i] > bl || (pl_[i] == bl && pr_[i] < br)) { bl = pl_[i]; br = pr_[i]; }
  return br;
}

// U_d[e] of plus.py: the load of e's hosts in domain m (its main if it lies there, then the domain's slots)
__device__ i64 domain_load(int m, int e, const Dims& d, const Loads& s, const int* se1) {
  i64 acc = dom_of_rank(main_rank_of(e, d), d) == m ? s.U[e] : 0;
  for (int q = m * d.rpd * d.N; q < (m + 1) * d.rpd * d.N; ++q)
    if (se1[q] == e && s.host[d.E + q]) acc += s.U[d.E + q];
  return acc;
}

// phase 7 (one block's work): the free moves of plus.py global_moves, on s.U and s.L in place. The candidate
// pairs (source instance on the busiest rank rb, target instance of the same expert) are listed from the
// target's side, a thread each: slot q and rb's instance of q's expert (rb hosts an expert at most once), then
// rb's slots and their experts' mains; candidates are filtered on the slot table (shared memory) before any
// other load, and U_d comes from the hosts' loads when a pair needs it. A pair is (rt, e), so the best move is
// the same in any listing order (better_move). s.host is marked before (the kernel's staging). Returns the number
// of moves.
__device__ int global_moves(const Dims& d, const Work& w, const Plus& pl, const Loads& s, const int* se1) {
  const int N = d.N, RN = d.R * N;
  int moves = 0;
  while (moves < pl.max_moves) {
    const int rb = block_busiest(d, s.L), d1 = dom_of_rank(rb, d);
    if (moves == 0) plus_stamp(pl, 1);
    const i64 lb = s.L[rb];
    Move best;
    best.delta = 0; best.lt = 0; best.rt = INT_MAX; best.e = INT_MAX; best.ps = -1; best.pt = -1;
    for (int i = threadIdx.x; i < RN + N; i += blockDim.x) {
      int e, ps, pt, rt;
      if (i < RN) {  // target: slot i; source: rb's instance of its expert
        e = se1[i];
        if (e < 0) continue;
        pt = d.E + i;
        rt = i / N;
        ps = -1;
        if (main_rank_of(e, d) == rb) ps = e;
        else for (int j = 0; j < N; ++j) if (se1[rb * N + j] == e) ps = d.E + rb * N + j;
        if (ps < 0) continue;
      } else {  // source: rb's slot i - RN; target: its expert's main
        ps = d.E + rb * N + (i - RN);
        e = se1[ps - d.E];
        if (e < 0) continue;
        pt = e;
        rt = main_rank_of(e, d);
      }
      if (rt == rb || !s.host[ps] || !s.host[pt]) continue;
      const i64 u = s.U[ps];
      if (u <= 0) continue;
      const i64 lt = s.L[rt], half = (lb - lt) >> 1;
      if (half <= 0) continue;
      const int d2 = dom_of_rank(rt, d);
      const bool cross = d2 != d1;
      const i64 f1 = max(u - w.om[(i64)rb * d.E + e], (i64)0);
      const i64 g2 = max(w.om[(i64)rt * d.E + e] - s.U[pt], (i64)0);
      i64 F1 = 0, G2 = 0;
      if (cross) {
        F1 = max(domain_load(d1, e, d, s, se1) - w.D[(i64)d1 * d.E + e], (i64)0);
        G2 = max(w.D[(i64)d2 * d.E + e] - domain_load(d2, e, d, s, se1), (i64)0);
      }
      i64 cap = min(u, half);
      if (cross) cap = min(cap, F1 + G2);
      Move m;
      m.delta = free_amount(cap, f1, g2, F1, G2, pl.a2, cross ? pl.bb : 0);
      if (m.delta <= 0) continue;
      m.lt = lt; m.rt = rt; m.e = e; m.ps = ps; m.pt = pt;
      if (better_move(m, best)) best = m;
    }
    best = block_best_move(best);
    if (moves == 0) plus_stamp(pl, 2);
    if (best.delta <= 0) break;
    if (threadIdx.x == 0) {
      s.U[best.ps] -= best.delta;
      s.U[best.pt] += best.delta;
      s.L[rb] -= best.delta;
      s.L[best.rt] += best.delta;
    }
    ++moves;
    __syncthreads();
  }
  return moves;
}

// Sums and exclusive scans over the gw lanes of a lane group (gw a power of two <= 32, groups aligned in
// the warp); every lane of the warp calls them.
__device__ __forceinline__ i64 group_sum(i64 v, int gw) {
  for (int off = gw >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off, gw);
  return v;
}

__device__ __forceinline__ i64 group_excl_scan(i64 v, int sub, int gw) {
  i64 x = v;
  for (int off = 1; off < gw; off <<= 1) {
    const i64 y = __shfl_up_sync(kFull, x, off, gw);
    if (sub >= off) x += y;
  }
  return x - v;
}

// The route of topoep_plus, common.hierarchical_route of the moved loads, in two passes with one grid barrier.
// Pass A, per group (expert e, domain m) and its sources s in m, with p(s) e's instance on s if any (valid:
// a main, or a replica with load): loc = min(omega[s, e], U[p(s)]) served on its own rank, u1 = U - loc;
// A = omega - loc and acum its exclusive prefix over the domain's sources; the group's m = min(sum u1, sum A);
// the group's instances in index order (the main first, then the slots: rank order) take c = min((m - cum
// u1)^+, u1), cumc = min(cum u1, m), u2 = u1 - c; the slots' u2 prefix inside the domain goes to cumu2; the
// sources keep w2 = A - min((m - acum)^+, A) and its prefix inside the domain in w2cum; the group's totals
// of w2 and of the slots' u2 go to w2tot and u2tot. Pass B, per (source s, instance p): route[s, p] =
// [s == rank] loc + (same domain) overlap([min(acum, m), min(acum + A, m)), [cumc, cumc + c)) + overlap of
// s's w2 and p's u2 intervals in the order over all domains, whose offsets (the totals of the domains
// before, and the main's u2 ahead of every slot) it sums only where both are nonzero. Exactly the
// reference's three steps.

// Pass A with a group of d.rw lanes (rpd <= 32; a lane per source, shuffle scans)
__device__ void route_groups_lanes(const Dims& d, const Work& w, const Plus& pl, const i64* U, const int* se1) {
  const int gw = d.rw, lane = threadIdx.x & 31, sub = lane & (gw - 1), per_warp = 32 / gw;
  const int warps = gridDim.x * kWarps, warp = blockIdx.x * kWarps + (threadIdx.x >> 5), groups = d.M * d.E;
  for (int g0 = warp * per_warp; g0 < groups; g0 += warps * per_warp) {  // uniform over the warp
    const int gi = g0 + lane / gw;
    const bool on = gi < groups && sub < d.rpd;
    int e = 0, s = 0, p = -1;
    i64 x = 0;
    if (on) {
      const int m = gi / d.E;
      e = gi - m * d.E;
      s = m * d.rpd + sub;
      x = w.om[(i64)s * d.E + e];
      if (main_rank_of(e, d) == s) p = e;
      else for (int j = 0; j < d.N; ++j) if (slot_holds(s * d.N + j, e, se1, d, U)) p = d.E + s * d.N + j;
    }
    const i64 u = p >= 0 ? U[p] : 0, loc = min(x, u), u1 = u - loc, a = x - loc;
    const bool is_main = p >= 0 && p < d.E, is_slot = p >= d.E;
    const i64 acum = group_excl_scan(a, sub, gw);
    const i64 mg = min(group_sum(a, gw), group_sum(u1, gw));
    const i64 main_u1 = group_sum(is_main ? u1 : 0, gw);                     // 0 when the main is elsewhere
    const i64 slot_cum = group_excl_scan(is_slot ? u1 : 0, sub, gw);
    const i64 cum = is_slot ? main_u1 + slot_cum : 0;                        // the main comes first
    const i64 c = min(max(mg - cum, (i64)0), u1), u2 = u1 - c, slot_u2 = is_slot ? u2 : 0;
    const i64 cumu2 = group_excl_scan(slot_u2, sub, gw), u2tot = group_sum(slot_u2, gw);
    const i64 w2 = a - min(max(mg - acum, (i64)0), a);
    const i64 w2cum = group_excl_scan(w2, sub, gw), w2tot = group_sum(w2, gw);
    if (p >= 0) {
      pl.loc[p] = loc; pl.c[p] = c; pl.cumc[p] = min(cum, mg); pl.u2[p] = u2; pl.cumu2[p] = is_slot ? cumu2 : 0;
    }
    if (on) {
      const i64 i = (i64)s * d.E + e;
      pl.A[i] = a; pl.acum[i] = acum; pl.w2[i] = w2; pl.w2cum[i] = w2cum;
      if (sub == 0) { pl.Mg[gi] = mg; pl.w2tot[gi] = w2tot; pl.u2tot[gi] = u2tot; }
    }
  }
}

// Pass A with a thread per group (rpd > 32, or more than two rounds of lane groups on the grid), serial over the
// domain's sources and slots
__device__ void route_groups_serial(const Dims& d, const Work& w, const Plus& pl, const i64* U, const int* se1) {
  const int threads = gridDim.x * blockDim.x, tid = blockIdx.x * blockDim.x + threadIdx.x;
  const i64* __restrict__ om = w.om;
  for (int gi = tid; gi < d.M * d.E; gi += threads) {
    const int m = gi / d.E, e = gi - m * d.E, s0 = m * d.rpd;
    i64 acc = 0;
#pragma unroll 4
    for (int s = s0; s < s0 + d.rpd; ++s) {
      const i64 x = om[(i64)s * d.E + e];
      int p = -1;  // e's instance on s, if any
      if (main_rank_of(e, d) == s) p = e;
      else for (int j = 0; j < d.N; ++j) if (slot_holds(s * d.N + j, e, se1, d, U)) p = d.E + s * d.N + j;
      i64 loc = 0;
      if (p >= 0) {
        const i64 u = U[p];
        loc = min(x, u);
        pl.loc[p] = loc;
        pl.u1[p] = u - loc;
      }
      pl.A[(i64)s * d.E + e] = x - loc;
      pl.acum[(i64)s * d.E + e] = acc;
      acc += x - loc;
    }
    const bool main_here = dom_of_rank(main_rank_of(e, d), d) == m;
    const int q0 = s0 * d.N, q1 = (s0 + d.rpd) * d.N;
    i64 cap = main_here ? pl.u1[e] : 0;
    for (int q = q0; q < q1; ++q) if (slot_holds(q, e, se1, d, U)) cap += pl.u1[d.E + q];
    const i64 mg = min(acc, cap);
    pl.Mg[gi] = mg;
    i64 cum = 0, slots_u2 = 0;
    for (int q = main_here ? q0 - 1 : q0; q < q1; ++q) {  // q0 - 1: the main
      int p = e;
      if (q >= q0) {
        if (!slot_holds(q, e, se1, d, U)) continue;
        p = d.E + q;
      }
      const i64 u1 = pl.u1[p], c = min(max(mg - cum, (i64)0), u1);
      pl.c[p] = c;
      pl.cumc[p] = min(cum, mg);
      pl.u2[p] = u1 - c;
      cum += u1;
      if (p < d.E) { pl.cumu2[p] = 0; continue; }  // the main is the first of e's instances
      pl.cumu2[p] = slots_u2;  // pass B adds the main's u2 and the slots of the domains before m
      slots_u2 += u1 - c;
    }
    i64 acc2 = 0;
    for (int s = s0; s < s0 + d.rpd; ++s) {
      const i64 i = (i64)s * d.E + e, a = pl.A[i];
      const i64 w2 = a - min(max(mg - pl.acum[i], (i64)0), a);
      pl.w2[i] = w2;
      pl.w2cum[i] = acc2;  // pass B adds the sources of the domains before m
      acc2 += w2;
    }
    pl.w2tot[gi] = acc2;
    pl.u2tot[gi] = slots_u2;
  }
}

__device__ void route_plus(const Dims& d, const Work& w, const Plus& pl, const i64* U, const int* se1,
                           i64* __restrict__ slot_expert, i64* __restrict__ route) {
  const int threads = gridDim.x * blockDim.x, tid = blockIdx.x * blockDim.x + threadIdx.x;
  // the final slot table
  for (int q = tid; q < d.R * d.N; q += threads) {
    int r;
    slot_expert[q] = plus_instance(d.E + q, se1, d, U, &r);
  }
  // lane groups where they take at most two rounds of the grid (results/planner_latency.md, "Grid size")
  const bool lanes = (d.skip & kRouteLanes) || (long long)d.M * d.E * d.rw <= 2ll * threads;
  if (d.rw > 0 && !(d.skip & kRouteSerial) && lanes) route_groups_lanes(d, w, pl, U, se1);
  else route_groups_serial(d, w, pl, U, se1);
  grid_sync();
  plus_stamp(pl, 4);
  // pass B: a thread per (source, instance)
  for (i64 i = tid; i < (i64)d.R * d.P; i += threads) {
    const int s = (int)(i / d.P), p = (int)(i - (i64)s * d.P);
    int r;
    const int e = plus_instance(p, se1, d, U, &r);
    i64 v = 0;
    if (e >= 0) {
      const i64 si = (i64)s * d.E + e;
      const int ds = dom_of_rank(s, d), dr = dom_of_rank(r, d);
      if (s == r) v += pl.loc[p];
      if (ds == dr) {
        const i64 mg = pl.Mg[(i64)dr * d.E + e];
        const i64 lo = min(pl.acum[si], mg), hi = min(pl.acum[si] + pl.A[si], mg);
        const i64 ov = min(hi, pl.cumc[p] + pl.c[p]) - max(lo, pl.cumc[p]);
        if (ov > 0) v += ov;
      }
      const i64 w2 = pl.w2[si], u2 = pl.u2[p];
      if (w2 > 0 && u2 > 0) {
        i64 w2cum = pl.w2cum[si], cumu2 = pl.cumu2[p];
        for (int m2 = 0; m2 < ds; ++m2) w2cum += pl.w2tot[(i64)m2 * d.E + e];
        if (p >= d.E) {  // a slot: after the main and the slots of the domains before its own
          cumu2 += pl.u2[e];
          for (int m2 = 0; m2 < dr; ++m2) cumu2 += pl.u2tot[(i64)m2 * d.E + e];
        }
        const i64 ov = min(w2cum + w2, cumu2 + u2) - max(w2cum, cumu2);
        if (ov > 0) v += ov;
      }
    }
    route[i] = v;
  }
}

// ---------------------------------------------------------------------------------------------------
template <int NT>
__global__ void __launch_bounds__(kThreads, 1) topoep_kernel(const i64* __restrict__ omega, const i64* __restrict__ cost_fs,
                                                            Dims d, Work w, Plus pl, i64* __restrict__ slot_expert,
                                                            i64* __restrict__ route) {
  extern __shared__ i64 smem[];
  __shared__ int num_listed;
  stamp(w, 0);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    w.stamps[6] = 0;  // the route's end: a max over blocks, below
    if (pl.on) for (int i = 0; i < kPlusStamps; ++i) pl.pst[i] = 0;
  }
  if (d.skip & kSkipAll) return;
  i64* scratch = smem;  // per-phase shared memory (smem_bytes)
  const ListState ls = {(int*)scratch + 2 * d.R * d.N, &num_listed};  // after the two slot tables
  if (d.local) {        // omega and the state move into shared memory, after the scratch area
    i64* om = smem + scratch_elems(d);
#pragma unroll 8
    for (int i = threadIdx.x; i < d.R * d.E; i += blockDim.x) om[i] = omega[i];
    w.om = om;
    carve(w, om + (size_t)d.R * d.E, d);
    __syncthreads();
  }
  // 1 demand
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d.M * d.E; i += gridDim.x * blockDim.x) {
    const int m = i / d.E, e = i % d.E;
    i64 acc = 0;
    for (int s = m * d.rpd; s < (m + 1) * d.rpd; ++s) acc += w.om[(i64)s * d.E + e];
    w.D[i] = acc;
    // instance counts of the mains alone (phase 3 adds the replicas): e's main is first of its instances
    w.cnt_dom0[i] = dom_of_rank(main_rank_of(e, d), d) == m;
    if (m == 0) { w.cnt_all0[e] = 1; w.pos_all0[e] = 0; w.pos_dom0[e] = 0; }
  }
  grid_sync();
  stamp(w, 1);
  // 2 placement (static loads; stage 1)
  for (int dom = blockIdx.x; dom < d.M; dom += gridDim.x) placement(dom, d, w, scratch);
  grid_sync();
  stamp(w, 2);
  // 3 instances of the stage-1 placement; the slot table stays staged in shared memory for phase 4
  int* se0 = (int*)scratch;
  for (int q = threadIdx.x; q < d.R * d.N; q += blockDim.x) se0[q] = (int)w.slot0[q];
  __syncthreads();
  instances(d, w, se0);
  grid_sync();
  stamp(w, 3);
  // 4 stage-2 split
  split(d, w, se0, ls);
  grid_sync();
  stamp(w, 4);
  // 5 refinement, a block per domain
  for (int dom = blockIdx.x; dom < d.M; dom += gridDim.x) refine<NT>(dom, cost_fs, d, w, scratch);
  grid_sync();
  stamp(w, 5);
  // 6 guard, final slots, route
  int* se1 = (int*)scratch;
  se0 = se1 + d.R * d.N;
  for (int q = threadIdx.x; q < d.R * d.N; q += blockDim.x) { se1[q] = (int)w.slot1[q]; se0[q] = (int)w.slot0[q]; }
  Loads s = {w.U, w.L, pl.host};
  if (pl.on && (d.plus_smem || blockIdx.x == 0)) {
    // topoep_plus, staged for the blocks that move: the hosts of the moves, fixed before the first move (a replica
    // a move empties still receives load later); with d.plus_smem every block's own copy of the loads (see Loads),
    // else block 0 alone moves the global state
    if (d.plus_smem) {
      i64* base = smem + scratch_elems(d);
      s = {base, base + d.P, base + d.P + d.R};
    }
    __syncthreads();  // se1
    for (int p = threadIdx.x; p < d.P; p += blockDim.x) {
      int r;
      if (d.plus_smem) s.U[p] = w.U[p];
      s.host[p] = plus_instance(p, se1, d, w.U, &r) >= 0;
    }
    if (d.plus_smem) for (int r = threadIdx.x; r < d.R; r += blockDim.x) s.L[r] = w.L[r];
  }
  const bool fb = guard_fires(d, w);  // contains block barriers (orders the staging above)
  if (pl.on && !fb) {  // topoep_plus: 7 free moves, 8-9 the own-rank-first route
    plus_stamp(pl, 0);
    if (d.plus_smem || blockIdx.x == 0) {
      const int moves = global_moves(d, w, pl, s, se1);
      if (blockIdx.x == 0 && threadIdx.x == 0) *pl.moves = moves;
    }
    if (!d.plus_smem) grid_sync();  // block 0's moves of the global state, before the route reads them
    plus_stamp(pl, 3);
    route_plus(d, w, pl, s.U, se1, slot_expert, route);
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      atomicMax((unsigned long long*)&pl.pst[kPlusStamps - 1], t);
    }
  } else {
    if (pl.on && blockIdx.x == 0 && threadIdx.x == 0) *pl.moves = 0;
    if (!(d.skip & kSkipRoute)) route_phase(d, w, se0, se1, fb, slot_expert, route, ls);
  }
  // no grid barrier follows the route: its end is the last block's, a max of every block's clock
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    atomicMax((unsigned long long*)&w.stamps[6], t);
  }
}

__global__ void static_kernel(const i64* __restrict__ omega, Dims d, i64* __restrict__ slot_expert,
                              i64* __restrict__ route) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (i64)d.R * d.N) slot_expert[i] = -1;
  if (i < (i64)d.R * d.P) {
    int s = (int)(i / d.P), p = (int)(i % d.P);
    route[i] = p < d.E ? omega[(i64)s * d.E + p] : 0;
  }
}

static inline int blocks_for(long long n, int t) { return (int)((n + t - 1) / t); }

// ---------------------------------------------------------------------------------------------------
// Workspace: stamps[kNumStamps], then the state (state_elems).
static Dims make_dims(int R, int E, int M, int N) {
  Dims d;
  d.R = R; d.E = E; d.M = M; d.rpd = R / M; d.N = N; d.P = E + R * N; d.Eloc = E / R; d.G = d.Eloc + N;
  d.W = 0; d.S = 0; d.local = 0; d.skip = 0; d.plus_smem = 0;
  d.inv_eloc = ((1ull << 32) + d.Eloc - 1) / d.Eloc;
  d.inv_rpd = ((1ull << 32) + d.rpd - 1) / d.rpd;
  d.gw = 1;
  while (d.gw < R && d.gw < 32) d.gw <<= 1;
  d.rw = 1;
  while (d.rw < d.rpd) d.rw <<= 1;
  if (d.rw > 32) d.rw = 0;
  return d;
}

size_t workspace_elems(int R, int E, int M, int N) {
  const Dims d = make_dims(R, E, M, N);
  return kNumStamps + state_elems(d) + plus_elems(d);
}

size_t phase_ns_offset(int, int, int, int) { return 0; }

size_t plus_moves_offset(int R, int E, int M, int N) {
  const Dims d = make_dims(R, E, M, N);
  return kNumStamps + state_elems(d) + plus_elems(d) - 1;  // the last element (carve_plus)
}

static int g_skip_stages = 0;  // set_skip_stages: read at every launch (and captured by CUDA graphs)
void set_skip_stages(int mask) { g_skip_stages = mask; }
static int g_grid_blocks = 0;  // set_grid_blocks: 0 the default (grid_blocks), else the grid of multi-block plans
void set_grid_blocks(int n) { g_grid_blocks = n; }

size_t smem_bytes(int R, int E, int M, int N) { return sizeof(i64) * scratch_elems(make_dims(R, E, M, N)); }

// One block (everything in shared memory) when a `topoep` plan is small and has one domain; else half the SMs.
static int grid_blocks(const Dims& d, int sms, size_t* smem, bool plus) {
  const long long pairs = (long long)d.R * d.P;
  const size_t local = sizeof(i64) * ((size_t)d.R * d.E + state_elems(d));
  *smem = sizeof(i64) * scratch_elems(d);
  // topoep_plus never: its route passes want the grid's threads (results/planner_latency.md, "Grid size": at EP 8
  // 48 us on the grid against 59 us in one block; topoep 41 against 37)
  if (!plus && !(d.skip & kNoLocal) && d.M == 1 && pairs <= 16384 && *smem + local <= kLocalSmemBytes) {
    *smem += local;
    return 0;  // local
  }
  // Half the SMs. A block holds almost all of an SM's registers (about 116 per thread), and a cooperative grid
  // starts only when every block has its SM: a grid of every SM would wait for any kernel that runs beside it
  // (a collective on another stream, a side-stream combine) to end, half leaves room for them. Measured alone
  // (results/planner_latency.md, "Grid size"), every SM saves about 4.5 us for topoep_plus at EP 128 and 1 us or
  // less elsewhere; fewer blocks cost more (at EP 128, 32 blocks 4 us, 16 blocks 20 us). Domains beyond the grid
  // are looped over.
  return max(1, sms / 2);
}

cudaError_t plan_topoep(const int64_t* omega, const int64_t* cost_fs, int R, int E, int M, int N, int64_t W,
                        int64_t S, int64_t* slot_expert, int64_t* route, int64_t* ws, cudaStream_t stream,
                        const PlusArgs* plus) {
  Dims d = make_dims(R, E, M, N);
  d.W = W; d.S = S; d.skip = g_skip_stages;
  Plus pl = {};
  carve_plus(pl, ws + kNumStamps + state_elems(d), d);
  if (plus != nullptr) { pl.on = 1; pl.max_moves = plus->max_moves; pl.a2 = plus->a2; pl.bb = plus->bb; }
  if (plus != nullptr && N == 0) {  // no slots: the static plan, no move
    cudaMemsetAsync(pl.moves, 0, sizeof(i64), stream);
  }
  if (N == 0) {
    static_kernel<<<blocks_for((long long)R * d.P, 256), 256, 0, stream>>>(omega, d, slot_expert, route);
    return cudaGetLastError();
  }
  Work w;
  w.om = omega;
  w.stamps = ws;
  carve(w, ws + kNumStamps, d);

  int dev = 0;
  cudaGetDevice(&dev);
  static int sms_of[64] = {0};  // SM count per device ordinal, queried once
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (sms_of[dev] == 0) cudaDeviceGetAttribute(&sms_of[dev], cudaDevAttrMultiProcessorCount, dev);
  size_t smem = 0;
  int blocks = grid_blocks(d, sms_of[dev], &smem, plus != nullptr);
  if (blocks == 0) { d.local = 1; blocks = 1; }
  else if (g_grid_blocks > 0) blocks = max(min(g_grid_blocks, sms_of[dev]), 1);
  const size_t plus_smem = sizeof(i64) * (2 * (size_t)d.P + d.R);  // Loads: U, L, host
  if (plus != nullptr && !d.local && !(d.skip & kPlusGlobal) && smem + plus_smem <= kLocalSmemBytes) {
    d.plus_smem = 1;
    smem += plus_smem;
  }
  // the refinement's slot loops are unrolled for 1-4 slots
  void (*kernel)(const i64*, const i64*, Dims, Work, Plus, i64*, i64*) =
      N == 1 ? topoep_kernel<1> : N == 2 ? topoep_kernel<2> : N == 3 ? topoep_kernel<3> : N == 4 ? topoep_kernel<4>
                                                                                           : topoep_kernel<0>;
  static int max_smem_set[5] = {0, 0, 0, 0, 0};  // allow more than 48 KiB of dynamic shared memory
  const int ki = N <= 4 ? N : 0;
  if ((int)smem > 48 * 1024 && (int)smem > max_smem_set[ki]) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
    max_smem_set[ki] = (int)smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = blocks > 1 ? 1 : 0;  // one block synchronises with block barriers: a plain launch
  return cudaLaunchKernelEx(&cfg, kernel, omega, cost_fs, d, w, pl, slot_expert, route);
}

cudaError_t plan_static(const int64_t* omega, int R, int E, int N, int64_t* slot_expert, int64_t* route,
                        cudaStream_t stream) {
  const Dims d = make_dims(R, E, 1, N);
  static_kernel<<<blocks_for((long long)R * d.P, 256), 256, 0, stream>>>(omega, d, slot_expert, route);
  return cudaGetLastError();
}

}  // namespace topoep
