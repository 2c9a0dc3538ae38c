// The `topoep_plus_spread` policy (and `topoep_plus_spread_tree`) of topoep/planners/spread.py on the GPU, bit for
// bit: the greedy load moves priced on the straggler's compute and the busiest replica and token links, the
// rollback to the best prefix, the drop of replicas left without load, and the route of the kept loads
// (`common.hierarchical_route`, a warp per expert: route_expert). The reference's module docstring is the spec;
// every choice below mirrors it.
//
// Two kernels. spread_kernel, one block of 512 threads: the greedy is a chain of dependent moves. Warp 1 is the
// accountant, the other 15 warps scan, and warp 0 also makes each move; per move the scanners pass two barriers of
// their own (a named barrier without the accountant):
//   1. Every scanner scores its (target rank, instance of the busiest rank) pairs, each with every word it may read
//      loaded before any test (a chain of three loads, not one per test); a warp reduction of their keys (three
//      words, compared as the reference's tuple) leaves each warp's best, and its move (the two instances, the
//      load, the copy source), in shared memory. Barrier.
//   2. Warp 0 finishes the reduction and makes the move with the winner's words: lane 0 writes the loads, lane 1
//      the slot and the copy counters; the warp finds the next busiest rank and publishes the move to the
//      accountant. Barrier.
//   The accountant follows the published moves, a move behind or more: it re-shares the moved expert's instances in
//   the one or two domains it touches, updates the domains' sums and computes the objective after the move, on its
//   own copy of the instance loads (U2), so the scanners never wait for it. Nothing the scan reads depends on these
//   sums: they only decide the kept prefix.
//   Each move is logged (its two instances, the load, the new slot); instead of copying the state at every new best
//   objective, the whole block undoes the moves after the kept prefix at the end (the load changes add up, so
//   integer atomics undo them in any order).
// spread_route_kernel, a grid of warps: the route of the kept loads, one expert per warp at a time.
//
// State (spread_layout: in shared memory where it fits, else in the workspace): per rank L (load), the replica
// copies it sends and receives over its NIC and over NVLink, its used slots, xin (its instances' share of their
// domains' inflow) and its domain; per instance U (load), U2 and part (its share); per expert its main rank; per
// (domain, expert) D (demand), Ud (load of the expert's instances in the domain) and the rank of its first copy
// there; per domain out / inn (assignments its sources send to / its instances receive from other domains); the
// slot table. In the workspace only: the move log, the kept loads (the route kernel's input) and the route kernel's
// scratch.

#include <cuda_runtime.h>
#include <stdint.h>

#include <initializer_list>

#include "planner.h"

namespace topoep {

namespace {

using i64 = int64_t;
using u64 = unsigned long long;
constexpr int kSpreadThreads = 512;
constexpr int kSpreadWarps = kSpreadThreads / 32;
constexpr int kRouteBlockWarps = 8;   // spread_route_kernel: warps per block
constexpr int kRouteMaxWarps = 512;   // and in all (each with its scratch in the workspace)
constexpr int kScanThreads = kSpreadThreads - 32;  // every warp but the accountant (warp 1) scans
// a logged move: its source and target instances, the load moved, its new slot (or -1), the expert, the source and
// target ranks, and after it the busiest rank's load and the busiest NIC and NVLink copy counts
enum LogWord { kLogPb, kLogPt, kLogDelta, kLogSlot, kLogE, kLogRb, kLogRt, kLogLmax, kLogNic, kLogNvl, kLogWords };
// the objective's transfer counts (spread.py REPLICA_TRANSFERS, TOKEN_TRANSFERS, INGRESS_TRANSFERS)
constexpr i64 kReplicaTransfers = 3, kTokenTransfers = 2, kIngressTransfers = 4;

struct SpreadDims {
  int R, E, N, M, P, Eloc, rpd, max_moves, trees;
  i64 W, S, t, a, b;  // expert bytes, token bytes, t_ffn in fs, two-level costs in fs per byte
  u64 stop_hi;        // a best key's hi word at or above this stops the greedy: its score >= -move_cost_fs
  i64 c4;                           // C4 holds for a new copy in domain m where D[m, e] > c4 = W / (2 S)
  double inv_rpd, inv_Eloc, inv_N;  // 1 / rpd, 1 / Eloc, 1 / N (0 without slots): fast_div
};

// x / y for 0 <= x < 2^31 and y >= 1, from inv = 1.0 / y (a few instructions instead of an integer division's
// dozens): the product is within 2^-20 / y of x / y, so its truncation is x / y or one below it (exact multiples)
__device__ __forceinline__ int fast_div(int x, int y, double inv) {
  const int q = (int)((double)x * inv);
  return x - q * y >= y ? q + 1 : q;
}
__device__ __forceinline__ int dom_of(const SpreadDims& d, int r) { return fast_div(r, d.rpd, d.inv_rpd); }
__device__ __forceinline__ int home_of(const SpreadDims& d, int e) { return fast_div(e, d.Eloc, d.inv_Eloc); }

inline int route_warps(int E) { return E < kRouteMaxWarps ? E : kRouteMaxWarps; }
// the move log's length: default_max_moves(R, E, N) = 4 R (E / R + N) moves (plan_spread refuses more)
inline size_t log_moves(int R, int E, int N) { return 4 * ((size_t)E + (size_t)R * N); }

// Where each array lives: `off` int64 elements into the dynamic shared memory (in_smem) or into the workspace. The
// workspace has room for every array (its size does not depend on the device); the launch moves the arrays into
// shared memory in the order of their use per move while they fit: the per-rank and per-instance state, the slot
// table and the per-domain sums first, then Ud, D and the first copies; the log, the kept loads and the route's
// scratch stay in the workspace.
struct Place {
  size_t off;
  int in_smem;
};

enum SpreadArray { kL, kNicOut, kNicIn, kNvlOut, kNvlIn, kUsed, kXin, kDom, kU, kUAcc, kPart, kSlots, kOut, kInn, kHome, kUd, kD,
                   kFirst,
                   kLog, kLoad, kRoute, kSpreadArrays };
// the route's scratch per warp (route_expert), each R + 1 elements: the expert's instances in index order, the
// instance on each rank, each source's remaining demand w, its matched amount and interval start, each instance's
// load after its own rank, after its domain, its matched amount and interval start, and the sources and instances
// with something left for step 3
enum RouteScratch { kInst, kInstOf, kW, kA, kAlo, kU1, kU2, kC, kClo, kSx, kKx, kRouteScratch };
constexpr int kHotArrays = kUd;  // kL .. kHome: all in shared memory, or none

struct SpreadLayout {
  Place at[kSpreadArrays];
  size_t elems, smem_bytes;
};

inline size_t spread_array_elems(int a, int R, int E, int M, int N) {
  const size_t P = (size_t)E + (size_t)R * N, ME = (size_t)M * E, RN = (size_t)R * N;
  switch (a) {
    case kU: case kUAcc: case kPart: case kLoad: return P;
    case kSlots: return RN;
    case kOut: case kInn: return M;
    case kLog: return kLogWords * log_moves(R, E, N);
    case kRoute: return (size_t)route_warps(E) * kRouteScratch * ((size_t)R + 1);
    case kUd: case kD: case kFirst: return ME;
    case kHome: return E;
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
  i64 *L, *nic_out, *nic_in, *nvl_out, *nvl_in, *used, *xin, *U, *U2, *part, *D, *Ud, *first, *out, *inn, *slots;
  i64 *dom, *home;  // each rank's domain, each expert's main rank
};

// the scanners' barrier (every warp but the accountant)
__device__ __forceinline__ void scan_barrier() { asm volatile("bar.sync 1, %0;" ::"n"(kScanThreads) : "memory"); }

// A candidate move's key, compared as the reference's tuple (extra - t delta, rt outside rb's domain, a new
// replica, L[rt], rt, e): hi the score with its sign bit flipped (signed order as unsigned), mid cross << 63 | fresh
// << 62 | L[rt], lo rt << 32 | e. (rt, e) is unique, so no two candidates tie. kNoMove is worse than any candidate
// and, like every score >= -move_cost_fs (SpreadDims.stop_hi), stops the greedy.
struct Key {
  u64 hi, mid, lo;
};
constexpr u64 kSignBit = 1ull << 63;
__device__ __forceinline__ Key no_move() { return Key{~0ull, ~0ull, ~0ull}; }

// A candidate's move, found by the scan: the load moved, e's instance on rb, e's instance on rt (-1: a new replica,
// placed by the move), the rank a new copy fetches from and whether over the NIC
struct Cand {
  i64 delta;
  int pb, pt, src;
  bool nic;
};

__device__ __forceinline__ bool less(const Key& x, const Key& y) {
  if (x.hi != y.hi) return x.hi < y.hi;
  if (x.mid != y.mid) return x.mid < y.mid;
  return x.lo < y.lo;
}

// The warp's least key (every lane gets it): word by word from the most significant, the lanes still tied keep the
// 32-bit minimum (redux.sync) of their next word, until one lane is left; then its key is broadcast.
__device__ __forceinline__ Key warp_min(Key k) {
  const unsigned words[6] = {(unsigned)(k.hi >> 32), (unsigned)k.hi, (unsigned)(k.mid >> 32), (unsigned)k.mid,
                             (unsigned)(k.lo >> 32), (unsigned)k.lo};
  const unsigned me = 1u << (threadIdx.x & 31);
  unsigned live = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < 6; ++i) {
    const bool in = live & me;
    const unsigned m = __reduce_min_sync(0xffffffffu, in ? words[i] : 0xffffffffu);
    live = __ballot_sync(0xffffffffu, in && words[i] == m);
    if ((live & (live - 1)) == 0) break;  // (uniform: one lane left)
  }
  const int src = __ffs(live) - 1;
  return Key{__shfl_sync(0xffffffffu, k.hi, src), __shfl_sync(0xffffffffu, k.mid, src),
             __shfl_sync(0xffffffffu, k.lo, src)};
}

// The warp's largest of a value >= 0 (every lane gets it), by two 32-bit reductions
__device__ __forceinline__ i64 warp_max_nonneg(i64 v) {
  const unsigned hi = __reduce_max_sync(0xffffffffu, (unsigned)((u64)v >> 32));
  const unsigned lo = __reduce_max_sync(0xffffffffu, (unsigned)((u64)v >> 32) == hi ? (unsigned)v : 0u);
  return (i64)((u64)hi << 32 | lo);
}

// The warp's busiest rank of each lane's (load >= 0, rank; or -1, 1 << 30 for a lane without a rank, and some lane
// has one): the largest load, ties the lowest rank (every lane gets it)
__device__ __forceinline__ void warp_busiest(i64& L, int& r) {
  const i64 m = warp_max_nonneg(L < 0 ? 0 : L);
  const bool at = L == m;
  r = (int)__reduce_min_sync(0xffffffffu, at ? (unsigned)r : 0xffffffffu);  // (a lane with a rank is at m)
  L = m;
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

// The Stat of the whole state, by one warp (every lane gets it).
__device__ Stat warp_stat(const SpreadDims& d, const SpreadState& s, int lane) {
  Stat m{-1, 0, 0, 0, 1 << 30};
  for (int r = lane; r < d.R; r += 32) merge(m, Stat{s.L[r], s.xin[r], 0, 0, r});
  for (int g = lane; g < d.M; g += 32) merge(m, Stat{-1, 0, s.out[g], s.inn[g], 1 << 30});
  warp_busiest(m.L, m.r);
  m.xin = warp_max_nonneg(m.xin);
  m.out = warp_max_nonneg(m.out);
  m.inn = warp_max_nonneg(m.inn);
  return m;
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
  if (s.home[e] == r) return e;
  for (int j = 0; j < d.N; ++j)
    if (s.slots[(i64)r * d.N + j] == e) return d.E + r * d.N + j;
  return -1;
}

// domain g's sums after its load of expert e changes by x (the first half of _State.apply's domain loop)
__device__ __forceinline__ void domain_add(const SpreadDims& d, const SpreadState& s, int g, int e, i64 x) {
  const i64 at = (i64)g * d.E + e, dd = s.D[at], u = s.Ud[at];
  s.Ud[at] = u + x;
  s.out[g] += imax(dd - u - x, 0) - imax(dd - u, 0);
  s.inn[g] += imax(u + x - dd, 0) - imax(u - dd, 0);
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

// The entries of v[0, n) above 0, by one warp (every lane calls it): their indices in order into idx, and each
// one's start, the sum of v before it, into start[its index]; returns their number (in every lane)
__device__ __forceinline__ int compact_positive(const i64* v, int n, i64* idx, i64* start, int lane) {
  const unsigned below = (1u << lane) - 1;
  int count = 0;
  i64 carry = 0;
  for (int j0 = 0; j0 < n; j0 += 32) {
    const int j = j0 + lane;
    const i64 x = j < n ? v[j] : 0, before = carry + warp_excl_scan(x, lane);
    const unsigned b = __ballot_sync(0xffffffffu, x > 0);
    if (x > 0) {
      idx[count + __popc(b & below)] = j;
      start[j] = before;
    }
    count += __popc(b);
    carry += warp_sum(x);
  }
  return count;
}

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
  auto rank_of = [&](i64 p) { return p < E ? home_of(d, (int)p) : fast_div((int)(p - E), N, d.inv_N); };
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
    for (int k = lane; k < n; k += 32) cap += dom_of(d, rank_of(inst[k])) == dm ? u1[k] : 0;
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
      const bool in = k < n && dom_of(d, rank_of(inst[k])) == dm;
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
      if (dom_of(d, rank_of(inst[k])) != dm || a[s] == 0 || c[k] == 0) continue;
      const i64 lo = imax(alo[s], clo[k]), hi = imin(alo[s] + a[s], clo[k] + c[k]);
      if (hi > lo) route[(i64)s * P + inst[k]] += hi - lo;
    }
    __syncwarp();
    for (int s = s_lo + lane; s < s_hi; s += 32) w[s] -= a[s];
    for (int k = lane; k < n; k += 32)
      if (dom_of(d, rank_of(inst[k])) == dm) u2[k] = u1[k] - c[k];
    __syncwarp();
  }
  // 3. then any source: what is left of every source's demand (index order) over what is left of every instance's
  // load (index order); only the sources and instances with something left pair up
  const int ns = compact_positive(w, R, sx, alo, lane), nk = compact_positive(u2, n, kx, clo, lane);
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

// kHot: the arrays kL .. kHome are in shared memory; kCold: kUd, kD and kFirst too (the launch picks the instance of
// the layout, so that the compiler addresses what is in shared memory as shared memory)
template <bool kHot, bool kCold>
__global__ void __launch_bounds__(kSpreadThreads) spread_kernel(const i64* __restrict__ omega,
                                                                 const bool* __restrict__ enable, SpreadDims d,
                                                                 SpreadLayout f, i64* ws, i64* slot_out, i64* info) {
  __shared__ Key sh_key[kSpreadWarps];     // each warp's best candidate
  __shared__ Cand sh_cand[kSpreadWarps];   // and its move
  __shared__ i64 sh_nic, sh_nvl, sh_Lrb;   // the busiest NIC / NVLink copy counts (they only grow); L of rb
  __shared__ i64 sh_obj, sh_static_obj;  // the kept prefix's objective, static's
  __shared__ int sh_rb, sh_stop, sh_moves, sh_kept;
  __shared__ int sh_made, sh_finished;  // moves published to the accountant; the scan is over
  __shared__ unsigned long long sh_dropped;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, R = d.R, E = d.E, N = d.N, M = d.M, P = d.P;
  extern __shared__ i64 smem_state[];
  i64* ptr[kSpreadArrays];
#pragma unroll
  for (int a = 0; a < kSpreadArrays; ++a) {
    const bool smem = a < kHotArrays ? kHot : a == kUd || a == kD || a == kFirst ? kCold : false;
    ptr[a] = smem ? smem_state + f.at[a].off : (f.at[a].in_smem ? smem_state : ws) + f.at[a].off;
  }
  const SpreadState s{ptr[kL],  ptr[kNicOut], ptr[kNicIn], ptr[kNvlOut], ptr[kNvlIn], ptr[kUsed],
                      ptr[kXin], ptr[kU],     ptr[kUAcc],    ptr[kPart],   ptr[kD],     ptr[kUd],
                      ptr[kFirst], ptr[kOut], ptr[kInn],   ptr[kSlots], ptr[kDom],  ptr[kHome]};
  i64* const log = ptr[kLog];
  if (enable != nullptr && !*enable) {  // left out (the pre-plan bound, the spread gate): the static plan, no state
    for (int j = tid; j < R * N; j += blockDim.x) slot_out[j] = -1;
    if (tid < 5) info[tid] = 0;
    return;
  }
  // the static plan: every expert's demand on its main
  for (int r = tid; r < R; r += blockDim.x) {
    s.L[r] = 0;
    s.nic_out[r] = s.nic_in[r] = s.nvl_out[r] = s.nvl_in[r] = s.used[r] = s.xin[r] = 0;
  }
  for (int j = tid; j < R * N; j += blockDim.x) s.slots[j] = -1;
  for (int r = tid; r < R; r += blockDim.x) s.dom[r] = r / d.rpd;
  for (int e = tid; e < E; e += blockDim.x) s.home[e] = e / d.Eloc;
  for (int p = tid; p < P; p += blockDim.x) { s.U[p] = 0; s.U2[p] = 0; s.part[p] = 0; }
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
    s.U[e] = s.U2[e] = u;
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
    if (x > 0) atomicAdd((u64*)&s.out[g / E], (u64)x);  // integers: exact
    if (x < 0) atomicAdd((u64*)&s.inn[g / E], (u64)(-x));
  }
  for (int e = tid; e < E; e += blockDim.x) {  // the mains' shares (one thread per instance; xin by atomics)
    const int r = e / d.Eloc;
    const i64 g = (i64)(r / d.rpd) * E + e;
    const i64 ud = s.Ud[g], x = ud - s.D[g];
    const i64 nw = ud > 0 ? s.U[e] * (x > 0 ? x : 0) / ud : 0;
    s.part[e] = nw;
    atomicAdd((u64*)&s.xin[r], (u64)nw);
  }
  __syncthreads();
  // Roles: warp 1 keeps the objective (the accountant: the shares, the domains' sums, the objective after every
  // move and the kept prefix, a move behind); the other warps scan, and warp 0 also makes each move.
  Stat st{};  // (warps 0 and 1: the static plan's, before any move)
  if (warp <= 1) st = warp_stat(d, s, lane);
  if (warp == 0) {
    if (lane == 0) {
      sh_rb = st.r;
      sh_Lrb = st.L;
      sh_stop = !(N > 0 && d.max_moves > 0 && (enable == nullptr || *enable));
      sh_made = 0;
      sh_finished = 0;
    }
  }
  __syncthreads();
  if (warp != 1) {
    const int si = warp == 0 ? tid : tid - 32;  // the scanner's index
    // its pairs: i = si, si + kScanThreads, ... of the R x K (target rank, instance of rb) pairs
    const int K = d.Eloc + N;  // instances a rank may hold
    const int rt0 = si / K, k0 = si - rt0 * K, step_rt = kScanThreads / K, step_k = kScanThreads - step_rt * K;
    int moves = 0;  // (warp 0's)
    while (!sh_stop) {
      // 1. every scanner's candidates (the reference's scan), then each warp's best. A new copy raises the busiest
      // NIC (NVLink) count by one where its source or target is a busiest one, else leaves it: extra is 0 or up_*.
      const int rb = sh_rb, drb = (int)s.dom[rb];
      const i64 Lrb = sh_Lrb, mx_nic = sh_nic, mx_nvl = sh_nvl;
      const i64 cur = replica_fs(d, mx_nic, mx_nvl);
      const i64 up_nic = replica_fs(d, mx_nic + 1, mx_nvl) - cur, up_nvl = replica_fs(d, mx_nic, mx_nvl + 1) - cur;
      Key mine = no_move();
      Cand best{};  // mine's move
      for (int rt = rt0, k = k0; rt < R; k += step_k, rt += step_rt + (k >= K), k -= k >= K ? K : 0) {
        // Every word the candidate may read is loaded before any test (all in range, shared memory where the state
        // fits), so its chain is three loads deep instead of one load per test. Ranks' domains and experts' mains
        // are computed (dom_of, home_of: the values of s.dom and s.home).
        const bool main_k = k < d.Eloc;
        const int p = main_k ? rb * d.Eloc + k : E + rb * N + (k - d.Eloc);
        const i64 Lrt = s.L[rt], u = s.U[p], used = s.used[rt], nin = s.nic_in[rt], vin = s.nvl_in[rt];
        const int es = main_k ? p : (int)s.slots[p - E];
        const int e = es < 0 ? 0 : es, drt = dom_of(d, rt), home = home_of(d, e), dh = dom_of(d, home);
        const i64 ge = (i64)drt * E + e;
        const i64 dem = s.D[ge], first = d.trees ? s.first[ge] : -1;
        int jt = home == rt ? -2 : -1;  // e's instance on rt: -2 its main, j >= 0 slot j, -1 none (instance_on)
        for (int j = 0; j < N; ++j)
          if (jt == -1 && s.slots[(i64)rt * N + j] == e) jt = j;
        const bool nic = dh != drt && first < 0;  // _State.source: the home, or the domain's first copy (NVLink)
        const int src = dh == drt || first < 0 ? home : (int)first;
        const i64 out = nic ? s.nic_out[src] : s.nvl_out[src];
        const i64 half = (Lrb - Lrt) / 2;  // Lrb >= Lrt: the floor
        if (half <= 0 || es < 0 || u <= 0) continue;
        const bool existing = jt != -1;
        i64 extra = 0;
        if (!existing) {
          if (used >= N) continue;
          if (dh != drt && !(dem > d.c4)) continue;  // C4
          extra = nic ? (out == mx_nic || nin == mx_nic ? up_nic : 0) : (out == mx_nvl || vin == mx_nvl ? up_nvl : 0);
        }
        const i64 delta = u < half ? u : half;
        const Key x{(u64)(extra - d.t * delta) ^ kSignBit, (u64)(drt != drb) << 63 | (u64)!existing << 62 | (u64)Lrt,
                    (u64)rt << 32 | (u64)e};
        if (less(x, mine)) {
          mine = x;
          best = Cand{delta, p, jt == -2 ? e : jt >= 0 ? E + rt * N + jt : -1, src, nic};
        }
      }
      const Key wmin = warp_min(mine);
      if (mine.lo == wmin.lo && mine.hi == wmin.hi && mine.mid == wmin.mid) {  // keys are unique: the lane that found
        sh_key[warp] = wmin;                                                   // it (or, without a candidate, every
        sh_cand[warp] = best;                                                  // lane, writing the same words)
      }
      scan_barrier();
      // 2. warp 0: the best candidate, the move (_State.apply's loads, slot and copy counters), the busiest rank
      if (warp == 0) {
        const Key b = warp_min(lane < kSpreadWarps && lane != 1 ? sh_key[lane] : no_move());
        if (b.hi >= d.stop_hi) {  // no candidate, or the best move gains at most move_cost_fs
          if (lane == 0) sh_stop = 1;
        } else {
          const int rt = (int)(b.lo >> 32), e = (int)(b.lo & 0xffffffffu), drt = (int)s.dom[rt];
          const bool fresh = (b.mid >> 62) & 1;
          // the winner's words, from the warp that found it: e's instance on rb and the load moved, e's instance on
          // rt (fresh: rt's lowest free slot) and the rank a new copy fetches from
          const unsigned at = __ballot_sync(0xffffffffu, lane < kSpreadWarps && lane != 1 && sh_key[lane].lo == b.lo &&
                                                             sh_key[lane].hi == b.hi && sh_key[lane].mid == b.mid);
          const Cand c = sh_cand[__ffs(at) - 1];
          const int pb = c.pb, src = c.src;
          const bool nic = c.nic;
          const i64 delta = c.delta;
          int pt = c.pt, slot = -1;
          if (fresh) {
            slot = rt * N + (int)s.used[rt];
            pt = E + slot;
          }
          __syncwarp();
          if (lane == 0) {
            s.U[pb] -= delta;
            s.U[pt] += delta;
            s.L[rb] -= delta;
            s.L[rt] += delta;
          } else if (lane == 1 && slot >= 0) {  // the new replica
            s.slots[slot] = e;
            s.used[rt] += 1;
            i64& first = s.first[(i64)drt * E + e];
            if (first < 0) first = rt;
            if (nic) sh_nic = imax(sh_nic, imax(++s.nic_out[src], ++s.nic_in[rt]));
            else sh_nvl = imax(sh_nvl, imax(++s.nvl_out[src], ++s.nvl_in[rt]));
          }
          __threadfence_block();  // (the slot table before the move's publication to the accountant)
          __syncwarp();
          // the busiest rank (largest L, ties: lowest rank)
          i64 Lm = -1;
          int rm = 1 << 30;
          for (int r = lane; r < R; r += 32) {
            const i64 l = s.L[r];
            if (l > Lm) { Lm = l; rm = r; }  // (ascending r: the first of equal loads stays)
          }
          warp_busiest(Lm, rm);
          if (lane == 0) {  // the move for the accountant, then its publication
            volatile i64* entry = log + (i64)kLogWords * moves;
            entry[kLogPb] = pb;
            entry[kLogPt] = pt;
            entry[kLogDelta] = delta;
            entry[kLogSlot] = slot;
            entry[kLogE] = e;
            entry[kLogRb] = rb;
            entry[kLogRt] = rt;
            entry[kLogLmax] = Lm;
            entry[kLogNic] = sh_nic;
            entry[kLogNvl] = sh_nvl;
            __threadfence_block();
            *(volatile int*)&sh_made = moves + 1;
            sh_rb = rm;
            sh_Lrb = Lm;
            if (moves + 1 >= d.max_moves) sh_stop = 1;
          }
          ++moves;
        }
      }
      scan_barrier();
    }
    if (tid == 0) {
      sh_moves = moves;
      __threadfence_block();
      *(volatile int*)&sh_finished = 1;
    }
  } else {
    // the accountant: the objective of the static plan, then of each published move in order
    const i64 static_obj = objective(d, st, 0, 0);
    i64 best_obj = static_obj;
    int kept = 0;
    for (int done = 0;; ++done) {
      int made = 0, finished = 0;
      do {
        if (lane == 0) {
          finished = *(volatile int*)&sh_finished;
          made = *(volatile int*)&sh_made;  // (read after finished: a final move is published before it)
        }
        made = __shfl_sync(0xffffffffu, made, 0);
        finished = __shfl_sync(0xffffffffu, finished, 0);
        if (made == done && !finished) __nanosleep(32);
      } while (made == done && !finished);
      if (made == done) break;
      __threadfence_block();
      const volatile i64* entry = log + (i64)kLogWords * done;
      const int pb = (int)entry[kLogPb], pt = (int)entry[kLogPt], e = (int)entry[kLogE], rb = (int)entry[kLogRb],
                rt = (int)entry[kLogRt];
      const i64 delta = entry[kLogDelta], Lmax = entry[kLogLmax], nic = entry[kLogNic], nvl = entry[kLogNvl];
      const int drb = dom_of(d, rb), drt = dom_of(d, rt);
      if (lane == 0) {
        s.U2[pb] -= delta;
        s.U2[pt] += delta;
      } else if (lane == 2 && drb != drt) {  // (in one domain the two changes cancel)
        domain_add(d, s, drb, e, -delta);
        domain_add(d, s, drt, e, delta);
      }
      __syncwarp();
      // every instance of e in the two domains shares anew (_share). A later move's new copy of e may already be
      // in the slot table: its load here is still 0, so its share stays 0, as without it.
      const int span = drb == drt ? d.rpd : 2 * d.rpd;
      for (int i = lane; i < span; i += 32) {
        const int r = i < d.rpd ? drb * d.rpd + i : drt * d.rpd + (i - d.rpd), g = dom_of(d, r);
        const int p = r == rt ? pt : r == rb ? pb : instance_on(d, s, r, e);
        if (p < 0) continue;
        const i64 at = (i64)g * E + e, ud = s.Ud[at], x = ud - s.D[at];
        const i64 nw = ud > 0 ? s.U2[p] * (x > 0 ? x : 0) / ud : 0;
        s.xin[r] += nw - s.part[p];
        s.part[p] = nw;
      }
      __syncwarp();
      st = warp_stat(d, s, lane);  // (its busiest rank races with warp 0's later moves: the move's own replaces it)
      st.L = Lmax;
      const i64 obj = objective(d, st, nic, nvl);
      if (obj < best_obj) {
        best_obj = obj;
        kept = done + 1;
      }
    }
    if (lane == 0) {
      sh_kept = kept;
      sh_obj = best_obj;
      sh_static_obj = static_obj;
    }
  }
  __syncthreads();
  // the kept prefix: the block undoes the later moves (their load changes add up; integer atomics, any order)
  for (int m = sh_kept + tid; m < sh_moves; m += blockDim.x) {
    const i64* entry = log + (i64)kLogWords * m;
    atomicAdd((u64*)&s.U[entry[kLogPb]], (u64)entry[kLogDelta]);
    atomicAdd((u64*)&s.U[entry[kLogPt]], (u64)(-entry[kLogDelta]));
    if (entry[kLogSlot] >= 0) s.slots[entry[kLogSlot]] = -1;
  }
  __syncthreads();
  // replicas left with no load are dropped; the kept loads go to the route kernel
  i64* load = ptr[kLoad];
  for (int p = tid; p < P; p += blockDim.x) load[p] = s.U[p];
  unsigned long long dropped = 0;
  for (int j = tid; j < R * N; j += blockDim.x) {
    const i64 x = s.slots[j];
    const bool served = s.U[E + j] > 0;
    dropped += x >= 0 && !served;
    slot_out[j] = served ? x : -1;
  }
  atomicAdd(&sh_dropped, dropped);
  __syncthreads();
  if (tid == 0) {
    info[0] = sh_kept;
    info[1] = sh_moves;
    info[2] = sh_obj;
    info[3] = sh_static_obj;
    info[4] = (i64)sh_dropped;
  }
}

// The route of the kept loads: warp w routes experts w, w + warps, ... (route_expert; route zeroed before). Left out
// (enable false): the static route, every expert's column of omega on its main instance.
__global__ void __launch_bounds__(kRouteBlockWarps * 32) spread_route_kernel(const i64* __restrict__ omega,
                                                                             const bool* __restrict__ enable,
                                                                             SpreadDims d, const i64* load,
                                                                             const i64* slot, i64* route, i64* scratch,
                                                                             int warps) {
  const int lane = threadIdx.x & 31, w = blockIdx.x * kRouteBlockWarps + (threadIdx.x >> 5);
  if (w >= warps) return;
  if (enable != nullptr && !*enable) {
    for (int e = w; e < d.E; e += warps)
      for (int r = lane; r < d.R; r += 32) route[(i64)r * d.P + e] = omega[(i64)r * d.E + e];
    return;
  }
  i64* sc = scratch + (size_t)w * kRouteScratch * ((size_t)d.R + 1);
  for (int r = lane; r < d.R; r += 32) sc[kInstOf * (d.R + 1) + r] = -1;
  __syncwarp();
  for (int e = w; e < d.E; e += warps) route_expert(d, omega, load, slot, route, e, sc, lane);
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
  d.c4 = d.W / (2 * d.S);  // (2 D S > W for integers D >= 0: D > floor(W / (2 S)))
  if (args.move_cost_fs < 0) return cudaErrorInvalidValue;  // (plan_spread's check names it)
  d.stop_hi = (u64)(-args.move_cost_fs) ^ kSignBit;  // score >= -g, in the keys' unsigned order
  d.inv_rpd = 1.0 / d.rpd;
  d.inv_Eloc = 1.0 / d.Eloc;
  d.inv_N = N > 0 ? 1.0 / N : 0.0;
  if ((size_t)args.max_moves > log_moves(R, E, N)) return cudaErrorInvalidValue;  // (plan_spread's check names it)
  int dev = 0;
  cudaGetDevice(&dev);
  static int optin_of[64] = {0};  // the opt-in dynamic shared memory per block, per device ordinal, queried once
  static int smem_set[64] = {0};  // the kernel's shared memory limit set so far, per device ordinal
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (optin_of[dev] == 0) cudaDeviceGetAttribute(&optin_of[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const size_t static_smem = 8 * 1024;  // the kernel's __shared__ variables, with room to spare
  const SpreadLayout f =
      spread_layout(R, E, M, N, optin_of[dev] > (int)static_smem ? optin_of[dev] - static_smem : 0);
  const bool hot = f.at[kL].in_smem, cold = f.at[kFirst].in_smem;  // (kFirst goes to shared memory last)
  auto kernel = cold ? spread_kernel<true, true> : hot ? spread_kernel<true, false> : spread_kernel<false, false>;
  if ((int)f.smem_bytes > 48 * 1024 && (int)f.smem_bytes > smem_set[dev]) {
    for (auto k : {spread_kernel<true, true>, spread_kernel<true, false>}) {
      cudaError_t err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)f.smem_bytes);
      if (err != cudaSuccess) return err;
    }
    smem_set[dev] = (int)f.smem_bytes;
  }
  kernel<<<1, kSpreadThreads, f.smem_bytes, stream>>>(omega, enable, d, f, ws, slot_expert, info);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(route, 0, sizeof(int64_t) * (size_t)R * d.P, stream);
  if (err != cudaSuccess) return err;
  const int warps = route_warps(E);
  spread_route_kernel<<<(warps + kRouteBlockWarps - 1) / kRouteBlockWarps, kRouteBlockWarps * 32, 0, stream>>>(
      omega, enable, d, ws + f.at[kLoad].off, slot_expert, route, ws + f.at[kRoute].off, warps);
  return cudaGetLastError();
}

}  // namespace topoep
