// Phase 6 of the planner kernel: the never-worse-than-static guard, the final slot table and the `topoep`
// policy's interval route.
#pragma once

#include "planner_device.cuh"

namespace topoep {

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

}  // namespace topoep
