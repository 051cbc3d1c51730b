// Packed tree mask, shared by every tree_attention kernel. No torch headers.
//
// mask_bits [Bm, T, W] int32, Bm in {1, B}, W = ceil(T / 32): bit (j % 32) of word j / 32 of
// row i is set iff tree node i may see tree node j. Prefix positions are always visible.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SK_MASK_HD __host__ __device__ __forceinline__
#else
#define SK_MASK_HD inline
#endif

namespace sequoia_kernels {

SK_MASK_HD bool tree_mask_bit(const int32_t* row, int64_t j) {
  return (static_cast<uint32_t>(row[j >> 5]) >> (j & 31)) & 1u;
}

// The bits of tree nodes [j0, min(j0 + 32, T)) of a row (j0 a multiple of 32), node j0 + i in bit i.
SK_MASK_HD uint32_t tree_mask_word(const int32_t* row, int64_t j0, int64_t T) {
  const uint32_t word = static_cast<uint32_t>(row[j0 >> 5]);
  return T - j0 >= 32 ? word : word & ((1u << (T - j0)) - 1u);
}

}  // namespace sequoia_kernels
