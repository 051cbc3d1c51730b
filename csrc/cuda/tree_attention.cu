// tree_attention CUDA launcher: checks, then the tensor-core kernel of
// csrc/kernels/tree_attention.cuh (and, with more than one split, its merge kernel) on the
// current stream. No host sync, no allocation (the
// split workspace is passed in): safe to capture in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <atomic>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/tree_attention.cuh"
#include "tree_attention_params.h"

namespace sequoia_kernels {

namespace {

// Occupancy assumptions the static checks (tests/test_sm90_static.py) hold the kernels to:
// TreeAttnConfig<D, warps>::kMinBlocks blocks of kThreads per SM (the __launch_bounds__), and
// kSmemBytes of dynamic shared memory a block (no static shared memory in the main kernel).
template <typename T, int D, int kWarps>
void launch_mma(const TreeAttentionParams& p, int64_t row_blocks, cudaStream_t stream) {
  using Cfg = TreeAttnConfig<D, kWarps>;
  auto kernel = tree_attention_mma_kernel<T, D, kWarps>;
  // > 48 KB of dynamic shared memory needs an opt-in, once per device (the first call, which
  // is the warm-up before any CUDA-graph capture)
  static std::atomic<uint64_t> opted_in{0};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg::kSmemBytes));
    opted_in.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(p.splits),
                  static_cast<unsigned>(p.B * p.Hkv));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void launch_dim(const TreeAttentionParams& p, cudaStream_t stream) {
  // 64 packed rows (4 warps) when they hold the whole group x tree, else 128 rows (8 warps).
  // Mirrored by sequoia_kernels.ops.tree_attention._cuda_block_m (the split heuristic).
  const int64_t rows = (p.Hq / p.Hkv) * p.T;
  if (rows <= 64) launch_mma<T, D, 4>(p, (rows + 63) / 64, stream);
  else launch_mma<T, D, 8>(p, (rows + 127) / 128, stream);
  if (p.splits > 1) {
    const int64_t cells = p.B * p.Hq * p.T;
    tree_attention_merge_kernel<T><<<static_cast<unsigned>((cells + 7) / 8), 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T>
void launch(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.D == 64) launch_dim<T, 64>(p, stream);
  else launch_dim<T, 128>(p, stream);
}

bool aligned16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

}  // namespace

void tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& prefix_len, const at::Tensor& mask_bits,
                         int64_t tree_len, double scale,
                         at::Tensor& out, at::Tensor& partial_out, at::Tensor& partial_lse) {
  TORCH_CHECK(q.is_cuda(), "tree_attention (cuda): tensors must be on a CUDA device");
  const TreeAttentionShape s = tree_attention_check(q, k_cache, v_cache, prefix_len, mask_bits,
                                                    tree_len, out, partial_out, partial_lse);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "tree_attention (cuda): the tensor-core kernel takes fp16 or bf16, got ", q.scalar_type(),
              " (the Python op runs other dtypes with the Triton kernel)");
  TORCH_CHECK(s.D == 64 || s.D == 128, "tree_attention (cuda): head dim must be 64 or 128, got ", s.D,
              " (the Python op runs other head dims with the Triton kernel)");
  TORCH_CHECK(s.S < (int64_t{1} << 30) && s.Hq / s.Hkv * s.T < (int64_t{1} << 31) &&
                  s.B * s.Hkv < 65536 && s.splits < 65536,
              "tree_attention (cuda): sizes out of range for the kernel's 32-bit positions / grid");
  TORCH_CHECK(aligned16(q) && aligned16(k_cache) && aligned16(v_cache) && aligned16(out),
              "tree_attention (cuda): q, k_cache, v_cache and out need 16-byte aligned data and strides "
              "that are multiples of 8 elements (cp.async 16-byte copies)");
  TORCH_CHECK(s.splits >= 1 && partial_out.size(0) == s.B && partial_out.size(1) == s.Hq &&
                  partial_out.size(2) == s.T && partial_out.size(3) == s.splits &&
                  partial_out.size(4) == s.D && partial_out.is_contiguous() &&
                  partial_lse.size(0) == s.B && partial_lse.size(1) == s.Hq &&
                  partial_lse.size(2) == s.T && partial_lse.is_contiguous(),
              "tree_attention (cuda): partial_out must be contiguous fp32 [B, Hq, T, splits, D] "
              "and partial_lse [B, Hq, T, splits] with splits >= 1");
  TORCH_CHECK(mask_bits.is_contiguous(), "tree_attention (cuda): mask_bits must be contiguous");
  TreeAttentionParams p{};
  p.q = q.const_data_ptr();
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.out = out.data_ptr();
  p.part_o = partial_out.data_ptr<float>();
  p.part_lse = partial_lse.data_ptr<float>();
  p.prefix_len = prefix_len.const_data_ptr();
  p.prefix_len_is64 = prefix_len.scalar_type() == at::kLong;
  p.mask_bits = mask_bits.const_data_ptr<int32_t>();
  p.B = s.B; p.Hq = s.Hq; p.Hkv = s.Hkv; p.T = s.T; p.Tk = s.Tk; p.D = s.D; p.S = s.S;
  p.Bm = s.Bm; p.W = s.W; p.splits = s.splits;
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_st = q.stride(2);
  p.k_sb = k_cache.stride(0); p.k_sh = k_cache.stride(1); p.k_ss = k_cache.stride(2);
  p.v_sb = v_cache.stride(0); p.v_sh = v_cache.stride(1); p.v_ss = v_cache.stride(2);
  p.o_sb = out.stride(0); p.o_sh = out.stride(1); p.o_st = out.stride(2);
  p.scale = static_cast<float>(scale);
  if (s.B * s.Hq * s.T == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (q.scalar_type() == at::kHalf) launch<__half>(p, stream);
  else launch<__nv_bfloat16>(p, stream);
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace sequoia_kernels
