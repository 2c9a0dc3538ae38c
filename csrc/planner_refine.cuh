// Phase 5 of the planner kernel: stage 3, the refinement of each domain's plan by one warp (refine_warp, and
// refine_warp_fast with the state in registers), and the staging of a domain's state in shared memory (refine).
#pragma once

#include "planner_device.cuh"

namespace topoep {

// phase 5: refinement of one domain by one warp. Candidate key, compared lexicographically as in the
// reference: (-delta, L[rt], cost[rb][rt], new replica, -U[p], rt, e); a = rt's index in the domain.
// Every lane keeps its best candidate; the warp then picks the best lane field by field with 32-bit
// warp reductions (__reduce_*_sync), stopping as soon as one lane is left.
struct Key {
  i64 delta, lt, cost, u;
  int a, e, gs, gt;  // gs / gt: local index of the source instance on rb / of the target instance on a
                     // (gt = -1 - j: a new replica in a's free slot j)
};

__device__ __forceinline__ bool better(const Key& x, const Key& y) {
  if (x.delta != y.delta) return x.delta > y.delta;
  if (x.lt != y.lt) return x.lt < y.lt;
  if (x.cost != y.cost) return x.cost < y.cost;
  if ((x.gt < 0) != (y.gt < 0)) return x.gt >= 0;  // an existing instance before a new replica
  if (x.u != y.u) return x.u > y.u;
  if (x.a != y.a) return x.a < y.a;
  return x.e < y.e;
}

__device__ __forceinline__ Key no_key() {
  Key k;
  k.delta = 0; k.lt = 0; k.cost = 0; k.u = 0; k.a = INT_MAX; k.e = INT_MAX; k.gs = -1; k.gt = 0;
  return k;  // every real candidate has delta >= 1, so this loses against all of them
}

// Among the lanes in `tied`, keep those whose v is largest (v >= 0 as unsigned 64-bit); exact.
__device__ __forceinline__ unsigned keep_max(unsigned tied, unsigned long long v) {
  const int lane = threadIdx.x & 31;
  const bool in = tied >> lane & 1;
  const unsigned hi = in ? (unsigned)(v >> 32) : 0u;
  const unsigned mh = __reduce_max_sync(kFull, hi);
  const unsigned lo = (in && hi == mh) ? (unsigned)v : 0u;
  const unsigned ml = __reduce_max_sync(kFull, lo);
  return __ballot_sync(kFull, in && hi == mh && (unsigned)v == ml);
}

// shared-memory state of one domain's refinement
struct DomState {
  i64* su;          // [rpd][G] instance loads
  i64* sl;          // [rpd] rank loads
  const i64* cost;  // [rpd][rpd] cost_fs of the domain (shared memory when rpd <= 32), row stride cs
  int cs;
  int* se;          // [rpd][N] slot experts
};

__device__ __forceinline__ int expert_at(const DomState& st, int a, int g, int r0, const Dims& d) {
  return g < d.Eloc ? (r0 + a) * d.Eloc + g : st.se[a * d.N + g - d.Eloc];
}

// Slot loops run to NT, the compile-time slot count (1-4), or to d.N when NT == 0 (any count).
template <int NT>
__device__ __forceinline__ int num_slots(const Dims& d) { return NT > 0 ? NT : d.N; }

// slot of expert e on the domain's rank a, or -1
template <int NT>
__device__ __forceinline__ int slot_of(const DomState& st, int a, int e, const Dims& d) {
  const int N = num_slots<NT>(d);
  int found = -1;
#pragma unroll
  for (int j = N - 1; j >= 0; --j) if (st.se[a * N + j] == e) found = j;
  return found;
}

template <int NT>
__device__ __forceinline__ int first_free(const DomState& st, int a, const Dims& d) {
  return slot_of<NT>(st, a, -1, d);
}

// local index of expert e's instance on the domain's rank a (global rank r0 + a), or -1
template <int NT>
__device__ __forceinline__ int find_on(const DomState& st, int a, int e, int r0, const Dims& d) {
  if (main_rank_of(e, d) == r0 + a) return e - (r0 + a) * d.Eloc;
  const int j = slot_of<NT>(st, a, e, d);
  return j < 0 ? -1 : d.Eloc + j;
}

__device__ __forceinline__ void consider(Key& best, i64 u, i64 half, i64 lt, i64 cost, int a, int e, int gs,
                                         int gt) {
  Key k;
  k.delta = u < half ? u : half;
  k.lt = lt; k.cost = cost; k.u = u; k.a = a; k.e = e; k.gs = gs; k.gt = gt;
  if (better(k, best)) best = k;
}

// The refinement's SM cycles per step, counted by lane 0 of domain 0 and written to the workspace's refinement
// counters (prof = w.head + kRefineCountersAt; see planner.h), only when kProfile is set: the clock reads order
// the loop's instructions and cost time of their own. Both refinement loops (refine_warp, refine_warp_fast) use it.
struct RefineClock {
  enum Step { kBusiest, kExisting, kRounds, kReduce, kMove, kSteps };
  bool on;
  long long begin, last, cycles[kSteps] = {0, 0, 0, 0, 0}, rounds = 0, iters = 0;
  __device__ explicit RefineClock(const Dims& d) : on((d.skip & kProfile) != 0) { begin = last = on ? clock64() : 0; }
  __device__ __forceinline__ void step(Step s) {  // the time since the previous step goes to s
    if (on) { const long long t = clock64(); cycles[s] += t - last; last = t; }
  }
  __device__ void write(i64* prof, int dom) const {
    if (!on || prof == nullptr || dom != 0 || (threadIdx.x & 31) != 0) return;
    prof[0] = iters; prof[1] = cycles[kBusiest]; prof[2] = cycles[kExisting]; prof[3] = cycles[kRounds];
    prof[4] = rounds; prof[5] = cycles[kReduce]; prof[6] = cycles[kMove]; prof[7] = clock64() - begin;
  }
};

template <int NT>
__device__ void refine_warp(int dom, const DomState& st, const Dims& d, i64* prof) {
  const int lane = threadIdx.x & 31, r0 = dom * d.rpd, N = num_slots<NT>(d);
  RefineClock clk(d);
  while (true) {
    // rb = busiest rank of the domain, ties -> lowest id
    i64 bl = -1;
    int b = INT_MAX;
    if (d.rpd <= 32) {  // a lane per rank: the lowest of the lanes with the largest load
      const i64 mine = lane < d.rpd ? st.sl[lane] : -1;
      b = __ffs(keep_max(kFull, (unsigned long long)(mine + 1))) - 1;
      bl = __shfl_sync(kFull, mine, b);
    } else {
      for (int a = lane; a < d.rpd; a += 32) if (st.sl[a] > bl) { bl = st.sl[a]; b = a; }
      const unsigned tied = keep_max(kFull, (unsigned long long)(bl + 1));
      b = (int)__reduce_min_sync(kFull, (tied >> lane & 1) ? (unsigned)b : 0xffffffffu);
      bl = st.sl[b];
    }
    clk.step(RefineClock::kBusiest);
    const i64* cost_row = st.cost + (i64)b * st.cs;
    // existing-instance candidates; `need`: this lane's targets that still want a new-replica candidate
    Key best = no_key();
    unsigned need = 0;
    for (int a = lane, k = 0; a < d.rpd; a += 32, ++k) {
      const i64 lt = st.sl[a], c = cost_row[a];
      const i64 half = (bl - lt) / 2;
      if (a == b || half <= 0) continue;
      i64 ex = 0;  // best existing delta for this target
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int x = st.se[a * N + j];  // an expert in a's slots that rb also hosts
        const int g = x < 0 ? -1 : find_on<NT>(st, b, x, r0, d);
        const i64 u = g < 0 ? 0 : st.su[b * d.G + g];
        if (u > 0) { consider(best, u, half, lt, c, a, x, g, d.Eloc + j); ex = max(ex, u < half ? u : half); }
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int y = st.se[b * N + j];  // an expert in rb's slots whose main is a
        const i64 u = (y >= 0 && main_rank_of(y, d) == r0 + a) ? st.su[b * d.G + d.Eloc + j] : 0;
        if (u > 0) { consider(best, u, half, lt, c, a, y, d.Eloc + j, y - (r0 + a) * d.Eloc); ex = max(ex, u < half ? u : half); }
      }
      // a new replica can only win with a larger delta (an existing instance wins ties)
      if (ex < half && first_free<NT>(st, a, d) >= 0) need |= 1u << k;
    }
    clk.step(RefineClock::kExisting);
    // new-replica candidates: rb's instances in (load desc, expert asc) order, one warp argmax per round;
    // a target takes the first one it does not host
    i64 pu = LLONG_MAX;
    int pe = -1;
    while (__any_sync(kFull, need != 0)) {
      i64 u = -1;
      int e = INT_MAX, g = -1;
      for (int gg = lane; gg < d.G; gg += 32) {
        const i64 uu = st.su[b * d.G + gg];
        const int ee = expert_at(st, b, gg, r0, d);
        if (uu <= 0 || ee < 0 || !(uu < pu || (uu == pu && ee > pe))) continue;
        if (uu > u || (uu == u && ee < e)) { u = uu; e = ee; g = gg; }
      }
      ++clk.rounds;
      unsigned top = keep_max(kFull, (unsigned long long)(u + 1));
      const int emin = (int)__reduce_min_sync(kFull, (top >> lane & 1) ? (unsigned)e : 0xffffffffu);
      const int src = __ffs(__ballot_sync(kFull, (top >> lane & 1) && e == emin)) - 1;
      u = __shfl_sync(kFull, u, src);
      g = __shfl_sync(kFull, g, src);
      e = emin;
      if (u < 0) break;  // rb has no further instance with load
      pu = u;
      pe = e;
      for (int a = lane, k = 0; a < d.rpd; a += 32, ++k) {
        if (!(need >> k & 1)) continue;
        if (find_on<NT>(st, a, e, r0, d) >= 0) continue;
        consider(best, u, (bl - st.sl[a]) / 2, st.sl[a], cost_row[a], a, e, g, -1 - first_free<NT>(st, a, d));
        need &= ~(1u << k);
      }
    }
    clk.step(RefineClock::kRounds);
    // the best lane, field by field
    unsigned tied = __ballot_sync(kFull, best.gs >= 0);
    if (tied == 0) break;  // no move helps
    tied = keep_max(tied, (unsigned long long)best.delta);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)best.lt);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)best.cost);
    if (__popc(tied) > 1) tied = keep_max(tied, best.gt >= 0 ? 1ull : 0ull);
    if (__popc(tied) > 1) tied = keep_max(tied, (unsigned long long)best.u);
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)(unsigned)best.a);
    // a lane's candidates have distinct targets from other lanes', so one lane is left here
    const int win = __ffs(tied) - 1;
    clk.step(RefineClock::kReduce);
    if (lane == win) {
      const int a = best.a;
      int gt = best.gt;
      if (gt < 0) {  // new replica in a's free slot
        const int j = -1 - gt;
        st.se[a * N + j] = best.e;
        gt = d.Eloc + j;
      }
      st.su[b * d.G + best.gs] -= best.delta;
      st.su[a * d.G + gt] += best.delta;
      st.sl[b] -= best.delta;
      st.sl[a] += best.delta;
    }
    __syncwarp();
    ++clk.iters;
    clk.step(RefineClock::kMove);
  }
  clk.write(prof, dom);
}

// The refinement of a domain of <= 32 ranks with 1-4 slots whose loads fit in 26 bits (the domain's total
// load is below 2^26; refinement keeps it, and every instance and rank load is at most that): the same
// moves as refine_warp with its state in registers. Lane a is the domain's rank a and holds its load, its
// slot experts, their main ranks and their loads; main-instance loads stay in shared memory. Per
// iteration: the busiest rank rb (one 32-bit max and a ballot); rb's slots by shuffles; every lane's best
// existing-instance candidate without branches (at most 2N: experts in its slots that rb hosts, experts
// in rb's slots whose main it is); new-replica rounds only while some lane wants one (the first round's
// loads are issued early, beside the existing candidates); the best lane field by field.
template <int NT>
__device__ void refine_warp_fast(int dom, const DomState& st, const Dims& d, i64* prof) {
  const int lane = threadIdx.x & 31, rpd = d.rpd, r0 = dom * rpd, me = r0 + lane, G = d.G, Eloc = d.Eloc;
  const bool valid = lane < rpd;
  RefineClock clk(d);
  i64* su = st.su;  // [rpd][G]; the main instances' loads are read and written here, the slots' in registers
  const i64* cost_s = st.sl + rpd;  // refine() stages the domain's cost rows here when rpd <= 32
  int la = valid ? (int)st.sl[lane] : 0, se[NT], sm[NT], us[NT];  // sm: the main rank of se (-1: empty)
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    se[j] = valid ? st.se[lane * NT + j] : -1;
    sm[j] = se[j] >= 0 ? main_rank_of(se[j], d) : -1;
    us[j] = valid ? (int)su[lane * G + Eloc + j] : 0;
  }
  while (true) {
    // rb = busiest rank, ties -> lowest id: one max over (load + 1) << 5 | (31 - lane) (lanes past the
    // domain send 0 and never win; loads are below 2^26)
    const unsigned top = __reduce_max_sync(kFull, valid ? ((unsigned)la + 1u) << 5 | (31u - lane) : 0u);
    const int b = 31 - (int)(top & 31u);
    const int bl = (int)(top >> 5) - 1, rb = r0 + b, bmain = rb * Eloc;
    const i64* sub = su + b * G;
    int sb[NT], sbm[NT], ub[NT];  // rb's slot experts, their main ranks and loads
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      sb[j] = __shfl_sync(kFull, se[j], b);
      sbm[j] = __shfl_sync(kFull, sm[j], b);
      ub[j] = __shfl_sync(kFull, us[j], b);
    }
    const i64 cost = cost_s[b * rpd + (valid ? lane : 0)];
    // the first new-replica round's loads (rb's best main instance on this lane's share), issued early
    int cu = 0, cg = INT_MAX;
    for (int g = lane; g < Eloc; g += 32) {  // g ascending: expert ascending, so ties keep the lowest
      const int u = (int)sub[g];
      if (u > cu) { cu = u; cg = g; }
    }
    clk.step(RefineClock::kBusiest);
    // this lane's best existing-instance candidate. Within a target L, cost and rank are the same for every
    // candidate and delta = min(u, half) grows with u, so (delta desc, load desc, expert asc) is (load desc,
    // expert asc): one 64-bit key per candidate, u << 32 | (2^29 - 1 - e) << 3 | index, maxed as a tree
    // (independent candidates, a short dependency chain)
    const int half = valid ? (bl - la) >> 1 : 0;  // 0 on rb itself
    const auto pack = [](int u, int e, int i) {
      return (unsigned long long)(unsigned)u << 32 | (unsigned long long)(0x1fffffffu - (unsigned)e) << 3 | (unsigned)i;
    };
    unsigned long long key[2 * NT];
    int gsj[NT];  // rb's instance of the expert in this rank's slot j
#pragma unroll
    for (int j = 0; j < NT; ++j) {  // an expert in this rank's slots that rb also hosts: as a main or in a slot
      const int x = se[j];
      const bool on_main = sm[j] == rb;
      int u = on_main ? (int)sub[x - bmain] : 0;
      gsj[j] = x - bmain;
#pragma unroll
      for (int k = 0; k < NT; ++k) {
        const bool hit = x >= 0 && sb[k] == x;
        u = hit ? ub[k] : u;
        gsj[j] = hit ? Eloc + k : gsj[j];
      }
      key[j] = u > 0 ? pack(u, x, j) : 0ull;
    }
#pragma unroll
    for (int k = 0; k < NT; ++k)  // an expert in rb's slots whose main is this rank
      key[NT + k] = (sbm[k] == me && ub[k] > 0) ? pack(ub[k], sb[k], NT + k) : 0ull;
#pragma unroll
    for (int w = 1; w < 2 * NT; w <<= 1)
#pragma unroll
      for (int i = 0; i + w < 2 * NT; i += 2 * w) key[i] = key[i] > key[i + w] ? key[i] : key[i + w];
    const unsigned long long kb = half > 0 ? key[0] : 0ull;
    int bu = (int)(kb >> 32), bd = min(bu, half), be = (int)(0x1fffffffu - (unsigned)(kb >> 3 & 0x1fffffffu));
    int bgs = -1, bgt = 0, bm = -1;  // bgt < 0: a new replica in slot -1 - bgt
    const int bi = (int)(kb & 7);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (bi == j) { bgs = gsj[j]; bgt = Eloc + j; }
      if (bi == NT + j) { bgs = Eloc + j; bgt = sb[j] - me * Eloc; }
    }
    int free_slot = -1;
#pragma unroll
    for (int j = NT - 1; j >= 0; --j) if (se[j] < 0) free_slot = j;
    // a new replica can only win with a larger delta (an existing instance wins ties)
    bool need = free_slot >= 0 && bd < half;
    clk.step(RefineClock::kExisting);
    // new-replica candidates: rb's instances in (load desc, expert asc) order, one round each; a lane takes
    // the first one its rank does not host; rounds run while some lane still wants one (the first round's
    // loads were issued above). (pu, pe): the last round's instance
    int pu = INT_MAX, pe = -1;
    for (bool first = true;; first = false) {
      if (!__any_sync(kFull, need)) break;
      if (!first) {
        cu = 0;
        cg = INT_MAX;
        for (int g = lane; g < Eloc; g += 32) {
          const int u = (int)sub[g], e = bmain + g;
          if (u > cu && (u < pu || (u == pu && e > pe))) { cu = u; cg = g; }
        }
      }
      ++clk.rounds;
      int su_ = 0, se_ = INT_MAX, sk = -1;  // rb's best slot after (pu, pe), the same on every lane
#pragma unroll
      for (int k = 0; k < NT; ++k) {
        const int u = ub[k], e = sb[k];
        const bool after = e >= 0 && u > 0 && (u < pu || (u == pu && e > pe));
        if (after && (u > su_ || (u == su_ && e < se_))) { su_ = u; se_ = e; sk = k; }
      }
      int wu = (int)__reduce_max_sync(kFull, (unsigned)cu);
      int wg = (int)__reduce_min_sync(kFull, cu == wu ? (unsigned)cg : 0xffffffffu), we = INT_MAX, wm = rb;
      if (wu > 0) we = bmain + wg;
      else wg = -1;
      if (sk >= 0 && (su_ > wu || (su_ == wu && se_ < we))) {
        wu = su_;
        we = se_;
        wg = Eloc + sk;
#pragma unroll
        for (int k = 0; k < NT; ++k) wm = k == sk ? sbm[k] : wm;
      }
      if (wg < 0) break;  // rb has no further instance with load
      pu = wu;
      pe = we;
      bool hosted = wm == me;
#pragma unroll
      for (int j = 0; j < NT; ++j) hosted |= se[j] == we;
      if (need && !hosted) {
        const int dl = min(wu, half);
        if (dl > bd) { bd = dl; bu = wu; be = we; bgs = wg; bgt = -1 - free_slot; bm = wm; }
        need = false;
      }
    }
    clk.step(RefineClock::kRounds);
    // the best lane: (delta desc, L asc, cost asc, existing first, load desc, rank asc)
    const unsigned md = __reduce_max_sync(kFull, (unsigned)bd);
    if (md == 0) break;  // no move helps
    const auto in = [&](unsigned t) { return (t >> lane & 1) != 0; };
    unsigned tied = __ballot_sync(kFull, (unsigned)bd == md);
    if (__popc(tied) > 1) {
      const unsigned ml = __reduce_min_sync(kFull, in(tied) ? (unsigned)la : 0xffffffffu);
      tied = __ballot_sync(kFull, in(tied) && (unsigned)la == ml);
    }
    if (__popc(tied) > 1) tied = keep_max(tied, ~(unsigned long long)cost);
    if (__popc(tied) > 1) {
      const unsigned ex = __ballot_sync(kFull, in(tied) && bgt >= 0);
      if (ex != 0) tied = ex;
    }
    if (__popc(tied) > 1) {
      const unsigned mu = __reduce_max_sync(kFull, in(tied) ? (unsigned)bu : 0u);
      tied = __ballot_sync(kFull, in(tied) && (unsigned)bu == mu);
    }
    const int win = __ffs(tied) - 1;
    clk.step(RefineClock::kReduce);
    // the move, by selects on rb's lane and the winner's (a new replica's slot held no load)
    const int dl = (int)md, gs = __shfl_sync(kFull, bgs, win);
    const bool is_b = lane == b, is_w = lane == win;
    la += is_w ? dl : is_b ? -dl : 0;
    if (is_b && gs < Eloc) su[b * G + gs] -= dl;
    if (is_w && bgt >= 0 && bgt < Eloc) su[lane * G + bgt] += dl;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const bool nw = is_w && bgt == -1 - j;
      se[j] = nw ? be : se[j];
      sm[j] = nw ? bm : sm[j];
      us[j] += (is_b && gs == Eloc + j) ? -dl : (is_w && (bgt == Eloc + j || nw)) ? dl : 0;
    }
    __syncwarp();
    ++clk.iters;
    clk.step(RefineClock::kMove);
  }
  if (valid) {  // the registers back to the shared state
    st.sl[lane] = la;
#pragma unroll
    for (int j = 0; j < NT; ++j) { st.se[lane * NT + j] = se[j]; su[lane * G + Eloc + j] = us[j]; }
  }
  clk.write(prof, dom);
}

template <int NT>
__device__ void refine(int dom, const i64* cost_fs, const Dims& d, const Work& w, i64* smem) {
  const int rpd = d.rpd, G = d.G, r0 = dom * rpd;
  DomState st;
  st.su = smem;
  st.sl = st.su + (i64)rpd * G;
  i64* cost = st.sl + rpd;
  if (rpd <= 32) {
    for (int i = threadIdx.x; i < rpd * rpd; i += blockDim.x) cost[i] = cost_fs[(i64)(r0 + i / rpd) * d.R + r0 + i % rpd];
    st.cost = cost;
    st.cs = rpd;
    cost += rpd * rpd;
  } else {
    st.cost = cost_fs + (i64)r0 * d.R + r0;
    st.cs = d.R;
  }
  st.se = (int*)cost;
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    const int a = i / G, g = i % G, r = r0 + a;
    st.su[i] = g < d.Eloc ? w.U[r * d.Eloc + g] : w.U[d.E + (i64)r * d.N + (g - d.Eloc)];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) st.se[i] = (int)w.slot0[(i64)r0 * d.N + i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int a = warp; a < rpd; a += kWarps) {
    i64 acc = 0;
    for (int g = lane; g < G; g += 32) acc += st.su[a * G + g];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(kFull, acc, off);
    if (lane == 0) st.sl[a] = acc;
  }
  __syncthreads();
  if (warp == 0 && !(d.skip & kSkipRefine)) {
    i64* prof = blockIdx.x == 0 ? w.head + kRefineCountersAt : nullptr;
    // the register path when every load fits in 26 bits: the domain's total (refinement keeps it) is below 2^26
    i64 total = lane < rpd ? st.sl[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(kFull, total, off);
    bool done = false;
    if constexpr (NT > 0) {
      if (rpd <= 32 && total < (1 << 26)) { refine_warp_fast<NT>(dom, st, d, prof); done = true; }
    }
    if (!done) refine_warp<NT>(dom, st, d, prof);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rpd * G; i += blockDim.x) {
    const int a = i / G, g = i % G, r = r0 + a;
    if (g < d.Eloc) w.U[r * d.Eloc + g] = st.su[i];
    else w.U[d.E + (i64)r * d.N + (g - d.Eloc)] = st.su[i];
  }
  for (int i = threadIdx.x; i < rpd * d.N; i += blockDim.x) w.slot1[(i64)r0 * d.N + i] = st.se[i];
  for (int a = threadIdx.x; a < rpd; a += blockDim.x) w.L[r0 + a] = st.sl[a];
  __syncthreads();
}

}  // namespace topoep
