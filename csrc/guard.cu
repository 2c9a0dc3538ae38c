// The net-benefit guard's selection (topoep/runtime/guard.py, NetBenefitGuard.select with rows per assignment) and the
// relay trees of a plan (topoep/relay.py, relay_sources / executed_sources) on the GPU, bit for bit: the reference's
// module docstrings are the spec.
//
// Why a kernel: the reference is ~150 small torch ops per layer call (about 0.2 ms from a CUDA graph on an H200, 0.6
// ms with relay trees), more than the 1 % of a layer the guard may cost. Here it is two launches (launch latency is
// most of their time).
//
// Exactness: every link time is an integer sum of flows x bytes x cost_fs (femtoseconds; integer atomics give the
// same sum in any order), turned into seconds by one multiplication (guard.py SECONDS_PER_FS); the remaining float64
// operations are the reference's, in its order, with explicit round-to-nearest intrinsics (no fused multiply-add).
//
// Where the planners left the call out (`planned` false: the guard's pre-plan bound, `worth_planning`), launch (1)
// only writes the static decision (saved = cost = 0) and launch (2) the static plan.
//
// Launches: (1) a block per (plan q, source rank s), q = 0 the static plan: the rows s sends to every rank (shared
// memory), the rank loads, the token bytes x cost on every link; for the balanced plans also the slots of rank s:
// their direct fetch and their relay tree's transfer, per level, and whether the direct fetch makes a home send more
// copies of one expert than a tree's share (relay.direct_beyond_tree). The last block to finish (a counter) takes the
// maxima (a warp per maximum), predicts every plan, chooses, and zeroes the accumulators and the counter for the next
// call: the workspace is zero between calls (the caller allocates it zeroed and keeps it; calls on one stream);
// (2) the executed plan: the kept plan's route and slot table, or the static plan's.

#include <cuda_runtime.h>
#include <stdint.h>

#include "planner.h"
#include "relay_tree.cuh"

namespace topoep {

namespace {

using i64 = int64_t;
using u64 = unsigned long long;
constexpr int kGuardThreads = 256;
constexpr int kLinks = 4;  // NVLink out, NVLink in, NIC out, NIC in (topoep/links.py LinkLoads)

__device__ __forceinline__ void add(i64* at, i64 v) { atomicAdd(reinterpret_cast<u64*>(at), (u64)v); }
// a load from L2 (another block's atomics), never from this SM's L1
__device__ __forceinline__ i64 ld_l2(const i64* at) { return (i64)__ldcg(reinterpret_cast<const long long*>(at)); }

using relay::relay_node;

// Shared memory of relay_duty: duty int[R], then a bit per expert (whether some slot holds it)
__host__ __device__ inline size_t duty_smem_bytes(int R, int E) {
  return (size_t)R * sizeof(int) + (size_t)((E + 31) / 32) * sizeof(unsigned);
}

// relay.relay_duty of slot table `slot` [R * N] into duty[R] (shared memory, `duty_smem_bytes` from `duty`), by the
// whole block (every thread calls it; it synchronises the block)
__device__ void relay_duty(const i64* __restrict__ slot, const i64* __restrict__ main_rank, int R, int N, int E,
                           int* duty) {
  unsigned* held = reinterpret_cast<unsigned*>(duty + R);
  for (int r = threadIdx.x; r < R; r += blockDim.x) duty[r] = 0;
  for (int w = threadIdx.x; w < (E + 31) / 32; w += blockDim.x) held[w] = 0u;
  __syncthreads();
  for (int k = threadIdx.x; k < R * N; k += blockDim.x) {
    const i64 e = slot[k];
    if (e >= 0) atomicOr(held + e / 32, 1u << (e % 32));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if ((held[e / 32] >> (e % 32)) & 1u) atomicAdd(duty + main_rank[e], 1);
  __syncthreads();
}

struct Acc {  // the workspace's accumulators (guard_layout), then the counter of finished blocks
  i64 *load, *tok, *fetch, *relayed, *copies, *occupied, *beyond, *chain, *slotload, *done;
  size_t elems;  // the accumulators' size (the counter is the element after them)
};

__host__ __device__ inline Acc guard_layout(i64* ws, int P, int R, int L, size_t* elems) {
  Bump b;
  const int Q = P + 1;
  const size_t load = b.take((size_t)Q * R), tok = b.take((size_t)Q * kLinks * R);
  const size_t fetch = b.take((size_t)P * kLinks * R), relayed = b.take((size_t)P * L * kLinks * R);
  const size_t copies = b.take((size_t)P * L), occupied = b.take(P), beyond = b.take(P), chain = b.take(P);
  const size_t slotload = b.take((size_t)P * R);
  const size_t accumulated = b.end, done = b.take(1);
  if (elems) *elems = b.end;
  return Acc{ws + load,  ws + tok,   ws + fetch,    ws + relayed, ws + copies, ws + occupied,
             ws + beyond, ws + chain, ws + slotload, ws + done,    accumulated};
}

// one flow of `fs` femtoseconds from s to r (s != r) onto a [kLinks][R] link array
__device__ __forceinline__ void add_flow(i64* links, int R, int rpd, int s, int r, i64 fs) {
  const int kind = (s / rpd == r / rpd) ? 0 : 2;
  add(links + kind * R + s, fs);
  add(links + (kind + 1) * R + r, fs);
}

__device__ void decide(const GuardArgs& a, const Acc& acc);

__global__ void __launch_bounds__(kGuardThreads) guard_flows(GuardArgs a, i64* ws) {
  extern __shared__ i64 rows[];
  const int s = blockIdx.x, q = blockIdx.y, R = a.R, E = a.E, N = a.N, I = E + R * N;
  if (a.planned != nullptr && !*a.planned) {  // no plan was made: nothing to price, the static plan runs
    if (s == 0 && q == 0 && threadIdx.x == 0) {  // (the workspace stays zero: no block adds to it)
      *a.choice = 0, *a.use = false, *a.fired = true, *a.relay = false, *a.saved = 0.0, *a.cost = 0.0;
    }
    return;
  }
  const Acc acc = guard_layout(ws, a.P, R, a.levels, nullptr);
  for (int r = threadIdx.x; r < R; r += blockDim.x) rows[r] = 0;
  __syncthreads();
  if (q == 0) {  // the static plan: every assignment on its expert's main rank
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const i64 v = a.omega[(i64)s * E + e];
      if (v) atomicAdd(reinterpret_cast<u64*>(rows + a.main_rank[e]), (u64)v);
    }
  } else {
    const i64* route = a.route[q - 1] + (i64)s * I;
    i64* slotload = acc.slotload + (i64)(q - 1) * R;  // (fetch_overlap: each rank's rows on its slots)
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
      const i64 v = route[i];
      if (v) atomicAdd(reinterpret_cast<u64*>(rows + (i < E ? a.main_rank[i] : (i - E) / N)), (u64)v);
      if (v && i >= E && a.fetch_overlap) add(slotload + (i - E) / N, v);
    }
  }
  __syncthreads();
  i64* tok = acc.tok + (i64)q * kLinks * R;
  i64 out_nvl = 0, out_nic = 0;
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    const i64 v = rows[r];
    if (!v) continue;
    add(acc.load + (i64)q * R + r, v);
    if (r == s) continue;
    const i64 fs = v * a.token_bytes * a.cost_fs[(i64)s * R + r];
    if (s / a.rpd == r / a.rpd) {
      out_nvl += fs;
      add(tok + 1 * R + r, fs);
    } else {
      out_nic += fs;
      add(tok + 3 * R + r, fs);
    }
  }
  if (out_nvl) add(tok + 0 * R + s, out_nvl);
  if (out_nic) add(tok + 2 * R + s, out_nic);
  const int p = q - 1;
  const i64* slot = q > 0 ? a.slot[p] : nullptr;
  int* duty = reinterpret_cast<int*>(rows + R);  // (dynamic shared memory after the rows)
  if (q > 0 && a.fanout > 0) relay_duty(slot, a.main_rank, R, N, E, duty);  // (uniform in the block)
  for (int j = threadIdx.x; q > 0 && j < N; j += blockDim.x) {
    const int g = s * N + j;
    const i64 e = slot[g];
    if (e < 0) continue;
    add(acc.occupied + p, 1);
    const int home = (int)a.main_rank[e];
    if (home != s)
      add_flow(acc.fetch + (i64)p * kLinks * R, R, a.rpd, home, s, a.expert_bytes * a.cost_fs[(i64)home * R + s]);
    if (a.fanout > 0) {
      i64 src, lvl;
      bool beyond;
      relay_node(slot, a.main_rank, duty, N, a.rpd, R / a.rpd, a.fanout, g, e, &src, &lvl, &beyond);
      if (a.trees != nullptr) {  // this plan's trees, for guard_execute to copy where the guard keeps the plan
        a.trees[(i64)(2 * (1 + p)) * R * N + g] = src;
        a.trees[(i64)(2 * (1 + p) + 1) * R * N + g] = lvl;
      }
      add(acc.copies + (i64)p * a.levels + (lvl - 1), 1);
      if (beyond) add(acc.beyond + p, 1);
      if (src != s)
        add_flow(acc.relayed + ((i64)p * a.levels + (lvl - 1)) * kLinks * R, R, a.rpd, (int)src, s,
                 a.expert_bytes * a.cost_fs[src * R + s]);
      if (a.async_fetch) {  // relay.copy_arrival: the hops from the home to this copy
        const i64 t = relay::relay_arrival(slot, a.main_rank, duty, a.cost_fs, R, N, a.rpd, a.fanout, a.levels,
                                           a.expert_bytes, g, e, src);
        atomicMax(reinterpret_cast<long long*>(acc.chain + p), (long long)t);
      }
    }
  }
  // the last block to finish decides (every other block's atomics are done and visible: fence, then count)
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(reinterpret_cast<u64*>(acc.done), 1ull) == (u64)gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    decide(a, acc);
  }
}

__device__ __forceinline__ i64 warp_max(i64 v) {
  for (int o = 16; o > 0; o >>= 1) {
    const i64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// One pass of links.chunk_pipeline with k equal chunks (dispatch d, compute c, combine d each; tail after the last):
// the later of its two streams' ends, in the reference's order of operations
__device__ double pipeline_pass(double d, double c, double tail, int k) {
  double x_end[kMaxTokenChunks];
  double t = 0.0, comp = 0.0;
  for (int i = 0; i < k; ++i) {
    t = __dadd_rn(t, d);
    comp = __dadd_rn(fmax(comp, t), c);
    x_end[i] = comp;
  }
  for (int i = 0; i < k; ++i) t = __dadd_rn(fmax(t, x_end[i]), d);
  return fmax(t, __dadd_rn(comp, tail));
}

// X = x + m t - h min(x, m t), or with k token chunks links.pipelined_layer_s(x, t, k) (guard._layer), in the
// reference's order of operations
__device__ __forceinline__ double layer_time(double x, double t, int m, double h, int k) {
  if (!m) return x;
  if (k > 0) {
    const double third = __ddiv_rn(x, 3.0), d = __ddiv_rn(t, (double)k), c = __ddiv_rn(third, (double)k);
    return __dadd_rn(pipeline_pass(d, c, 0.0, k), pipeline_pass(d, c, third, k));
  }
  const double mt = __dmul_rn((double)m, t);
  return __dsub_rn(__dadd_rn(x, mt), __dmul_rn(h, fmin(x, mt)));
}

// One block (the flows kernel's last): maxima, the prediction of every plan, the choice; then the accumulators back
// to zero. Reads with ld_l2: the other blocks' atomics are in L2.
__device__ void decide(const GuardArgs& a, const Acc& acc) {
  // maxima: per plan q in 0..P: its largest rank load and busiest token link; per balanced plan: the direct fetch's
  // busiest link and each relay step's (relay.relay_steps: step s carries the levels l - 1 in [s - C + 1, s])
  __shared__ i64 maxima[2 * (kMaxGuardPlans + 1) + kMaxGuardPlans * (1 + kMaxRelaySteps) + 2 * kMaxGuardPlans];
  __shared__ i64 relay_steps_used[kMaxGuardPlans];
  const int R = a.R, P = a.P, L = a.levels, C = a.chunks, Q = P + 1;
  // relay steps per plan: levels + chunks - 1, or copy by copy one, the busiest link over all levels
  const bool async = a.fanout > 0 && a.async_fetch;
  const int S = L > 0 ? (async ? 1 : L + C - 1) : 0;
  // fetch_overlap: per plan the busiest link of its dispatch with the fetch's bytes added where the dispatch runs,
  // for the direct fetch and (with relays) the trees' (every level's copies)
  const bool overlap = a.fetch_overlap && a.n > 0;
  const int V = overlap ? (a.fanout > 0 ? 2 : 1) : 0, shared_at = 2 * Q + P * (1 + S);
  const int items = shared_at + P * V;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int it = warp; it < items; it += warps) {
    const i64* src;
    int n, window = 1;  // a relay step sums its window of levels link by link
    if (it < Q) {
      src = acc.load + (i64)it * R, n = R;
    } else if (it < 2 * Q) {
      src = acc.tok + (i64)(it - Q) * kLinks * R, n = kLinks * R;
    } else if (it < 2 * Q + P) {
      src = acc.fetch + (i64)(it - 2 * Q) * kLinks * R, n = kLinks * R;
    } else if (it < shared_at) {
      const int p = (it - 2 * Q - P) / S, s = (it - 2 * Q - P) % S;
      const int first = async ? 0 : (s - C + 1 > 0 ? s - C + 1 : 0), last = async ? L - 1 : (s < L - 1 ? s : L - 1);
      src = acc.relayed + ((i64)p * L + first) * kLinks * R, n = kLinks * R, window = last - first + 1;
    } else {  // fetch_overlap: tok + fetch on the links the dispatch uses (the direct fetch, or the trees')
      const int p = (it - shared_at) / V, relayed = (it - shared_at) % V;
      const i64* tok = acc.tok + (i64)(p + 1) * kLinks * R;
      const i64* rep = relayed ? acc.relayed + (i64)p * L * kLinks * R : acc.fetch + (i64)p * kLinks * R;
      const int levels = relayed ? L : 1;
      i64 v = 0;
      for (int k = lane; k < kLinks * R; k += 32) {
        const i64 t = ld_l2(tok + k);
        i64 x = 0;
        for (int l = 0; l < levels; ++l) x += ld_l2(rep + (i64)l * kLinks * R + k);
        x = t > 0 ? t + x : t;
        v = x > v ? x : v;
      }
      v = warp_max(v);
      if (lane == 0) maxima[it] = v;
      continue;
    }
    i64 v = 0;
    for (int k = lane; k < n; k += 32) {
      i64 x = 0;
      for (int l = 0; l < window; ++l) x += ld_l2(src + (i64)l * kLinks * R + k);
      v = x > v ? x : v;
    }
    v = warp_max(v);
    if (lane == 0) maxima[it] = v;
  }
  __shared__ i64 chain[kMaxGuardPlans];
  if (threadIdx.x < P) {  // the relay steps that carry a copy (copy by copy: the levels that do), whether the plan
    // has a replica, whether its direct fetch exceeds a tree's share; its longest chain of hops
    i64 used = 0;
    for (int s = 0; s < (async ? L : S); ++s) {
      i64 copies = 0;
      const int first = async ? s : (s - C + 1 > 0 ? s - C + 1 : 0), last = async ? s : (s < L - 1 ? s : L - 1);
      for (int l = first; l <= last; ++l) copies += ld_l2(acc.copies + (i64)threadIdx.x * L + l);
      used += copies > 0;
    }
    chain[threadIdx.x] = ld_l2(acc.chain + threadIdx.x);
    relay_steps_used[threadIdx.x] = (used * 2 + (ld_l2(acc.beyond + threadIdx.x) > 0)) * 2 +
                                    (ld_l2(acc.occupied + threadIdx.x) > 0);
  }
  __syncthreads();
  const double kSecondsPerFs = 1e-15;
  // each plan's fetch (a thread per plan): direct, or relayed where that is faster (or relay_share asks), its time,
  // and with fetch_overlap the forward's chunk time, stretch and time without the fetch
  __shared__ double fetch_s[kMaxGuardPlans], chunk_s[kMaxGuardPlans], stretch_s[kMaxGuardPlans],
      alone_s[kMaxGuardPlans], wait_s[kMaxGuardPlans];
  __shared__ bool relay_s[kMaxGuardPlans];
  const int kk = a.k > 0 ? a.k : 1;  // the forward's chunks (guard.token_chunks, or 1)
  if (threadIdx.x < P) {
    const int p = threadIdx.x;
    double t = __dadd_rn(__dmul_rn((double)maxima[2 * Q + p], kSecondsPerFs), a.latency);
    bool relay = false;
    if (a.fanout > 0) {
      i64 fs = 0;
      for (int s = 0; s < S; ++s) fs += maxima[2 * Q + P + p * S + s];
      fs /= C;  // each step moves 1/C of its copies (relay.relay_fetch_fs: the sum, floor-divided)
      if (async && chain[p] > fs) fs = chain[p];  // relay.async_fetch_fs: the longer of busiest link and chain
      const i64 steps = relay_steps_used[p] / 4;
      const bool beyond = (relay_steps_used[p] / 2) & 1;
      const double relayed = __dadd_rn(__dmul_rn((double)fs, kSecondsPerFs), __dmul_rn((double)steps, a.latency));
      relay = relayed < t || (a.share && beyond);
      if (relay) t = relayed;
    }
    fetch_s[p] = t, relay_s[p] = relay;
    if (overlap) {  // links.overlapped_forward_s's scalars, in guard._overlapped's order of operations
      const double t_dispatch = a.m ? __dmul_rn((double)maxima[Q + 1 + p], kSecondsPerFs) : 0.0;
      const double tc = __ddiv_rn(t_dispatch, (double)kk);
      const double x = __dmul_rn(a.t_ffn, (double)maxima[1 + p]);
      const double c = __ddiv_rn(__ddiv_rn(x, 3.0), (double)kk);
      alone_s[p] = pipeline_pass(tc, c, 0.0, kk);
      const i64 shared = maxima[shared_at + p * V + (relay ? 1 : 0)];
      const double delay = __dmul_rn((double)(shared - maxima[Q + 1 + p]), kSecondsPerFs);
      const double span = __dmul_rn((double)kk, tc);
      chunk_s[p] = tc;
      stretch_s[p] = span > 0 ? __dadd_rn(1.0, __ddiv_rn(fmax(delay, 0.0), span)) : 1.0;
    }
  }
  __syncthreads();
  if (overlap) {  // a warp per plan: every rank's chunks (lanes over ranks), then the forward's end and the wait
    for (int p = warp; p < P; p += warps) {
      const double tc = chunk_s[p], st = stretch_s[p], t_rep = fetch_s[p];
      double top[kMaxTokenChunks];
      for (int i = 0; i < kk; ++i) top[i] = 0.0;
      for (int r = lane; r < R; r += 32) {
        const i64 on_slots = ld_l2(acc.slotload + (i64)p * R + r);
        const double main = (double)(ld_l2(acc.load + (i64)(p + 1) * R + r) - on_slots), slot = (double)on_slots;
        const double mp = __ddiv_rn(__ddiv_rn(__dmul_rn(a.t_ffn, main), 3.0), (double)kk);
        const double sp = __ddiv_rn(__ddiv_rn(__dmul_rn(a.t_ffn, slot), 3.0), (double)kk);
        double comp = 0.0;
        for (int i = 0; i < kk; ++i) {
          comp = __dadd_rn(fmax(comp, __dmul_rn(__dmul_rn((double)(i + 1), tc), st)), mp);
          comp = __dadd_rn(fmax(comp, t_rep), sp);
          top[i] = fmax(top[i], comp);
        }
      }
      for (int i = 0; i < kk; ++i)
        for (int o = 16; o > 0; o >>= 1) top[i] = fmax(top[i], __shfl_xor_sync(0xffffffffu, top[i], o));
      if (lane == 0) {
        double t = __dmul_rn(__dmul_rn((double)kk, tc), st);
        for (int i = 0; i < kk; ++i) t = __dadd_rn(fmax(t, top[i]), tc);
        const double wait = __dsub_rn(t, alone_s[p]);
        wait_s[p] = wait > 0 ? wait : 0.0;
      }
    }
    __syncthreads();
  }
  for (size_t k = threadIdx.x; k < acc.elems; k += blockDim.x) acc.load[k] = 0;  // the workspace is zero again
  if (threadIdx.x == 0) *acc.done = 0;
  if (threadIdx.x != 0) return;
  double x_static = __dmul_rn(a.t_ffn, (double)maxima[0]);
  const double X_static = layer_time(x_static, __dmul_rn((double)maxima[Q], kSecondsPerFs), a.m, a.h, a.k);
  int best = 0;
  double best_net = 0, saved_best = 0, cost_best = 0;
  bool relay_best = false;
  for (int p = 0; p < P; ++p) {
    const double x = __dmul_rn(a.t_ffn, (double)maxima[1 + p]);
    const double t_dispatch = __dmul_rn((double)maxima[Q + 1 + p], kSecondsPerFs);
    const double saved = __dsub_rn(X_static, layer_time(x, t_dispatch, a.m, a.h, a.k));
    const double t = fetch_s[p];
    const bool relay = relay_s[p];
    const double occupied = (relay_steps_used[p] & 1) ? 1.0 : 0.0;
    const double transfer = overlap ? __dmul_rn(__dadd_rn(__dmul_rn((double)(a.n - 1), t), wait_s[p]), occupied)
                                    : __dmul_rn(__dmul_rn((double)a.n, t), occupied);
    const double cost = __dadd_rn(a.plan_s, transfer);
    const double net = __dsub_rn(saved, cost);
    if (p == 0 || net > best_net) {  // the first of equal ones (torch.argmax)
      best = p, best_net = net, saved_best = saved, cost_best = cost, relay_best = relay;
    }
  }
  const bool use = saved_best > cost_best && (a.allow == nullptr || *a.allow);
  *a.choice = best;
  *a.use = use;
  *a.fired = !use;
  *a.relay = relay_best;
  *a.saved = saved_best;
  *a.cost = cost_best;
}

// the executed plan: the kept plan's route and slot table where the guard uses it, else the static plan's; with
// a.trees also its relay trees (relay.executed_sources: the kept plan's trees from guard_flows where the fetch runs
// relayed, else every copy from its home at level 1; the static plan has no copy)
__global__ void guard_execute(GuardArgs a) {
  const int R = a.R, E = a.E, N = a.N, I = E + R * N;
  const i64 RN = (i64)R * N;
  const bool use = *a.use;
  const int c = (int)*a.choice;
  const i64 route_elems = (i64)R * I, slots_end = route_elems + RN, total = slots_end + (a.trees ? RN : 0);
  for (i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x; k < total; k += (i64)gridDim.x * blockDim.x) {
    if (k < route_elems) {
      const i64 s = k / I, i = k % I;
      a.route_out[k] = use ? a.route[c][k] : (i < E ? a.omega[s * E + i] : 0);
    } else if (k < slots_end) {
      const i64 g = k - route_elems;
      a.slot_out[g] = use ? a.slot[c][g] : -1;
    } else {
      const i64 g = k - slots_end, e = use ? a.slot[c][g] : -1;
      i64 src = -1, lvl = 0;
      if (e >= 0 && *a.relay) {
        src = a.trees[(i64)(2 * (1 + c)) * RN + g];
        lvl = a.trees[(i64)(2 * (1 + c) + 1) * RN + g];
      } else if (e >= 0) {
        src = a.main_rank[e];
        lvl = 1;
      }
      a.trees[g] = src;
      a.trees[RN + g] = lvl;
    }
  }
}

// relay.executed_sources: the relay trees of a plan, or, where *relay is false, every copy from its home at level 1.
// Every block computes the ranks' duty first (relay_duty, dynamic shared memory)
__global__ void relay_trees_kernel(const i64* __restrict__ slot, const i64* __restrict__ main_rank, int R, int N,
                                   int E, int rpd, int fanout, const bool* relay, i64* source, i64* level) {
  extern __shared__ int duty_s[];
  relay_duty(slot, main_rank, R, N, E, duty_s);
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= R * N) return;
  const i64 e = slot[g];
  if (e < 0) {
    source[g] = -1, level[g] = 0;
  } else if (relay != nullptr && !*relay) {
    source[g] = main_rank[e], level[g] = 1;
  } else {
    relay_node(slot, main_rank, duty_s, N, rpd, R / rpd, fanout, g, e, source + g, level + g);
  }
}

}  // namespace

size_t guard_workspace_elems(int P, int R, int levels) {
  size_t elems = 0;
  guard_layout(nullptr, P, R, levels, &elems);
  return elems;
}

cudaError_t guard_select(const GuardArgs& a, i64* ws, cudaStream_t stream) {
  // shared memory: the rows of one source, then (with relays) the ranks' duty
  const size_t smem = a.R * sizeof(i64) + (a.fanout > 0 ? duty_smem_bytes(a.R, a.E) : 0);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(guard_flows, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
  }
  guard_flows<<<dim3(a.R, a.P + 1), kGuardThreads, smem, stream>>>(a, ws);
  const i64 total = (i64)a.R * (a.E + (i64)a.R * a.N) + (i64)a.R * a.N * (a.trees != nullptr ? 2 : 1);
  const int blocks = (int)((total + 255) / 256 < 1024 ? (total + 255) / 256 : 1024);
  guard_execute<<<blocks > 0 ? blocks : 1, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t relay_trees(const i64* slot, const i64* main_rank, int R, int N, int E, int rpd, int fanout,
                        const bool* relay, i64* source, i64* level, cudaStream_t stream) {
  if (R * N == 0) return cudaSuccess;
  const size_t smem = duty_smem_bytes(R, E);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(relay_trees_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem);
    if (err != cudaSuccess) return err;
  }
  relay_trees_kernel<<<(R * N + 255) / 256, 256, smem, stream>>>(slot, main_rank, R, N, E, rpd, fanout, relay, source,
                                                                 level);
  return cudaGetLastError();
}

}  // namespace topoep
