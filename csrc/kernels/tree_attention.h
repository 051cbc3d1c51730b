// tree_attention: the CUDA kernels' parameters (no torch, no CUDA headers), filled by the torch
// glue (csrc/cuda/bindings.cpp) and read by the kernels of tree_attention.cuh.
#pragma once
#include <cstdint>

namespace sequoia_kernels {

struct TreeAttentionParams {
  const void* q;  // [B, Hq, T, D]
  const void* k;  // [B, Hkv, S, D]
  const void* v;  // [B, Hkv, S, D]
  void* out;      // [B, Hq, T, D]
  float* part_o;  // [B, Hq, T, splits, D] contiguous
  float* part_lse;  // [B, Hq, T, splits] contiguous
  const void* prefix_len;  // [B] int32 or int64
  bool prefix_len_is64;
  const int32_t* mask_bits;  // [Bm, T, W] contiguous
  int64_t B, Hq, Hkv, T, Tk, D, S, Bm, W, splits;  // T query rows, Tk tree keys
  int64_t q_sb, q_sh, q_st;  // strides in elements
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t o_sb, o_sh, o_st;
  float scale;
};

}  // namespace sequoia_kernels
