// sampling_probs and sample_children CUDA launchers (framework-free, see launch.h; kernels:
// csrc/kernels/sampling.cuh). Launch configuration (static): one block per row;
// kSamplingThreads = 512 threads for sampling_probs, kChildrenThreads = 256 for
// sample_children; no dynamic shared memory.
#include "kernels/sampling.cuh"
#include "launch.h"

namespace sequoia_kernels {

cudaError_t launch_sampling_probs(const SamplingProbsParams& p, ElemType t, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.R));
  switch (t) {
    case ElemType::kHalf: sampling_probs_kernel<__half><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case ElemType::kBFloat16: sampling_probs_kernel<__nv_bfloat16><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case ElemType::kFloat: sampling_probs_kernel<float><<<grid, kSamplingThreads, 0, stream>>>(p); break;
    case ElemType::kDouble: sampling_probs_kernel<double><<<grid, kSamplingThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_sample_children(const SampleChildrenParams& p, cudaStream_t stream) {
  sample_children_kernel<<<static_cast<unsigned>(p.R), kChildrenThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sequoia_kernels
