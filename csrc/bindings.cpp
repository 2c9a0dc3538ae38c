// The one binding file of csrc/: validates inputs (TORCH_CHECK) and registers the planner as torch.library
// ops (fake implementations are in topoep/planners/cuda.py), so torch.compile and CUDA graphs see them.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdio>
#include <vector>

#include "planner.h"

// A check whose message has values: formatted here, printf-style, into one C string, which TORCH_CHECK passes to
// torch as it is. TORCH_CHECK with several message arguments formats them through a std::ostringstream instantiated
// in this library and hands torch a std::string; a check failing that way ended the process with a segmentation
// fault on the GPU machine (this library built on another machine) where a check with one C string raised its
// RuntimeError (results/gpu/product_shape/README.md). Every check here has one C string message or this macro.
#define TOPOEP_CHECK(cond, ...)                                       \
  do {                                                                \
    if (!(cond)) {                                                    \
      char topoep_msg_[768];                                          \
      std::snprintf(topoep_msg_, sizeof(topoep_msg_), __VA_ARGS__);   \
      TORCH_CHECK(false, static_cast<const char*>(topoep_msg_));     \
    }                                                                 \
  } while (0)

namespace {

void check_i64_cuda(const at::Tensor& t, const char* name) {
  TOPOEP_CHECK(t.is_cuda(), "%s must be a CUDA tensor", name);
  TOPOEP_CHECK(t.scalar_type() == at::kLong, "%s must be int64", name);
  TOPOEP_CHECK(t.is_contiguous(), "%s must be contiguous", name);
}

void check_outputs(const at::Tensor& omega, int64_t N, const at::Tensor& slot_expert, const at::Tensor& route) {
  const int64_t R = omega.size(0), E = omega.size(1);
  check_i64_cuda(slot_expert, "slot_expert");
  check_i64_cuda(route, "route");
  TORCH_CHECK(slot_expert.dim() == 2 && slot_expert.size(0) == R && slot_expert.size(1) == N,
              "slot_expert must be int64[R, num_slots]");
  TORCH_CHECK(route.dim() == 2 && route.size(0) == R && route.size(1) == E + R * N, "route must be int64[R, E + R*N]");
}

// num_blocks: the grid of multi-block plans, 0 the default (bench/planner_latency.py sweeps it; a user may cap it);
// skip_stages: stages the planner leaves out, and tuning bits (planner.h kSkip*; latency measurements and tests)
void plan(const at::Tensor& omega, const at::Tensor& cost_fs, int64_t num_domains, int64_t num_slots,
          int64_t expert_bytes, int64_t token_bytes, at::Tensor slot_expert, at::Tensor route, at::Tensor workspace,
          int64_t num_blocks, int64_t skip_stages, const topoep::PlusArgs* plus,
          const c10::optional<at::Tensor>& enable) {
  check_i64_cuda(omega, "omega");
  if (enable.has_value())
    TORCH_CHECK(enable->is_cuda() && enable->scalar_type() == at::kBool && enable->numel() == 1 &&
                    enable->device() == omega.device(),
                "enable must be one bool on omega's device (topoep.solve's enable), or None");
  check_i64_cuda(cost_fs, "cost_fs");
  check_i64_cuda(workspace, "workspace");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  const int64_t R = omega.size(0), E = omega.size(1);
  TORCH_CHECK(R >= 1 && E % R == 0, "E must be a multiple of R");
  TORCH_CHECK(num_domains >= 1 && R % num_domains == 0, "num_domains must divide R");
  TOPOEP_CHECK(R / num_domains <= topoep::kMaxRanksPerDomain, "at most %d ranks per domain",
               topoep::kMaxRanksPerDomain);
  TORCH_CHECK(num_slots >= 0, "num_slots must be >= 0");
  TOPOEP_CHECK(num_blocks >= 0 && num_blocks <= 4096, "num_blocks must be in [0, 4096] (0: the default), got %lld",
               (long long)num_blocks);
  TOPOEP_CHECK(skip_stages >= 0 && skip_stages < 256, "skip_stages must be a combination of 1 (refine), 2 (route), "
               "4 (all), 8 (profile the refinement), 16 (topoep_plus's moves on the global loads), 32 / 64 (its "
               "route's pass A a thread / a lane group per group), 128 (no one-block plan), got %lld",
               (long long)skip_stages);
  TOPOEP_CHECK(E < (1 << 20) && E / R < 4096, "the CUDA planner supports fewer than 2^20 experts and 4096 experts per "
               "rank (E=%lld, R=%lld); use backend='reference'", (long long)E, (long long)R);
  TORCH_CHECK(cost_fs.dim() == 2 && cost_fs.size(0) == R && cost_fs.size(1) == R, "cost_fs must be int64[R, R]");
  TORCH_CHECK(workspace.numel() >= (int64_t)topoep::workspace_layout(R, E, num_domains, num_slots).elems,
              "workspace too small");
  TOPOEP_CHECK(topoep::smem_bytes(R, E, num_domains, num_slots) <= 200 * 1024,
               "the planner's per-block state does not fit in shared memory (ranks_per_domain x (E/R + slots), "
               "or E, or R x slots too large): use fewer experts per rank or slots");
  check_outputs(omega, num_slots, slot_expert, route);
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::plan_topoep(omega.data_ptr<int64_t>(), cost_fs.data_ptr<int64_t>(), (int)R, (int)E,
                                     (int)num_domains, (int)num_slots, expert_bytes, token_bytes,
                                     slot_expert.data_ptr<int64_t>(), route.data_ptr<int64_t>(),
                                     workspace.data_ptr<int64_t>(), (int)num_blocks, (int)skip_stages,
                                     c10::cuda::getCurrentCUDAStream().stream(), plus,
                                     enable.has_value() ? enable->data_ptr<bool>() : nullptr));
}

void plan_topoep(const at::Tensor& omega, const at::Tensor& cost_fs, int64_t num_domains, int64_t num_slots,
                 int64_t expert_bytes, int64_t token_bytes, at::Tensor slot_expert, at::Tensor route,
                 at::Tensor workspace, int64_t num_blocks, int64_t skip_stages,
                 const c10::optional<at::Tensor>& enable) {
  plan(omega, cost_fs, num_domains, num_slots, expert_bytes, token_bytes, slot_expert, route, workspace, num_blocks,
       skip_stages, nullptr, enable);
}

// topoep_plus: a2 and bb from common.two_level_costs of an exactly two-level cost matrix (checked by the caller)
void plan_topoep_plus(const at::Tensor& omega, const at::Tensor& cost_fs, int64_t num_domains, int64_t num_slots,
                      int64_t expert_bytes, int64_t token_bytes, int64_t a2, int64_t bb, int64_t max_moves,
                      at::Tensor slot_expert, at::Tensor route, at::Tensor workspace, int64_t num_blocks,
                      int64_t skip_stages, const c10::optional<at::Tensor>& enable, bool inter_domain) {
  TORCH_CHECK(a2 >= 0 && bb >= 0, "a2 and bb must be >= 0");
  TORCH_CHECK(max_moves >= 0 && max_moves < (1ll << 31), "max_moves must be in [0, 2^31)");
  const topoep::PlusArgs plus{(int)max_moves, a2, bb, inter_domain ? 0 : 1};
  plan(omega, cost_fs, num_domains, num_slots, expert_bytes, token_bytes, slot_expert, route, workspace, num_blocks,
       skip_stages, &plus, enable);
}

void plan_static(const at::Tensor& omega, int64_t num_slots, at::Tensor slot_expert, at::Tensor route) {
  check_i64_cuda(omega, "omega");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  check_outputs(omega, num_slots, slot_expert, route);
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::plan_static(omega.data_ptr<int64_t>(), (int)omega.size(0), (int)omega.size(1),
                                     (int)num_slots, slot_expert.data_ptr<int64_t>(), route.data_ptr<int64_t>(),
                                     c10::cuda::getCurrentCUDAStream().stream()));
}

// the capacity step on a plan, in place (csrc/capacity.cu): slot_expert and route in and out, info out
void fit_capacity(const at::Tensor& omega, int64_t ranks_per_domain, int64_t capacity, const at::Tensor& allow_new,
                  at::Tensor slot_expert, at::Tensor route, at::Tensor workspace, at::Tensor info) {
  check_i64_cuda(omega, "omega");
  TORCH_CHECK(allow_new.is_cuda() && allow_new.scalar_type() == at::kBool && allow_new.numel() == 1,
              "allow_new must be one bool on the GPU");
  check_i64_cuda(workspace, "workspace");
  check_i64_cuda(info, "info");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  const int64_t R = omega.size(0), E = omega.size(1), N = slot_expert.dim() == 2 ? slot_expert.size(1) : -1;
  TORCH_CHECK(R >= 1 && R <= 2048 && E % R == 0, "the capacity step needs 1 <= R <= 2048 ranks and E a multiple of R");
  TORCH_CHECK(ranks_per_domain >= 1 && R % ranks_per_domain == 0, "ranks_per_domain must divide R");
  TORCH_CHECK(capacity >= 1, "capacity must be >= 1");
  check_outputs(omega, N, slot_expert, route);
  TORCH_CHECK(workspace.numel() >= (int64_t)topoep::fit_workspace_elems((int)R, (int)E, (int)N), "workspace too small");
  TORCH_CHECK(info.numel() >= 4 + R * N, "info must hold 4 + R * num_slots elements");
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::fit_capacity(omega.data_ptr<int64_t>(), (int)R, (int)E, (int)N, (int)ranks_per_domain,
                                      capacity, allow_new.data_ptr<bool>(), slot_expert.data_ptr<int64_t>(),
                                      route.data_ptr<int64_t>(), workspace.data_ptr<int64_t>(),
                                      info.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream()));
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TOPOEP_CHECK(t.device() == ref.device(), "%s must be on omega's device", name);
}

void check_bool_scalar(const c10::optional<at::Tensor>& t, const at::Tensor& omega, const char* name) {
  if (t.has_value())
    TOPOEP_CHECK(t->is_cuda() && t->scalar_type() == at::kBool && t->numel() == 1 && t->device() == omega.device(),
                 "%s must be one bool on omega's device, or None", name);
}

// the net-benefit guard's selection (csrc/guard.cu; topoep/runtime/guard_cuda.py calls it)
void guard_select(const at::Tensor& omega, const at::Tensor& main_rank, const at::Tensor& cost_fs,
                  const std::vector<at::Tensor>& routes, const std::vector<at::Tensor>& slots,
                  int64_t ranks_per_domain, int64_t token_bytes, int64_t expert_bytes, double t_ffn,
                  int64_t token_transfers, double token_overlap, int64_t token_chunks, double plan_s, double latency,
                  int64_t exposed,
                  int64_t fanout, int64_t levels, int64_t chunks, bool share, bool async_fetch,
                  bool fetch_overlap,
                  const c10::optional<at::Tensor>& allow,
                  const c10::optional<at::Tensor>& planned, at::Tensor route_out,
                  at::Tensor slot_out, at::Tensor choice, at::Tensor use, at::Tensor fired, at::Tensor relay,
                  at::Tensor saved, at::Tensor cost, at::Tensor workspace,
                  const c10::optional<at::Tensor>& trees) {
  check_i64_cuda(omega, "omega");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  const int64_t R = omega.size(0), E = omega.size(1), P = (int64_t)routes.size();
  TOPOEP_CHECK(P >= 1 && P <= topoep::kMaxGuardPlans && (int64_t)slots.size() == P, "the guard selects among 1 to "
               "%d plans, with as many slot tables as routes; got %lld routes and %lld slot tables",
               topoep::kMaxGuardPlans, (long long)P, (long long)slots.size());
  TOPOEP_CHECK(R >= 1 && R <= 6144, "the guard kernel supports 1 to 6144 ranks, got %lld", (long long)R);
  TORCH_CHECK(ranks_per_domain >= 1 && R % ranks_per_domain == 0, "ranks_per_domain must divide R");
  check_i64_cuda(main_rank, "main_rank");
  TORCH_CHECK(main_rank.numel() == E, "main_rank must be int64[E]");
  check_i64_cuda(cost_fs, "cost_fs");
  TORCH_CHECK(cost_fs.dim() == 2 && cost_fs.size(0) == R && cost_fs.size(1) == R, "cost_fs must be int64[R, R]");
  const int64_t N = slots[0].dim() == 2 ? slots[0].size(1) : -1;
  for (int64_t p = 0; p < P; ++p) {
    check_outputs(omega, N, slots[p], routes[p]);
    check_same_device(routes[p], omega, "every route");
    check_same_device(slots[p], omega, "every slot table");
  }
  check_outputs(omega, N, slot_out, route_out);
  check_bool_scalar(allow, omega, "allow");
  check_bool_scalar(planned, omega, "planned");
  TOPOEP_CHECK(fanout >= 0 && levels >= 0 && levels <= topoep::kMaxRelayLevels && (fanout == 0) == (levels == 0),
               "fanout 0 needs levels 0, a fanout >= 1 between 1 and %d levels; got fanout %lld, levels %lld",
               topoep::kMaxRelayLevels, (long long)fanout, (long long)levels);
  TOPOEP_CHECK(chunks >= 1 && chunks <= topoep::kMaxRelayChunks && (fanout > 0 || chunks == 1),
               "chunks must be 1 without relays, else 1 to %d; got %lld", topoep::kMaxRelayChunks, (long long)chunks);
  TOPOEP_CHECK(!async_fetch || (fanout > 0 && chunks == 1), "async_fetch (relay_schedule 'async') prices relayed "
               "copies moved whole: it needs fanout >= 1 and chunks 1, got fanout %lld, chunks %lld", (long long)fanout,
               (long long)chunks);
  TORCH_CHECK(token_transfers >= 0 && exposed >= 0, "token_transfers and exposed must be >= 0");
  TOPOEP_CHECK(token_chunks >= 0 && token_chunks <= topoep::kMaxTokenChunks, "token_chunks must be 0 (the "
               "token_overlap formula) or 1 to %d, got %lld", topoep::kMaxTokenChunks, (long long)token_chunks);
  for (const at::Tensor* t : {&choice, &use, &fired, &relay, &saved, &cost})
    TOPOEP_CHECK(t->is_cuda() && t->numel() == 1 && t->device() == omega.device(), "the guard's outputs must be "
                 "one element each on omega's device");
  TORCH_CHECK(choice.scalar_type() == at::kLong && use.scalar_type() == at::kBool &&
                  fired.scalar_type() == at::kBool && relay.scalar_type() == at::kBool &&
                  saved.scalar_type() == at::kDouble &&
                  cost.scalar_type() == at::kDouble,
              "choice int64, use, fired and relay bool, saved and cost float64");
  check_i64_cuda(workspace, "workspace");
  TORCH_CHECK(workspace.numel() >= (int64_t)topoep::guard_workspace_elems((int)P, (int)R, (int)levels),
              "workspace too small");
  topoep::GuardArgs a{};
  a.omega = omega.data_ptr<int64_t>();
  a.main_rank = main_rank.data_ptr<int64_t>();
  a.cost_fs = cost_fs.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    a.route[p] = routes[p].data_ptr<int64_t>();
    a.slot[p] = slots[p].data_ptr<int64_t>();
  }
  a.P = (int)P, a.R = (int)R, a.E = (int)E, a.N = (int)N, a.rpd = (int)ranks_per_domain;
  a.token_bytes = token_bytes, a.expert_bytes = expert_bytes;
  a.t_ffn = t_ffn, a.h = token_overlap, a.plan_s = plan_s, a.latency = latency;
  a.m = (int)token_transfers, a.n = (int)exposed, a.fanout = (int)fanout, a.levels = (int)levels;
  a.chunks = (int)chunks, a.share = share, a.async_fetch = async_fetch, a.k = (int)token_chunks;
  a.fetch_overlap = fetch_overlap;
  a.allow = allow.has_value() ? allow->data_ptr<bool>() : nullptr;
  a.planned = planned.has_value() ? planned->data_ptr<bool>() : nullptr;
  a.route_out = route_out.data_ptr<int64_t>(), a.slot_out = slot_out.data_ptr<int64_t>();
  a.choice = choice.data_ptr<int64_t>(), a.use = use.data_ptr<bool>(), a.fired = fired.data_ptr<bool>();
  a.relay = relay.data_ptr<bool>();
  a.saved = saved.data_ptr<double>(), a.cost = cost.data_ptr<double>();
  a.trees = nullptr;
  if (trees.has_value()) {
    check_i64_cuda(*trees, "trees");
    check_same_device(*trees, omega, "trees");
    TOPOEP_CHECK(fanout >= 1 && trees->numel() == (P + 1) * 2 * R * N, "trees (the executed plan's relay trees and "
                 "each plan's) needs relay trees (fanout >= 1) and int64[P + 1, 2, R, N] = %lld elements, got fanout "
                 "%lld and %lld elements", (long long)((P + 1) * 2 * R * N), (long long)fanout,
                 (long long)trees->numel());
    a.trees = trees->data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::guard_select(a, workspace.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream()));
}

int64_t guard_workspace_elems(int64_t P, int64_t R, int64_t levels) {
  return (int64_t)topoep::guard_workspace_elems((int)P, (int)R, (int)levels);
}

// topoep.relay.executed_sources on the GPU (csrc/guard.cu)
void relay_trees(const at::Tensor& slot_expert, const at::Tensor& main_rank, int64_t ranks_per_domain, int64_t fanout,
                 const c10::optional<at::Tensor>& relay, at::Tensor source, at::Tensor level) {
  check_i64_cuda(slot_expert, "slot_expert");
  check_i64_cuda(main_rank, "main_rank");
  check_i64_cuda(source, "source");
  check_i64_cuda(level, "level");
  TORCH_CHECK(slot_expert.dim() == 2, "slot_expert must be int64[R, N]");
  const int64_t R = slot_expert.size(0), N = slot_expert.size(1);
  TORCH_CHECK(source.sizes() == slot_expert.sizes() && level.sizes() == slot_expert.sizes(),
              "source and level must have slot_expert's shape");
  TORCH_CHECK(ranks_per_domain >= 1 && R % ranks_per_domain == 0, "ranks_per_domain must divide R");
  TORCH_CHECK(fanout >= 1, "fanout must be >= 1");
  check_bool_scalar(relay, slot_expert, "relay");
  const c10::cuda::CUDAGuard guard(slot_expert.device());
  C10_CUDA_CHECK(topoep::relay_trees(slot_expert.data_ptr<int64_t>(), main_rank.data_ptr<int64_t>(), (int)R, (int)N,
                                     (int)main_rank.numel(), (int)ranks_per_domain, (int)fanout,
                                     relay.has_value() ? relay->data_ptr<bool>() : nullptr, source.data_ptr<int64_t>(),
                                     level.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream()));
}

// topoep_plus_spread / _tree on the GPU (csrc/spread.cu): slot_expert, route and info out
void plan_spread(const at::Tensor& omega, int64_t num_domains, int64_t num_slots, int64_t expert_bytes,
                 int64_t token_bytes, int64_t t_fs, int64_t a, int64_t b, int64_t max_moves, int64_t move_cost_fs,
                 bool trees, const c10::optional<at::Tensor>& enable, at::Tensor slot_expert, at::Tensor route,
                 at::Tensor info, at::Tensor workspace) {
  check_i64_cuda(omega, "omega");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  const int64_t R = omega.size(0), E = omega.size(1), N = num_slots;
  TOPOEP_CHECK(R >= 1 && R <= 2048 && E % R == 0, "the spread planner needs 1 <= R <= 2048 ranks and E a multiple of "
               "R (default placement); got R=%lld, E=%lld", (long long)R, (long long)E);
  TOPOEP_CHECK(E < (1 << 24), "the spread planner supports fewer than 2^24 experts, got %lld", (long long)E);
  TORCH_CHECK(num_domains >= 1 && R % num_domains == 0, "num_domains must divide R");
  TOPOEP_CHECK(N >= 0 && N <= 64, "num_slots must be in [0, 64], got %lld", (long long)N);
  TORCH_CHECK(expert_bytes >= 1 && token_bytes >= 1 && t_fs >= 0 && a >= 0 && b >= 0,
              "expert_bytes and token_bytes must be >= 1, t_fs, a and b >= 0");
  TOPOEP_CHECK(max_moves >= 0 && max_moves <= 4 * (E + R * N),
               "max_moves must be in [0, 4 (E + R num_slots)] (the move log's length; the default, "
               "spread.default_max_moves, is the bound), got %lld", (long long)max_moves);
  TOPOEP_CHECK(move_cost_fs >= 0, "move_cost_fs must be >= 0 (the least gain of a greedy move, fs), got %lld",
               (long long)move_cost_fs);
  check_bool_scalar(enable, omega, "enable");
  check_outputs(omega, N, slot_expert, route);
  check_i64_cuda(info, "info");
  check_i64_cuda(workspace, "workspace");
  TORCH_CHECK(info.numel() >= 5, "info must hold 5 elements");
  TORCH_CHECK(workspace.numel() >= (int64_t)topoep::spread_workspace_elems((int)R, (int)E, (int)num_domains, (int)N),
              "workspace too small");
  for (const at::Tensor* t : {&slot_expert, &route, &info, &workspace}) check_same_device(*t, omega, "every output");
  const topoep::SpreadArgs args{(int)max_moves, trees ? 1 : 0, expert_bytes, token_bytes, t_fs, a, b, move_cost_fs};
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::plan_spread(omega.data_ptr<int64_t>(), (int)R, (int)E, (int)num_domains, (int)N, args,
                                     enable.has_value() ? enable->data_ptr<bool>() : nullptr,
                                     slot_expert.data_ptr<int64_t>(), route.data_ptr<int64_t>(),
                                     info.data_ptr<int64_t>(), workspace.data_ptr<int64_t>(),
                                     c10::cuda::getCurrentCUDAStream().stream()));
}

// deepseek / flexmoe on the GPU (csrc/peers.cu): slot_expert, route and info (flexmoe's steps) out
void plan_peer(const at::Tensor& omega, int64_t policy, int64_t num_domains, int64_t num_slots,
               const c10::optional<at::Tensor>& enable, at::Tensor slot_expert, at::Tensor route, at::Tensor info,
               at::Tensor workspace, int64_t smem_limit) {
  check_i64_cuda(omega, "omega");
  TORCH_CHECK(omega.dim() == 2, "omega must be int64[R, E]");
  const int64_t R = omega.size(0), E = omega.size(1), N = num_slots;
  TOPOEP_CHECK(policy == topoep::kPeerDeepseek || policy == topoep::kPeerFlexmoe,
               "policy must be 0 (deepseek) or 1 (flexmoe), got %lld", (long long)policy);
  TOPOEP_CHECK(R >= 1 && E % R == 0 && E < (1 << 24), "the peers' planners need E a multiple of R (default placement) "
               "and fewer than 2^24 experts; got R=%lld, E=%lld", (long long)R, (long long)E);
  TORCH_CHECK(num_domains >= 1 && R % num_domains == 0, "num_domains must divide R");
  TOPOEP_CHECK(N >= 0 && N <= 64, "num_slots must be in [0, 64], got %lld", (long long)N);
  TOPOEP_CHECK(policy != topoep::kPeerFlexmoe || (R <= 256 && E / R + N <= 1024),
               "the CUDA flexmoe planner takes at most 256 ranks and 1024 experts per rank plus slots; got R=%lld, "
               "E=%lld, num_slots=%lld; use backend='reference'", (long long)R, (long long)E, (long long)N);
  const int64_t smem = (int64_t)topoep::peer_smem_bytes((int)policy, (int)R, (int)E, (int)num_domains, (int)N);
  TOPOEP_CHECK(smem <= smem_limit, "the CUDA %s planner needs %lld bytes of shared memory for R=%lld, E=%lld, "
               "num_slots=%lld; the device has %lld; use backend='reference'",
               policy == topoep::kPeerDeepseek ? "deepseek" : "flexmoe", (long long)smem, (long long)R, (long long)E,
               (long long)N, (long long)smem_limit);
  check_bool_scalar(enable, omega, "enable");
  check_outputs(omega, N, slot_expert, route);
  check_i64_cuda(info, "info");
  check_i64_cuda(workspace, "workspace");
  TORCH_CHECK(info.numel() >= 1, "info must hold 1 element");
  TORCH_CHECK(workspace.numel() >= (int64_t)topoep::peer_workspace_elems((int)R, (int)E, (int)N), "workspace too small");
  for (const at::Tensor* t : {&slot_expert, &route, &info, &workspace}) check_same_device(*t, omega, "every output");
  const c10::cuda::CUDAGuard guard(omega.device());
  C10_CUDA_CHECK(topoep::plan_peer((int)policy, omega.data_ptr<int64_t>(), (int)R, (int)E, (int)num_domains, (int)N,
                                   enable.has_value() ? enable->data_ptr<bool>() : nullptr,
                                   slot_expert.data_ptr<int64_t>(), route.data_ptr<int64_t>(),
                                   info.data_ptr<int64_t>(), workspace.data_ptr<int64_t>(),
                                   c10::cuda::getCurrentCUDAStream().stream()));
}

int64_t peer_workspace_elems(int64_t R, int64_t E, int64_t N) {
  return (int64_t)topoep::peer_workspace_elems((int)R, (int)E, (int)N);
}

int64_t peer_smem_bytes(int64_t policy, int64_t R, int64_t E, int64_t M, int64_t N) {
  TORCH_CHECK(R >= 1 && M >= 1 && R % M == 0 && E % R == 0, "peer_smem_bytes: E a multiple of R, M dividing R");
  return (int64_t)topoep::peer_smem_bytes((int)policy, (int)R, (int)E, (int)M, (int)N);
}

int64_t spread_workspace_elems(int64_t R, int64_t E, int64_t M, int64_t N) {
  return (int64_t)topoep::spread_workspace_elems((int)R, (int)E, (int)M, (int)N);
}

int64_t fit_workspace_elems(int64_t R, int64_t E, int64_t N) {
  return (int64_t)topoep::fit_workspace_elems((int)R, (int)E, (int)N);
}

// The planner's workspace for (R, E, domains, slots) (planner.h), in int64 elements: [its size, then offset and
// count of: the phase stamps, the refinement counters, topoep_plus's stamps, then the offset of its number of
// moves] (topoep/planners/cuda.py WORKSPACE_FIELDS names them)
std::vector<int64_t> workspace_layout(int64_t R, int64_t E, int64_t num_domains, int64_t num_slots) {
  namespace t = topoep;
  return {(int64_t)t::workspace_layout((int)R, (int)E, (int)num_domains, (int)num_slots).elems,
          t::kStampsAt, t::kPhaseStamps, t::kRefineCountersAt, t::kRefineCounters, t::kPlusStampsAt, t::kPlusStamps,
          t::kMovesAt};
}

}  // namespace

TORCH_LIBRARY(topoep, m) {
  m.def("plan_topoep(Tensor omega, Tensor cost_fs, int num_domains, int num_slots, int expert_bytes, "
        "int token_bytes, Tensor(a!) slot_expert, Tensor(b!) route, Tensor(c!) workspace, int num_blocks=0, "
        "int skip_stages=0, Tensor? enable=None) -> ()");
  m.def("plan_topoep_plus(Tensor omega, Tensor cost_fs, int num_domains, int num_slots, int expert_bytes, "
        "int token_bytes, int a2, int bb, int max_moves, Tensor(a!) slot_expert, Tensor(b!) route, "
        "Tensor(c!) workspace, int num_blocks=0, int skip_stages=0, Tensor? enable=None, bool inter_domain=True) "
        "-> ()");
  m.def("plan_static(Tensor omega, int num_slots, Tensor(a!) slot_expert, Tensor(b!) route) -> ()");
  m.def("fit_capacity(Tensor omega, int ranks_per_domain, int capacity, Tensor allow_new, Tensor(a!) slot_expert, "
        "Tensor(b!) route, Tensor(c!) workspace, Tensor(d!) info) -> ()");
  m.def("fit_workspace_elems(int R, int E, int N) -> int", &fit_workspace_elems);
  m.def("guard_select(Tensor omega, Tensor main_rank, Tensor cost_fs, Tensor[] routes, Tensor[] slots, "
        "int ranks_per_domain, int token_bytes, int expert_bytes, float t_ffn, int token_transfers, "
        "float token_overlap, int token_chunks, float plan_s, float latency, int exposed, int fanout, int levels, "
        "int chunks, bool share, bool async_fetch, bool fetch_overlap, "
        "Tensor? allow, "
        "Tensor? planned, "
        "Tensor(a!) route_out, Tensor(b!) slot_out, Tensor(c!) choice, Tensor(d!) use, Tensor(e!) fired, "
        "Tensor(f!) relay, Tensor(g!) saved, Tensor(h!) cost, Tensor(i!) workspace, Tensor(j!)? trees=None) -> ()");
  m.def("guard_workspace_elems(int P, int R, int levels) -> int", &guard_workspace_elems);
  m.def("relay_trees(Tensor slot_expert, Tensor main_rank, int ranks_per_domain, int fanout, Tensor? relay, "
        "Tensor(a!) source, Tensor(b!) level) -> ()");
  m.def("plan_spread(Tensor omega, int num_domains, int num_slots, int expert_bytes, int token_bytes, int t_fs, "
        "int a, int b, int max_moves, int move_cost_fs, bool trees, Tensor? enable, Tensor(a!) slot_expert, "
        "Tensor(b!) route, Tensor(c!) info, Tensor(d!) workspace) -> ()");
  m.def("spread_workspace_elems(int R, int E, int M, int N) -> int", &spread_workspace_elems);
  m.def("plan_peer(Tensor omega, int policy, int num_domains, int num_slots, Tensor? enable, Tensor(a!) slot_expert, "
        "Tensor(b!) route, Tensor(c!) info, Tensor(d!) workspace, int smem_limit) -> ()");
  m.def("peer_workspace_elems(int R, int E, int N) -> int", &peer_workspace_elems);
  m.def("peer_smem_bytes(int policy, int R, int E, int M, int N) -> int", &peer_smem_bytes);
  m.def("workspace_layout(int R, int E, int num_domains, int num_slots) -> int[]", &workspace_layout);
}

TORCH_LIBRARY_IMPL(topoep, CUDA, m) {
  m.impl("plan_topoep", &plan_topoep);
  m.impl("plan_topoep_plus", &plan_topoep_plus);
  m.impl("plan_static", &plan_static);
  m.impl("fit_capacity", &fit_capacity);
  m.impl("guard_select", &guard_select);
  m.impl("relay_trees", &relay_trees);
  m.impl("plan_spread", &plan_spread);
  m.impl("plan_peer", &plan_peer);
}
