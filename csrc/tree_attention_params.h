// tree_attention: shape, dtype and device checks that need no host sync, shared by the CPU
// (csrc/cpu/tree_attention.cpp) and CUDA (csrc/cuda/tree_attention.cu) launchers.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace sequoia_kernels {

struct TreeAttentionShape {
  int64_t B, Hq, Hkv, T, Tk, D, S, Bm, W, splits;  // T queries, Tk tree keys
};

inline TreeAttentionShape tree_attention_check(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& prefix_len,
                                               const at::Tensor& mask_bits, int64_t tree_len,
                                               const at::Tensor& out,
                                               const at::Tensor& partial_out,
                                               const at::Tensor& partial_lse) {
  TORCH_CHECK(q.dim() == 4, "tree_attention: q must be [B, Hq, T, D], got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "tree_attention: k_cache and v_cache must both be [B, Hkv, S, D], got ", k.sizes(),
              " and ", v.sizes());
  TreeAttentionShape s{};
  s.B = q.size(0);
  s.Hq = q.size(1);
  s.T = q.size(2);
  s.D = q.size(3);
  s.Hkv = k.size(1);
  s.S = k.size(2);
  TORCH_CHECK(k.size(0) == s.B && k.size(3) == s.D,
              "tree_attention: k_cache must be [B, Hkv, S, D] with B = ", s.B, " and D = ", s.D,
              ", got ", k.sizes());
  TORCH_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0, "tree_attention: Hq = ", s.Hq,
              " must be a multiple of Hkv = ", s.Hkv);
  s.Tk = tree_len;
  TORCH_CHECK(s.T >= 1 && s.Tk >= 1 && s.Tk <= s.S, "tree_attention: need T >= 1 queries and 1 <= tree_len <= S = ",
              s.S, ", got T = ", s.T, ", tree_len = ", s.Tk);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "tree_attention: q, k_cache, v_cache must share a dtype");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(),
              "tree_attention: out must be like q");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1,
              "tree_attention: the head dimension of q, k_cache, v_cache and out must be contiguous");
  TORCH_CHECK(prefix_len.dim() == 1 && prefix_len.size(0) == s.B &&
                  (prefix_len.scalar_type() == at::kInt || prefix_len.scalar_type() == at::kLong),
              "tree_attention: prefix_len must be int32/int64 [B]");
  s.W = (s.Tk + 31) / 32;
  TORCH_CHECK(mask_bits.scalar_type() == at::kInt && mask_bits.dim() == 3 &&
                  (mask_bits.size(0) == 1 || mask_bits.size(0) == s.B) &&
                  mask_bits.size(1) == s.T && mask_bits.size(2) == s.W,
              "tree_attention: mask_bits must be int32 [1 or B, T, ceil(tree_len/32)], got ",
              mask_bits.sizes());
  s.Bm = mask_bits.size(0);
  TORCH_CHECK(partial_lse.dim() == 4 && partial_out.dim() == 5 &&
                  partial_lse.scalar_type() == at::kFloat &&
                  partial_out.scalar_type() == at::kFloat,
              "tree_attention: partial_out must be fp32 [B, Hq, T, splits, D] and partial_lse "
              "fp32 [B, Hq, T, splits]");
  s.splits = partial_lse.size(3);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &prefix_len, &mask_bits, &out, &partial_out, &partial_lse})
    TORCH_CHECK(t->device() == q.device(), "tree_attention: all tensors must be on ", q.device());
  return s;
}

}  // namespace sequoia_kernels
