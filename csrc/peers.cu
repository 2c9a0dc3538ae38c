// The peers' placements of topoep/planners/baselines.py on the GPU, bit for bit: `deepseek` (DeepSeek EPLB's
// hierarchical policy with fixed mains) and `flexmoe` (FlexMoE's expand / migrate greedy), each followed by the even
// token split over all of an expert's instances (`common.even_split`, locality "none"). The reference's docstrings
// are the spec; every tie is broken as there. Default placement only: E a multiple of R, main(e) = e / (E / R),
// domains of R / M contiguous ranks.
//
// Three kernels on one stream, no host synchronisation:
//   deepseek_kernel  one block per domain: the block sums its experts' demand, then warp 0 hands out the domain's
//                    R_d N replica slots one at a time to the expert with the largest demand per instance (each lane
//                    keeps the best of its experts; only the lane whose expert won recomputes its own) and packs the
//                    replicas, heaviest first, onto the least-loaded rank with a free slot and no copy of the expert.
//   flexmoe_kernel   one block: all warps sum the demand, then the greedy. Where every load fits in 31 bits (the
//                    usual case) warp 0 runs it alone (flexmoe_fast): the reference's tries one after another, each
//                    reduction one redux.sync, no block barrier. Otherwise each step warp 0 finds the busiest rank and
//                    orders its experts as the reference tries them, and the eight warps price eight of those tries
//                    at once on the unchanged state (a failed try changes nothing, so the first try that helps is the
//                    reference's); the warp that priced it makes it. A lane owns the ranks lane + 32 k (k < R / 32
//                    rounded up); an expert's replicas are a bit mask over ranks, so an instance's position among its
//                    expert's instances (its share of the even split) is a popcount, and each expert's T // n and
//                    T % n are kept, so a share costs no division.
//   peer_route_kernel a grid over (source, instance): route[s, p] = omega[s, e] split over e's n instances, the
//                    remainder rotated by the source (even_split), from the counts and positions the planner wrote.

#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include "planner.h"

namespace topoep {

namespace {

using i64 = int64_t;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kPeerThreads = 256;
constexpr int kRouteThreads = 256;

struct PeerDims {
  int R, E, N, M, rpd, Eloc, P, MW;  // MW: 32-bit words of a rank mask (flexmoe)
  int max_steps;                       // flexmoe: 4 R N
};

// the share of instance `pos` of an expert with demand T split over n instances: T // n + (pos < T % n)
__device__ __forceinline__ i64 share_of(i64 q, i64 rem, int pos) { return q + (pos < rem ? 1 : 0); }

// x // y and x % y for 0 <= x, 1 <= y: 32-bit arithmetic when x fits (integer division's cost is in its width)
__device__ __forceinline__ void divmod(i64 x, int y, i64& quo, int& rem) {
  if ((x >> 32) == 0) {
    const unsigned a = (unsigned)x, b = (unsigned)y, qq = a / b;
    quo = qq, rem = (int)(a - qq * b);
  } else {
    quo = x / y, rem = (int)(x % y);
  }
}

__device__ __forceinline__ i64 quot(i64 x, int y) {
  i64 q;
  int r;
  divmod(x, y, q, r);
  return q;
}

// -- deepseek ----------------------------------------------------------------------------------------------------

// a better than b for the replica count greedy: larger T / count (cross-multiplied), then the lower index; i < 0:
// no candidate
__device__ __forceinline__ bool ds_better(i64 Ta, int ca, int ia, i64 Tb, int cb, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const i64 x = Ta * cb, y = Tb * ca;
  return x > y || (x == y && ia < ib);
}

__global__ void __launch_bounds__(kPeerThreads) deepseek_kernel(const i64* __restrict__ omega,
                                                                const bool* __restrict__ enable, PeerDims d,
                                                                i64* __restrict__ slot_expert, int* __restrict__ n_out,
                                                                int* __restrict__ pos_out) {
  extern __shared__ i64 smem[];
  const int dom = blockIdx.x, Ed = d.rpd * d.Eloc, e0 = dom * Ed, r0 = dom * d.rpd, S = d.rpd * d.N;
  i64* T = smem;                       // [Ed] demand
  i64* load = T + Ed;                  // [rpd]
  int* cnt = (int*)(load + d.rpd);     // [Ed] instances wanted (the count greedy), then placed
  int* used = cnt + Ed;                // [rpd] slots filled
  int* slots = used + d.rpd;           // [rpd * N] expert of each slot of the domain, -1 empty
  const bool on = enable == nullptr || *enable;
  for (int i = threadIdx.x; i < Ed; i += blockDim.x) {
    i64 s = 0;
    if (on)
      for (int src = 0; src < d.R; ++src) s += omega[(size_t)src * d.E + e0 + i];
    T[i] = s;
    cnt[i] = 1;
  }
  for (int q = threadIdx.x; q < S; q += blockDim.x) slots[q] = -1;
  for (int r = threadIdx.x; r < d.rpd; r += blockDim.x) used[r] = 0;
  __syncthreads();
  if (on && threadIdx.x < 32) {
    const int lane = threadIdx.x;
    // 1. replica counts: R_d N picks of the expert with the largest T / count (count < R_d, T > 0)
    auto local_best = [&](i64& bT, int& bc, int& bi) {
      bT = 0, bc = 1, bi = -1;
      for (int i = lane; i < Ed; i += 32)
        if (cnt[i] < d.rpd && T[i] > 0 && ds_better(T[i], cnt[i], i, bT, bc, bi)) bT = T[i], bc = cnt[i], bi = i;
    };
    i64 lT;
    int lc, li;
    local_best(lT, lc, li);
    for (int it = 0; it < S; ++it) {
      i64 bT = lT;
      int bc = lc, bi = li;
      for (int o = 16; o > 0; o >>= 1) {
        const i64 oT = __shfl_xor_sync(kAll, bT, o);
        const int oc = __shfl_xor_sync(kAll, bc, o), oi = __shfl_xor_sync(kAll, bi, o);
        if (ds_better(oT, oc, oi, bT, bc, bi)) bT = oT, bc = oc, bi = oi;
      }
      if (bi < 0) break;
      if ((bi & 31) == lane) {
        cnt[bi] += 1;
        local_best(lT, lc, li);
      }
      __syncwarp();
    }
    // 2. loads: each main carries T // count
    for (int r = lane; r < d.rpd; r += 32) {
      i64 s = 0;
      for (int i = r * d.Eloc; i < (r + 1) * d.Eloc; ++i) s += quot(T[i], cnt[i]);
      load[r] = s;
    }
    __syncwarp();
    // 3. the replicas, heaviest (T // count) first, then the lower expert, each to the least-loaded rank of the
    // domain with a free slot and no instance of the expert (none: dropped); cnt[i] becomes the instances placed
    for (;;) {
      i64 bw = -1;
      int bi = -1;
      for (int i = lane; i < Ed; i += 32)
        if (cnt[i] > 1) {
          const i64 w = quot(T[i], cnt[i]);
          if (w > bw) bw = w, bi = i;  // (i rises: the first of equal weights is the lowest)
        }
      for (int o = 16; o > 0; o >>= 1) {
        const i64 ow = __shfl_xor_sync(kAll, bw, o);
        const int oi = __shfl_xor_sync(kAll, bi, o);
        if (oi >= 0 && (bi < 0 || ow > bw || (ow == bw && oi < bi))) bw = ow, bi = oi;
      }
      if (bi < 0) break;
      const int copies = cnt[bi] - 1, home = bi / d.Eloc;
      int placed = 0;
      for (int c = 0; c < copies; ++c) {
        i64 bl = 0;
        int br = -1;
        for (int r = lane; r < d.rpd; r += 32) {
          bool ok = used[r] < d.N && r != home;
          for (int j = 0; ok && j < used[r]; ++j) ok = slots[r * d.N + j] != bi;
          if (ok && (br < 0 || load[r] < bl)) bl = load[r], br = r;
        }
        for (int o = 16; o > 0; o >>= 1) {
          const i64 ol = __shfl_xor_sync(kAll, bl, o);
          const int orr = __shfl_xor_sync(kAll, br, o);
          if (orr >= 0 && (br < 0 || ol < bl || (ol == bl && orr < br))) bl = ol, br = orr;
        }
        if (br < 0) break;  // no rank left for this expert: its remaining copies are dropped too
        if (lane == 0) {
          slots[br * d.N + used[br]] = bi;
          used[br] += 1;
          load[br] += bw;
        }
        ++placed;
        __syncwarp();
      }
      if (lane == 0) cnt[bi] = -(1 + placed);  // done: -(instances placed) until the end
      __syncwarp();
    }
    for (int i = lane; i < Ed; i += 32)
      if (cnt[i] < 0) cnt[i] = -cnt[i];
  }
  __syncthreads();
  // outputs: the slot table, each expert's instances, each slot's position among its expert's instances (the main is
  // 0; an expert's replicas all lie in its domain, in slot order)
  for (int i = threadIdx.x; i < Ed; i += blockDim.x) n_out[e0 + i] = on ? cnt[i] : 1;
  for (int q = threadIdx.x; q < S; q += blockDim.x) {
    const int f = slots[q];
    int pos = 1;
    for (int q2 = 0; q2 < q && f >= 0; ++q2) pos += slots[q2] == f;
    slot_expert[(size_t)r0 * d.N + q] = f < 0 ? -1 : e0 + f;
    pos_out[(size_t)r0 * d.N + q] = pos;
  }
}

// -- flexmoe -----------------------------------------------------------------------------------------------------

constexpr int kMaxWords = 8;  // R <= 256 ranks (a lane keeps a value per 32 ranks)
constexpr int kFlexWarps = kPeerThreads / 32;

struct FlexState {
  i64* T;          // [E] demand
  i64* q;          // [E] T // n
  int* rem;        // [E] T % n
  int* n;          // [E] instances per expert
  i64* L;          // [R] rank loads
  int* slot;       // [R N] expert of each slot, -1 empty
  int* filled;     // [R] slots filled (slots fill in order and never empty)
  unsigned* mask;  // [E MW] ranks holding a replica of each expert
  int* cand;       // [2 (Eloc + N)] the busiest rank's experts as found, then in the order the reference tries them
  i64* key;        // [Eloc + N] each found candidate's share on the busiest rank
};

__device__ __forceinline__ int popc_below(unsigned w, int lane) { return __popc(w & ((1u << lane) - 1u)); }

// The position of expert e's replica on rank r among its instances (the main is 0, replicas in rank order).
__device__ int replica_pos(const FlexState& s, const PeerDims& d, int e, int r) {
  const unsigned* m = s.mask + (size_t)e * d.MW;
  int pos = 1;
  for (int k = 0; k < (r >> 5); ++k) pos += __popc(m[k]);
  return pos + popc_below(m[r >> 5], r & 31);
}

// dl[k] += the change of expert e's shares on rank lane + 32 k when a replica is added on r_add and / or removed from
// r_rem (-1: none)
__device__ void share_deltas(const FlexState& s, const PeerDims& d, int e, int r_add, int r_rem, int lane, i64* dl) {
  const int na = s.n[e], nb = na + (r_add >= 0) - (r_rem >= 0), home = e / d.Eloc;
  const i64 qa = s.q[e];
  const int ra = s.rem[e];
  i64 qb;
  int rb;
  divmod(s.T[e], nb, qb, rb);
  const unsigned* m = s.mask + (size_t)e * d.MW;
  int runa = 1, runb = 1;
#pragma unroll
  for (int k = 0; k < kMaxWords; ++k) {
    if (k < d.MW) {
      const unsigned A = m[k];
      unsigned B = A;
      if (r_add >= 0 && (r_add >> 5) == k) B |= 1u << (r_add & 31);
      if (r_rem >= 0 && (r_rem >> 5) == k) B &= ~(1u << (r_rem & 31));
      const int r = 32 * k + lane;
      i64 before = 0, after = 0;
      if (r == home) {
        before = share_of(qa, ra, 0), after = share_of(qb, rb, 0);
      } else {
        if ((A >> lane) & 1u) before = share_of(qa, ra, runa + popc_below(A, lane));
        if ((B >> lane) & 1u) after = share_of(qb, rb, runb + popc_below(B, lane));
      }
      dl[k] += after - before;
      runa += __popc(A), runb += __popc(B);
    }
  }
}

// The largest of v over the warp, and the lowest index holding it (i < 0: none)
__device__ __forceinline__ void warp_argmax(i64& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const i64 ov = __shfl_xor_sync(kAll, v, o);
    const int oi = __shfl_xor_sync(kAll, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) v = ov, i = oi;
  }
}
__device__ __forceinline__ void warp_argmin(i64& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const i64 ov = __shfl_xor_sync(kAll, v, o);
    const int oi = __shfl_xor_sync(kAll, i, o);
    if (oi >= 0 && (i < 0 || ov < v || (ov == v && oi < i))) v = ov, i = oi;
  }
}

// try_change of the reference, priced without changing anything: whether the deltas dl leave no rank above the
// busiest rank's load before (Lrb) and the busiest rank rb lighter
__device__ bool improves(const FlexState& s, const PeerDims& d, int lane, int rb, i64 Lrb, const i64* dl) {
  i64 mx = LLONG_MIN, at_rb = 0;
#pragma unroll
  for (int k = 0; k < kMaxWords; ++k) {
    const int r = 32 * k + lane;
    if (k < d.MW && r < d.R) {
      const i64 v = s.L[r] + dl[k];
      mx = v > mx ? v : mx;
      if (r == rb) at_rb = v;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const i64 ov = __shfl_xor_sync(kAll, mx, o);
    mx = ov > mx ? ov : mx;
  }
  at_rb = __shfl_sync(kAll, at_rb, rb & 31);
  return mx <= Lrb && at_rb < Lrb;
}

// Makes the try that helps, every lane of the warp that priced it: the rank loads by the deltas dl, then (lane 0)
// the instance tables: kind 0 adds a replica of `hot` in rank `where`'s next slot, kind 1 gives slot `where` from
// expert f to `hot`.
__device__ __forceinline__ void commit_try(const FlexState& s, const PeerDims& d, int lane, const i64* dl, int kind,
                                           int where, int hot, int f) {
#pragma unroll
  for (int k = 0; k < kMaxWords; ++k) {
    const int r = 32 * k + lane;
    if (k < d.MW && r < d.R) s.L[r] += dl[k];
  }
  if (lane == 0) {
    const int r = kind == 0 ? where : where / d.N;
    if (kind == 0) {
      s.slot[r * d.N + s.filled[r]] = hot;
      s.filled[r] += 1;
    } else {
      s.slot[where] = hot;
      s.mask[(size_t)f * d.MW + (r >> 5)] &= ~(1u << (r & 31));
      s.n[f] -= 1;
      divmod(s.T[f], s.n[f], s.q[f], s.rem[f]);
    }
    s.mask[(size_t)hot * d.MW + (r >> 5)] |= 1u << (r & 31);
    s.n[hot] += 1;
    divmod(s.T[hot], s.n[hot], s.q[hot], s.rem[hot]);
  }
}

// The greedy in warp 0 alone where every load fits in 31 bits (the usual case): the same tries in the reference's
// order, one after another, each reduction a single redux.sync; no block barrier. Most steps keep their first try,
// so ordering the busiest rank's experts is left to one argmax per try. Returns the steps taken.
__device__ int flexmoe_fast(const FlexState& s, const PeerDims& d, int lane) {
  const int C = d.Eloc + d.N;
  int steps = 0;
  while (steps < d.max_steps) {
    ++steps;
    int lv = INT_MIN, lr = INT_MAX;  // the busiest rank, the lowest of equal loads
    for (int r = lane; r < d.R; r += 32) {
      const int v = (int)s.L[r];
      if (v > lv) lv = v, lr = r;
    }
    const int Lrb = __reduce_max_sync(kAll, lv);
    const int rb = __reduce_min_sync(kAll, lv == Lrb ? lr : INT_MAX);
    unsigned tried = 0u;  // bit j: the lane's candidate lane + 32 j was tried
    bool changed = false;
    for (;;) {
      int ls = 0, le = INT_MAX;  // the lane's best untried candidate: the largest share on rb, then the lower expert
      for (int c = lane, j = 0; c < C; c += 32, ++j) {
        if ((tried >> j) & 1u) continue;
        int e, sh;
        if (c < d.Eloc) {
          e = rb * d.Eloc + c;
          sh = (int)share_of(s.q[e], s.rem[e], 0);
        } else {
          if (c - d.Eloc >= s.filled[rb]) continue;
          e = s.slot[rb * d.N + c - d.Eloc];
          sh = (int)share_of(s.q[e], s.rem[e], replica_pos(s, d, e, rb));
        }
        if (sh > ls || (sh == ls && sh > 0 && e < le)) ls = sh, le = e;
      }
      const int bs = __reduce_max_sync(kAll, ls);
      if (bs <= 0) break;  // none left: the step changes nothing
      const int hot = __reduce_min_sync(kAll, ls == bs ? le : INT_MAX);
      for (int c = lane, j = 0; c < C; c += 32, ++j) {  // mark it tried (its lane holds it)
        const int e = c < d.Eloc ? rb * d.Eloc + c : (c - d.Eloc < s.filled[rb] ? s.slot[rb * d.N + c - d.Eloc] : -1);
        if (e == hot) tried |= 1u << j;
      }
      const int home = hot / d.Eloc;
      const unsigned* hm = s.mask + (size_t)hot * d.MW;
      int lt = INT_MAX, lrt = INT_MAX;  // expand: the least-loaded rank with a free slot and no instance of hot
      for (int r = lane; r < d.R; r += 32) {
        const bool host = r == home || ((hm[r >> 5] >> (r & 31)) & 1u);
        const int v = (int)s.L[r];
        if (!host && s.filled[r] < d.N && v < lt) lt = v, lrt = r;
      }
      const int mt = __reduce_min_sync(kAll, lt);
      const int rt = __reduce_min_sync(kAll, lt == mt ? lrt : INT_MAX);
      i64 dl[kMaxWords];
#pragma unroll
      for (int k = 0; k < kMaxWords; ++k) dl[k] = 0;
      int kind = -1, where = -1, f = -1;
      if (rt != INT_MAX) {
        share_deltas(s, d, hot, rt, -1, lane, dl);
        kind = 0, where = rt;
      } else {  // migrate: the lightest replica (share, then slot) of another expert on a rank without hot
        int ls2 = INT_MAX, lq = INT_MAX;
        for (int q = lane; q < d.R * d.N; q += 32) {
          const int r = q / d.N, g = s.slot[q];
          if (g < 0 || g == hot || r == home || ((hm[r >> 5] >> (r & 31)) & 1u)) continue;
          const int sh = (int)share_of(s.q[g], s.rem[g], replica_pos(s, d, g, r));
          if (sh < ls2) ls2 = sh, lq = q;  // (q rises: the first of equal shares is the lowest slot)
        }
        const int ms = __reduce_min_sync(kAll, ls2);
        const int q = __reduce_min_sync(kAll, ls2 == ms ? lq : INT_MAX);
        if (q == INT_MAX) continue;
        f = s.slot[q];
        share_deltas(s, d, f, -1, q / d.N, lane, dl);
        share_deltas(s, d, hot, q / d.N, -1, lane, dl);
        kind = 1, where = q;
      }
      int mx = INT_MIN, at_rb = 0;  // the loads after the change: none above Lrb, rb lighter
#pragma unroll
      for (int k = 0; k < kMaxWords; ++k) {
        const int r = 32 * k + lane;
        if (k < d.MW && r < d.R) {
          const int v = (int)(s.L[r] + dl[k]);
          mx = v > mx ? v : mx;
          if (r == rb) at_rb = v;
        }
      }
      mx = __reduce_max_sync(kAll, mx);
      at_rb = __shfl_sync(kAll, at_rb, rb & 31);
      if (!(mx <= Lrb && at_rb < Lrb)) continue;
      commit_try(s, d, lane, dl, kind, where, hot, f);
      __syncwarp();
      changed = true;
      break;
    }
    if (!changed) break;
  }
  return steps;
}

// The reference's greedy. Each step: warp 0 finds the busiest rank and orders its experts (share there, then the
// lower expert); then every warp tries one of them at once (expand, or migrate when no rank without the expert has a
// free slot) on the unchanged state, and the first in the order whose change helps is made by the warp that priced
// it: a failed try changes nothing, so this is the reference's sequence of tries. Candidates beyond the warps go in
// further rounds, until one helps (or none does: the greedy ends).
__global__ void __launch_bounds__(kPeerThreads) flexmoe_kernel(const i64* __restrict__ omega,
                                                               const bool* __restrict__ enable, PeerDims d,
                                                               i64* __restrict__ slot_expert, int* __restrict__ n_out,
                                                               int* __restrict__ pos_out, i64* __restrict__ steps_out) {
  extern __shared__ i64 smem[];
  __shared__ int step_rb, step_count, tried_ok[kFlexWarps];
  __shared__ bool fast;
  __shared__ i64 step_Lrb;
  const int C = d.Eloc + d.N;  // candidates on a rank: its mains, then its slots
  FlexState s;
  s.T = smem;
  s.q = s.T + d.E;
  s.L = s.q + d.E;
  s.key = s.L + d.R;
  s.rem = (int*)(s.key + C);
  s.n = s.rem + d.E;
  s.slot = s.n + d.E;
  s.filled = s.slot + d.R * d.N;
  s.cand = s.filled + d.R;  // [2 C]: the candidates as found, then in order
  s.mask = (unsigned*)(s.cand + 2 * C);
  int* order = s.cand + C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool on = enable == nullptr || *enable;
  for (int e = threadIdx.x; e < d.E; e += blockDim.x) {
    i64 t = 0;
    if (on)
      for (int src = 0; src < d.R; ++src) t += omega[(size_t)src * d.E + e];
    s.T[e] = t, s.q[e] = t, s.rem[e] = 0, s.n[e] = 1;
  }
  for (int q = threadIdx.x; q < d.R * d.N; q += blockDim.x) s.slot[q] = -1;
  for (int i = threadIdx.x; i < d.E * d.MW; i += blockDim.x) s.mask[i] = 0u;
  __syncthreads();
  for (int r = threadIdx.x; r < d.R; r += blockDim.x) {
    i64 l = 0;
    for (int e = r * d.Eloc; e < (r + 1) * d.Eloc; ++e) l += s.T[e];
    s.L[r] = l;
    s.filled[r] = 0;
  }
  __syncthreads();
  if (warp == 0) {  // every load fits in 31 bits: the greedy in warp 0 alone (flexmoe_fast)
    i64 total = 0;
    for (int r = lane; r < d.R; r += 32) total += s.L[r];
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kAll, total, o);
    if (lane == 0) fast = total < INT_MAX;
  }
  __syncthreads();
  int steps = 0;
  if (on && fast) {
    if (warp == 0) steps = flexmoe_fast(s, d, lane);
  }
  while (on && !fast && steps < d.max_steps) {
    ++steps;
    if (warp == 0) {  // the busiest rank (the lowest of equal loads) and its experts in order
      i64 Lrb = LLONG_MIN;
      int rb = -1;
      for (int r = lane; r < d.R; r += 32)
        if (rb < 0 || s.L[r] > Lrb) Lrb = s.L[r], rb = r;
      warp_argmax(Lrb, rb);
      for (int c = lane; c < C; c += 32) {  // each candidate's share on rb (0: not a candidate)
        int e = -1;
        i64 sh = 0;
        if (c < d.Eloc) {
          e = rb * d.Eloc + c;
          sh = share_of(s.q[e], s.rem[e], 0);
        } else if (c - d.Eloc < s.filled[rb]) {
          e = s.slot[rb * d.N + c - d.Eloc];
          sh = share_of(s.q[e], s.rem[e], replica_pos(s, d, e, rb));
        }
        s.cand[c] = e;
        s.key[c] = sh;
      }
      __syncwarp();
      int count = 0;
      for (int c = lane; c < C; c += 32) {  // its place: the candidates before it in the order
        const int e = s.cand[c];
        const i64 sh = s.key[c];
        if (sh <= 0) continue;
        int before = 0;
        for (int c2 = 0; c2 < C; ++c2) {
          const i64 sh2 = s.key[c2];
          before += sh2 > 0 && (sh2 > sh || (sh2 == sh && s.cand[c2] < e));
        }
        order[before] = e;
        ++count;
      }
      for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(kAll, count, o);
      if (lane == 0) step_rb = rb, step_Lrb = Lrb, step_count = count;
    }
    __syncthreads();
    const int rb = step_rb, count = step_count;
    const i64 Lrb = step_Lrb;
    bool changed = false;
    for (int base = 0; base < count && !changed; base += kFlexWarps) {
      const int at = base + warp;
      i64 dl[kMaxWords];
#pragma unroll
      for (int k = 0; k < kMaxWords; ++k) dl[k] = 0;
      int kind = -1, where = -1, f = -1;  // 0: expand onto rank `where`, 1: migrate slot `where` (of expert f)
      const int hot = at < count ? order[at] : -1;
      if (hot >= 0) {
        const int home = hot / d.Eloc;
        const unsigned* hm = s.mask + (size_t)hot * d.MW;
        i64 lt = 0;
        int rt = -1;  // expand: the least-loaded rank with a free slot and no instance of hot
        for (int r = lane; r < d.R; r += 32) {
          const bool host = r == home || ((hm[r >> 5] >> (r & 31)) & 1u);
          if (!host && s.filled[r] < d.N && (rt < 0 || s.L[r] < lt)) lt = s.L[r], rt = r;
        }
        warp_argmin(lt, rt);
        if (rt >= 0) {
          share_deltas(s, d, hot, rt, -1, lane, dl);
          if (improves(s, d, lane, rb, Lrb, dl)) kind = 0, where = rt;
        } else {  // migrate: the lightest replica (share, then rank, then slot) of another expert on a rank without hot
          i64 ls = 0;
          int lq = -1;
          for (int q = lane; q < d.R * d.N; q += 32) {
            const int r = q / d.N, g = s.slot[q];
            if (g < 0 || g == hot || r == home || ((hm[r >> 5] >> (r & 31)) & 1u)) continue;
            const i64 sh = share_of(s.q[g], s.rem[g], replica_pos(s, d, g, r));
            if (lq < 0 || sh < ls) ls = sh, lq = q;  // (q rises: the first of equal shares is the lowest slot)
          }
          warp_argmin(ls, lq);
          if (lq >= 0) {
            f = s.slot[lq];
            share_deltas(s, d, f, -1, lq / d.N, lane, dl);
            share_deltas(s, d, hot, lq / d.N, -1, lane, dl);
            if (improves(s, d, lane, rb, Lrb, dl)) kind = 1, where = lq;
          }
        }
      }
      if (lane == 0) tried_ok[warp] = kind >= 0;
      __syncthreads();
      int first = -1;  // the first try in the order that helps
      for (int w = 0; w < kFlexWarps && first < 0; ++w)
        if (tried_ok[w]) first = w;
      if (first >= 0) {
        changed = true;
        if (warp == first) commit_try(s, d, lane, dl, kind, where, hot, f);
      }
      __syncthreads();
    }
    if (!changed) break;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < d.E; e += blockDim.x) n_out[e] = s.n[e];
  for (int q = threadIdx.x; q < d.R * d.N; q += blockDim.x) {
    const int f = s.slot[q];
    slot_expert[q] = f;
    pos_out[q] = f < 0 ? 0 : replica_pos(s, d, f, q / d.N);
  }
  if (threadIdx.x == 0 && steps_out != nullptr) *steps_out = steps;
}

// -- the route ---------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRouteThreads) peer_route_kernel(const i64* __restrict__ omega, PeerDims d,
                                                                   const i64* __restrict__ slot_expert,
                                                                   const int* __restrict__ n, const int* __restrict__ pos,
                                                                   i64* __restrict__ route) {
  const size_t total = (size_t)d.R * d.P;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    const int src = (int)(idx / d.P), p = (int)(idx % d.P);
    int e = p, ps = 0;
    if (p >= d.E) {
      e = (int)slot_expert[p - d.E];
      ps = pos[p - d.E];
    }
    if (e < 0) {
      route[idx] = 0;
      continue;
    }
    const i64 w = omega[(size_t)src * d.E + e], nn = n[e];
    i64 m = (ps - src) % nn;
    if (m < 0) m += nn;
    route[idx] = w / nn + (m < w % nn ? 1 : 0);
  }
}

size_t deepseek_smem(int rpd, int Eloc, int N) {
  const size_t Ed = (size_t)rpd * Eloc;
  return 8 * (Ed + rpd) + 4 * (Ed + rpd + (size_t)rpd * N);
}

size_t flexmoe_smem(int R, int E, int N) {  // flexmoe_kernel's FlexState
  const size_t MW = ((size_t)R + 31) / 32, C = (size_t)E / R + N;
  return 8 * (2 * (size_t)E + R + C) + 4 * (2 * (size_t)E + (size_t)R * N + R + 2 * C + (size_t)E * MW);
}

}  // namespace

size_t peer_workspace_elems(int R, int E, int N) { return ((size_t)E + (size_t)R * N + 1) / 2 + 1; }

size_t peer_smem_bytes(int policy, int R, int E, int M, int N) {
  return policy == kPeerDeepseek ? deepseek_smem(R / M, E / R, N) : flexmoe_smem(R, E, N);
}

cudaError_t plan_peer(int policy, const int64_t* omega, int R, int E, int M, int N, const bool* enable,
                      int64_t* slot_expert, int64_t* route, int64_t* info, int64_t* ws, cudaStream_t stream) {
  if (R < 1 || E % R != 0 || M < 1 || R % M != 0 || N < 0) return cudaErrorInvalidValue;
  if (policy == kPeerFlexmoe && R > 32 * kMaxWords) return cudaErrorInvalidValue;
  PeerDims d;
  d.R = R, d.E = E, d.N = N, d.M = M, d.rpd = R / M, d.Eloc = E / R, d.P = E + R * N, d.MW = (R + 31) / 32;
  d.max_steps = 4 * R * N;
  int* n = (int*)ws;
  int* pos = n + E;
  const size_t smem = peer_smem_bytes(policy, R, E, M, N);
  int dev = 0;
  cudaGetDevice(&dev);
  static size_t smem_set[2][64] = {{0}};  // the kernels' shared memory limits set so far, per device ordinal
  if (dev >= 64) return cudaErrorInvalidDevice;
  const void* fn = policy == kPeerDeepseek ? (const void*)deepseek_kernel : (const void*)flexmoe_kernel;
  if (smem > 48 * 1024 && smem > smem_set[policy][dev]) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
    smem_set[policy][dev] = smem;
  }
  if (policy == kPeerDeepseek) {
    deepseek_kernel<<<M, kPeerThreads, smem, stream>>>(omega, enable, d, slot_expert, n, pos);
    if (info != nullptr) cudaMemsetAsync(info, 0, sizeof(int64_t), stream);
  } else {
    flexmoe_kernel<<<1, kPeerThreads, smem, stream>>>(omega, enable, d, slot_expert, n, pos, info);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t total = (size_t)R * d.P;
  const int blocks = (int)((total + kRouteThreads - 1) / kRouteThreads < 1024 ? (total + kRouteThreads - 1) / kRouteThreads
                                                                               : 1024);
  peer_route_kernel<<<blocks, kRouteThreads, 0, stream>>>(omega, d, slot_expert, n, pos, route);
  return cudaGetLastError();
}

}  // namespace topoep
