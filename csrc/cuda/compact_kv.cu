// compact_kv_ CUDA launcher (framework-free, see launch.h): picks the widest vector the row
// layout allows and launches the kernel in csrc/kernels/compact_kv.cuh.
#include <algorithm>

#include "kernels/compact_kv.cuh"
#include "launch.h"

namespace sequoia_kernels {

namespace {

template <typename VecT>
cudaError_t launch(const CompactKVParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = p.N * p.B * p.H * (p.row_bytes / static_cast<int64_t>(sizeof(VecT)));
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535L * 8);
  compact_kv_kernel<VecT, 8><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
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

cudaError_t launch_compact_kv(const CompactKVParams& p, cudaStream_t stream) {
  switch (vector_bytes(p)) {
    case 16: return launch<uint4>(p, stream);
    case 8: return launch<uint2>(p, stream);
    case 4: return launch<uint32_t>(p, stream);
    case 2: return launch<uint16_t>(p, stream);
    default: return launch<uint8_t>(p, stream);
  }
}

}  // namespace sequoia_kernels
