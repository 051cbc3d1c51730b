// tree_attention CUDA launcher (framework-free, see launch.h): the tensor-core kernel of
// csrc/kernels/tree_attention.cuh and, with more than one split, its merge kernel. No
// allocation (the split workspace is passed in): safe to capture in a CUDA graph.
#include <atomic>

#include "kernels/tree_attention.cuh"
#include "launch.h"

namespace sequoia_kernels {

namespace {

// Occupancy assumptions the static checks (tests/test_sm90_static.py) hold the kernels to:
// TreeAttnConfig<D, warps>::kMinBlocks blocks of kThreads per SM (the __launch_bounds__), and
// kSmemBytes of dynamic shared memory a block (no static shared memory in the main kernel).
template <typename T, int D, int kWarps>
cudaError_t launch_mma(const TreeAttentionParams& p, int64_t row_blocks, cudaStream_t stream) {
  using Cfg = TreeAttnConfig<D, kWarps>;
  auto kernel = tree_attention_mma_kernel<T, D, kWarps>;
  // > 48 KB of dynamic shared memory needs an opt-in, once per device (the first call, which
  // is the warm-up before any CUDA-graph capture)
  static std::atomic<uint64_t> opted_in{0};
  int dev = 0;
  SK_CUDA_TRY(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    SK_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    opted_in.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(p.splits),
                  static_cast<unsigned>(p.B * p.Hkv));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_dim(const TreeAttentionParams& p, cudaStream_t stream) {
  // 64 packed rows (4 warps) when they hold the whole group x tree, else 128 rows (8 warps).
  // Mirrored by sequoia_kernels.ops.tree_attention._cuda_block_m (the split heuristic).
  const int64_t rows = (p.Hq / p.Hkv) * p.T;
  if (rows <= 64) SK_CUDA_TRY((launch_mma<T, D, 4>(p, (rows + 63) / 64, stream)));
  else SK_CUDA_TRY((launch_mma<T, D, 8>(p, (rows + 127) / 128, stream)));
  if (p.splits > 1) {
    const int64_t cells = p.B * p.Hq * p.T;
    tree_attention_merge_kernel<T><<<static_cast<unsigned>((cells + 7) / 8), 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const TreeAttentionParams& p, cudaStream_t stream) {
  return p.D == 64 ? launch_dim<T, 64>(p, stream) : launch_dim<T, 128>(p, stream);
}

}  // namespace

cudaError_t launch_tree_attention(const TreeAttentionParams& p, ElemType t, cudaStream_t stream) {
  return t == ElemType::kHalf ? launch<__half>(p, stream) : launch<__nv_bfloat16>(p, stream);
}

}  // namespace sequoia_kernels
