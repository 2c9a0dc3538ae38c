// The experts' grouped GEMMs with CUTLASS's Hopper grouped GEMM under tiles and schedules of our choosing
// (topoep_research/cutlass_wgrad.py): the weight gradients (K-grouped) and the forward and data-gradient GEMMs
// (M-grouped).
//
// Weight gradients:
// out[g] = a[rows of g]^T b[rows of g] for a [A, P], b [A, Q] (rows contiguous), groups given by their int32 end
// offsets (offs[g - 1] .. offs[g] - 1, offs[-1] = 0), out [G, P, Q] bf16, summed in fp32. Per group this is a GEMM of
// shape (P, Q, K_g) whose A operand is a^T (P contiguous: column-major) and whose B operand is b (Q contiguous): the
// K-grouped form of torch._grouped_mm(a.t(), b, offs=offs), the layer's weight gradients.
//
// Why: at 4096 tokens per rank an expert has about 256 rows, so each output tile sums over K = 256 only and its
// epilogue (a 128 x 256 bf16 tile) is as long as its main loop; torch's kernel uses the cooperative schedule, whose
// two warp groups run the main loop and then the epilogue together. The pingpong schedule gives each warp group a
// tile of its own and runs one's epilogue beside the other's main loop. The configurations below are the candidates
// `bench/grouped_gemm.py --cutlass` times against torch._grouped_mm; the cooperative 128 x 256 one is torch's choice
// for these shapes (the control).
//
// M-grouped: out[rows of g] = a[rows of g] b[g] for a [A, K] (rows contiguous), b [G, K, N] with either N contiguous
// (the data gradients: gy w2[g]) or K contiguous (the forward GEMMs: x w1[g]^T, w1[g] [N, K] row-major), out [A, N]
// (rows past offs[-1] are not written): torch._grouped_mm(a, b, offs=offs). Groups of about 256 rows at 4096 tokens
// and random routing: a group just over a multiple of a 128-row tile pays a whole extra tile; 64-row tiles (pingpong)
// waste half as much.
//
// No host synchronisation: a one-thread-per-group kernel writes each group's problem shape, operand pointers and
// strides from the device offsets; a group without rows is given no tiles (M = 0), and for the weight gradients a
// second small kernel writes its zeros.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace topoep_wgrad {

using cute::Shape;
using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;
using Bf16 = cutlass::bfloat16_t;
using GroupShape = cute::Shape<int, int, int>;  // (M, N, K) of one group
using Problem = cutlass::gemm::GroupProblemShape<GroupShape>;

// one kernel configuration: the tile one warp group (pingpong) or the two together (cooperative) compute, the
// cluster, the schedule, and the layouts of A and B (CUTLASS's tags: B as its K x N matrix)
template <class Tile, class Cluster, bool Pingpong, class LayoutA, class LayoutB>
struct Config {
  using MainloopSchedule = std::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Bf16, cutlass::layout::RowMajor*, 8, Bf16,
      cutlass::layout::RowMajor*, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Bf16, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, 8, Bf16, LayoutB*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using ColMajor = cutlass::layout::ColumnMajor;
using RowMajor = cutlass::layout::RowMajor;

// the per-group arguments of the grouped GEMM, written on the device
template <class StrideA, class StrideB, class StrideD>
struct GroupArgs {
  GroupShape* shape;
  const Bf16** a;
  const Bf16** b;
  Bf16** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
};

template <class StrideA, class StrideB, class StrideD>
__global__ void group_args_kernel(const Bf16* a, const Bf16* b, Bf16* out, const int32_t* offs, int G, int P, int Q,
                                  GroupArgs<StrideA, StrideB, StrideD> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= G) return;
  const int first = g ? offs[g - 1] : 0;
  const int rows = offs[g] - first;
  args.shape[g] = GroupShape{rows > 0 ? P : 0, Q, rows};  // no rows: no tiles (zero_empty_kernel writes its zeros)
  args.a[g] = a + (int64_t)first * P;
  args.b[g] = b + (int64_t)first * Q;
  args.d[g] = out + (int64_t)g * P * Q;
  args.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(P, rows, 1));
  args.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(Q, rows, 1));
  args.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(P, Q, 1));
}

template <class StrideA, class StrideB, class StrideD>
__global__ void mm_group_args_kernel(const Bf16* a, const Bf16* b, Bf16* out, const int32_t* offs, int G, int K, int N,
                                     GroupArgs<StrideA, StrideB, StrideD> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= G) return;
  const int first = g ? offs[g - 1] : 0;
  const int rows = offs[g] - first;
  args.shape[g] = GroupShape{rows, N, K};
  args.a[g] = a + (int64_t)first * K;
  args.b[g] = b + (int64_t)g * K * N;
  args.d[g] = out + (int64_t)first * N;
  args.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(rows, K, 1));
  args.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  args.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(rows, N, 1));
}

// zeros for the groups without rows: block (chunk, g) clears its chunk of out[g] when group g is empty
__global__ void zero_empty_kernel(Bf16* out, const int32_t* offs, int64_t per_group) {
  const int g = blockIdx.y;
  const int first = g ? offs[g - 1] : 0;
  if (offs[g] > first) return;
  Bf16* o = out + (int64_t)g * per_group;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_group; i += (int64_t)gridDim.x * blockDim.x)
    o[i] = Bf16(0.0f);
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// one device buffer for the seven per-group arrays of C's grouped GEMM (each 16-byte aligned)
template <class C>
struct GroupBuffers {
  c10::DataPtr buffer;
  GroupArgs<typename C::StrideA, typename C::StrideB, typename C::StrideD> args;

  explicit GroupBuffers(int G) {
    const size_t n = static_cast<size_t>(G);
    const size_t sizes[7] = {n * sizeof(GroupShape), n * sizeof(void*), n * sizeof(void*), n * sizeof(void*),
                             n * sizeof(typename C::StrideA), n * sizeof(typename C::StrideB),
                             n * sizeof(typename C::StrideD)};
    size_t at_[7], total = 0;
    for (int i = 0; i < 7; ++i) at_[i] = total, total += align16(sizes[i]);
    buffer = c10::cuda::CUDACachingAllocator::get()->allocate(total);
    char* base = static_cast<char*>(buffer.get());
    args = {reinterpret_cast<GroupShape*>(base + at_[0]), reinterpret_cast<const Bf16**>(base + at_[1]),
            reinterpret_cast<const Bf16**>(base + at_[2]), reinterpret_cast<Bf16**>(base + at_[3]),
            reinterpret_cast<typename C::StrideA*>(base + at_[4]),
            reinterpret_cast<typename C::StrideB*>(base + at_[5]),
            reinterpret_cast<typename C::StrideD*>(base + at_[6])};
  }
};

// C's grouped GEMM over the G groups whose arguments are on the device
template <class C>
void launch(const GroupBuffers<C>& g, int G, int device) {
  using Gemm = typename C::Gemm;
  auto stream = c10::cuda::getCurrentCUDAStream();
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {G, g.args.shape, nullptr},  // problem shapes on the device only: the host never reads the offsets
      {g.args.a, g.args.stride_a, g.args.b, g.args.stride_b},
      {{}, const_cast<const Bf16**>(g.args.d), g.args.stride_d, g.args.d, g.args.stride_d}};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  arguments.hw_info.device_id = device;
  arguments.hw_info.sm_count = sms;
  Gemm gemm;
  TORCH_CHECK(gemm.can_implement(arguments) == cutlass::Status::kSuccess,
              "cutlass_wgrad: CUTLASS cannot run this configuration on these shapes");
  auto workspace = c10::cuda::CUDACachingAllocator::get()->allocate(Gemm::get_workspace_size(arguments));
  TORCH_CHECK(gemm.initialize(arguments, workspace.get(), stream) == cutlass::Status::kSuccess,
              "cutlass_wgrad: the grouped GEMM did not initialise");
  TORCH_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "cutlass_wgrad: the grouped GEMM did not launch");
}

template <class C>
void run_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& out) {
  const int G = static_cast<int>(offs.size(0)), P = static_cast<int>(a.size(1)), Q = static_cast<int>(b.size(1));
  auto stream = c10::cuda::getCurrentCUDAStream();
  GroupBuffers<C> g(G);
  auto* out_ptr = reinterpret_cast<Bf16*>(out.data_ptr());
  const auto* offs_ptr = offs.data_ptr<int32_t>();
  group_args_kernel<<<(G + 127) / 128, 128, 0, stream>>>(reinterpret_cast<const Bf16*>(a.data_ptr()),
                                                          reinterpret_cast<const Bf16*>(b.data_ptr()), out_ptr,
                                                          offs_ptr, G, P, Q, g.args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t per_group = static_cast<int64_t>(P) * Q;
  zero_empty_kernel<<<dim3(static_cast<unsigned>(std::min<int64_t>((per_group + 255) / 256, 64)), G), 256, 0,
                      stream>>>(out_ptr, offs_ptr, per_group);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch<C>(g, G, a.get_device());
}

template <class C>
void run_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& out) {
  const int G = static_cast<int>(offs.size(0)), K = static_cast<int>(a.size(1)), N = static_cast<int>(b.size(2));
  auto stream = c10::cuda::getCurrentCUDAStream();
  GroupBuffers<C> g(G);
  mm_group_args_kernel<<<(G + 127) / 128, 128, 0, stream>>>(
      reinterpret_cast<const Bf16*>(a.data_ptr()), reinterpret_cast<const Bf16*>(b.data_ptr()),
      reinterpret_cast<Bf16*>(out.data_ptr()), offs.data_ptr<int32_t>(), G, K, N, g.args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch<C>(g, G, a.get_device());
}

// the configurations, by index (cutlass_wgrad.py's WGRAD_CONFIGS and MM_CONFIGS name them in this order)
template <class Tile, class Cluster, bool Pingpong>
using Wgrad = Config<Tile, Cluster, Pingpong, ColMajor, RowMajor>;  // A = a^T (P contiguous), B = b (Q contiguous)
using WgradPingpong128 = Wgrad<Shape<_128, _128, _64>, Shape<_1, _1, _1>, true>;
using WgradPingpong128Cluster2 = Wgrad<Shape<_128, _128, _64>, Shape<_2, _1, _1>, true>;
using WgradPingpong64 = Wgrad<Shape<_64, _128, _64>, Shape<_1, _1, _1>, true>;
using WgradCooperative128x256 = Wgrad<Shape<_128, _256, _64>, Shape<_2, _1, _1>, false>;
using WgradCooperative128 = Wgrad<Shape<_128, _128, _64>, Shape<_1, _1, _1>, false>;

// M-grouped, B with N contiguous (RowMajor) or K contiguous (ColumnMajor)
template <class LayoutB>
struct Mm {
  using Pingpong64x128 = Config<Shape<_64, _128, _64>, Shape<_1, _1, _1>, true, RowMajor, LayoutB>;
  using Pingpong64x256 = Config<Shape<_64, _256, _64>, Shape<_1, _1, _1>, true, RowMajor, LayoutB>;
  using Cooperative128 = Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>, false, RowMajor, LayoutB>;
  using Cooperative128x256 = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, false, RowMajor, LayoutB>;

  static void run(int64_t config, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, at::Tensor& out) {
    switch (config) {
      case 0: run_mm<Pingpong64x128>(a, b, offs, out); break;
      case 1: run_mm<Pingpong64x256>(a, b, offs, out); break;
      case 2: run_mm<Cooperative128>(a, b, offs, out); break;
      case 3: run_mm<Cooperative128x256>(a, b, offs, out); break;
      default: TORCH_CHECK(false, "cutlass_wgrad: M-grouped config ", config, " is not one of 0..3");
    }
  }
};

void check_common(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && offs.is_cuda(), "cutlass_wgrad: a, b and offs must be CUDA tensors");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16,
              "cutlass_wgrad: a and b must be bf16");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1 && offs.is_contiguous(),
              "cutlass_wgrad: offs must be a contiguous int32 vector");
}

at::Tensor grouped_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t config) {
  check_common(a, b, offs);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0), "cutlass_wgrad: a [A, P] and b [A, Q]");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "cutlass_wgrad: a and b must be contiguous");
  TORCH_CHECK(a.size(1) % 8 == 0 && b.size(1) % 8 == 0, "cutlass_wgrad: P and Q must be multiples of 8 (16-byte rows)");
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({offs.size(0), a.size(1), b.size(1)}, a.options());
  if (offs.size(0) == 0) return out;
  switch (config) {
    case 0: run_wgrad<WgradPingpong128>(a, b, offs, out); break;
    case 1: run_wgrad<WgradPingpong128Cluster2>(a, b, offs, out); break;
    case 2: run_wgrad<WgradPingpong64>(a, b, offs, out); break;
    case 3: run_wgrad<WgradCooperative128x256>(a, b, offs, out); break;
    case 4: run_wgrad<WgradCooperative128>(a, b, offs, out); break;
    default: TORCH_CHECK(false, "cutlass_wgrad: config ", config, " is not one of 0..4");
  }
  return out;
}

// out [A, N] = per group g, a[rows of g] b[g]; b [G, K, N] with N or K contiguous (a transposed view of a
// contiguous [G, N, K] tensor); rows of out past offs[-1] are left as allocated
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t config) {
  check_common(a, b, offs);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1) && b.size(0) == offs.size(0),
              "cutlass_wgrad: a [A, K], b [G, K, N] and offs [G]");
  TORCH_CHECK(a.is_contiguous(), "cutlass_wgrad: a must be contiguous");
  const bool n_major = b.stride(2) == 1 && b.stride(1) == b.size(2) && b.stride(0) == b.size(1) * b.size(2);
  const bool k_major = b.stride(1) == 1 && b.stride(2) == b.size(1) && b.stride(0) == b.size(1) * b.size(2);
  TORCH_CHECK(n_major || k_major, "cutlass_wgrad: b must be a contiguous [G, K, N] tensor or the transpose(1, 2) of a "
              "contiguous [G, N, K] one");
  TORCH_CHECK(a.size(1) % 8 == 0 && b.size(2) % 8 == 0, "cutlass_wgrad: K and N must be multiples of 8");
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({a.size(0), b.size(2)}, a.options());
  if (offs.size(0) == 0) return out;
  if (n_major)
    Mm<RowMajor>::run(config, a, b, offs, out);
  else
    Mm<ColMajor>::run(config, a, b, offs, out);
  return out;
}

}  // namespace topoep_wgrad

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_wgrad", &topoep_wgrad::grouped_wgrad, "out[g] = a[rows of g]^T b[rows of g] (bf16, fp32 sums)");
  m.def("grouped_mm", &topoep_wgrad::grouped_mm, "out[rows of g] = a[rows of g] b[g] (bf16, fp32 sums)");
}
