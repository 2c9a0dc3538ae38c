// The relay trees' rule for one copy (topoep/relay.py, relay_sources; its module docstring is the spec), shared by
// csrc/guard.cu (the guard's pricing and the runtime's trees) and a host build that the CPU tests compare with the
// reference bit for bit (csrc/relay_host.cpp, tests/test_relay_host.py). Plain integer code: the same on both sides.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define TOPOEP_HD __host__ __device__ __forceinline__
#else
#define TOPOEP_HD inline
#endif

namespace topoep {
namespace relay {

using i64 = int64_t;

// depth of heap node `index` with `fanout` children per node (relay._heap_depth): the depths k >= 1 whose first
// index (f^k - 1) / (f - 1) (k for f = 1) it reaches
TOPOEP_HD i64 heap_depth(i64 index, int fanout) {
  if (fanout == 1) return index;
  i64 depth = 0;
  for (i64 first = 1; index >= first; first = first * fanout + 1) ++depth;
  return depth;
}

// The root of the j-th (1-based) remote domain holding expert e, in the domains' cyclic order from the home's
// (relay.relay_sources' NIC tree): the rank of that domain's first copy of e in list order (least duty, then slot index); -1 if
// fewer domains hold one
TOPOEP_HD i64 nic_root(const i64* __restrict__ slot, const int* __restrict__ duty, int N, int rpd, int M, int home_dom,
                       i64 e, i64 j) {
  i64 seen = 0;
  for (int q = 1; q < M; ++q) {
    const int base = ((home_dom + q) % M) * rpd * N, end = base + rpd * N;
    int root = -1;
    for (int k = base; k < end; ++k)
      if (slot[k] == e && (root < 0 || duty[k / N] < duty[root / N])) root = k;
    if (root >= 0 && ++seen == j) return root / N;
  }
  return -1;
}

// relay.relay_sources for the occupied slot g = rank * N + j holding expert e: (source rank, level); with `beyond`,
// also whether the direct fetch of this copy exceeds a tree's share (relay.direct_beyond_tree): it is the home's
// (fanout + 1)-th copy of e into its own domain or over its NIC. duty[r] (relay.relay_duty): how many of rank r's
// experts have a copy; a domain's copies are listed by (duty of their rank, slot index); the remote domains' roots
// hang below the home as a heap of `fanout` children (the NIC tree), the domains in cyclic order from the home's. M:
// the number of domains. A copy on e's home rank is copied within that rank (level 1) and is no node of a tree: it
// is not listed
TOPOEP_HD void relay_node(const i64* __restrict__ slot, const i64* __restrict__ main_rank, const int* __restrict__ duty,
                          int N, int rpd, int M, int fanout, int g, i64 e, i64* source, i64* level,
                          bool* beyond = nullptr) {
  const int rank = g / N, dom = rank / rpd;
  const i64 home = main_rank[e];
  const int home_dom = (int)(home / rpd);
  const bool local = home_dom == dom;
  if (rank == home) {
    *source = home;
    *level = 1;
    if (beyond) *beyond = false;
    return;
  }
  const int base = dom * rpd * N, end = base + rpd * N, dg = duty[rank];
  i64 p = 0;  // copies of e listed before g in this domain: the list is [home, copies...] at home, [copies...] elsewhere
  for (int k = base; k < end; ++k) {
    if (slot[k] != e || k == g || k / N == home) continue;
    const int dk = duty[k / N];
    p += dk < dg || (dk == dg && k < g);
  }
  const i64 idx = local ? p + 1 : p;
  // a remote domain's index in the NIC tree (1 + the remote domains before it that hold e) and the copies of e in
  // those domains (the direct fetch sends them all over the home's NIC)
  i64 nic = 0, before = 0;
  if (!local) {
    const int rel = (dom - home_dom + M) % M;
    for (int q = 1; q < rel; ++q) {
      const int b2 = ((home_dom + q) % M) * rpd * N;
      i64 c = 0;
      for (int k = b2; k < b2 + rpd * N; ++k) c += slot[k] == e;
      nic += c > 0;
      before += c;
    }
    ++nic;
  }
  *level = heap_depth(idx, fanout) + (local ? 0 : heap_depth(nic, fanout));
  if (beyond) *beyond = local ? idx > fanout : before + idx >= fanout;
  if (!local && idx == 0) {  // a remote domain's root: from its parent in the NIC tree
    const i64 j = (nic - 1) / fanout;
    *source = j == 0 ? home : nic_root(slot, duty, N, rpd, M, home_dom, e, j);
    return;
  }
  const i64 parent_idx = (idx - 1) / fanout;
  if (local && parent_idx == 0) {
    *source = home;
    return;
  }
  const i64 parent_pos = local ? parent_idx - 1 : parent_idx;  // the parent's position among the domain's copies
  i64 seen = 0;  // the copies in list order: duty 0 first (the parent is listed before g: its duty is at most g's)
  for (int dv = 0; dv <= dg; ++dv) {
    for (int k = base; k < end; ++k) {
      if (slot[k] != e || duty[k / N] != dv || k / N == home) continue;
      if (seen == parent_pos) {
        *source = k / N;
        return;
      }
      ++seen;
    }
  }
  *source = -1;  // unreachable: the parent precedes the node
}

// relay.copy_arrival for the occupied slot g holding expert e, fetched from rank `source` (relay_node): the sum of
// the hops on its path from the home, each expert_bytes x cost_fs[from * R + to] (0 for a copy within one rank);
// at most `levels` hops
TOPOEP_HD i64 relay_arrival(const i64* __restrict__ slot, const i64* __restrict__ main_rank,
                            const int* __restrict__ duty, const i64* __restrict__ cost_fs, int R, int N, int rpd,
                            int fanout, int levels, i64 expert_bytes, int g, i64 e, i64 source) {
  const int s = g / N;
  const i64 home = main_rank[e];
  i64 t = source != s ? expert_bytes * cost_fs[source * R + s] : 0;
  for (int rank = (int)source, hops = 0; rank != home && hops < levels; ++hops) {
    int gp = -1;  // the parent's slot: its rank holds e once
    for (int j = 0; j < N && gp < 0; ++j)
      if (slot[rank * N + j] == e) gp = rank * N + j;
    if (gp < 0) break;  // unreachable: a relay holds the expert it sends
    i64 psrc, plvl;
    relay_node(slot, main_rank, duty, N, rpd, R / rpd, fanout, gp, e, &psrc, &plvl);
    if (psrc != rank) t += expert_bytes * cost_fs[psrc * R + rank];
    rank = (int)psrc;
  }
  return t;
}

}  // namespace relay
}  // namespace topoep
