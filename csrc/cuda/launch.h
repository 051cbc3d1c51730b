// The CUDA launchers, framework-free (no torch headers): csrc/cuda/<op>.cu compiles the kernels
// of csrc/kernels/<op>.cuh and its launcher with nvcc alone; the torch side (checks, tensors ->
// parameters, device guard, current stream, errors, registration) is csrc/cuda/bindings.cpp,
// compiled by the host compiler once. nvcc then never parses torch's headers, once per GPU
// architecture as it did when the launchers took tensors (~25 s a unit -> a few seconds).
// Every launcher enqueues on `stream` and returns the launch's error (cudaGetLastError), never
// syncs, never allocates: safe inside CUDA graphs.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/compact_kv.h"
#include "kernels/sampling.h"
#include "kernels/tree_attention.h"
#include "kernels/verify_tree.h"

// Return a failed CUDA call's error from the enclosing launcher.
#define SK_CUDA_TRY(expr)                      \
  do {                                         \
    const cudaError_t sk_err_ = (expr);        \
    if (sk_err_ != cudaSuccess) return sk_err_; \
  } while (0)

namespace sequoia_kernels {

enum class ElemType { kHalf, kBFloat16, kFloat, kDouble };

// The widest vector (16, 8, 4, 2 or 1 bytes) the cache rows' layout allows.
cudaError_t launch_compact_kv(const CompactKVParams& p, cudaStream_t stream);
// fp16 / bf16 (t), D = 64 or 128; with p.splits > 1 the merge kernel after the main one.
cudaError_t launch_tree_attention(const TreeAttentionParams& p, ElemType t, cudaStream_t stream);
cudaError_t launch_sampling_probs(const SamplingProbsParams& p, ElemType t, cudaStream_t stream);
cudaError_t launch_sample_children(const SampleChildrenParams& p, cudaStream_t stream);
// The kernel (cluster or one block a sequence) planned for (device, B, V) on its first call.
cudaError_t launch_verify_tree(const VerifyTreeParams& p, int device, cudaStream_t stream);

}  // namespace sequoia_kernels
