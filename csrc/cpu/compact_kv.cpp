// compact_kv_ CPU implementation: one task per (n, b, h), rows copied in increasing order
// (snapshot semantics, see csrc/kernels/compact_kv.h). Dtype-agnostic: rows are moved as bytes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "compact_kv_params.h"

namespace sequoia_kernels {

void compact_kv_cpu(at::Tensor& cache, const at::Tensor& src_pos, const at::Tensor& dst_start,
                    const at::Tensor& num_accepted) {
  TORCH_CHECK(cache.device().is_cpu(), "compact_kv_ (cpu): cache must be a CPU tensor");
  const CompactKVParams p = compact_kv_params(cache, src_pos, dst_start, num_accepted);
  const int64_t tasks = p.N * p.B * p.H;
  if (tasks == 0 || p.row_bytes == 0) return;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t % p.H;
      const int64_t b = (t / p.H) % p.B;
      const int64_t n = t / (p.H * p.B);
      char* base = p.cache + n * p.stride_n + b * p.stride_b + h * p.stride_h;
      const int64_t count = compact_kv_count(p, b);
      for (int64_t i = 0; i < count; ++i) {
        int64_t src, dst;
        if (compact_kv_positions(p, b, i, &src, &dst) && src != dst) {
          std::memmove(base + dst * p.stride_s, base + src * p.stride_s, p.row_bytes);
        }
      }
    }
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("compact_kv_", &compact_kv_cpu); }

}  // namespace sequoia_kernels
