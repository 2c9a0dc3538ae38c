// Phase 7 of the planner kernel (`topoep_plus` only): the free load moves across the EP group.
#pragma once

#include "planner_device.cuh"

namespace topoep {

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
      // the global words a pair may need, loaded before the filters so that their latencies overlap
      const int d2 = dom_of_rank(rt, d);
      const bool cross = d2 != d1;
      const i64 om_b = w.om[(i64)rb * d.E + e], om_t = w.om[(i64)rt * d.E + e];
      const i64 D1 = cross ? w.D[(i64)d1 * d.E + e] : 0, D2 = cross ? w.D[(i64)d2 * d.E + e] : 0;
      if (rt == rb || !s.host[ps] || !s.host[pt]) continue;
      const i64 u = s.U[ps];
      if (u <= 0) continue;
      const i64 lt = s.L[rt], half = (lb - lt) >> 1;
      if (half <= 0) continue;
      const i64 f1 = max(u - om_b, (i64)0);
      const i64 g2 = max(om_t - s.U[pt], (i64)0);
      i64 F1 = 0, G2 = 0;
      if (cross) {
        F1 = max(domain_load(d1, e, d, s, se1) - D1, (i64)0);
        G2 = max(D2 - domain_load(d2, e, d, s, se1), (i64)0);
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

}  // namespace topoep
