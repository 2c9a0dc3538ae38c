// Phases 2-4 of the planner kernel: stage 1's placement of replicas per domain, the instances of that
// placement, and stage 2's split of every (source, expert) demand over them (U0, the instance loads).
#pragma once

#include "planner_device.cuh"

namespace topoep {

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
  if (d.M == 1 || d.N == 0 || d.intra) return;  // no remote experts / no slots / topoep_plus_local: nothing to place
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

}  // namespace topoep
