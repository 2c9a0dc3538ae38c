// GPU planner: the `static` and `topoep` policies of topoep/planners/reference.py and `topoep_plus` of
// topoep/planners/plus.py, bit for bit. This file holds the kernels, which run the phases in order, and their
// launch (the host side of planner.h); the phases are device functions in one header each, compiled into this
// file's kernel (one translation unit, so the cooperative kernel needs no relocatable device code):
//   planner_device.cuh      sizes, state, index helpers, barriers and stamps shared by the phases
//   planner_stages.cuh      phases 2-4 (stage 1's placement, its instances, stage 2's split)
//   planner_refine.cuh      phase 5 (stage 3, the refinement)
//   planner_route.cuh       phase 6 (the guard and `topoep`'s route)
//   planner_plus_moves.cuh  phase 7 (topoep_plus's free moves)
//   planner_plus_route.cuh  phases 8-9 (topoep_plus's route)
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
//                (own-rank loads, the domain's sources, the group's matched amount m and its instances): a lane
//                per source of the domain and shuffle scans where that takes at most two rounds of the grid, else
//                a thread per group, with the sources in registers on domains of up to 8 ranks; B a thread per
//                instance and every few sources (the instance's words loaded once), which adds the prefixes
//                across domains only where a cross-domain share can be nonzero
// Block 0 records a %globaltimer stamp after every phase in the workspace's head (planner.h); the route's end,
// with no grid barrier after it, is the latest block's. topoep_plus stamps its own phases after the refinement.

#include "planner.h"
#include "planner_device.cuh"
#include "planner_stages.cuh"
#include "planner_refine.cuh"
#include "planner_route.cuh"
#include "planner_plus_moves.cuh"
#include "planner_plus_route.cuh"

namespace topoep {

// The static plan (every assignment on its expert's main instance, no slot used), grid-strided from thread `i`.
__device__ __forceinline__ void write_static(const i64* __restrict__ omega, const Dims& d, i64* __restrict__ slot_expert,
                                             i64* __restrict__ route, i64 i, i64 stride) {
  for (i64 q = i; q < (i64)d.R * d.N; q += stride) slot_expert[q] = -1;
  for (; i < (i64)d.R * d.P; i += stride) {
    int s = (int)(i / d.P), p = (int)(i % d.P);
    route[i] = p < d.E ? omega[(i64)s * d.E + p] : 0;
  }
}

template <int NT>
__global__ void __launch_bounds__(kThreads, 1) topoep_kernel(const i64* __restrict__ omega, const i64* __restrict__ cost_fs,
                                                            Dims d, Work w, Plus pl, i64* __restrict__ slot_expert,
                                                            i64* __restrict__ route, const bool* __restrict__ enable) {
  extern __shared__ i64 smem[];
  __shared__ int num_listed;
  stamp(w, 0);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    w.head[kStampsAt + kPhaseStamps - 1] = 0;  // the route's end: a max over blocks, below
    if (pl.on) for (int i = 0; i < kPlusStamps; ++i) pl.pst[i] = 0;
  }
  if (d.skip & kSkipAll) return;
  if (enable != nullptr && !*enable) {  // the guard's pre-plan bound says no plan can pay: the static plan, no moves
    if (pl.on && blockIdx.x == 0 && threadIdx.x == 0) *pl.moves = 0;
    write_static(omega, d, slot_expert, route, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
    return;  // every block returns here: no grid barrier is left waiting
  }
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
    atomicMax((unsigned long long*)&w.head[kStampsAt + kPhaseStamps - 1], t);
  }
}

__global__ void static_kernel(const i64* __restrict__ omega, Dims d, i64* __restrict__ slot_expert,
                              i64* __restrict__ route) {
  write_static(omega, d, slot_expert, route, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}

static inline int blocks_for(long long n, int t) { return (int)((n + t - 1) / t); }

// ---------------------------------------------------------------------------------------------------
static Dims make_dims(int R, int E, int M, int N) {
  Dims d;
  d.R = R; d.E = E; d.M = M; d.rpd = R / M; d.N = N; d.P = E + R * N; d.Eloc = E / R; d.G = d.Eloc + N;
  d.W = 0; d.S = 0; d.local = 0; d.skip = 0; d.plus_smem = 0; d.intra = 0;
  d.inv_eloc = ((1ull << 32) + d.Eloc - 1) / d.Eloc;
  d.inv_rpd = ((1ull << 32) + d.rpd - 1) / d.rpd;
  d.gw = 1;
  while (d.gw < R && d.gw < 32) d.gw <<= 1;
  d.rw = 1;
  while (d.rw < d.rpd) d.rw <<= 1;
  if (d.rw > 32) d.rw = 0;
  return d;
}

WorkspaceLayout workspace_layout(int R, int E, int M, int N) {
  const Dims d = make_dims(R, E, M, N);
  WorkspaceLayout l;
  Bump b;
  b.take(kHeadElems);
  l.state = b.take(state_layout(d).elems);
  l.plus = b.take(plus_layout(d).elems);
  l.elems = b.end;
  return l;
}

size_t smem_bytes(int R, int E, int M, int N) { return sizeof(i64) * scratch_elems(make_dims(R, E, M, N)); }

// One block (everything in shared memory) when a `topoep` plan is small and has one domain; else half the SMs.
static int grid_blocks(const Dims& d, int sms, size_t* smem, bool plus) {
  const long long pairs = (long long)d.R * d.P;
  const size_t local = sizeof(i64) * ((size_t)d.R * d.E + state_layout(d).elems);
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
                        int64_t S, int64_t* slot_expert, int64_t* route, int64_t* ws, int num_blocks,
                        int skip_stages, cudaStream_t stream, const PlusArgs* plus, const bool* enable) {
  Dims d = make_dims(R, E, M, N);
  d.W = W; d.S = S; d.skip = skip_stages;
  const WorkspaceLayout layout = workspace_layout(R, E, M, N);
  Plus pl = {};
  carve_plus(pl, ws, ws + layout.plus, d);
  if (plus != nullptr) {
    pl.on = 1; pl.max_moves = plus->max_moves; pl.a2 = plus->a2; pl.bb = plus->bb;
    d.intra = plus->intra_only;
  }
  if (plus != nullptr && N == 0) {  // no slots: the static plan, no move
    cudaMemsetAsync(pl.moves, 0, sizeof(i64), stream);
  }
  if (N == 0) {
    static_kernel<<<blocks_for((long long)R * d.P, 256), 256, 0, stream>>>(omega, d, slot_expert, route);
    return cudaGetLastError();
  }
  Work w;
  w.om = omega;
  w.head = ws;
  carve(w, ws + layout.state, d);

  int dev = 0;
  cudaGetDevice(&dev);
  static int sms_of[64] = {0};  // SM count per device ordinal, queried once
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (sms_of[dev] == 0) cudaDeviceGetAttribute(&sms_of[dev], cudaDevAttrMultiProcessorCount, dev);
  size_t smem = 0;
  int blocks = grid_blocks(d, sms_of[dev], &smem, plus != nullptr);
  if (blocks == 0) { d.local = 1; blocks = 1; }
  else if (num_blocks > 0) blocks = max(min(num_blocks, sms_of[dev]), 1);
  const size_t plus_smem = sizeof(i64) * (2 * (size_t)d.P + d.R);  // Loads: U, L, host
  if (plus != nullptr && !d.local && !(d.skip & kPlusGlobal) && smem + plus_smem <= kLocalSmemBytes) {
    d.plus_smem = 1;
    smem += plus_smem;
  }
  // the refinement's slot loops are unrolled for 1-4 slots
  void (*kernel)(const i64*, const i64*, Dims, Work, Plus, i64*, i64*, const bool*) =
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
  return cudaLaunchKernelEx(&cfg, kernel, omega, cost_fs, d, w, pl, slot_expert, route, enable);
}

cudaError_t plan_static(const int64_t* omega, int R, int E, int N, int64_t* slot_expert, int64_t* route,
                        cudaStream_t stream) {
  const Dims d = make_dims(R, E, 1, N);
  static_kernel<<<blocks_for((long long)R * d.P, 256), 256, 0, stream>>>(omega, d, slot_expert, route);
  return cudaGetLastError();
}

}  // namespace topoep
