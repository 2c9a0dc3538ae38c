// The capacity step of topoep/planners/capacity.py on the GPU, bit for bit: after any policy (and after the
// runtime's guard), move rows until no receive region of a rank (its main experts' rows, its replica slots' rows)
// holds more than `capacity` rows. The reference's module docstring is the spec; every choice below mirrors it.
//
// One block: the step is a chain of dependent moves, each a few block-wide reductions. When the plan already fits
// (the common case) the kernel computes the instance loads and the region loads and returns.
//
// State in the workspace (fit_layout): U[P] instance loads, B[P] loads before the step, IE[P] instance experts,
// LD[2R] region loads, ST[2R] stuck flags; then a second plan (slot table [R*N], route [R*P]) for the refit from
// the static plan (step 5).

#include <cuda_runtime.h>
#include <stdint.h>

#include "planner.h"

namespace topoep {

namespace {

using i64 = int64_t;
constexpr int kFitThreads = 512;

struct FitDims {
  int R, E, N, P, Eloc, rpd;
  i64 C;
  int allow_new;  // set in the kernel from the device flag, and only with slots
};

// A candidate move, compared lexicographically on (self, fresh, ltot, cross, neg_delta, neg_u, p, q) (the
// reference's key); valid == 0 is worse than any candidate.
struct Cand {
  i64 ltot, neg_delta, neg_u;
  int self, fresh, cross, p, q, valid;
};

__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  if (a.valid != b.valid) return a.valid > b.valid;
  if (!a.valid) return false;
  if (a.self != b.self) return a.self < b.self;
  if (a.fresh != b.fresh) return a.fresh < b.fresh;
  if (a.ltot != b.ltot) return a.ltot < b.ltot;
  if (a.cross != b.cross) return a.cross < b.cross;
  if (a.neg_delta != b.neg_delta) return a.neg_delta < b.neg_delta;
  if (a.neg_u != b.neg_u) return a.neg_u < b.neg_u;
  if (a.p != b.p) return a.p < b.p;
  return a.q < b.q;
}

struct FitState {
  i64 *U, *B, *LD, *se, *route;
  int *IE, *ST;
};

__device__ __forceinline__ int inst_rank(int p, const FitDims& d) { return p < d.E ? p / d.Eloc : (p - d.E) / d.N; }
__device__ __forceinline__ int region_of(int p, const FitDims& d) { return 2 * inst_rank(p, d) + (p < d.E ? 0 : 1); }

// loads of the plan in s.se / s.route: U, B = U, IE, LD; returns the rows beyond the capacity (every thread)
__device__ i64 load_state(const FitDims& d, const FitState& s, i64* red) {
  for (int g = threadIdx.x; g < 2 * d.R; g += blockDim.x) { s.LD[g] = 0; s.ST[g] = 0; }
  __syncthreads();
  for (int p = threadIdx.x; p < d.P; p += blockDim.x) {
    i64 u = 0;
    for (int r = 0; r < d.R; ++r) u += s.route[(i64)r * d.P + p];
    s.U[p] = u;
    s.B[p] = u;
    s.IE[p] = p < d.E ? p : (int)s.se[p - d.E];
    atomicAdd((unsigned long long*)&s.LD[region_of(p, d)], (unsigned long long)u);  // integers: exact
  }
  __syncthreads();
  i64 over = 0;
  for (int g = threadIdx.x; g < 2 * d.R; g += blockDim.x) over += s.LD[g] > d.C ? s.LD[g] - d.C : 0;
  if (threadIdx.x == 0) *red = 0;
  __syncthreads();
  atomicAdd((unsigned long long*)red, (unsigned long long)over);
  __syncthreads();
  const i64 total = *red;
  __syncthreads();
  return total;
}

// the lowest free slot of rank t, or -1
__device__ __forceinline__ int free_slot(int t, const FitDims& d, const FitState& s) {
  for (int j = 0; j < d.N; ++j)
    if (s.se[(i64)t * d.N + j] < 0) return j;
  return -1;
}

__device__ __forceinline__ bool slots_hold(int t, int e, const FitDims& d, const FitState& s) {
  for (int j = 0; j < d.N; ++j)
    if (s.se[(i64)t * d.N + j] == e) return true;
  return false;
}

// steps 1-4 on the plan in s (in place); returns (moves, overflow) in out[0..1]; fitted[q] = 1 for the slots it
// places a replica in
__device__ void fit_loop(const FitDims& d, const FitState& s, int* fitted, i64* out, Cand* cands, i64* red) {
  __shared__ unsigned long long best_region;
  __shared__ int n_moves;
  const int tid = threadIdx.x;
  const i64 over0 = load_state(d, s, red);
  if (over0 == 0) {
    if (tid == 0) { out[0] = 0; out[1] = 0; }
    __syncthreads();
    return;
  }
  if (tid == 0) n_moves = 0;
  __syncthreads();
  const int max_moves = 4 * d.R + d.P;
  while (n_moves < max_moves) {
    // 1. the region with the largest excess (ties: lower region index 2r + k), not stuck
    if (tid == 0) best_region = 0;
    __syncthreads();
    for (int g = tid; g < 2 * d.R; g += blockDim.x) {
      const i64 x = s.LD[g] - d.C;
      if (x > 0 && !s.ST[g]) atomicMax(&best_region, ((unsigned long long)x << 12) | (unsigned long long)(4095 - g));
    }
    __syncthreads();
    const unsigned long long br = best_region;
    __syncthreads();
    if (br == 0) break;
    const int g = 4095 - (int)(br & 4095ull), r = g >> 1, k = g & 1;
    const i64 X = (i64)(br >> 12);
    // 2. candidate pairs: (instance p of the region) x (existing instance q of its expert | new replica on t)
    const int n_p = k == 0 ? d.Eloc : d.N;
    const int p0 = k == 0 ? r * d.Eloc : d.E + r * d.N;
    const int width = d.P + d.R;
    Cand mine;
    mine.valid = 0;
    for (int i = tid; i < n_p * width; i += blockDim.x) {
      const int p = p0 + i / width, c = i % width;
      const int e = s.IE[p];
      const i64 u = s.U[p];
      if (e < 0 || u <= 0) continue;
      Cand x;
      int t, kq, q;
      if (c < d.P) {  // existing instance q of e
        q = c;
        if (q == p || s.IE[q] != e) continue;
        t = inst_rank(q, d);
        kq = q < d.E ? 0 : 1;
        if (2 * t + kq == g) continue;
        x.fresh = 0;
      } else {  // a new replica of e on rank t
        if (!d.allow_new) continue;
        t = c - d.P;
        kq = 1;
        if (2 * t + 1 == g) continue;
        const int j = free_slot(t, d, s);
        if (j < 0 || slots_hold(t, e, d, s)) continue;
        q = d.E + t * d.N + j;
        x.fresh = 1;
      }
      const i64 room = d.C - s.LD[2 * t + kq];
      if (room <= 0) continue;
      i64 delta = X < u ? X : u;
      delta = delta < room ? delta : room;
      x.self = t == r;
      x.ltot = s.LD[2 * t] + s.LD[2 * t + 1];
      x.cross = (t / d.rpd) != (r / d.rpd);
      x.neg_delta = -delta;
      x.neg_u = -u;
      x.p = p;
      x.q = q;
      x.valid = 1;
      if (better(x, mine)) mine = x;
    }
    cands[tid] = mine;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h >>= 1) {
      if (tid < h && better(cands[tid + h], cands[tid])) cands[tid] = cands[tid + h];
      __syncthreads();
    }
    const Cand b = cands[0];
    __syncthreads();
    if (!b.valid) {  // stuck: skipped from now on
      if (tid == 0) s.ST[g] = 1;
      __syncthreads();
      continue;
    }
    // 3. apply the move
    const int p = b.p, q = b.q, e = s.IE[p], t = inst_rank(q, d), kq = q < d.E ? 0 : 1;
    const i64 delta = -b.neg_delta;
    // rows taken from the sources of p in the order (s != t, dom(s) != dom(t), s == r, s): each source's share is
    // what is left of delta after the sources before it (O(R^2) in all, spread over the block)
    for (int src = tid; src < d.R; src += blockDim.x) {
      const int key = ((src != t) << 2) | (((src / d.rpd) != (t / d.rpd)) << 1) | (src == r);
      i64 before = 0;
      for (int o = 0; o < d.R; ++o) {
        const int ko = ((o != t) << 2) | (((o / d.rpd) != (t / d.rpd)) << 1) | (o == r);
        if (ko < key || (ko == key && o < src)) before += s.route[(i64)o * d.P + p];
      }
      const i64 v = s.route[(i64)src * d.P + p];
      i64 take = delta - before;
      take = take < 0 ? 0 : (take > v ? v : take);
      // every thread read route[:, p] above before any writes it: the barrier below orders them
      red[1 + src] = take;
    }
    __syncthreads();
    for (int src = tid; src < d.R; src += blockDim.x) {
      const i64 take = red[1 + src];
      if (take) {
        s.route[(i64)src * d.P + p] -= take;
        s.route[(i64)src * d.P + q] += take;
      }
    }
    if (tid == 0) {
      if (b.fresh) {
        s.se[q - d.E] = e;
        s.IE[q] = e;
        fitted[q - d.E] = 1;
      }
      s.U[p] -= delta;
      s.U[q] += delta;
      s.LD[g] -= delta;
      s.LD[2 * t + kq] += delta;
      ++n_moves;
    }
    __syncthreads();
  }
  // replicas the step emptied serve nothing
  for (int j = tid; j < d.R * d.N; j += blockDim.x) {
    const int p = d.E + j;
    if (s.se[j] >= 0 && s.U[p] == 0 && s.B[p] > 0) s.se[j] = -1;
  }
  __syncthreads();
  i64 over = 0;
  for (int gg = tid; gg < 2 * d.R; gg += blockDim.x) over += s.LD[gg] > d.C ? s.LD[gg] - d.C : 0;
  if (tid == 0) *red = 0;
  __syncthreads();
  atomicAdd((unsigned long long*)red, (unsigned long long)over);
  __syncthreads();
  if (tid == 0) { out[0] = n_moves; out[1] = *red; }
  __syncthreads();
}

// The workspace (offsets in int64 elements; the int arrays IE, ST, fitted and fitted2 as runs of int64s, two ints per
// element): red [1 + R] (reductions, each source's share of a move), U [P], B [P], LD [2R], IE [P] and ST [2R] as
// ints, the refit's slot table se2 [R*N] and route route2 [R*P], the two fits' placed-replica flags [R*N] each as
// ints, and their (moves, overflow) out and out2 [2] each. Its size is `elems`. The host computes it (for
// fit_workspace_elems and for every launch) and hands it to the kernel.
struct FitLayout {
  size_t red, U, B, LD, IE, ST, se2, route2, fitted, fitted2, out, out2, elems;
};

inline FitLayout fit_layout(int R, int E, int N) {
  const size_t P = (size_t)E + (size_t)R * N, RN = (size_t)R * N;
  FitLayout f;
  Bump b;
  f.red = b.take(1 + (size_t)R);
  f.U = b.take(P);
  f.B = b.take(P);
  f.LD = b.take(2 * (size_t)R);
  f.IE = b.take((P + 1) / 2);
  f.ST = b.take(R);
  f.se2 = b.take(RN);
  f.route2 = b.take((size_t)R * P);
  f.fitted = b.take((RN + 1) / 2);
  f.fitted2 = b.take((RN + 1) / 2);
  f.out = b.take(2);
  f.out2 = b.take(2);
  f.elems = b.end;
  return f;
}

// info: [moves, overflow, refit (1: the refit from the static plan was kept), new replicas, then R*N flags of the
// slots the step placed a replica in]
__global__ void __launch_bounds__(kFitThreads) fit_kernel(const i64* __restrict__ omega, const bool* __restrict__ allow,
                                                           FitDims d, FitLayout f, i64* slot_expert, i64* route,
                                                           i64* ws, i64* info) {
  extern __shared__ unsigned char smem_raw[];
  d.allow_new = d.N > 0 && *allow;
  Cand* cands = reinterpret_cast<Cand*>(smem_raw);
  const int tid = threadIdx.x, RN = d.R * d.N;
  i64* red = ws + f.red;
  FitState s;
  s.U = ws + f.U;
  s.B = ws + f.B;
  s.LD = ws + f.LD;
  s.IE = (int*)(ws + f.IE);
  s.ST = (int*)(ws + f.ST);
  i64* se2 = ws + f.se2;
  i64* route2 = ws + f.route2;
  int* fitted = (int*)(ws + f.fitted);
  int* fitted2 = (int*)(ws + f.fitted2);
  i64* out = ws + f.out;
  i64* out2 = ws + f.out2;
  int had_replica = 0;
  for (int j = 0; j < RN; ++j) had_replica |= slot_expert[j] >= 0;  // every thread, the same answer
  for (int j = tid; j < RN; j += blockDim.x) { fitted[j] = 0; fitted2[j] = 0; }
  __syncthreads();
  s.se = slot_expert;
  s.route = route;
  fit_loop(d, s, fitted, out, cands, red);
  const i64 over1 = out[1];
  int refit = 0;
  if (over1 > 0 && d.allow_new && had_replica) {  // step 5: once more from the static plan
    for (int j = tid; j < RN; j += blockDim.x) se2[j] = -1;
    for (i64 i = tid; i < (i64)d.R * d.P; i += blockDim.x) {
      const int src = (int)(i / d.P), p = (int)(i % d.P);
      route2[i] = p < d.E ? omega[(i64)src * d.E + p] : 0;
    }
    __syncthreads();
    s.se = se2;
    s.route = route2;
    fit_loop(d, s, fitted2, out2, cands, red);
    refit = out2[1] < over1;
    if (refit) {
      for (int j = tid; j < RN; j += blockDim.x) { slot_expert[j] = se2[j]; fitted[j] = fitted2[j]; }
      for (i64 i = tid; i < (i64)d.R * d.P; i += blockDim.x) route[i] = route2[i];
    }
    __syncthreads();
  }
  if (tid == 0) {
    const i64* o = refit ? out2 : out;
    info[0] = o[0];
    info[1] = o[1];
    info[2] = refit;
  }
  int n_new = 0;
  for (int j = tid; j < RN; j += blockDim.x) {
    info[4 + j] = fitted[j];
    n_new += fitted[j];
  }
  if (tid == 0) red[0] = 0;
  __syncthreads();
  atomicAdd((unsigned long long*)red, (unsigned long long)n_new);
  __syncthreads();
  if (tid == 0) info[3] = red[0];
}

}  // namespace

size_t fit_workspace_elems(int R, int E, int N) { return fit_layout(R, E, N).elems; }

cudaError_t fit_capacity(const int64_t* omega, int R, int E, int N, int ranks_per_domain, int64_t capacity,
                         const bool* allow_new, int64_t* slot_expert, int64_t* route, int64_t* ws, int64_t* info,
                         cudaStream_t stream) {
  FitDims d;
  d.R = R;
  d.E = E;
  d.N = N;
  d.P = E + R * N;
  d.Eloc = E / R;
  d.rpd = ranks_per_domain;
  d.C = capacity;
  d.allow_new = 0;
  fit_kernel<<<1, kFitThreads, kFitThreads * sizeof(Cand), stream>>>(omega, allow_new, d, fit_layout(R, E, N),
                                                                      slot_expert, route, ws, info);
  return cudaGetLastError();
}

}  // namespace topoep
