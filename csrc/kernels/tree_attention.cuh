// tree_attention CUDA kernels on tensor cores: framework-free (no torch headers).
//
// FlashAttention-2 style, written for this op from the algorithm (sm_80 instructions, which sm_90
// runs too): mma.sync.m16n8k16 (fp16 / bf16 in, fp32 accumulate), ldmatrix from shared memory,
// cp.async 16-byte global -> shared copies double-buffered (tile n+1 is in flight while tile n
// is multiplied), online softmax in registers (exp2, fp32).
//
// Work decomposition. Grid (row blocks, splits, B * Hkv). The M dimension of a block packs the
// rows of ONE kv head: (the G = Hq / Hkv query heads of its group) x (the T tree nodes), row
// r = g * T + i, so each K/V tile is read from global memory once per kv head (per split, per
// row block: one row block covers M = G * T <= 128 rows). Each of the kWarps warps owns 16 rows
// and the whole key tile: S = Q K^T [16 x BN] and O [16 x D] live in that warp's registers.
//
// Keys of row (b, i): position p is visible iff p < prefix_len[b] (the prefix), or p =
// prefix_len[b] + j with j < Tk (the tree keys) and bit j of the packed mask row i is set
// (tree_mask.h). A split covers [lo, hi) of [0, L = prefix_len[b] + Tk); key tiles that lie
// entirely inside the prefix run without any mask work, only the tile(s) that reach the tree
// keys or the end of the split apply the mask. Positions >= hi are never read (cp.async
// zero-fills those rows of the tile). Rows that see nothing output zeros (lse = -inf).
//
// With one split the kernel writes `out` directly; with several, each split writes its
// normalised fp32 partial output and log-sum-exp, and tree_attention_merge_kernel combines
// them. prefix_len is read on the device: no host sync, no allocation.
//
// Requirements (the launcher checks them): D in {64, 128}; fp16 or bf16; q, k, v, out base
// pointers 16-byte aligned and all their strides multiples of 8 elements (16 bytes).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tree_attention.h"
#include "tree_mask.h"

namespace sequoia_kernels {

__device__ __forceinline__ int64_t tree_attention_prefix(const TreeAttentionParams& p, int64_t b) {
  int64_t P = p.prefix_len_is64 ? static_cast<const int64_t*>(p.prefix_len)[b]
                                : static_cast<const int32_t*>(p.prefix_len)[b];
  // never read outside the cache, even when the host-side validation was skipped
  if (P > p.S - p.Tk) P = p.S - p.Tk;
  return P < 0 ? 0 : P;
}

// ------------------------------------------------------------------------------ configuration

// Keys per tile, and the one place that fixes the block shape for (D, kWarps). Used by the
// launcher (grid, dynamic shared memory, occupancy) and by the static checks (tests/sm90.py).
template <int D_, int kWarps_>
struct TreeAttnConfig {
  static constexpr int D = D_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int BM = 16 * kWarps;  // packed query rows per block
  static constexpr int BN = 64;           // keys per tile
  static constexpr int kStride = D + 8;   // shared-memory row pitch (elements): +16 B, so the
                                          // 8 rows an ldmatrix reads hit 8 distinct bank groups
  static constexpr int kStages = 2;       // K/V tiles in flight
  static constexpr int kSmemBytes = (BM + 2 * kStages * BN) * kStride * 2;
  // launch bounds: 1 block of 8 warps or 2 of 4 warps per SM -> <= 255 registers a thread
  static constexpr int kMinBlocks = kWarps >= 8 ? 1 : 2;
  static_assert(D % 16 == 0 && BN % 16 == 0, "tile shapes");
};

// ---------------------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, L2 only; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                                  uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T> struct MmaType;
template <> struct MmaType<__half> { static constexpr bool bf16 = false; };
template <> struct MmaType<__nv_bfloat16> { static constexpr bool bf16 = true; };

// c[4] += a[4] (16x16, row) * b[2] (16x8, col); fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (MmaType<T>::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// two fp32 -> one register of two 16-bit values (x in the low half)
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ----------------------------------------------------------------------------- main kernel

template <typename T, int D, int kWarps>
__global__ void __launch_bounds__(TreeAttnConfig<D, kWarps>::kThreads,
                                  TreeAttnConfig<D, kWarps>::kMinBlocks)
tree_attention_mma_kernel(const TreeAttentionParams p) {
  using Cfg = TreeAttnConfig<D, kWarps>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, LD = Cfg::kStride, NT = Cfg::kThreads;
  constexpr int KD = D / 16;   // k-steps of Q K^T
  constexpr int NS = BN / 8;   // n8 tiles of S
  constexpr int ND = D / 8;    // n8 tiles of O
  constexpr int CH = D / 8;    // 16-byte chunks per row

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);   // [BM][LD]
  T* k_s = q_s + BM * LD;                    // [2][BN][LD]
  T* v_s = k_s + 2 * BN * LD;                // [2][BN][LD]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t bh = blockIdx.z;
  const int64_t b = bh / p.Hkv, hkv = bh % p.Hkv;
  const int64_t split = blockIdx.y;
  const int64_t G = p.Hq / p.Hkv, M = G * p.T;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BM;

  // key positions fit in 32 bits (the launcher checks S < 2^31)
  const int P = static_cast<int>(tree_attention_prefix(p, b));
  const int L = P + static_cast<int>(p.Tk);
  const int per = (L + static_cast<int>(p.splits) - 1) / static_cast<int>(p.splits);
  const int chunk = (per + BN - 1) / BN * BN;
  const int lo = static_cast<int>(split) * chunk;
  const int hi = lo + chunk < L ? lo + chunk : L;
  const int n_tiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;

  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + b * p.k_sb + hkv * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + b * p.v_sb + hkv * p.v_sh;

  // ---- Q tile (zero rows beyond M) and the first K/V tile: one cp.async group
  static_assert((BM * CH) % NT == 0 && (BN * CH) % NT == 0, "whole copy rounds");
#pragma unroll
  for (int it = 0; it < BM * CH / NT; ++it) {
    const int c = tid + it * NT;
    const int r = c / CH, col = (c % CH) * 8;
    const int64_t row = row0 + r;
    const bool ok = row < M;
    const int64_t h = hkv * G + (ok ? row / p.T : 0), i = ok ? row % p.T : 0;
    const T* src = ok ? qg + b * p.q_sb + h * p.q_sh + i * p.q_st + col : qg;
    cp_async_16(smem_u32(q_s + r * LD + col), src, ok);
  }
  // this thread's 16-byte chunks of a K/V tile: rows kv_r0 + it * (NT / CH), column kv_col
  static_assert(NT % CH == 0, "copy layout");
  const int kv_r0 = tid / CH, kv_col = (tid % CH) * 8;
  const uint32_t k_s0 = smem_u32(k_s + kv_r0 * LD + kv_col), v_s0 = smem_u32(v_s + kv_r0 * LD + kv_col);
  auto load_kv = [&](int tile, int stage) {
    const int t0 = lo + tile * BN + kv_r0;
    const T* kr = kg + static_cast<int64_t>(t0) * p.k_ss + kv_col;
    const T* vr = vg + static_cast<int64_t>(t0) * p.v_ss + kv_col;
    const uint32_t so = stage * BN * LD * 2;
#pragma unroll
    for (int it = 0; it < BN * CH / NT; ++it) {
      constexpr int RS = NT / CH;
      const bool ok = t0 + it * RS < hi;
      cp_async_16(k_s0 + so + it * RS * LD * 2, ok ? kr + it * RS * p.k_ss : kg, ok);
      cp_async_16(v_s0 + so + it * RS * LD * 2, ok ? vr + it * RS * p.v_ss : vg, ok);
    }
  };
  cp_async_commit();  // group: Q
  if (n_tiles > 0) load_kv(0, 0);
  cp_async_commit();  // group: K/V tile 0

  // per thread: rows g and g + 8 of its warp's 16 rows; columns 2t, 2t + 1 of each n8 tile
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t wrow0 = row0 + warp * 16;
  const bool warp_active = wrow0 < M;  // warp-uniform: padding warps skip the math
  const int64_t r_a = wrow0 + g, r_b = wrow0 + g + 8;
  const int32_t* mask_b = p.mask_bits + (p.Bm == 1 ? 0 : b) * p.T * p.W;
  const int32_t* mrow_a = mask_b + (r_a < M ? r_a % p.T : 0) * p.W;
  const int32_t* mrow_b = mask_b + (r_b < M ? r_b % p.T : 0) * p.W;
  const float qk_scale = p.scale * 1.4426950408889634f;  // exp2 domain

  float o[ND][4];
#pragma unroll
  for (int j = 0; j < ND; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  // Q fragments stay in registers for the whole key loop
  uint32_t qf[KD][4];
  cp_async_wait<1>();  // the Q group has landed (tile 0 may still be in flight)
  __syncthreads();
  if (warp_active) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
      ldmatrix_x4(smem_u32(q_s + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8),
                  qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < n_tiles) load_kv(tile + 1, stage ^ 1);  // the stage freed at the end of tile - 1
    cp_async_commit();
    cp_async_wait<1>();  // everything but the newest group: this tile is in shared memory
    __syncthreads();
    if (warp_active) {
      const T* ks = k_s + stage * BN * LD;
      const T* vs = v_s + stage * BN * LD;
      // ---- S = Q K^T: [16 x BN] per warp
      float s[NS][4];
#pragma unroll
      for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
        for (int j = 0; j < NS; j += 2) {
          uint32_t bk[4];
          const int key = j * 8 + (lane & 7) + ((lane >> 4) << 3);
          const int col = kk * 16 + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(smem_u32(ks + key * LD + col), bk[0], bk[1], bk[2], bk[3]);
          mma_16816<T>(s[j], qf[kk], bk);
          mma_16816<T>(s[j + 1], qf[kk], bk + 2);
        }
      }
      // ---- mask: only tiles that reach the tree keys or the end of the split
      const int t0 = lo + tile * BN;
      const bool need_mask = t0 + BN > (P < hi ? P : hi);
#pragma unroll
      for (int j = 0; j < NS; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= qk_scale;
      }
      if (need_mask) {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int pos = t0 + j * 8 + 2 * t4 + e;
            bool va = pos < hi, vb = va;
            if (va && pos >= P) {
              const int rel = pos - P;
              va = (static_cast<uint32_t>(__ldg(mrow_a + (rel >> 5))) >> (rel & 31)) & 1u;
              vb = (static_cast<uint32_t>(__ldg(mrow_b + (rel >> 5))) >> (rel & 31)) & 1u;
            }
            if (!va) s[j][e] = -INFINITY;
            if (!vb) s[j][2 + e] = -INFINITY;
          }
        }
      }
      // ---- online softmax: the 4 threads of a quad share a row
      float mx_a = m_a, mx_b = m_b;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
      }
#pragma unroll
      for (int o_ = 1; o_ < 4; o_ <<= 1) {
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o_));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o_));
      }
      const float base_a = mx_a == -INFINITY ? 0.f : mx_a;  // a row with nothing visible yet
      const float base_b = mx_b == -INFINITY ? 0.f : mx_b;
      const float alpha_a = fast_exp2(m_a - base_a), alpha_b = fast_exp2(m_b - base_b);
      m_a = mx_a;
      m_b = mx_b;
      float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        s[j][0] = fast_exp2(s[j][0] - base_a);
        s[j][1] = fast_exp2(s[j][1] - base_a);
        s[j][2] = fast_exp2(s[j][2] - base_b);
        s[j][3] = fast_exp2(s[j][3] - base_b);
        sum_a += s[j][0] + s[j][1];
        sum_b += s[j][2] + s[j][3];
      }
      l_a = l_a * alpha_a + sum_a;  // per-thread partial sums: reduced over the quad at the end
      l_b = l_b * alpha_b + sum_b;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        o[j][0] *= alpha_a;
        o[j][1] *= alpha_a;
        o[j][2] *= alpha_b;
        o[j][3] *= alpha_b;
      }
      // ---- O += P V: P from the S accumulators (A fragment), V via ldmatrix.trans
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int j = 0; j < ND; j += 2) {
          uint32_t bv[4];
          const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int col = j * 8 + (lane >> 4) * 8;
          ldmatrix_x4_trans(smem_u32(vs + key * LD + col), bv[0], bv[1], bv[2], bv[3]);
          mma_16816<T>(o[j], pa, bv);
          mma_16816<T>(o[j + 1], pa, bv + 2);
        }
      }
    }
    __syncthreads();  // every warp is done with `stage` before the next iteration refills it
  }
  cp_async_wait<0>();  // (the last, empty group)

  if (!warp_active) return;
#pragma unroll
  for (int o_ = 1; o_ < 4; o_ <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, o_);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, o_);
  }
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = half ? r_b : r_a;
    if (row >= M) continue;
    const float inv = half ? inv_b : inv_a;
    const int64_t h = hkv * G + row / p.T, i = row % p.T;
    if (p.splits == 1) {
      T* out = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + i * p.o_st;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        const uint32_t v2 = pack2<T>(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
        *reinterpret_cast<uint32_t*>(out + j * 8 + 2 * t4) = v2;
      }
    } else {
      const int64_t cell = ((b * p.Hq + h) * p.T + i) * p.splits + split;
      float* po = p.part_o + cell * D;
#pragma unroll
      for (int j = 0; j < ND; ++j)
        *reinterpret_cast<float2*>(po + j * 8 + 2 * t4) =
            make_float2(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
      if (t4 == 0) {
        const float l = half ? l_b : l_a, m = half ? m_b : m_a;
        // m is in the exp2 domain: lse (natural log) = (m + log2 l) * ln 2
        p.part_lse[cell] = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : -INFINITY;
      }
    }
  }
}

// One warp per (b, h, t): combine the splits' partial outputs by their log-sum-exp. Only
// launched with splits > 1.
template <typename T>
__global__ void __launch_bounds__(256) tree_attention_merge_kernel(const TreeAttentionParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (cell >= p.B * p.Hq * p.T) return;
  const int64_t t = cell % p.T, h = (cell / p.T) % p.Hq, b = cell / (p.T * p.Hq);
  const float* lse = p.part_lse + cell * p.splits;
  float mx = -INFINITY;
  for (int64_t s = lane; s < p.splits; s += 32) mx = fmaxf(mx, lse[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  T* out = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + t * p.o_st;
  for (int64_t d = 2 * lane; d < p.D; d += 64) {  // D is even (64 or 128): 2 columns a lane
    float a0 = 0.f, a1 = 0.f, wsum = 0.f;
    if (mx != -INFINITY) {
      for (int64_t s = 0; s < p.splits; ++s) {
        const float w = __expf(lse[s] - mx);  // 0 for an empty split
        if (w == 0.f) continue;
        const float2 x = *reinterpret_cast<const float2*>(p.part_o + (cell * p.splits + s) * p.D + d);
        wsum += w;
        a0 += w * x.x;
        a1 += w * x.y;
      }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    *reinterpret_cast<uint32_t*>(out + d) = pack2<T>(a0 * inv, a1 * inv);
  }
}

}  // namespace sequoia_kernels
