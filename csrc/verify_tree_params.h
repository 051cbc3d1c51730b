// verify_tree: checks that need no host sync and the tensor -> VerifyTreeParams translation,
// shared by the CPU (csrc/cpu/verify_tree.cpp) and CUDA (csrc/cuda/verify_tree.cu) launchers.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels/verify_tree.h"

namespace sequoia_kernels {

inline VerifyTreeParams verify_tree_params(const at::Tensor& target_probs,
                                           const at::Tensor& draft_probs,
                                           const at::Tensor& tokens, const at::Tensor& parents,
                                           const at::Tensor& uniforms, bool greedy,
                                           at::Tensor& path, at::Tensor& num_accepted,
                                           at::Tensor& bonus, at::Tensor& workspace) {
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.sizes() == draft_probs.sizes(),
              "verify_tree: target_probs and draft_probs must both be [B, T, V], got ",
              target_probs.sizes(), " and ", draft_probs.sizes());
  const int64_t B = target_probs.size(0), T = target_probs.size(1), V = target_probs.size(2);
  TORCH_CHECK(T >= 1 && V >= 1, "verify_tree: need T >= 1 and V >= 1");
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat && draft_probs.scalar_type() == at::kFloat &&
                  uniforms.scalar_type() == at::kFloat,
              "verify_tree: target_probs, draft_probs and uniforms must be float32");
  TORCH_CHECK(target_probs.stride(2) == 1 && draft_probs.stride(2) == 1,
              "verify_tree: the vocabulary dimension must be contiguous");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(0) == B &&
                  tokens.size(1) == T && tokens.stride(1) == 1,
              "verify_tree: tokens must be int64 [B, T] with contiguous rows");
  TORCH_CHECK(parents.scalar_type() == at::kLong && parents.dim() == 1 && parents.size(0) == T &&
                  parents.is_contiguous(),
              "verify_tree: parents must be contiguous int64 [T]");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == T &&
                  uniforms.stride(1) == 1,
              "verify_tree: uniforms must be float32 [B, T] with contiguous rows");
  TORCH_CHECK(path.scalar_type() == at::kLong && path.dim() == 2 && path.size(0) == B &&
                  path.size(1) == T && path.stride(1) == 1,
              "verify_tree: path must be int64 [B, T] with contiguous rows");
  TORCH_CHECK(num_accepted.scalar_type() == at::kLong && bonus.scalar_type() == at::kLong &&
                  num_accepted.numel() == B && bonus.numel() == B &&
                  num_accepted.is_contiguous() && bonus.is_contiguous(),
              "verify_tree: num_accepted and bonus must be contiguous int64 [B]");
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= 2 * B * V,
              "verify_tree: workspace must be contiguous float32 with at least 2 * B * V elements");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&draft_probs, &tokens, &parents, &uniforms, &path, &num_accepted,
                              &bonus, &workspace})
    TORCH_CHECK(t->device() == target_probs.device(), "verify_tree: all tensors must be on ",
                target_probs.device());
  VerifyTreeParams p{};
  p.p = target_probs.const_data_ptr<float>();
  p.q = draft_probs.const_data_ptr<float>();
  p.tokens = tokens.const_data_ptr<int64_t>();
  p.parents = parents.const_data_ptr<int64_t>();
  p.uniforms = uniforms.const_data_ptr<float>();
  p.path = path.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int64_t>();
  p.bonus = bonus.data_ptr<int64_t>();
  p.workspace = workspace.data_ptr<float>();
  p.B = B; p.T = T; p.V = V;
  p.p_sb = target_probs.stride(0); p.p_st = target_probs.stride(1);
  p.q_sb = draft_probs.stride(0); p.q_st = draft_probs.stride(1);
  p.tok_sb = tokens.stride(0); p.uni_sb = uniforms.stride(0); p.path_sb = path.stride(0);
  p.greedy = greedy;
  return p;
}

}  // namespace sequoia_kernels
