// The relay trees' device rule (csrc/relay_tree.cuh) built for the host, so that the CPU tests compare what
// csrc/guard.cu computes per copy with topoep/relay.py bit for bit (tests/test_relay_host.py builds it with the
// system's C++ compiler and calls it through ctypes).
#include <vector>

#include "../../csrc/relay_tree.cuh"

// duty (relay.relay_duty) as csrc/guard.cu's blocks compute it, then every slot's (source, level, share flag) and,
// with cost_fs [R, R] (else null), its arrival copy by copy (relay.copy_arrival) over at most `levels` hops
extern "C" void relay_sources_host(const int64_t* slot, const int64_t* main_rank, int R, int N, int E, int rpd,
                                   int fanout, int64_t* source, int64_t* level, uint8_t* beyond,
                                   const int64_t* cost_fs, int64_t expert_bytes, int levels, int64_t* arrival) {
  std::vector<unsigned> held((E + 31) / 32, 0u);
  std::vector<int> duty(R, 0);
  for (int k = 0; k < R * N; ++k)
    if (slot[k] >= 0) held[slot[k] / 32] |= 1u << (slot[k] % 32);
  for (int e = 0; e < E; ++e)
    if ((held[e / 32] >> (e % 32)) & 1u) ++duty[main_rank[e]];
  for (int g = 0; g < R * N; ++g) {
    const int64_t e = slot[g];
    if (e < 0) {
      source[g] = -1, level[g] = 0, beyond[g] = 0;
      if (cost_fs) arrival[g] = 0;
      continue;
    }
    bool b = false;
    topoep::relay::relay_node(slot, main_rank, duty.data(), N, rpd, R / rpd, fanout, g, e, source + g, level + g,
                              &b);
    beyond[g] = b;
    if (cost_fs)
      arrival[g] = topoep::relay::relay_arrival(slot, main_rank, duty.data(), cost_fs, R, N, rpd, fanout, levels,
                                                expert_bytes, g, e, source[g]);
  }
}
