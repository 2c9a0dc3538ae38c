// The `topoep_plus_spread` policy (and `topoep_plus_spread_tree`) of topoep/planners/spread.py on the GPU, bit for
// bit: the greedy load moves priced on the straggler's compute and the busiest replica and token links, the
// rollback to the best prefix, the drop of replicas left without load, and the route of the kept loads
// (`common.hierarchical_route`, a warp per expert: route_expert). The reference's module docstring is the spec;
// every choice below mirrors it.
//
// One block: the greedy is a chain of dependent moves. A move is one scan of every (target rank, instance of the
// busiest rank) pair with a block reduction of the best, the move itself (one thread), each instance's share of
// its domain's inflow for the moved expert (a thread per rank of the one or two domains it touches), and one block
// reduction of the loads for the objective and the next busiest rank. Instead of replaying the kept prefix, the
// kernel copies the instance loads and the slot table whenever the objective reaches a new minimum.
//
// State (spread_layout: in shared memory where it fits, else in the workspace): per rank L (load), the replica
// copies it sends and receives over its NIC and over NVLink, its used slots and xin (its instances' share of their domains' inflow); per instance U (load)
// and part (its share); per (domain, expert) D (demand), Ud (load of the expert's instances in the domain) and the
// rank of its first copy there; per domain out / inn (assignments its sources send to / its instances receive from
// other domains); the slot table; the snapshot of U and the slot table at the best objective so far.

#include <cuda_runtime.h>
#include <stdint.h>

#include <initializer_list>

#include "planner.h"

namespace topoep {

namespace {

using i64 = int64_t;
constexpr int kSpreadThreads = 512;
constexpr int kSpreadWarps = kSpreadThreads / 32;
// the objective's transfer counts (spread.py REPLICA_TRANSFERS, TOKEN_TRANSFERS, INGRESS_TRANSFERS)
constexpr i64 kReplicaTransfers = 3, kTokenTransfers = 2, kIngressTransfers = 4;

struct SpreadDims {
  int R, E, N, M, P, Eloc, rpd, max_moves, trees;
  i64 W, S, t, a, b;  // expert bytes, token bytes, t_ffn in fs, two-level costs in fs per byte
};

// Where each array lives: `off` int64 elements into the dynamic shared memory (in_smem) or into the workspace. The
// workspace has room for every array (its size does not depend on the device); the launch moves the arrays into
// shared memory in the order of their use per move while they fit: the per-rank and per-instance state, the slot
// table and the per-domain sums first, then Ud, D and the first copies; the snapshot stays in the workspace.
struct Place {
  size_t off;
  int in_smem;
};

enum SpreadArray { kL, kNicOut, kNicIn, kNvlOut, kNvlIn, kUsed, kXin, kU, kPart, kSlots, kOut, kInn, kUd, kD, kFirst,
                   kBestU, kBestSlots, kRoute, kSpreadArrays };
// the route's scratch per warp (route_expert), each R + 1 elements: the expert's instances in index order, the
// instance on each rank, each source's remaining demand w, its matched amount and interval start, each instance's
// load after its own rank, after its domain, its matched amount and interval start, and the sources and instances
// with something left for step 3
enum RouteScratch { kInst, kInstOf, kW, kA, kAlo, kU1, kU2, kC, kClo, kSx, kKx, kRouteScratch };
constexpr int kHotArrays = kUd;  // kL .. kInn: all in shared memory, or none

struct SpreadLayout {
  Place at[kSpreadArrays];
  size_t elems, smem_bytes;
};

inline size_t spread_array_elems(int a, int R, int E, int M, int N) {
  const size_t P = (size_t)E + (size_t)R * N, ME = (size_t)M * E, RN = (size_t)R * N;
  switch (a) {
    case kU: case kPart: case kBestU: return P;
    case kSlots: case kBestSlots: return RN;
    case kOut: case kInn: return M;
    case kRoute: return (size_t)kSpreadWarps * kRouteScratch * ((size_t)R + 1);
    case kUd: case kD: case kFirst: return ME;
    default: return R;
  }
}

// smem_limit: bytes of dynamic shared memory the kernel may take (0: none)
inline SpreadLayout spread_layout(int R, int E, int M, int N, size_t smem_limit) {
  SpreadLayout f;
  Bump g, sm;
  for (int a = 0; a < kSpreadArrays; ++a) f.at[a] = Place{g.take(spread_array_elems(a, R, E, M, N)), 0};
  f.elems = g.end;
  const size_t limit = smem_limit / sizeof(int64_t);
  size_t hot = 0;
  for (int a = 0; a < kHotArrays; ++a) hot += spread_array_elems(a, R, E, M, N);
  if (hot <= limit) {
    for (int a = 0; a < kHotArrays; ++a) f.at[a] = Place{sm.take(spread_array_elems(a, R, E, M, N)), 1};
    for (int a : {kUd, kD, kFirst}) {
      const size_t n = spread_array_elems(a, R, E, M, N);
      if (sm.end + n <= limit) f.at[a] = Place{sm.take(n), 1};
    }
  }
  f.smem_bytes = sm.end * sizeof(int64_t);
  return f;
}

struct SpreadState {
  i64 *L, *nic_out, *nic_in, *nvl_out, *nvl_in, *used, *xin, *U, *part, *D, *Ud, *first, *out, *inn, *slots, *best_U,
      *best_slots;
};

// A candidate move of load delta of expert e from the busiest rank to rank rt, compared lexicographically on
// (score, cross, fresh, lrt, rt, e): the reference's key (extra - t delta, rt outside rb's domain, a new replica,
// L[rt], rt, e). valid == 0 is worse than any candidate.
struct Move {
  i64 score, lrt, delta;
  int cross, fresh, rt, e, valid;
};

__device__ __forceinline__ bool better(const Move& x, const Move& y) {
  if (x.valid != y.valid) return x.valid > y.valid;
  if (!x.valid) return false;
  if (x.score != y.score) return x.score < y.score;
  if (x.cross != y.cross) return x.cross < y.cross;
  if (x.fresh != y.fresh) return x.fresh < y.fresh;
  if (x.lrt != y.lrt) return x.lrt < y.lrt;
  if (x.rt != y.rt) return x.rt < y.rt;
  return x.e < y.e;
}

__device__ __forceinline__ Move shfl_down(const Move& m, int off) {
  Move o;
  o.score = __shfl_down_sync(0xffffffffu, m.score, off);
  o.lrt = __shfl_down_sync(0xffffffffu, m.lrt, off);
  o.delta = __shfl_down_sync(0xffffffffu, m.delta, off);
  o.cross = __shfl_down_sync(0xffffffffu, m.cross, off);
  o.fresh = __shfl_down_sync(0xffffffffu, m.fresh, off);
  o.rt = __shfl_down_sync(0xffffffffu, m.rt, off);
  o.e = __shfl_down_sync(0xffffffffu, m.e, off);
  o.valid = __shfl_down_sync(0xffffffffu, m.valid, off);
  return o;
}

// The block's best move; every thread gets it.
__device__ Move block_best(Move m, Move* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int off = 16; off > 0; off >>= 1) {
    const Move o = shfl_down(m, off);
    if (better(o, m)) m = o;
  }
  if (lane == 0) sm[warp] = m;
  __syncthreads();
  if (warp == 0) {
    if (lane < kSpreadWarps) m = sm[lane];
    else m.valid = 0;
    for (int off = 16; off > 0; off >>= 1) {
      const Move o = shfl_down(m, off);
      if (better(o, m)) m = o;
    }
    if (lane == 0) sm[kSpreadWarps] = m;
  }
  __syncthreads();
  const Move best = sm[kSpreadWarps];
  __syncthreads();
  return best;
}

// The loads the objective reads: the busiest rank (largest L, ties: lowest rank), the largest xin, out and inn.
struct Stat {
  i64 L, xin, out, inn;
  int r;
};

__device__ __forceinline__ void merge(Stat& s, const Stat& o) {
  if (o.L > s.L || (o.L == s.L && o.r < s.r)) { s.L = o.L; s.r = o.r; }
  s.xin = o.xin > s.xin ? o.xin : s.xin;
  s.out = o.out > s.out ? o.out : s.out;
  s.inn = o.inn > s.inn ? o.inn : s.inn;
}

__device__ __forceinline__ Stat shfl_down(const Stat& s, int off) {
  Stat o;
  o.L = __shfl_down_sync(0xffffffffu, s.L, off);
  o.xin = __shfl_down_sync(0xffffffffu, s.xin, off);
  o.out = __shfl_down_sync(0xffffffffu, s.out, off);
  o.inn = __shfl_down_sync(0xffffffffu, s.inn, off);
  o.r = __shfl_down_sync(0xffffffffu, s.r, off);
  return o;
}

__device__ Stat block_stat(const SpreadDims& d, const SpreadState& s, Stat* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Stat m{-1, 0, 0, 0, 1 << 30};
  for (int r = threadIdx.x; r < d.R; r += blockDim.x) merge(m, Stat{s.L[r], s.xin[r], 0, 0, r});
  for (int g = threadIdx.x; g < d.M; g += blockDim.x) merge(m, Stat{-1, 0, s.out[g], s.inn[g], 1 << 30});
  for (int off = 16; off > 0; off >>= 1) merge(m, shfl_down(m, off));
  if (lane == 0) sm[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kSpreadWarps ? sm[lane] : Stat{-1, 0, 0, 0, 1 << 30};
    for (int off = 16; off > 0; off >>= 1) merge(m, shfl_down(m, off));
    if (lane == 0) sm[kSpreadWarps] = m;
  }
  __syncthreads();
  const Stat out = sm[kSpreadWarps];
  __syncthreads();
  return out;
}

__device__ __forceinline__ i64 imax(i64 x, i64 y) { return x > y ? x : y; }

// R of the objective for the busiest NIC / NVLink copy counts (spread.py _replica_fs)
__device__ __forceinline__ i64 replica_fs(const SpreadDims& d, i64 nic, i64 nvl) {
  return kReplicaTransfers * d.W * imax(d.b * nic, d.a * nvl);
}

__device__ __forceinline__ i64 objective(const SpreadDims& d, const Stat& st, i64 nic, i64 nvl) {
  const i64 tok = imax(kTokenTransfers * d.S * d.b * imax(st.out, st.inn) / d.rpd, kIngressTransfers * d.S * d.b * st.xin);
  return d.t * st.L + replica_fs(d, nic, nvl) + tok;
}

// the instance of expert e on rank r (its main, or the slot holding it), or -1
__device__ __forceinline__ int instance_on(const SpreadDims& d, const SpreadState& s, int r, int e) {
  if (e / d.Eloc == r) return e;
  for (int j = 0; j < d.N; ++j)
    if (s.slots[(i64)r * d.N + j] == e) return d.E + r * d.N + j;
  return -1;
}

// instance p (of expert e on rank r): its share of its domain's inflow for e, floor(U (Ud - D)^+ / Ud) (_share)
__device__ __forceinline__ void share(const SpreadDims& d, const SpreadState& s, int r, int e, int p) {
  const i64 g = (i64)(r / d.rpd) * d.E + e;
  const i64 ud = s.Ud[g], x = ud - s.D[g];
  const i64 nw = ud > 0 ? s.U[p] * (x > 0 ? x : 0) / ud : 0;
  s.xin[r] += nw - s.part[p];
  s.part[p] = nw;
}

// the rank a new copy of e on rt fetches from, and whether over the NIC (_State.source)
__device__ __forceinline__ int copy_source(const SpreadDims& d, const SpreadState& s, int e, int rt, bool* nic) {
  const int home = e / d.Eloc, m = rt / d.rpd;
  if (home / d.rpd == m) { *nic = false; return home; }
  const i64 first = d.trees ? s.first[(i64)m * d.E + e] : -1;
  *nic = first < 0;
  return first < 0 ? home : (int)first;
}

__device__ __forceinline__ i64 warp_sum(i64 v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ i64 warp_excl_scan(i64 v, int lane) {
  i64 x = v;
  for (int off = 1; off < 32; off <<= 1) {
    const i64 y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x - v;
}

__device__ __forceinline__ i64 imin(i64 x, i64 y) { return x < y ? x : y; }

// The route of expert e's kept loads, common.hierarchical_route's three steps for one expert, by one warp (every lane
// calls it; sc: the warp's scratch, RouteScratch arrays of R + 1, its instance-of-rank array all -1 on entry and on
// exit). route[:, p] of e's instances must be 0 on entry. U: the instance loads, slot: the slot table after the drop.
__device__ void route_expert(const SpreadDims& d, const i64* __restrict__ omega, const i64* U, const i64* slot,
                             i64* route, int e, i64* sc, int lane) {
  const int R = d.R, E = d.E, N = d.N, P = d.P, rpd = d.rpd, stride = R + 1;
  const unsigned below = (1u << lane) - 1;
  i64 *inst = sc + kInst * stride, *inst_of = sc + kInstOf * stride, *w = sc + kW * stride, *a = sc + kA * stride,
      *alo = sc + kAlo * stride, *u1 = sc + kU1 * stride, *u2 = sc + kU2 * stride, *c = sc + kC * stride,
      *clo = sc + kClo * stride, *sx = sc + kSx * stride, *kx = sc + kKx * stride;
  auto rank_of = [&](i64 p) { return p < E ? (int)(p / d.Eloc) : (int)((p - E) / N); };
  // e's instances in index order: its main, then the slots holding it (rank order)
  int n = 1;
  if (lane == 0) inst[0] = e;
  for (int j0 = 0; j0 < R * N; j0 += 32) {
    const int j = j0 + lane;
    const bool hit = j < R * N && slot[j] == e;
    const unsigned b = __ballot_sync(0xffffffffu, hit);
    if (hit) inst[n + __popc(b & below)] = E + j;
    n += __popc(b);
  }
  __syncwarp();
  for (int k = lane; k < n; k += 32) inst_of[rank_of(inst[k])] = k;
  __syncwarp();
  // 1. each instance serves its own rank's demand
  for (int s = lane; s < R; s += 32) {
    const i64 x = omega[(i64)s * E + e], k = inst_of[s];
    i64 loc = 0;
    if (k >= 0) {
      const i64 u = U[inst[k]];
      loc = imin(x, u);
      u1[k] = u2[k] = u - loc;
      route[(i64)s * P + inst[k]] = loc;
    }
    w[s] = x - loc;
  }
  __syncwarp();
  // 2. then its domain's: the domain's sources (index order) fill m = min(their demand, the instances' loads), the
  // instances (index order) take m, and each pair gets the overlap of the two intervals
  for (int dm = 0; dm < d.M; ++dm) {
    const int s_lo = dm * rpd, s_hi = s_lo + rpd;
    i64 cap = 0, dem = 0;
    for (int k = lane; k < n; k += 32) cap += rank_of(inst[k]) / rpd == dm ? u1[k] : 0;
    for (int s = s_lo + lane; s < s_hi; s += 32) dem += w[s];
    const i64 m = imin(warp_sum(cap), warp_sum(dem));
    if (m == 0) continue;  // (the same in every lane)
    i64 carry = 0;
    for (int s0 = s_lo; s0 < s_hi; s0 += 32) {
      const int s = s0 + lane;
      const i64 v = s < s_hi ? w[s] : 0, before = carry + warp_excl_scan(v, lane);
      if (s < s_hi) {
        alo[s] = imin(before, m);
        a[s] = imin(imax(m - before, 0), v);
      }
      carry += warp_sum(v);
    }
    carry = 0;
    for (int k0 = 0; k0 < n; k0 += 32) {
      const int k = k0 + lane;
      const bool in = k < n && rank_of(inst[k]) / rpd == dm;
      const i64 v = in ? u1[k] : 0, before = carry + warp_excl_scan(v, lane);
      if (in) {
        clo[k] = imin(before, m);
        c[k] = imin(imax(m - before, 0), v);
      }
      carry += warp_sum(v);
    }
    __syncwarp();
    for (int i = lane; i < rpd * n; i += 32) {
      const int s = s_lo + i / n, k = i % n;
      if (rank_of(inst[k]) / rpd != dm || a[s] == 0 || c[k] == 0) continue;
      const i64 lo = imax(alo[s], clo[k]), hi = imin(alo[s] + a[s], clo[k] + c[k]);
      if (hi > lo) route[(i64)s * P + inst[k]] += hi - lo;
    }
    __syncwarp();
    for (int s = s_lo + lane; s < s_hi; s += 32) w[s] -= a[s];
    for (int k = lane; k < n; k += 32)
      if (rank_of(inst[k]) / rpd == dm) u2[k] = u1[k] - c[k];
    __syncwarp();
  }
  // 3. then any source: what is left of every source's demand (index order) over what is left of every instance's
  // load (index order); only the sources and instances with something left pair up
  int ns = 0, nk = 0;
  i64 carry = 0;
  for (int s0 = 0; s0 < R; s0 += 32) {
    const int s = s0 + lane;
    const i64 v = s < R ? w[s] : 0, before = carry + warp_excl_scan(v, lane);
    const unsigned b = __ballot_sync(0xffffffffu, v > 0);
    if (v > 0) {
      sx[ns + __popc(b & below)] = s;
      alo[s] = before;
    }
    ns += __popc(b);
    carry += warp_sum(v);
  }
  carry = 0;
  for (int k0 = 0; k0 < n; k0 += 32) {
    const int k = k0 + lane;
    const i64 v = k < n ? u2[k] : 0, before = carry + warp_excl_scan(v, lane);
    const unsigned b = __ballot_sync(0xffffffffu, v > 0);
    if (v > 0) {
      kx[nk + __popc(b & below)] = k;
      clo[k] = before;
    }
    nk += __popc(b);
    carry += warp_sum(v);
  }
  __syncwarp();
  for (int i = lane; i < ns * nk; i += 32) {
    const int s = (int)sx[i / nk], k = (int)kx[i % nk];
    const i64 lo = imax(alo[s], clo[k]), hi = imin(alo[s] + w[s], clo[k] + u2[k]);
    if (hi > lo) route[(i64)s * P + inst[k]] += hi - lo;
  }
  __syncwarp();
  for (int k = lane; k < n; k += 32) inst_of[rank_of(inst[k])] = -1;
  __syncwarp();
}

__global__ void __launch_bounds__(kSpreadThreads) spread_kernel(const i64* __restrict__ omega,
                                                                 const bool* __restrict__ enable, SpreadDims d,
                                                                 SpreadLayout f, i64* ws, i64* slot_out,
                                                                 i64* route_out, i64* info) {
  __shared__ Move sm_move[kSpreadWarps + 1];
  __shared__ Stat sm_stat[kSpreadWarps + 1];
  __shared__ i64 sh_nic, sh_nvl;  // the busiest NIC / NVLink copy counts (they only grow)
  __shared__ unsigned long long sh_dropped;
  const int tid = threadIdx.x, R = d.R, E = d.E, N = d.N, M = d.M, P = d.P;
  extern __shared__ i64 smem_state[];
  i64* ptr[kSpreadArrays];
  for (int a = 0; a < kSpreadArrays; ++a) ptr[a] = (f.at[a].in_smem ? smem_state : ws) + f.at[a].off;
  const SpreadState s{ptr[kL],  ptr[kNicOut], ptr[kNicIn], ptr[kNvlOut], ptr[kNvlIn], ptr[kUsed],
                      ptr[kXin], ptr[kU],     ptr[kPart],  ptr[kD],      ptr[kUd],     ptr[kFirst],
                      ptr[kOut], ptr[kInn],   ptr[kSlots], ptr[kBestU],  ptr[kBestSlots]};
  // the static plan: every expert's demand on its main
  for (int r = tid; r < R; r += blockDim.x) {
    s.L[r] = 0;
    s.nic_out[r] = s.nic_in[r] = s.nvl_out[r] = s.nvl_in[r] = s.used[r] = s.xin[r] = 0;
  }
  for (int j = tid; j < R * N; j += blockDim.x) s.slots[j] = -1;
  for (int p = tid; p < P; p += blockDim.x) { s.U[p] = 0; s.part[p] = 0; }
  for (int g = tid; g < M; g += blockDim.x) { s.out[g] = 0; s.inn[g] = 0; }
  for (i64 g = tid; g < (i64)M * E; g += blockDim.x) {
    const int m = (int)(g / E), e = (int)(g % E);
    i64 dem = 0;
    for (int r = m * d.rpd; r < (m + 1) * d.rpd; ++r) dem += omega[(i64)r * E + e];
    s.D[g] = dem;
    s.Ud[g] = 0;
    s.first[g] = -1;
  }
  if (tid == 0) { sh_nic = 0; sh_nvl = 0; sh_dropped = 0; }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {  // an expert's load: its domains' demands
    i64 u = 0;
    for (int m = 0; m < M; ++m) u += s.D[(i64)m * E + e];
    s.U[e] = u;
    s.Ud[(i64)((e / d.Eloc) / d.rpd) * E + e] = u;
  }
  __syncthreads();
  for (int r = tid; r < R; r += blockDim.x) {
    i64 l = 0;
    for (int k = 0; k < d.Eloc; ++k) l += s.U[r * d.Eloc + k];
    s.L[r] = l;
  }
  for (i64 g = tid; g < (i64)M * E; g += blockDim.x) {
    const i64 x = s.D[g] - s.Ud[g];
    if (x > 0) atomicAdd((unsigned long long*)&s.out[g / E], (unsigned long long)x);  // integers: exact
    if (x < 0) atomicAdd((unsigned long long*)&s.inn[g / E], (unsigned long long)(-x));
  }
  for (int e = tid; e < E; e += blockDim.x) {  // the mains' shares (one thread per instance; xin by atomics)
    const int r = e / d.Eloc;
    const i64 g = (i64)(r / d.rpd) * E + e;
    const i64 ud = s.Ud[g], x = ud - s.D[g];
    const i64 nw = ud > 0 ? s.U[e] * (x > 0 ? x : 0) / ud : 0;
    s.part[e] = nw;
    atomicAdd((unsigned long long*)&s.xin[r], (unsigned long long)nw);
  }
  __syncthreads();
  Stat st = block_stat(d, s, sm_stat);
  const i64 static_obj = objective(d, st, 0, 0);
  i64 best_obj = static_obj;  // every thread keeps the same copy
  int best_len = 0, moves = 0;
  for (int p = tid; p < P; p += blockDim.x) s.best_U[p] = s.U[p];
  for (int j = tid; j < R * N; j += blockDim.x) s.best_slots[j] = -1;
  const bool on = N > 0 && (enable == nullptr || *enable);
  const int K = d.Eloc + N;  // instances a rank may hold
  while (on && moves < d.max_moves) {
    const int rb = st.r, drb = rb / d.rpd;
    const i64 Lrb = st.L, mx_nic = sh_nic, mx_nvl = sh_nvl;
    const i64 cur = replica_fs(d, mx_nic, mx_nvl);
    Move mine;
    mine.valid = 0;
    for (int i = tid; i < R * K; i += blockDim.x) {
      const int rt = i / K, k = i % K;
      const i64 Lrt = s.L[rt];
      const i64 half = (Lrb - Lrt) / 2;  // Lrb >= Lrt: the floor
      if (half <= 0) continue;
      int p, e;
      if (k < d.Eloc) {
        p = rb * d.Eloc + k;
        e = p;
      } else {
        p = E + rb * N + (k - d.Eloc);
        e = (int)s.slots[p - E];
        if (e < 0) continue;
      }
      const i64 u = s.U[p];
      if (u <= 0) continue;
      const int home = e / d.Eloc, drt = rt / d.rpd;
      const bool existing = instance_on(d, s, rt, e) >= 0;
      i64 extra = 0;
      if (!existing) {
        if (s.used[rt] >= N) continue;
        if (home / d.rpd != drt && !(2 * s.D[(i64)drt * E + e] * d.S > d.W)) continue;  // C4
        bool nic;
        const int src = copy_source(d, s, e, rt, &nic);
        if (nic) extra = replica_fs(d, imax(mx_nic, imax(s.nic_out[src] + 1, s.nic_in[rt] + 1)), mx_nvl) - cur;
        else extra = replica_fs(d, mx_nic, imax(mx_nvl, imax(s.nvl_out[src] + 1, s.nvl_in[rt] + 1))) - cur;
      }
      Move x;
      x.delta = u < half ? u : half;
      x.score = extra - d.t * x.delta;
      x.lrt = Lrt;
      x.cross = drt != drb;
      x.fresh = !existing;
      x.rt = rt;
      x.e = e;
      x.valid = 1;
      if (better(x, mine)) mine = x;
    }
    const Move b = block_best(mine, sm_move);
    if (!b.valid || b.score >= 0) break;
    const int rt = b.rt, e = b.e, drt = rt / d.rpd;
    if (tid == 0) {  // the move (_State.apply)
      int pt = instance_on(d, s, rt, e);
      if (pt < 0) {
        const int j = (int)s.used[rt]++;
        s.slots[(i64)rt * N + j] = e;
        pt = E + rt * N + j;
        bool nic;
        const int src = copy_source(d, s, e, rt, &nic);
        i64& first = s.first[(i64)drt * E + e];
        if (first < 0) first = rt;
        if (nic) {
          sh_nic = imax(sh_nic, imax(++s.nic_out[src], ++s.nic_in[rt]));
        } else {
          sh_nvl = imax(sh_nvl, imax(++s.nvl_out[src], ++s.nvl_in[rt]));
        }
      }
      const int pb = instance_on(d, s, rb, e);
      s.U[pb] -= b.delta;
      s.U[pt] += b.delta;
      s.L[rb] -= b.delta;
      s.L[rt] += b.delta;
      const int doms[2] = {drb, drt};
      const i64 xs[2] = {-b.delta, b.delta};
      for (int h = 0; h < 2; ++h) {
        const i64 g = (i64)doms[h] * E + e, dd = s.D[g], u = s.Ud[g], x = xs[h];
        s.Ud[g] = u + x;
        s.out[doms[h]] += imax(dd - u - x, 0) - imax(dd - u, 0);
        s.inn[doms[h]] += imax(u + x - dd, 0) - imax(u - dd, 0);
      }
    }
    __syncthreads();
    // every instance of e in the two domains shares anew (a thread per rank)
    const int span = drb == drt ? d.rpd : 2 * d.rpd;
    for (int i = tid; i < span; i += blockDim.x) {
      const int r = i < d.rpd ? drb * d.rpd + i : drt * d.rpd + (i - d.rpd);
      const int p = instance_on(d, s, r, e);
      if (p >= 0) share(d, s, r, e, p);
    }
    __syncthreads();
    ++moves;
    st = block_stat(d, s, sm_stat);
    const i64 obj = objective(d, st, sh_nic, sh_nvl);
    if (obj < best_obj) {  // the same decision in every thread
      best_obj = obj;
      best_len = moves;
      for (int p = tid; p < P; p += blockDim.x) s.best_U[p] = s.U[p];
      for (int j = tid; j < R * N; j += blockDim.x) s.best_slots[j] = s.slots[j];
    }
  }
  __syncthreads();
  // the kept prefix; replicas left with no load are dropped
  unsigned long long dropped = 0;
  for (int j = tid; j < R * N; j += blockDim.x) {
    const i64 x = s.best_slots[j];
    const bool served = s.best_U[E + j] > 0;
    dropped += x >= 0 && !served;
    slot_out[j] = served ? x : -1;
  }
  atomicAdd(&sh_dropped, dropped);
  __syncthreads();
  if (tid == 0) {
    info[0] = best_len;
    info[1] = moves;
    info[2] = best_obj;
    info[3] = static_obj;
    info[4] = (i64)sh_dropped;
  }
  // the route of the kept loads (common.hierarchical_route), a warp per expert
  for (i64 i = tid; i < (i64)R * P; i += blockDim.x) route_out[i] = 0;
  const int lane = tid & 31;
  i64* sc = ptr[kRoute] + (size_t)(tid >> 5) * kRouteScratch * ((size_t)R + 1);
  for (int r = lane; r < R; r += 32) sc[kInstOf * (R + 1) + r] = -1;
  __syncthreads();
  for (int e = tid >> 5; e < E; e += kSpreadWarps) route_expert(d, omega, s.best_U, slot_out, route_out, e, sc, lane);
}

}  // namespace

size_t spread_workspace_elems(int R, int E, int M, int N) { return spread_layout(R, E, M, N, 0).elems; }

cudaError_t plan_spread(const int64_t* omega, int R, int E, int M, int N, const SpreadArgs& args, const bool* enable,
                        int64_t* slot_expert, int64_t* route, int64_t* info, int64_t* ws, cudaStream_t stream) {
  SpreadDims d;
  d.R = R;
  d.E = E;
  d.N = N;
  d.M = M;
  d.P = E + R * N;
  d.Eloc = E / R;
  d.rpd = R / M;
  d.max_moves = args.max_moves;
  d.trees = args.trees;
  d.W = args.expert_bytes;
  d.S = args.token_bytes;
  d.t = args.t_fs;
  d.a = args.a;
  d.b = args.b;
  int dev = 0;
  cudaGetDevice(&dev);
  static int optin_of[64] = {0};  // the opt-in dynamic shared memory per block, per device ordinal, queried once
  static int smem_set[64] = {0};  // the kernel's shared memory limit set so far, per device ordinal
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (optin_of[dev] == 0) cudaDeviceGetAttribute(&optin_of[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const size_t static_smem = 8 * 1024;  // the block reductions' __shared__ arrays, with room to spare
  const SpreadLayout f =
      spread_layout(R, E, M, N, optin_of[dev] > (int)static_smem ? optin_of[dev] - static_smem : 0);
  if ((int)f.smem_bytes > 48 * 1024 && (int)f.smem_bytes > smem_set[dev]) {
    cudaError_t err = cudaFuncSetAttribute(spread_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)f.smem_bytes);
    if (err != cudaSuccess) return err;
    smem_set[dev] = (int)f.smem_bytes;
  }
  spread_kernel<<<1, kSpreadThreads, f.smem_bytes, stream>>>(omega, enable, d, f, ws, slot_expert, route, info);
  return cudaGetLastError();
}

}  // namespace topoep
