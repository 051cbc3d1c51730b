// compact_kv: checks that need no host sync, and the tensor -> CompactKVParams translation,
// shared by the CPU (csrc/cpu/compact_kv.cpp) and CUDA (csrc/cuda/compact_kv.cu) launchers.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels/compact_kv.h"

namespace sequoia_kernels {

inline IndexView index_view(const at::Tensor& t) {
  return IndexView{t.const_data_ptr(), t.stride(0), t.dim() == 2 ? t.stride(1) : 0,
                   t.scalar_type() == at::kLong};
}

inline CompactKVParams compact_kv_params(const at::Tensor& cache, const at::Tensor& src_pos,
                                         const at::Tensor& dst_start,
                                         const at::Tensor& num_accepted) {
  TORCH_CHECK(cache.dim() == 5, "compact_kv_: cache must be [N, B, H, S, D], got ",
              cache.sizes());
  const int64_t B = cache.size(1);
  TORCH_CHECK(src_pos.dim() == 2 && src_pos.size(0) == B,
              "compact_kv_: src_pos must be [B, M] with B = ", B, ", got ", src_pos.sizes());
  TORCH_CHECK(dst_start.dim() == 1 && dst_start.size(0) == B,
              "compact_kv_: dst_start must be [B] with B = ", B, ", got ", dst_start.sizes());
  TORCH_CHECK(num_accepted.dim() == 1 && num_accepted.size(0) == B,
              "compact_kv_: num_accepted must be [B] with B = ", B, ", got ",
              num_accepted.sizes());
  for (const at::Tensor* t : {&src_pos, &dst_start, &num_accepted}) {
    TORCH_CHECK(t->scalar_type() == at::kLong || t->scalar_type() == at::kInt,
                "compact_kv_: index tensors must be int32 or int64, got ", t->scalar_type());
    TORCH_CHECK(t->device() == cache.device(), "compact_kv_: index tensors must be on ",
                cache.device(), ", got ", t->device());
  }
  TORCH_CHECK(cache.size(4) == 1 || cache.stride(4) == 1,
              "compact_kv_: the last (head) dimension of cache must be contiguous");
  const int64_t es = static_cast<int64_t>(cache.element_size());
  CompactKVParams p{};
  p.cache = static_cast<char*>(cache.data_ptr());
  p.N = cache.size(0);
  p.B = B;
  p.H = cache.size(2);
  p.S = cache.size(3);
  p.row_bytes = cache.size(4) * es;
  p.stride_n = cache.stride(0) * es;
  p.stride_b = cache.stride(1) * es;
  p.stride_h = cache.stride(2) * es;
  p.stride_s = cache.stride(3) * es;
  p.M = src_pos.size(1);
  p.src_pos = index_view(src_pos);
  p.dst_start = index_view(dst_start);
  p.num_accepted = index_view(num_accepted);
  return p;
}

}  // namespace sequoia_kernels
