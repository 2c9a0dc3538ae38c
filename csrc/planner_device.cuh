// Definitions shared by the planner's phases (planner_*.cuh) and its kernel (planner_kernel.cu): the sizes
// of a plan (Dims), the state between phases and where it lives (Work, Plus, Loads), index helpers, the
// barriers and timestamps, and the block-local list of instances that phases 4 and 6 work through.
//
// Instances (plan.py): P = E + R*N; p < E is expert p's main on rank p / (E / R); p = E + r*N + j
// is slot j of rank r. Default placement main(e) = e / (E / R) only.
#pragma once

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
  int intra;                         // 1: no stage-1 placement (topoep_plus_local: every slot for phase 5)
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
  i64* head;  // the workspace's head (planner.h: stamps and counters), always global
};

// Where the state's arrays lie: offsets (int64 elements) from its base, and the int arrays' offsets (ints) from
// `ints`, where they share a run of int64s, two per element. Its size is `elems`.
struct StateLayout {
  size_t D, L0, U, L, slot0, slot1, T, ints, elems;
  size_t pos_all0, pos_dom0, cnt_all0, cnt_dom0;
};

__host__ __device__ inline StateLayout state_layout(const Dims& d) {
  StateLayout s;
  Bump b, ints;
  s.D = b.take((size_t)d.M * d.E);
  s.L0 = b.take(d.R);
  s.U = b.take(d.P);
  s.L = b.take(d.R);
  s.slot0 = b.take((size_t)d.R * d.N);
  s.slot1 = b.take((size_t)d.R * d.N);
  s.T = b.take(d.E);
  s.pos_all0 = ints.take(d.P);
  s.pos_dom0 = ints.take(d.P);
  s.cnt_all0 = ints.take(d.E);
  s.cnt_dom0 = ints.take((size_t)d.M * d.E);
  s.ints = b.take((ints.end + 1) / 2);
  s.elems = b.end;
  return s;
}

// The state's arrays from `base`: in the workspace, or (d.local) in shared memory
__host__ __device__ inline void carve(Work& w, i64* base, const Dims& d) {
  const StateLayout s = state_layout(d);
  w.D = base + s.D;
  w.L0 = base + s.L0;
  w.U = base + s.U;
  w.L = base + s.L;
  w.slot0 = base + s.slot0;
  w.slot1 = base + s.slot1;
  w.T = base + s.T;
  int* ints = (int*)(base + s.ints);
  w.pos_all0 = ints + s.pos_all0;
  w.pos_dom0 = ints + s.pos_dom0;
  w.cnt_all0 = ints + s.cnt_all0;
  w.cnt_dom0 = ints + s.cnt_dom0;
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
    w.head[kStampsAt + i] = (i64)t;
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

// `topoep_plus` (topoep/planners/plus.py): after the refinement, free load moves across the EP group
// (phase 7), then the own-rank-first route of common.hierarchical_route (phases 8-9) instead of phase 6's
// interval route. Its state follows the topoep state in the workspace (plus_layout).
struct Plus {
  int on;                   // 0: the `topoep` policy (phase 6's route)
  int max_moves;            // the loop's bound, 4 R (E / R + N)
  i64 a2, bb;               // 2 S_tok a and 2 S_tok (b - a) in fs per assignment (common.two_level_costs)
  i64 *w2tot, *u2tot, *Mg;  // [M*E] per (domain, expert) group: its w2 total, its slots' u2 total, its m
  i64 *loc, *u1, *c, *cumc, *u2, *cumu2;  // [P] per instance (see route_plus)
  i64* host;                // [P] 1: the instance takes part in the moves (a main, or a replica with load)
  i64 *A, *acum, *w2, *w2cum;             // [R*E] per (source, expert)
  i64* pst;                 // [kPlusStamps] %globaltimer stamps (in the workspace's head), 0 until reached
  i64* moves;               // [1] the number of moves made (info["global_moves"]; in the workspace's head)
};

// Where topoep_plus's arrays lie: offsets (int64 elements) from its base; its size is `elems`
struct PlusLayout {
  size_t w2tot, u2tot, Mg, loc, u1, c, cumc, u2, cumu2, host, A, acum, w2, w2cum, elems;
};

inline PlusLayout plus_layout(const Dims& d) {
  const size_t ME = (size_t)d.M * d.E, RE = (size_t)d.R * d.E;
  PlusLayout s;
  Bump b;
  s.w2tot = b.take(ME); s.u2tot = b.take(ME); s.Mg = b.take(ME);
  s.loc = b.take(d.P); s.u1 = b.take(d.P); s.c = b.take(d.P); s.cumc = b.take(d.P); s.u2 = b.take(d.P);
  s.cumu2 = b.take(d.P); s.host = b.take(d.P);
  s.A = b.take(RE); s.acum = b.take(RE); s.w2 = b.take(RE); s.w2cum = b.take(RE);
  s.elems = b.end;
  return s;
}

// topoep_plus's arrays from `base` and its stamps and move count in the workspace's head `ws`
inline void carve_plus(Plus& pl, i64* ws, i64* base, const Dims& d) {
  const PlusLayout s = plus_layout(d);
  pl.w2tot = base + s.w2tot; pl.u2tot = base + s.u2tot; pl.Mg = base + s.Mg;
  pl.loc = base + s.loc; pl.u1 = base + s.u1; pl.c = base + s.c; pl.cumc = base + s.cumc; pl.u2 = base + s.u2;
  pl.cumu2 = base + s.cumu2; pl.host = base + s.host;
  pl.A = base + s.A; pl.acum = base + s.acum; pl.w2 = base + s.w2; pl.w2cum = base + s.w2cum;
  pl.pst = ws + kPlusStampsAt;
  pl.moves = ws + kMovesAt;
}

__device__ __forceinline__ void plus_stamp(const Plus& pl, int i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    pl.pst[i] = (i64)t;
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

}  // namespace topoep
