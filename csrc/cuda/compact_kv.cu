// compact_kv_ CUDA launcher: picks the widest vector the row layout allows and launches the
// framework-free kernel in csrc/kernels/compact_kv.cuh on the current stream. No host sync,
// no allocation: safe to capture in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "compact_kv_params.h"
#include "kernels/compact_kv.cuh"

namespace sequoia_kernels {

namespace {

template <typename VecT>
void launch(const CompactKVParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = p.N * p.B * p.H * (p.row_bytes / static_cast<int64_t>(sizeof(VecT)));
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535L * 8);
  compact_kv_kernel<VecT, 8><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Largest power-of-two byte width (<= 16) dividing the base address, every byte stride and
// the row size.
int vector_bytes(const CompactKVParams& p) {
  uint64_t g = reinterpret_cast<uintptr_t>(p.cache) | static_cast<uint64_t>(p.row_bytes) |
               static_cast<uint64_t>(p.stride_n) | static_cast<uint64_t>(p.stride_b) |
               static_cast<uint64_t>(p.stride_h) | static_cast<uint64_t>(p.stride_s) | 16u;
  return static_cast<int>(g & (~g + 1));  // lowest set bit
}

}  // namespace

void compact_kv_cuda(at::Tensor& cache, const at::Tensor& src_pos, const at::Tensor& dst_start,
                     const at::Tensor& num_accepted) {
  TORCH_CHECK(cache.is_cuda(), "compact_kv_ (cuda): cache must be a CUDA tensor");
  const CompactKVParams p = compact_kv_params(cache, src_pos, dst_start, num_accepted);
  if (p.N * p.B * p.H == 0 || p.row_bytes == 0 || p.M == 0) return;
  const c10::cuda::CUDAGuard guard(cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (vector_bytes(p)) {
    case 16: launch<uint4>(p, stream); break;
    case 8: launch<uint2>(p, stream); break;
    case 4: launch<uint32_t>(p, stream); break;
    case 2: launch<uint16_t>(p, stream); break;
    default: launch<uint8_t>(p, stream); break;
  }
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) { m.impl("compact_kv_", &compact_kv_cuda); }

}  // namespace sequoia_kernels
