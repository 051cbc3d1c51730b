// verify_tree CUDA launcher: one block per sequence on the current stream. No host sync, no
// allocation (the residual workspace is passed in): safe to capture in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/verify_tree.cuh"
#include "verify_tree_params.h"

namespace sequoia_kernels {

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
  constexpr int kThreads = 512;
  verify_tree_kernel<kThreads><<<static_cast<unsigned>(p.B), kThreads, 0,
                                 c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) { m.impl("verify_tree", &verify_tree_cuda); }

}  // namespace sequoia_kernels
