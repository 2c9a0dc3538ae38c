// Phases 8-9 of the planner kernel (`topoep_plus` only): the own-rank-first route of
// common.hierarchical_route in two passes.
#pragma once

#include "planner_device.cuh"

namespace topoep {

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

// e's instance on rank s that the route counts (plus_instance): its main if mr (e's main rank) is s, else the slot of
// s that holds e with load; -1 if none (a rank hosts an expert at most once)
__device__ __forceinline__ int instance_on(int s, int e, int mr, const int* se1, const Dims& d, const i64* U) {
  if (mr == s) return e;
  int p = -1;
  for (int j = 0; j < d.N; ++j) if (slot_holds(s * d.N + j, e, se1, d, U)) p = d.E + s * d.N + j;
  return p;
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
      p = instance_on(s, e, main_rank_of(e, d), se1, d, U);
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
      const int p = instance_on(s, e, main_rank_of(e, d), se1, d, U);
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
    i64 acc2 = 0, acum = 0;  // acum: pl.acum again, summed as the first loop did
    for (int s = s0; s < s0 + d.rpd; ++s) {
      const i64 i = (i64)s * d.E + e, a = pl.A[i];
      const i64 w2 = a - min(max(mg - acum, (i64)0), a);
      acum += a;
      pl.w2[i] = w2;
      pl.w2cum[i] = acc2;  // pass B adds the sources of the domains before m
      acc2 += w2;
    }
    pl.w2tot[gi] = acc2;
    pl.u2tot[gi] = slots_u2;
  }
}

constexpr int kRegSources = 8;  // route_groups_regs: domains of up to 8 ranks (an NVLink node of 8 GPUs)

// Pass A with a thread per group whose domain has at most K sources (rpd <= K): route_groups_serial with the
// sources' instances, loads and A in registers (loops unrolled over K, so nothing is indexed at run time). A rank
// hosts an expert at most once, so the domain's instances of e are the sources' own: the main (on its rank, if that
// lies in the domain) and the slots in rank order, which is the order of the sources.
template <int K>
__device__ void route_groups_regs(const Dims& d, const Work& w, const Plus& pl, const i64* U, const int* se1) {
  const int threads = gridDim.x * blockDim.x, tid = blockIdx.x * blockDim.x + threadIdx.x;
  const i64* __restrict__ om = w.om;
  for (int gi = tid; gi < d.M * d.E; gi += threads) {
    const int m = gi / d.E, e = gi - m * d.E, s0 = m * d.rpd, mr = main_rank_of(e, d);
    i64 a[K], u1[K];
    int ps[K];
    i64 acc = 0, cap = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      ps[k] = -1; a[k] = 0; u1[k] = 0;
      if (k >= d.rpd) continue;
      const int s = s0 + k;
      const i64 x = om[(i64)s * d.E + e];
      const int p = instance_on(s, e, mr, se1, d, U);
      i64 loc = 0;
      if (p >= 0) {
        const i64 u = U[p];
        loc = min(x, u);
        pl.loc[p] = loc;
        u1[k] = u - loc;
        cap += u1[k];
      }
      ps[k] = p;
      a[k] = x - loc;
      pl.A[(i64)s * d.E + e] = a[k];
      pl.acum[(i64)s * d.E + e] = acc;
      acc += a[k];
    }
    const i64 mg = min(acc, cap);
    pl.Mg[gi] = mg;
    i64 cum = 0, slots_u2 = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {  // the main first (the first of e's instances)
      if (ps[k] != e) continue;
      const i64 c = min(max(mg - cum, (i64)0), u1[k]);
      pl.c[e] = c; pl.cumc[e] = min(cum, mg); pl.u2[e] = u1[k] - c; pl.cumu2[e] = 0;
      cum += u1[k];
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {  // then the slots, in rank order
      const int p = ps[k];
      if (p < d.E) continue;
      const i64 c = min(max(mg - cum, (i64)0), u1[k]);
      pl.c[p] = c; pl.cumc[p] = min(cum, mg); pl.u2[p] = u1[k] - c;
      pl.cumu2[p] = slots_u2;  // pass B adds the main's u2 and the slots of the domains before m
      cum += u1[k];
      slots_u2 += u1[k] - c;
    }
    i64 acc2 = 0, acum = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k >= d.rpd) continue;
      const i64 i = (i64)(s0 + k) * d.E + e;
      const i64 w2 = a[k] - min(max(mg - acum, (i64)0), a[k]);
      acum += a[k];
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
  else if (d.rpd <= kRegSources) route_groups_regs<kRegSources>(d, w, pl, U, se1);
  else route_groups_serial(d, w, pl, U, se1);
  grid_sync();
  plus_stamp(pl, 4);
  // pass B: route[s, p], a thread per instance p and every per_p-th source (threads next to each other write next
  // instances of one source row); an instance's own words are loaded once for all its sources
  const int per_p = max(threads / d.P, 1);
  for (int t = tid; t < per_p * d.P; t += threads) {
    const int p = t % d.P, s_first = t / d.P;
    int r;
    const int e = plus_instance(p, se1, d, U, &r);
    if (e < 0) {
      for (int s = s_first; s < d.R; s += per_p) route[(i64)s * d.P + p] = 0;
      continue;
    }
    const int dr = dom_of_rank(r, d);
    const i64 loc = pl.loc[p], mg = pl.Mg[(i64)dr * d.E + e], cumc = pl.cumc[p], c = pl.c[p], u2 = pl.u2[p];
    i64 cumu2 = pl.cumu2[p];
    if (u2 > 0 && p >= d.E) {  // a slot: after the main and the slots of the domains before its own
      cumu2 += pl.u2[e];
      for (int m2 = 0; m2 < dr; ++m2) cumu2 += pl.u2tot[(i64)m2 * d.E + e];
    }
    for (int s = s_first; s < d.R; s += per_p) {
      const i64 si = (i64)s * d.E + e;
      const int ds = dom_of_rank(s, d);
      i64 v = s == r ? loc : 0;
      if (ds == dr) {
        const i64 acum = pl.acum[si], lo = min(acum, mg), hi = min(acum + pl.A[si], mg);
        const i64 ov = min(hi, cumc + c) - max(lo, cumc);
        if (ov > 0) v += ov;
      }
      if (u2 > 0) {
        const i64 w2 = pl.w2[si];
        if (w2 > 0) {
          i64 w2cum = pl.w2cum[si];
          for (int m2 = 0; m2 < ds; ++m2) w2cum += pl.w2tot[(i64)m2 * d.E + e];
          const i64 ov = min(w2cum + w2, cumu2 + u2) - max(w2cum, cumu2);
          if (ov > 0) v += ov;
        }
      }
      route[(i64)s * d.P + p] = v;
    }
  }
}

}  // namespace topoep
