// compact_kv: framework-free kernel parameters and the per-row copy rule, shared by the
// C++ CPU implementation (csrc/cpu/compact_kv.cpp) and the CUDA kernel (compact_kv.cuh).
// No torch headers here.
//
// cache    [N, B, H, S, D]   N = 2 x layers (K and V of every layer), D contiguous
// src_pos  [B, M]            int32 or int64, strictly increasing per row
// dst_start[B], num_accepted[B]
// For i < num_accepted[b]:  cache[:, b, :, dst_start[b] + i] := cache[:, b, :, src_pos[b, i]]
// with snapshot semantics. Because src_pos[b, i] >= dst_start[b] + i and src_pos is
// increasing, copying rows in increasing i (or staging a chunk of rows before writing them)
// never reads a row that an earlier copy of the same (n, b, h) has overwritten.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SK_HOST_DEVICE inline
#endif

namespace sequoia_kernels {

// A read-only int32 or int64 tensor of rank 1 or 2 (strides in elements).
struct IndexView {
  const void* ptr;
  int64_t stride0, stride1;
  bool is64;
  SK_HOST_DEVICE int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t k = i * stride0 + j * stride1;
    return is64 ? static_cast<const int64_t*>(ptr)[k]
                : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[k]);
  }
};

struct CompactKVParams {
  char* cache;             // base pointer
  int64_t N, B, H, S;      // sizes
  int64_t row_bytes;       // D * element size
  int64_t stride_n, stride_b, stride_h, stride_s;  // in bytes
  int64_t M;               // columns of src_pos
  IndexView src_pos;       // [B, M]
  IndexView dst_start;
  IndexView num_accepted;
};

// Number of rows to copy for batch row b, clamped so that no kernel ever reads or writes
// outside the cache even when the host-side validation was skipped.
SK_HOST_DEVICE int64_t compact_kv_count(const CompactKVParams& p, int64_t b) {
  int64_t n = p.num_accepted(b);
  n = n < 0 ? 0 : (n > p.M ? p.M : n);
  return n;
}

// Source and destination positions of copy i of row b; false when out of bounds (skipped).
SK_HOST_DEVICE bool compact_kv_positions(const CompactKVParams& p, int64_t b, int64_t i,
                                         int64_t* src, int64_t* dst) {
  *src = p.src_pos(b, i);
  *dst = p.dst_start(b) + i;
  return *src >= 0 && *src < p.S && *dst >= 0 && *dst < p.S;
}

}  // namespace sequoia_kernels
