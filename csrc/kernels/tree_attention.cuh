// tree_attention CUDA kernels: framework-free (no torch headers).
//
// Split-KV (flash-decoding) tree attention. Grid: (splits, B * Hkv, row blocks). The rows of a
// block are the G = Hq / Hkv query heads x T tree nodes that share one KV head, so every K/V
// tile is read from global memory once for all of them (GQA). Each block walks its share of
// the keys [0, prefix_len[b] + T) in tiles staged in shared memory; each warp keeps an online
// softmax (fp32 max, sum and output accumulators) for ROWS_PER_WARP query rows. The partial
// results and their log-sum-exp go to a workspace, and tree_attention_merge_kernel combines
// the splits. prefix_len is read on the device: no host sync, no allocation.
//
// Key position p of query row (b, i) is visible iff p < prefix_len[b], or p = prefix_len[b] + j
// with j < Tk (the tree keys) and bit j of the packed mask row i set. Rows that see nothing
// output zeros.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tree_mask.h"

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

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int64_t tree_attention_prefix(const TreeAttentionParams& p, int64_t b) {
  int64_t P = p.prefix_len_is64 ? static_cast<const int64_t*>(p.prefix_len)[b]
                                : static_cast<const int32_t*>(p.prefix_len)[b];
  // never read outside the cache, even when the host-side validation was skipped
  if (P > p.S - p.Tk) P = p.S - p.Tk;
  return P < 0 ? 0 : P;
}

constexpr int kTreeAttnWarps = 8;
constexpr int kTreeAttnRowsPerWarp = 2;
constexpr int kTreeAttnRowsPerBlock = kTreeAttnWarps * kTreeAttnRowsPerWarp;

// DPL: head-dim elements per lane (D <= 32 * DPL). BN: keys per shared-memory tile (<= 32).
template <typename T, int DPL, int BN>
__global__ void __launch_bounds__(kTreeAttnWarps * 32)
tree_attention_split_kernel(TreeAttentionParams p) {
  constexpr int DMAX = 32 * DPL;
  constexpr int PAD = sizeof(T) == 4 ? 1 : 2;  // conflict-free column reads of K
  __shared__ T k_s[BN][DMAX + PAD];
  __shared__ T v_s[BN][DMAX];
  __shared__ float q_s[kTreeAttnRowsPerBlock][DMAX];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t split = blockIdx.x;
  const int64_t b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  const int64_t G = p.Hq / p.Hkv, rows = G * p.T, D = p.D;
  const int64_t P = tree_attention_prefix(p, b);
  const int64_t L = P + p.Tk;
  const int64_t chunk = (L + p.splits - 1) / p.splits;
  const int64_t start = split * chunk, end = min(L, start + chunk);

  const T* q = static_cast<const T*>(p.q);
  const T* kp = static_cast<const T*>(p.k) + b * p.k_sb + hkv * p.k_sh;
  const T* vp = static_cast<const T*>(p.v) + b * p.v_sb + hkv * p.v_sh;
  const int32_t* mask_b = p.mask_bits + (p.Bm == 1 ? 0 : b) * p.T * p.W;

  // stage this block's query rows (scaled) in shared memory
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * kTreeAttnRowsPerBlock;
  for (int idx = threadIdx.x; idx < kTreeAttnRowsPerBlock * DMAX; idx += blockDim.x) {
    const int r = idx / DMAX, d = idx % DMAX;
    const int64_t row = row0 + r;
    float x = 0.f;
    if (row < rows && d < D) {
      const int64_t h = hkv * G + row / p.T, t = row % p.T;
      x = to_float(q[b * p.q_sb + h * p.q_sh + t * p.q_st + d]) * p.scale;
    }
    q_s[r][d] = x;
  }

  float m[kTreeAttnRowsPerWarp], l[kTreeAttnRowsPerWarp], o[kTreeAttnRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kTreeAttnRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) o[r][k] = 0.f;
  }

  for (int64_t tile = start; tile < end; tile += BN) {
    __syncthreads();  // previous tile fully consumed (and q_s written, first time)
    for (int idx = threadIdx.x; idx < BN * DMAX; idx += blockDim.x) {
      const int j = idx / DMAX, d = idx % DMAX;
      const int64_t pos = tile + j;
      const bool in = pos < end && d < D;
      k_s[j][d] = in ? kp[pos * p.k_ss + d] : from_float<T>(0.f);
      v_s[j][d] = in ? vp[pos * p.v_ss + d] : from_float<T>(0.f);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kTreeAttnRowsPerWarp; ++r) {
      const int rl = warp * kTreeAttnRowsPerWarp + r;
      const int64_t row = row0 + rl;
      if (row >= rows) continue;  // warp-uniform
      const int64_t node = row % p.T;
      // one key per lane
      const int64_t pos = tile + lane;
      bool visible = lane < BN && pos < end;
      if (visible && pos >= P) visible = tree_mask_bit(mask_b + node * p.W, pos - P);
      float s = -INFINITY;
      if (visible) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += q_s[rl][d] * to_float(k_s[lane][d]);
        s = acc;
      }
      const float m_new = fmaxf(m[r], warp_max(s));
      if (m_new == -INFINITY) continue;  // nothing visible yet
      const float alpha = __expf(m[r] - m_new);  // m = -inf -> 0
      const float e = visible ? __expf(s - m_new) : 0.f;
      l[r] = l[r] * alpha + warp_sum(e);
      m[r] = m_new;
#pragma unroll
      for (int k = 0; k < DPL; ++k) o[r][k] *= alpha;
      for (int j = 0; j < BN; ++j) {
        const float ej = __shfl_sync(0xffffffffu, e, j);
        if (ej == 0.f) continue;  // warp-uniform
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + 32 * k;
          if (d < D) o[r][k] += ej * to_float(v_s[j][d]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kTreeAttnRowsPerWarp; ++r) {
    const int64_t row = row0 + warp * kTreeAttnRowsPerWarp + r;
    if (row >= rows) continue;
    const int64_t h = hkv * G + row / p.T, t = row % p.T;
    const int64_t cell = ((b * p.Hq + h) * p.T + t) * p.splits + split;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const int d = lane + 32 * k;
      if (d < D) p.part_o[cell * D + d] = o[r][k] * inv;
    }
    if (lane == 0) p.part_lse[cell] = l[r] > 0.f ? m[r] + __logf(l[r]) : -INFINITY;
  }
}

// One warp per (b, h, t): combine the splits' partial outputs by their log-sum-exp.
template <typename T>
__global__ void tree_attention_merge_kernel(TreeAttentionParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (cell >= p.B * p.Hq * p.T) return;
  const int64_t t = cell % p.T, h = (cell / p.T) % p.Hq, b = cell / (p.T * p.Hq);
  const float* lse = p.part_lse + cell * p.splits;
  float mx = -INFINITY;
  for (int64_t s = 0; s < p.splits; ++s) mx = fmaxf(mx, lse[s]);
  T* out = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + t * p.o_st;
  for (int64_t d = lane; d < p.D; d += 32) {
    float acc = 0.f, wsum = 0.f;
    if (mx != -INFINITY) {
      for (int64_t s = 0; s < p.splits; ++s) {
        const float w = __expf(lse[s] - mx);
        wsum += w;
        acc += w * p.part_o[(cell * p.splits + s) * p.D + d];
      }
    }
    out[d] = from_float<T>(wsum > 0.f ? acc / wsum : 0.f);
  }
}

}  // namespace sequoia_kernels
