// The host interface of the GPU planner (planner_kernel.cu), the spread planner (spread.cu), the capacity step
// (capacity.cu) and the guard (guard.cu). Called by bindings.cpp only.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace topoep {

constexpr int kMaxRanksPerDomain = 1024;  // placement's shared rank order; refinement's 32 targets per lane
constexpr int kLocalSmemBytes = 160 * 1024;  // one-block plans keep omega and their state in shared memory
// The bits of plan_topoep's skip_stages. Stages the `topoep` kernel leaves out, for latency measurements only (the
// plan is then not the policy's): the refinement (the stage-1/2 plan is routed), the route phase (the
// route is not written), or everything (the launch alone). kProfile (the plan is the policy's) also counts
// the refinement's SM cycles per step (the workspace's refinement counters; the clock reads slow it down).
// kPlusGlobal (the plan is the policy's) makes topoep_plus take the path of plans too large for a copy of the
// loads per block: block 0 moves the global state (tests).
// kRouteSerial / kRouteLanes (tuning; the plan is the policy's): topoep_plus's route pass A with a thread per
// group (its sources in registers on domains of up to 8 ranks) / a lane group per group (domains of at most 32
// ranks) whatever the grid. kNoLocal (tuning): no one-block plan with its state in shared memory; the grid of
// multi-block plans instead.
constexpr int kSkipRefine = 1, kSkipRoute = 2, kSkipAll = 4, kProfile = 8, kPlusGlobal = 16, kRouteSerial = 32,
              kRouteLanes = 64, kNoLocal = 128;

// Offsets of consecutive arrays in an int64 buffer: take(n) places the next n elements and returns their offset;
// `end` is the size so far. The workspaces' layouts (workspace_layout, and those of their parts) are written with it.
struct Bump {
  size_t end = 0;
  __host__ __device__ size_t take(size_t n) {
    end += n;
    return end - n;
  }
};

// The planner's workspace (int64 elements). Its head has a fixed layout, written by block 0 for measurements: the
// `topoep` phases' %globaltimer stamps (ns; the kernel's start, then the end of phases 1-6, the route's end being
// the latest block's), the refinement's counters of domain 0 (written under kProfile: iterations, then SM cycles
// in: busiest rank, existing candidates, new-candidate rounds, the number of rounds, reduction, move, whole loop),
// topoep_plus's stamps and its number of moves. topoep_plus's stamps, in this order: after the staging of the loads
// and the guard, after the first move iteration's busiest rank, after its best move (the pair scan and the block
// reduction), after the moves, after the route's pass A (and its grid barrier), the route's end (the latest
// block's); 0 where the plan has no such phase. The `topoep` state and the topoep_plus state follow the head
// (planner_device.cuh: state_layout, plus_layout).
constexpr int kPhaseStamps = 7, kRefineCounters = 8, kPlusStamps = 6;
constexpr int kStampsAt = 0;
constexpr int kRefineCountersAt = kStampsAt + kPhaseStamps;
constexpr int kPlusStampsAt = kRefineCountersAt + kRefineCounters;
constexpr int kMovesAt = kPlusStampsAt + kPlusStamps;
constexpr int kHeadElems = kMovesAt + 1;
struct WorkspaceLayout {
  size_t state, plus;  // offsets of the `topoep` state and the topoep_plus state
  size_t elems;        // the workspace's size
};
// The workspace for (R, E, M domains, N slots): plan_topoep carves it, the workspace_layout op hands it to Python.
WorkspaceLayout workspace_layout(int R, int E, int M, int N);
// Dynamic shared memory of the planner kernel.
size_t smem_bytes(int R, int E, int M, int N);

// The `topoep_plus` policy's constants (topoep/planners/plus.py): the move loop's bound and the two-level costs
// a2 = 2 S_tok a, bb = 2 S_tok (b - a) in fs per assignment (common.two_level_costs; exact two-level only).
struct PlusArgs {
  int max_moves;
  int64_t a2, bb;
  int intra_only;  // 1: topoep_plus_local, without stage 1's inter-domain placement (every slot for the refinement)
};

// The `topoep` policy, or `topoep_plus` when plus is given. omega int64[R, E]; cost_fs int64[R, R]; outputs
// slot_expert int64[R, N] and route int64[R, E + R*N]; ws: workspace_layout().elems int64 (topoep_plus also
// leaves its number of moves at ws[kMovesAt]). All device pointers, enqueued on `stream`. num_blocks: the
// cooperative grid of a multi-block plan (at most one block per SM; more are capped), 0 for the default, half the
// SMs; the plan does not depend on it. skip_stages: kSkip* bits, 0 for the policy's plan. enable: one bool on the
// device, or null: when it holds false the kernel writes the static plan and plans nothing (the net-benefit guard's
// pre-plan bound, topoep/runtime/guard.py), so a CUDA graph replays either case.
cudaError_t plan_topoep(const int64_t* omega, const int64_t* cost_fs, int R, int E, int M, int N, int64_t W,
                        int64_t S, int64_t* slot_expert, int64_t* route, int64_t* ws, int num_blocks,
                        int skip_stages, cudaStream_t stream, const PlusArgs* plus = nullptr,
                        const bool* enable = nullptr);
// The capacity step (capacity.cu, topoep/planners/capacity.py) on a plan, in place: slot_expert int64[R, N] and
// route int64[R, E + R*N] become the fitted plan; omega int64[R, E] (for the refit from the static plan); allow_new:
// one bool on the device (false: no new replica; the runtime left the slots out); ws: fit_workspace_elems() int64;
// info int64[4 + R*N]: moves, rows beyond the capacity, 1 if the refit from the static plan was kept, replicas
// placed, then a flag per slot the step placed a replica in. One block, on `stream`.
size_t fit_workspace_elems(int R, int E, int N);
cudaError_t fit_capacity(const int64_t* omega, int R, int E, int N, int ranks_per_domain, int64_t capacity,
                         const bool* allow_new, int64_t* slot_expert, int64_t* route, int64_t* ws, int64_t* info,
                         cudaStream_t stream);
// The net-benefit guard's selection among P <= kMaxGuardPlans balanced plans of one routing (guard.cu;
// topoep/runtime/guard.py NetBenefitGuard.select with token rows per assignment). Device pointers: omega int64[R, E],
// main_rank int64[E], cost_fs int64[R, R], route[p] int64[R, E + R*N], slot[p] int64[R, N], allow one bool or null;
// outputs route_out, slot_out (the executed plan), choice int64, use, fired (= !use) and relay bool, saved and cost
// float64. Domains
// are contiguous blocks of rpd ranks. fanout 0: no relays (levels 0, chunks 1), else relay trees of that fanout over
// `levels` levels (topoep.relay.max_level, at most kMaxRelayLevels), each copy in `chunks` chunks (at most
// kMaxRelayChunks; the fetch runs levels + chunks - 1 steps, topoep.relay.relay_steps).
constexpr int kMaxGuardPlans = 6, kMaxRelayLevels = 128, kMaxRelayChunks = 64;
constexpr int kMaxTokenChunks = 64;  // guard.token_chunks (NetBenefitGuard checks the same bound)
constexpr int kMaxRelaySteps = kMaxRelayLevels + kMaxRelayChunks - 1;
struct GuardArgs {
  const int64_t* omega;
  const int64_t* main_rank;
  const int64_t* cost_fs;
  const int64_t* route[kMaxGuardPlans];
  const int64_t* slot[kMaxGuardPlans];
  int P, R, E, N, rpd;
  int64_t token_bytes, expert_bytes;
  double t_ffn, h, plan_s, latency;
  int m, n, fanout, levels, chunks;  // token transfers, exposed replica transfers, relay fanout (0: none), relay
                                     // levels, chunks per relayed copy
  int k;  // token chunks of the pipeline the prediction follows (guard.token_chunks; 0: the token_overlap formula)
  bool share;  // relay every plan whose direct fetch exceeds a tree's share (relay.direct_beyond_tree)
  bool async_fetch;  // the relayed fetch runs copy by copy (relay.async_fetch_fs; chunks 1): priced as the longer of
                     // its busiest link over all levels and its longest chain of hops
  bool fetch_overlap;  // the forward fetch runs beside the dispatch and the main GEMMs (guard.fetch_overlap): the first
                       // exposed transfer is priced at what the forward waits for it (links.overlapped_forward_s)
  const bool* allow;
  const bool* planned;  // null, or false: the planners left this call out (worth_planning), nothing is priced
  int64_t *route_out, *slot_out, *choice;
  bool *use, *fired, *relay;
  double *saved, *cost;
  // null, or (fanout >= 1) int64[P + 1][2][R * N]: [0] receives the executed plan's relay trees (source, level:
  // topoep.relay.executed_sources of the executed plan and the fetch choice), [1 + p] the trees of plan p (scratch)
  int64_t* trees;
};
size_t guard_workspace_elems(int P, int R, int levels);
cudaError_t guard_select(const GuardArgs& args, int64_t* ws, cudaStream_t stream);
// topoep.relay.executed_sources: slot int64[R, N], main_rank int64[E] (expert e's home; E experts); relay: one bool (false: the direct fetch) or
// null (the trees); outputs source and level int64[R, N].
cudaError_t relay_trees(const int64_t* slot, const int64_t* main_rank, int R, int N, int E, int rpd, int fanout,
                        const bool* relay, int64_t* source, int64_t* level, cudaStream_t stream);
// The `topoep_plus_spread` policy (spread.cu; topoep/planners/spread.py), `topoep_plus_spread_tree` with trees: the
// greedy's slot table after the rollback and the drop, and the route of its loads. omega int64[R, E] (default
// placement: E a multiple of R, domains of R / M contiguous ranks); outputs slot_expert int64[R, N], route int64[R,
// E + R*N], info int64[5]: moves kept, moves made, objective and static objective (fs), replicas dropped. enable:
// one bool on the device or null (false: the static plan). max_moves <= 4 (E + R N). The greedy stops where no move
// gains more than move_cost_fs (>= 0). The greedy in one block, then the route in a grid of warps, on `stream`.
struct SpreadArgs {
  int max_moves, trees;
  int64_t expert_bytes, token_bytes, t_fs, a, b;  // W, S_tok, t_ffn in fs, two-level costs in fs per byte
  int64_t move_cost_fs;                           // the least gain of a move (spread.py move_cost_fs)
};
size_t spread_workspace_elems(int R, int E, int M, int N);
cudaError_t plan_spread(const int64_t* omega, int R, int E, int M, int N, const SpreadArgs& args, const bool* enable,
                        int64_t* slot_expert, int64_t* route, int64_t* info, int64_t* ws, cudaStream_t stream);
// The peers' placements (peers.cu; topoep/planners/baselines.py): policy kPeerDeepseek (solve_deepseek) or
// kPeerFlexmoe (solve_flexmoe, R <= 256), each with the even split over all instances (common.even_split, locality
// "none"). omega int64[R, E] (default placement); outputs slot_expert int64[R, N], route int64[R, E + R*N], info
// int64[1] (flexmoe's steps; 0 for deepseek) or null. enable: one bool on the device or null (false: the static
// plan). The placement in one block per domain (deepseek) or one block (flexmoe), then the route in a grid.
constexpr int kPeerDeepseek = 0, kPeerFlexmoe = 1;
size_t peer_workspace_elems(int R, int E, int N);
size_t peer_smem_bytes(int policy, int R, int E, int M, int N);  // the placement kernel's dynamic shared memory
cudaError_t plan_peer(int policy, const int64_t* omega, int R, int E, int M, int N, const bool* enable,
                      int64_t* slot_expert, int64_t* route, int64_t* info, int64_t* ws, cudaStream_t stream);
// The `static` policy (main instances only).
cudaError_t plan_static(const int64_t* omega, int R, int E, int N, int64_t* slot_expert, int64_t* route,
                        cudaStream_t stream);

}  // namespace topoep
