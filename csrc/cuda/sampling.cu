// sampling_probs and sample_children CUDA launchers (kernels: csrc/kernels/sampling.cuh), on the
// current stream. Layout checks only (no host sync, no allocation): safe in CUDA graphs. Value
// checks (finite logits, q >= 0, uniforms in (0, 1]) are done by sequoia_kernels/ops/sampling.py.
// Launch configuration (static): one block per row; kSamplingThreads = 512 threads for
// sampling_probs, kChildrenThreads = 256 for sample_children; no dynamic shared memory.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>

#include "kernels/sampling.cuh"

namespace sequoia_kernels {

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
  const dim3 grid(static_cast<unsigned>(R));
  switch (logits.scalar_type()) {
    case at::kHalf: sampling_probs_kernel<__half><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case at::kBFloat16: sampling_probs_kernel<__nv_bfloat16><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case at::kFloat: sampling_probs_kernel<float><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case at::kDouble: sampling_probs_kernel<double><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    default: TORCH_CHECK(false, "sampling_probs: logits must be fp16, bf16, fp32 or fp64, got ", logits.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  sample_children_kernel<<<static_cast<unsigned>(R), kChildrenThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CUDA, m) {
  m.impl("sampling_probs", &sampling_probs_cuda);
  m.impl("sample_children", &sample_children_cuda);
}

}  // namespace sequoia_kernels
