// GPU planner: the `static` and `topoep` policies of topoep/planners/reference.py, bit for bit.
//
// Every decision is integer and breaks ties by the lowest index, exactly as the reference (its module
// docstring is the spec). No host synchronisation: sizes come from the tensor shapes, data never leaves
// the device. Kernels, in order (one stream):
//   demand     D[d, e] = sum of omega over domain d's ranks; T[e] = total demand of e
//   placement  stage 1, one block per domain: positive-benefit candidates ranked by counting (D desc,
//              e asc), round robin over the domain's ranks sorted by static load
//   instances  positions and counts of every instance of the stage-1 placement (main first, p order)
//   split      stage 2: U0[p], the even split with same-domain preference, summed over sources (a block
//              per instance)
//   refine     stage 3, one block per domain, state in shared memory, warp/block argmin per iteration
//   finalize   drop replicas that serve nothing; the never-worse-than-static guard
//   route      per instance, the interval mapping of each (expert, domain) group's sources
//
// Layout (plan.py): P = E + R*N instances; p < E is expert p's main on rank p / (E / R); p = E + r*N + j
// is slot j of rank r. Default placement main(e) = e / (E / R) only.

#include <cuda_runtime.h>
#include <stdint.h>

#include "planner.h"

namespace topoep {

using i64 = int64_t;

struct Dims {
  int R, E, M, rpd, N, P, Eloc;
  i64 W, S;
};

__device__ __forceinline__ int main_rank_of(int e, const Dims& d) { return e / d.Eloc; }
__device__ __forceinline__ int dom_of_rank(int r, const Dims& d) { return r / d.rpd; }
__device__ __forceinline__ i64 floor_mod(i64 a, i64 n) { i64 m = a % n; return m < 0 ? m + n : m; }

// ---------------------------------------------------------------------------------------------------
// demand: one thread per expert column (coalesced over e)
__global__ void demand_kernel(const i64* __restrict__ omega, Dims d, i64* __restrict__ D, i64* __restrict__ T) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= d.E) return;
  i64 total = 0;
  for (int m = 0; m < d.M; ++m) {
    i64 acc = 0;
    for (int s = m * d.rpd; s < (m + 1) * d.rpd; ++s) acc += omega[(i64)s * d.E + e];
    D[(i64)m * d.E + e] = acc;
    total += acc;
  }
  T[e] = total;
}

// static rank loads L0[r] = sum of T over r's main experts
__device__ i64 static_load(const i64* T, int r, const Dims& d) {
  i64 acc = 0;
  for (int i = 0; i < d.Eloc; ++i) acc += T[r * d.Eloc + i];
  return acc;
}

// ---------------------------------------------------------------------------------------------------
// placement (stage 1): one block per domain. slot_expert must be -1 on entry.
__global__ void placement_kernel(const i64* __restrict__ D, const i64* __restrict__ T, Dims d,
                                 i64* __restrict__ slot_expert) {
  extern __shared__ i64 smem[];
  const int dom = blockIdx.x;
  i64* keys = smem;                        // [E] compacted positive keys
  __shared__ int num_pos;
  __shared__ int rank_order[kMaxRanksPerDomain];  // domain ranks sorted by (static load, id)
  if (threadIdx.x == 0) num_pos = 0;
  __syncthreads();
  // compact the positive-benefit candidates (order is irrelevant: they are ranked by counting next)
  for (int e = threadIdx.x; e < d.E; e += blockDim.x) {
    i64 De = D[(i64)dom * d.E + e];
    bool remote = dom_of_rank(main_rank_of(e, d), d) != dom;
    if (remote && 2 * De * d.S > d.W) {
      int i = atomicAdd(&num_pos, 1);
      keys[i] = De * d.E + (d.E - 1 - e);  // descending key == (D desc, e asc); all keys distinct
    }
  }
  // ranks of the domain by (static load asc, id asc): position = number of ranks before it
  for (int a = threadIdx.x; a < d.rpd; a += blockDim.x) {
    int r = dom * d.rpd + a;
    i64 la = static_load(T, r, d);
    int pos = 0;
    for (int b = 0; b < d.rpd; ++b) {
      i64 lb = static_load(T, dom * d.rpd + b, d);
      pos += (lb < la) || (lb == la && b < a);
    }
    rank_order[pos] = r;
  }
  __syncthreads();
  const int n = num_pos;
  const int cap = d.rpd * d.N;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    i64 k = keys[i];
    int rank = 0;  // candidates with a larger key come first
    for (int j = 0; j < n; ++j) rank += keys[j] > k;
    if (rank < cap) {
      int e = d.E - 1 - (int)(k % d.E);
      int r = rank_order[rank % d.rpd];
      slot_expert[(i64)r * d.N + rank / d.rpd] = e;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// instances of a placement: pos_all[p] (position among e's instances), pos_dom[p] (among e's instances
// in p's domain), cnt_all[e], cnt_dom[m*E+e]. Threads: E mains + R*N slots.
__global__ void instances_kernel(const i64* __restrict__ slot_expert_g, Dims d, int* __restrict__ pos_all,
                                 int* __restrict__ pos_dom, int* __restrict__ cnt_all, int* __restrict__ cnt_dom) {
  extern __shared__ i64 slot_expert[];  // the R*N slot table, staged once per block
  const int RN = d.R * d.N;
  for (int q = threadIdx.x; q < RN; q += blockDim.x) slot_expert[q] = slot_expert_g[q];
  __syncthreads();
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < d.E) {  // main of expert t: first of its instances; counts over all slots
    int e = t, md = dom_of_rank(main_rank_of(e, d), d);
    pos_all[e] = 0;
    pos_dom[e] = 0;
    for (int m = 0; m < d.M; ++m) cnt_dom[(i64)m * d.E + e] = (m == md);
    int c = 1;
    for (int q = 0; q < RN; ++q) {
      if (slot_expert[q] == e) {
        ++c;
        cnt_dom[(i64)dom_of_rank(q / d.N, d) * d.E + e] += 1;
      }
    }
    cnt_all[e] = c;
  } else if (t < d.E + RN) {
    int q = t - d.E;
    i64 e = slot_expert[q];
    int p = d.E + q;
    if (e < 0) { pos_all[p] = 0; pos_dom[p] = 0; return; }
    int md = dom_of_rank(q / d.N, d);
    int pa = 1, pd = (dom_of_rank(main_rank_of((int)e, d), d) == md);
    for (int q2 = 0; q2 < q; ++q2) {
      if (slot_expert[q2] == e) {
        ++pa;
        pd += dom_of_rank(q2 / d.N, d) == md;
      }
    }
    pos_all[p] = pa;
    pos_dom[p] = pd;
  }
}

// share of omega[s, e] that the stage-2 split gives instance p (of expert e, on domain pdom)
__device__ __forceinline__ i64 split_share(const i64* omega, int s, int e, int p, int pdom, const int* pos_all,
                                           const int* pos_dom, const int* cnt_all, const int* cnt_dom,
                                           const Dims& d) {
  int sd = dom_of_rank(s, d);
  int nloc = cnt_dom[(i64)sd * d.E + e];
  i64 n, pos;
  if (nloc > 0) {
    if (pdom != sd) return 0;
    n = nloc;
    pos = pos_dom[p];
  } else {
    n = cnt_all[e];
    pos = pos_all[p];
  }
  i64 w = omega[(i64)s * d.E + e];
  return w / n + (floor_mod(pos - s, n) < w % n ? 1 : 0);
}

__device__ __forceinline__ void instance_of(int p, const i64* slot_expert, const Dims& d, int* e, int* rank) {
  if (p < d.E) { *e = p; *rank = main_rank_of(p, d); }
  else { *e = (int)slot_expert[p - d.E]; *rank = (p - d.E) / d.N; }
}

// split (stage 2): U0[p] = sum over sources of the split; one block per instance, threads over sources
__global__ void split_kernel(const i64* __restrict__ omega, const i64* __restrict__ slot_expert, Dims d,
                             const int* __restrict__ pos_all, const int* __restrict__ pos_dom,
                             const int* __restrict__ cnt_all, const int* __restrict__ cnt_dom, i64* __restrict__ U) {
  __shared__ i64 partial[32];
  const int p = blockIdx.x;
  int e, r;
  instance_of(p, slot_expert, d, &e, &r);
  if (e < 0) {
    if (threadIdx.x == 0) U[p] = 0;
    return;
  }
  const int pdom = dom_of_rank(r, d);
  i64 acc = 0;
  for (int s = threadIdx.x; s < d.R; s += blockDim.x)
    acc += split_share(omega, s, e, p, pdom, pos_all, pos_dom, cnt_all, cnt_dom, d);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    i64 total = 0;
    for (int w = 0; w < nwarps; ++w) total += partial[w];  // fixed order: integer sums are exact anyway
    U[p] = total;
  }
}

// ---------------------------------------------------------------------------------------------------
// refine (stage 3): one block per domain. Candidate key, compared lexicographically:
// (-delta, L[rt], cost[rb][rt], new replica, -U[p], rt, e)
struct Cand {
  i64 neg_delta, lt, cost, neg_u;
  int is_new, rt, e, slot;  // slot: local index of the source instance on rb (0..Eloc+N-1)
};

__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  if (a.neg_delta != b.neg_delta) return a.neg_delta < b.neg_delta;
  if (a.lt != b.lt) return a.lt < b.lt;
  if (a.cost != b.cost) return a.cost < b.cost;
  if (a.is_new != b.is_new) return a.is_new < b.is_new;
  if (a.neg_u != b.neg_u) return a.neg_u < b.neg_u;
  if (a.rt != b.rt) return a.rt < b.rt;
  return a.e < b.e;
}

__device__ __forceinline__ Cand shfl_cand(const Cand& c, int src) {
  Cand o;
  o.neg_delta = __shfl_sync(0xffffffff, c.neg_delta, src);
  o.lt = __shfl_sync(0xffffffff, c.lt, src);
  o.cost = __shfl_sync(0xffffffff, c.cost, src);
  o.neg_u = __shfl_sync(0xffffffff, c.neg_u, src);
  o.is_new = __shfl_sync(0xffffffff, c.is_new, src);
  o.rt = __shfl_sync(0xffffffff, c.rt, src);
  o.e = __shfl_sync(0xffffffff, c.e, src);
  o.slot = __shfl_sync(0xffffffff, c.slot, src);
  return o;
}

__device__ __forceinline__ Cand warp_best(Cand c) {
  for (int off = 16; off > 0; off >>= 1) {
    Cand o = shfl_cand(c, (threadIdx.x & 31) ^ off);
    if (better(o, c)) c = o;
  }
  return c;
}

// A "none" candidate that loses against every real one.
__device__ __forceinline__ Cand no_cand() {
  Cand c;
  c.neg_delta = 0; c.lt = 0; c.cost = 0; c.neg_u = 0; c.is_new = 0; c.rt = 0x7fffffff; c.e = 0x7fffffff; c.slot = -1;
  return c;
}

__global__ void refine_kernel(i64* __restrict__ slot_expert, const i64* __restrict__ cost_fs, Dims d,
                              i64* __restrict__ U, i64* __restrict__ L, int* __restrict__ iters_out) {
  extern __shared__ i64 smem[];
  const int dom = blockIdx.x, rpd = d.rpd, G = d.Eloc + d.N;
  const int r0 = dom * rpd;
  i64* su = smem;                        // [rpd][G] instance loads: mains then slots
  i64* sl = su + (i64)rpd * G;           // [rpd] rank loads
  int* se = (int*)(sl + rpd);            // [rpd][N] slot experts
  __shared__ Cand warp_res[32];
  __shared__ Cand best;
  __shared__ int rb_s;
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    int a = i / G, g = i % G, r = r0 + a;
    su[i] = g < d.Eloc ? U[r * d.Eloc + g] : U[d.E + (i64)r * d.N + (g - d.Eloc)];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) se[i] = (int)slot_expert[(i64)r0 * d.N + i];
  __syncthreads();
  for (int a = threadIdx.x; a < rpd; a += blockDim.x) {
    i64 acc = 0;
    for (int g = 0; g < G; ++g) acc += su[a * G + g];
    sl[a] = acc;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  int iters = 0;
  while (true) {
    // rb = busiest rank of the domain, ties -> lowest id (rpd is small: one thread scans)
    if (threadIdx.x == 0) {
      int b = 0;
      for (int a = 1; a < rpd; ++a) if (sl[a] > sl[b]) b = a;
      rb_s = b;
    }
    __syncthreads();
    const int b = rb_s;
    const i64 lb = sl[b];
    Cand mine = no_cand();
    const int ncand = G * rpd;  // (source instance g on rb) x (target a)
    for (int c = threadIdx.x; c < ncand; c += blockDim.x) {
      int g = c / rpd, a = c % rpd;
      if (a == b) continue;
      i64 u = su[b * G + g];
      if (u <= 0) continue;
      int e = g < d.Eloc ? (r0 + b) * d.Eloc + g : se[b * d.N + (g - d.Eloc)];
      if (e < 0) continue;
      i64 half = (lb - sl[a]) / 2;  // lb >= sl[a]: floor division
      if (half <= 0) continue;
      int rt = r0 + a;
      bool existing = main_rank_of(e, d) == rt;
      bool has_free = false;
      for (int j = 0; j < d.N; ++j) {
        int x = se[a * d.N + j];
        existing |= (x == e);
        has_free |= (x < 0);
      }
      if (!existing && !has_free) continue;
      Cand k;
      k.neg_delta = -(u < half ? u : half);
      k.lt = sl[a];
      k.cost = cost_fs[(i64)(r0 + b) * d.R + rt];
      k.is_new = existing ? 0 : 1;
      k.neg_u = -u;
      k.rt = rt;
      k.e = e;
      k.slot = g;
      if (better(k, mine)) mine = k;
    }
    mine = warp_best(mine);
    if (lane == 0) warp_res[warp] = mine;
    __syncthreads();
    if (warp == 0) {
      Cand c = lane < nwarps ? warp_res[lane] : no_cand();
      c = warp_best(c);
      if (lane == 0) best = c;
    }
    __syncthreads();
    if (best.slot < 0) break;  // no move helps
    if (threadIdx.x == 0) {
      const Cand k = best;
      const i64 delta = -k.neg_delta;
      const int a = k.rt - r0;
      int gt = -1;  // target instance on rt
      if (main_rank_of(k.e, d) == k.rt) gt = k.e - k.rt * d.Eloc;
      for (int j = 0; j < d.N && gt < 0; ++j) if (se[a * d.N + j] == k.e) gt = d.Eloc + j;
      if (gt < 0) {  // new replica in rt's lowest free slot
        for (int j = 0; j < d.N; ++j) if (se[a * d.N + j] < 0) { se[a * d.N + j] = k.e; gt = d.Eloc + j; break; }
      }
      su[b * G + k.slot] -= delta;
      su[a * G + gt] += delta;
      sl[b] -= delta;
      sl[a] += delta;
    }
    ++iters;
    __syncthreads();
  }
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    int a = i / G, g = i % G, r = r0 + a;
    if (g < d.Eloc) U[r * d.Eloc + g] = su[i];
    else U[d.E + (i64)r * d.N + (g - d.Eloc)] = su[i];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) slot_expert[(i64)r0 * d.N + i] = se[i];
  for (int a = threadIdx.x; a < rpd; a += blockDim.x) L[r0 + a] = sl[a];
  if (threadIdx.x == 0) iters_out[dom] = iters;
}

// ---------------------------------------------------------------------------------------------------
// finalize: one block. flag = (max refined load > max static load); drop replicas with no load.
__global__ void finalize_kernel(const i64* __restrict__ T, const i64* __restrict__ L, const i64* __restrict__ U,
                                Dims d, i64* __restrict__ slot_expert, int* __restrict__ flag) {
  __shared__ i64 red_l[32], red_s[32];
  i64 ml = 0, ms = 0;
  for (int r = threadIdx.x; r < d.R; r += blockDim.x) {
    ml = max(ml, L[r]);
    ms = max(ms, static_load(T, r, d));
  }
  for (int off = 16; off > 0; off >>= 1) {
    ml = max(ml, __shfl_xor_sync(0xffffffff, ml, off));
    ms = max(ms, __shfl_xor_sync(0xffffffff, ms, off));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 0) { red_l[warp] = ml; red_s[warp] = ms; }
  __syncthreads();
  __shared__ int fb;
  if (threadIdx.x == 0) {
    for (int w = 1; w < nwarps; ++w) { ml = max(ml, red_l[w]); ms = max(ms, red_s[w]); }
    fb = ml > ms;
    *flag = fb;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < d.R * d.N; q += blockDim.x)
    if (fb || U[d.E + q] <= 0) slot_expert[q] = -1;
}

// ---------------------------------------------------------------------------------------------------
// route: one block per instance p of the final placement. Its group is (expert e, domain of p's rank);
// the group's sources send A[s] (what stage 2 sent to the group's initial instances), filled in source
// order into the group's instances in p order (cumU[p] = load of the group's instances before p).
__global__ void route_kernel(const i64* __restrict__ omega, const i64* __restrict__ slot_final,
                             const i64* __restrict__ slot0, const i64* __restrict__ U, Dims d,
                             const int* __restrict__ pos_all0, const int* __restrict__ cnt_all0,
                             const int* __restrict__ cnt_dom0, const int* __restrict__ flag, i64* __restrict__ route) {
  const int p = blockIdx.x;
  __shared__ i64 scan[kRouteThreads];
  __shared__ i64 carry;
  if (*flag) {  // fallback: the static plan
    for (int s = threadIdx.x; s < d.R; s += blockDim.x)
      route[(i64)s * d.P + p] = p < d.E ? omega[(i64)s * d.E + p] : 0;
    return;
  }
  int e, r;
  instance_of(p, slot_final, d, &e, &r);
  if (e < 0) {
    for (int s = threadIdx.x; s < d.R; s += blockDim.x) route[(i64)s * d.P + p] = 0;
    return;
  }
  const int gd = dom_of_rank(r, d);
  const i64 up = U[p];
  // cumU: the group's instances before p: the main (if it is in the group and p is a slot), then slots
  i64 cu = 0;
  if (p >= d.E && dom_of_rank(main_rank_of(e, d), d) == gd) cu += U[e];
  if (p >= d.E) {
    for (int q = gd * d.rpd * d.N; q < p - d.E; ++q)
      if (slot_final[q] == e) cu += U[d.E + q];
  }
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const int n_all = cnt_all0[e];
  for (int base = 0; base < d.R; base += blockDim.x) {
    const int s = base + threadIdx.x;
    i64 a = 0;
    if (s < d.R) {
      const int sd = dom_of_rank(s, d);
      const i64 w = omega[(i64)s * d.E + e];
      if (sd == gd) {
        a = w;
      } else if (cnt_dom0[(i64)sd * d.E + e] == 0 && w > 0) {  // orphan: its share of the group's initial instances
        const i64 wq = w / n_all, wr = w % n_all;
        if (dom_of_rank(main_rank_of(e, d), d) == gd) a += wq + (floor_mod(0 - s, n_all) < wr ? 1 : 0);
        for (int q = gd * d.rpd * d.N; q < (gd + 1) * d.rpd * d.N; ++q)
          if (slot0[q] == e) a += wq + (floor_mod((i64)pos_all0[d.E + q] - s, n_all) < wr ? 1 : 0);
      }
    }
    // block inclusive scan of a (Hillis-Steele)
    scan[threadIdx.x] = a;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
      i64 v = threadIdx.x >= off ? scan[threadIdx.x - off] : 0;
      __syncthreads();
      scan[threadIdx.x] += v;
      __syncthreads();
    }
    const i64 lo = carry + scan[threadIdx.x] - a, hi = lo + a;
    if (s < d.R) {
      const i64 ov = min(hi, cu + up) - max(lo, cu);
      route[(i64)s * d.P + p] = ov > 0 ? ov : 0;
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry += scan[threadIdx.x];
    __syncthreads();
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

// ---------------------------------------------------------------------------------------------------
size_t workspace_elems(int R, int E, int M, int N) {
  const size_t P = (size_t)E + (size_t)R * N;
  // i64: D[M*E], T[E], U[P], L[R], slot0[R*N];  i32 (two per i64): pos_all0[P], pos_dom0[P], cnt_all0[E],
  // cnt_dom0[M*E], flag, iters[M]
  size_t i64s = (size_t)M * E + E + P + R + (size_t)R * N;
  size_t i32s = 2 * P + E + (size_t)M * E + 1 + M;
  return i64s + (i32s + 1) / 2 + 1;
}

static inline int blocks_for(long long n, int t) { return (int)((n + t - 1) / t); }

void plan_topoep(const int64_t* omega, const int64_t* cost_fs, int R, int E, int M, int N, int64_t W, int64_t S,
                 int64_t* slot_expert, int64_t* route, int64_t* ws, cudaStream_t stream) {
  Dims d;
  d.R = R; d.E = E; d.M = M; d.rpd = R / M; d.N = N; d.P = E + R * N; d.Eloc = E / R; d.W = W; d.S = S;
  const int threads = 256;
  if (N == 0) {
    static_kernel<<<blocks_for((long long)R * d.P, threads), threads, 0, stream>>>(omega, d, slot_expert, route);
    return;
  }
  i64* D = ws;
  i64* T = D + (size_t)M * E;
  i64* U = T + E;
  i64* L = U + d.P;
  i64* slot0 = L + R;
  int* pos_all0 = (int*)(slot0 + (size_t)R * N);
  int* pos_dom0 = pos_all0 + d.P;
  int* cnt_all0 = pos_dom0 + d.P;
  int* cnt_dom0 = cnt_all0 + E;
  int* flag = cnt_dom0 + (size_t)M * E;
  int* iters = flag + 1;

  const size_t G = (size_t)d.Eloc + N;
  const size_t refine_smem = sizeof(i64) * ((size_t)d.rpd * G + d.rpd) + sizeof(int) * (size_t)d.rpd * N;
  static bool attrs_set = false;  // allow more than 48 KiB of dynamic shared memory (large E or domains)
  if (!attrs_set) {
    cudaFuncSetAttribute(placement_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    cudaFuncSetAttribute(refine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    cudaFuncSetAttribute(instances_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    attrs_set = true;
  }
  cudaMemsetAsync(slot_expert, 0xff, sizeof(int64_t) * (size_t)R * N, stream);  // -1
  demand_kernel<<<blocks_for(E, threads), threads, 0, stream>>>(omega, d, D, T);
  if (M > 1) {
    placement_kernel<<<M, threads, sizeof(i64) * E, stream>>>(D, T, d, slot_expert);
  }
  cudaMemcpyAsync(slot0, slot_expert, sizeof(int64_t) * (size_t)R * N, cudaMemcpyDeviceToDevice, stream);
  instances_kernel<<<blocks_for(E + R * N, threads), threads, sizeof(i64) * (size_t)R * N, stream>>>(
      slot0, d, pos_all0, pos_dom0, cnt_all0, cnt_dom0);
  split_kernel<<<d.P, 128, 0, stream>>>(omega, slot0, d, pos_all0, pos_dom0, cnt_all0, cnt_dom0, U);
  refine_kernel<<<M, threads, refine_smem, stream>>>(slot_expert, cost_fs, d, U, L, iters);
  finalize_kernel<<<1, 1024, 0, stream>>>(T, L, U, d, slot_expert, flag);
  route_kernel<<<d.P, kRouteThreads, 0, stream>>>(omega, slot_expert, slot0, U, d, pos_all0, cnt_all0, cnt_dom0,
                                                 flag, route);
}

void plan_static(const int64_t* omega, int R, int E, int N, int64_t* slot_expert, int64_t* route,
                 cudaStream_t stream) {
  Dims d;
  d.R = R; d.E = E; d.M = 1; d.rpd = R; d.N = N; d.P = E + R * N; d.Eloc = E / R; d.W = 0; d.S = 0;
  static_kernel<<<blocks_for((long long)R * d.P, 256), 256, 0, stream>>>(omega, d, slot_expert, route);
}

size_t refine_smem_bytes(int R, int E, int M, int N) {
  const int rpd = R / M;
  const size_t G = (size_t)E / R + N;
  return sizeof(i64) * ((size_t)rpd * G + rpd) + sizeof(int) * (size_t)rpd * N;
}

}  // namespace topoep
