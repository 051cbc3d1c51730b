// compact_kv CUDA kernel: framework-free (no torch headers), see compact_kv.h for the rule.
//
// One thread owns one VecT-sized slice of the rows of one (n, b, h): it walks that slice's
// accepted rows in increasing order, staging CHUNK rows in registers before writing them.
// Threads never touch each other's bytes, so no synchronisation is needed, and the staged
// order keeps snapshot semantics (see compact_kv.h). Reads num_accepted on the device: no
// host sync, no allocation, safe inside CUDA graphs.
#pragma once
#include "compact_kv.h"

namespace sequoia_kernels {

template <typename VecT, int CHUNK>
__global__ void compact_kv_kernel(CompactKVParams p) {
  const int64_t vecs_per_row = p.row_bytes / static_cast<int64_t>(sizeof(VecT));
  const int64_t total = p.N * p.B * p.H * vecs_per_row;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r = t;
    const int64_t v = r % vecs_per_row; r /= vecs_per_row;
    const int64_t h = r % p.H; r /= p.H;
    const int64_t b = r % p.B;
    const int64_t n = r / p.B;
    char* base = p.cache + n * p.stride_n + b * p.stride_b + h * p.stride_h +
                 v * static_cast<int64_t>(sizeof(VecT));
    const int64_t count = compact_kv_count(p, b);
    for (int64_t i0 = 0; i0 < count; i0 += CHUNK) {
      VecT staged[CHUNK];
      int64_t dst[CHUNK];
      bool ok[CHUNK];
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) {
        int64_t src;
        ok[c] = (i0 + c < count) && compact_kv_positions(p, b, i0 + c, &src, &dst[c]) &&
                src != dst[c];
        if (ok[c]) staged[c] = *reinterpret_cast<const VecT*>(base + src * p.stride_s);
      }
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) {
        if (ok[c]) *reinterpret_cast<VecT*>(base + dst[c] * p.stride_s) = staged[c];
      }
    }
  }
}

}  // namespace sequoia_kernels
