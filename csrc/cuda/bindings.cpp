// The torch side of the CUDA ops, compiled by the host compiler (nvcc compiles only the
// framework-free kernels and launchers, csrc/cuda/<op>.cu; see launch.h): argument checks,
// tensors -> kernel parameters, the device guard and current stream, CUDA errors as torch
// errors, registration under the CUDA dispatch key.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>

#include "compact_kv_params.h"
#include "launch.h"
#include "tree_attention_params.h"
#include "verify_tree_params.h"

namespace sequoia_kernels {

namespace {

bool aligned16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}


ElemType elem_type(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ElemType::kHalf;
    case at::kBFloat16: return ElemType::kBFloat16;
    case at::kFloat: return ElemType::kFloat;
    case at::kDouble: return ElemType::kDouble;
    default: TORCH_CHECK(false, "sampling_probs: logits must be fp16, bf16, fp32 or fp64, got ", t);
  }
  return ElemType::kFloat;  // not reached
}

}  // namespace

// ---- compact_kv_ (in place; no host sync, no allocation)
void compact_kv_cuda(at::Tensor& cache, const at::Tensor& src_pos, const at::Tensor& dst_start,
                     const at::Tensor& num_accepted) {
  TORCH_CHECK(cache.is_cuda(), "compact_kv_ (cuda): cache must be a CUDA tensor");
  const CompactKVParams p = compact_kv_params(cache, src_pos, dst_start, num_accepted);
  if (p.N * p.B * p.H == 0 || p.row_bytes == 0 || p.M == 0) return;
  const c10::cuda::CUDAGuard guard(cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(launch_compact_kv(p, stream));
}

// ---- tree_attention (the split workspace is passed in)
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
  C10_CUDA_CHECK(launch_tree_attention(p, q.scalar_type() == at::kHalf ? ElemType::kHalf : ElemType::kBFloat16,
                                       stream));
}

// ---- sampling_probs, sample_children (layout checks only; value checks: sequoia_kernels/ops/sampling.py)
void sampling_probs_cuda(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                         at::Tensor& out) {
  TORCH_CHECK(logits.is_cuda() && out.device() == logits.device(),
              "sampling_probs (cuda): logits and out must be on the same CUDA device");
  TORCH_CHECK(logits.dim() == 2 && out.dim() == 2 && out.sizes() == logits.sizes(),
              "sampling_probs: logits and out must both be [R, V], got ", logits.sizes(), " and ",
              out.sizes());
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "sampling_probs: need V >= 1");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "sampling_probs: out must be float32");
  TORCH_CHECK((V == 1 || logits.stride(1) == 1) && (V == 1 || out.stride(1) == 1),
              "sampling_probs: the vocabulary dimension must be contiguous");
  TORCH_CHECK(temperature >= 0.0 && std::isfinite(temperature), "sampling_probs: temperature must be >= 0");
  TORCH_CHECK(top_k >= 0, "sampling_probs: top_k must be >= 0");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "sampling_probs: top_p must be in (0, 1]");
  if (R == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  SamplingProbsParams p{};
  p.logits = logits.const_data_ptr();
  p.out = out.data_ptr<float>();
  p.R = R; p.V = V; p.s_x = logits.stride(0); p.s_o = out.stride(0);
  p.temperature = static_cast<float>(temperature);
  p.top_k = top_k;
  p.top_p = top_p;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(launch_sampling_probs(p, elem_type(logits.scalar_type()), stream));
}

void sample_children_cuda(const at::Tensor& draft_probs, const at::Tensor& num_children,
                          const at::Tensor& uniforms, at::Tensor& out) {
  TORCH_CHECK(draft_probs.is_cuda(), "sample_children (cuda): tensors must be on a CUDA device");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&num_children, &uniforms, &out})
    TORCH_CHECK(t->device() == draft_probs.device(), "sample_children: all tensors must be on ",
                draft_probs.device());
  TORCH_CHECK(draft_probs.dim() == 2 && draft_probs.scalar_type() == at::kFloat,
              "sample_children: draft_probs must be float32 [R, V]");
  const int64_t R = draft_probs.size(0), V = draft_probs.size(1);
  TORCH_CHECK(V >= 1, "sample_children: need V >= 1");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.sizes() == draft_probs.sizes(),
              "sample_children: uniforms must be float32 [R, V]");
  TORCH_CHECK(V == 1 || (draft_probs.stride(1) == 1 && uniforms.stride(1) == 1),
              "sample_children: the vocabulary dimension must be contiguous");
  TORCH_CHECK((num_children.scalar_type() == at::kInt || num_children.scalar_type() == at::kLong) &&
                  num_children.dim() == 1 && num_children.size(0) == R,
              "sample_children: num_children must be int32/int64 [R]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 2 && out.size(0) == R,
              "sample_children: out must be int64 [R, K]");
  const int64_t K = out.size(1);
  if (R == 0 || K == 0) return;
  const c10::cuda::CUDAGuard guard(draft_probs.device());
  SampleChildrenParams p{};
  p.q = draft_probs.const_data_ptr<float>();
  p.u = uniforms.const_data_ptr<float>();
  p.nch = num_children.const_data_ptr();
  p.nch64 = num_children.scalar_type() == at::kLong;
  p.out = out.data_ptr<int64_t>();
  p.R = R; p.V = V; p.K = K;
  p.s_q = draft_probs.stride(0); p.s_u = uniforms.stride(0); p.s_n = num_children.stride(0);
  p.s_o0 = out.stride(0); p.s_o1 = out.stride(1);
  C10_CUDA_CHECK(launch_sample_children(p, c10::cuda::getCurrentCUDAStream()));
}

// ---- verify_tree (the fallback kernel's residuals in the workspace passed in)
void verify_tree_cuda(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                      const at::Tensor& tokens, const at::Tensor& parents,
                      const at::Tensor& uniforms, bool greedy, at::Tensor& path,
                      at::Tensor& num_accepted, at::Tensor& bonus, at::Tensor& workspace) {
  TORCH_CHECK(target_probs.is_cuda(), "verify_tree (cuda): tensors must be on a CUDA device");
  const VerifyTreeParams p = verify_tree_params(target_probs, draft_probs, tokens, parents,
                                                uniforms, greedy, path, num_accepted, bonus,
                                                workspace);
  if (p.B == 0) return;
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(launch_verify_tree(p, target_probs.get_device(), stream));
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) {
  m.impl("compact_kv_", &compact_kv_cuda);
  m.impl("tree_attention", &tree_attention_cuda);
  m.impl("sampling_probs", &sampling_probs_cuda);
  m.impl("sample_children", &sample_children_cuda);
  m.impl("verify_tree", &verify_tree_cuda);
}

}  // namespace sequoia_kernels
