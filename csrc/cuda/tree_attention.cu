// tree_attention CUDA launcher: checks, then the split-KV kernel and the merge kernel of
// csrc/kernels/tree_attention.cuh on the current stream. No host sync, no allocation (the
// split workspace is passed in): safe to capture in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/tree_attention.cuh"
#include "tree_attention_params.h"

namespace sequoia_kernels {

namespace {

template <typename T, int DPL>
void launch(const TreeAttentionParams& p, cudaStream_t stream) {
  // keeps the K + V tiles <= 16 KB (static shared memory is capped at 48 KB)
  constexpr int row_bytes = DPL * 32 * sizeof(T);
  constexpr int BN = row_bytes <= 256 ? 32 : (row_bytes <= 512 ? 16 : 8);
  const int64_t rows = (p.Hq / p.Hkv) * p.T;
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.B * p.Hkv),
                  static_cast<unsigned>((rows + kTreeAttnRowsPerBlock - 1) / kTreeAttnRowsPerBlock));
  tree_attention_split_kernel<T, DPL, BN><<<grid, kTreeAttnWarps * 32, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t cells = p.B * p.Hq * p.T;
  tree_attention_merge_kernel<T><<<static_cast<unsigned>((cells + 7) / 8), 256, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_dim(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.D <= 64) launch<T, 2>(p, stream);
  else if (p.D <= 96) launch<T, 3>(p, stream);
  else if (p.D <= 128) launch<T, 4>(p, stream);
  else launch<T, 8>(p, stream);
}

}  // namespace

void tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& prefix_len, const at::Tensor& mask_bits,
                         int64_t tree_len, double scale,
                         at::Tensor& out, at::Tensor& partial_out, at::Tensor& partial_lse) {
  TORCH_CHECK(q.is_cuda(), "tree_attention (cuda): tensors must be on a CUDA device");
  const TreeAttentionShape s = tree_attention_check(q, k_cache, v_cache, prefix_len, mask_bits,
                                                    tree_len, out, partial_out, partial_lse);
  TORCH_CHECK(s.D <= 256, "tree_attention (cuda): head dim must be <= 256, got ", s.D);
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
  switch (q.scalar_type()) {
    case at::kHalf: launch_dim<__half>(p, stream); break;
    case at::kBFloat16: launch_dim<__nv_bfloat16>(p, stream); break;
    case at::kFloat: launch_dim<float>(p, stream); break;
    default: TORCH_CHECK(false, "tree_attention (cuda): dtype must be fp16, bf16 or fp32, got ", q.scalar_type());
  }
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace sequoia_kernels
