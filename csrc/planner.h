// Launchers of the GPU planner (planner.cu). Called by bindings.cpp only.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace topoep {

constexpr int kMaxRanksPerDomain = 1024;  // placement_kernel's shared rank order
constexpr int kRouteThreads = 128;        // route_kernel block size (its scan width)

// int64 elements of the workspace plan_topoep needs for (R, E, M domains, N slots); mirrored by
// topoep/planners/cuda.py:workspace_elems.
size_t workspace_elems(int R, int E, int M, int N);
// Dynamic shared memory of the refinement kernel (one block per domain).
size_t refine_smem_bytes(int R, int E, int M, int N);

// The `topoep` policy. omega int64[R, E]; cost_fs int64[R, R]; outputs slot_expert int64[R, N] and
// route int64[R, E + R*N]; ws: workspace_elems() int64. All device pointers, enqueued on `stream`.
void plan_topoep(const int64_t* omega, const int64_t* cost_fs, int R, int E, int M, int N, int64_t W, int64_t S,
                 int64_t* slot_expert, int64_t* route, int64_t* ws, cudaStream_t stream);
// The `static` policy (main instances only).
void plan_static(const int64_t* omega, int R, int E, int N, int64_t* slot_expert, int64_t* route,
                 cudaStream_t stream);

}  // namespace topoep
