// CUDA kernels for sampling_probs and sample_children (specs: sequoia_kernels/reference/sampling.py).
// Framework-free; the launcher is csrc/cuda/sampling.cu. One block per row; no host sync, no
// allocation, no data-dependent launch: safe inside CUDA graphs.
//
// sampling_probs: a bounded number of passes over the row (at most 11: max, 4 top-k radix
// passes, 4 top-p radix passes, the kept mass, the write), independent of the data:
// * y = (x - m) / T in IEEE fp32 (__fsub_rn, __fdiv_rn), keyed by the order-preserving uint32
//   image of y (-0.0 keyed as +0.0, so key order is exactly the fp32 order of y).
// * top-k: radix select, 8 bits per pass from the most significant byte, of the top_k-th
//   largest key (shared-memory histogram of counts per digit among keys matching the prefix
//   found so far): tau_k = exactly the k-th largest y; keep = key >= tau_k (ties kept).
// * top-p: the smallest key t with F(t) = mass{kept, key > t} < top_p * Z (Z = kept mass, fp64),
//   again 8 bits per pass: with M = F(top of the current bucket) and h[d] the fp64 mass of the
//   bucket's keys with next digit d, F(top of digit d) = M + sum_{d' > d} h[d'], non-increasing
//   in d; the smallest d where it is < top_p * Z holds t. keep = key >= t equals the spec's
//   "mass strictly above < top_p * Z" set (t >= tau_k, since F < top_p * Z < Z below tau_k is
//   impossible). The digit masses: per-thread 4-slot register caches spilled into per-warp
//   shared-memory histograms (fp64 atomics, rare and contended within a warp only), merged in
//   warp order. fp64 sums in another order than the reference (the atomics' order may also vary
//   between runs); the spec allows any order; decisions differ only for a mass within ~1e-16
//   relative of the boundary.
// * out = keep ? exp(y) / f32(sum_fp64 kept exp(y)) : 0, with expf (the reference uses torch.exp:
//   the values agree to an ulp or two, as for the Triton kernel).
//
// sample_children: the exponential race of the spec (key = min(-log(u) / q, FLT_MAX) for q > 0)
// in one pass: every thread keeps its smallest (key, index) pair (its "head") over its strided
// elements; each of the K rounds takes the block minimum of the heads (lexicographic, so ties go
// to the lower index), writes it, and the winning thread's next head (its elements strictly above
// the pair it just gave up: V / THREADS keys, from L2) is found by the whole block, one element
// per thread, and a reduction. Total work ~V + K * V / THREADS keys instead of K * V; each round
// costs two block reductions.
#pragma once
#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "sampling.h"

namespace sequoia_kernels {

template <typename T>
__device__ __forceinline__ float to_f32(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<double>(double v) { return __double2float_rn(v); }

// order-preserving uint32 image of an fp32 value; -0.0 and +0.0 share +0.0's key
__device__ __forceinline__ uint32_t okey(float y) {
  uint32_t b = __float_as_uint(y == 0.f ? 0.f : y);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct KeyIdx {
  float k;
  int64_t i;
};
struct KeyIdxMin {  // smaller key, then lower index
  __device__ __forceinline__ KeyIdx operator()(const KeyIdx& a, const KeyIdx& b) const {
    return (b.k < a.k || (b.k == a.k && b.i < a.i)) ? b : a;
  }
};
struct ValIdxMax {  // larger value, then lower index (first argmax)
  __device__ __forceinline__ KeyIdx operator()(const KeyIdx& a, const KeyIdx& b) const {
    return (b.k > a.k || (b.k == a.k && b.i < a.i)) ? b : a;
  }
};

template <typename TIN>
__global__ void __launch_bounds__(kSamplingThreads, 1) sampling_probs_kernel(SamplingProbsParams p) {
  constexpr int THREADS = kSamplingThreads;
  using ReduceKI = cub::BlockReduce<KeyIdx, THREADS>;
  using ReduceD = cub::BlockReduce<double, THREADS>;
  __shared__ union {
    typename ReduceKI::TempStorage ki;
    typename ReduceD::TempStorage d;
  } tmp;
  __shared__ uint32_t s_cnt[256];
  constexpr int kWarps = THREADS / 32;
  __shared__ double s_mass[256];
  __shared__ double s_wmass[kWarps][256];  // per-warp digit masses (top-p)
  __shared__ float s_f;
  __shared__ int64_t s_i;
  __shared__ uint32_t s_prefix;
  __shared__ double s_d;

  const int64_t row = blockIdx.x, V = p.V;
  const int tid = threadIdx.x;
  const TIN* x = static_cast<const TIN*>(p.logits) + row * p.s_x;
  float* out = p.out + row * p.s_o;

  // pass 1: max and first argmax
  KeyIdx best{-INFINITY, V};
  for (int64_t v = tid; v < V; v += THREADS) best = ValIdxMax()(best, KeyIdx{to_f32(x[v]), v});
  const KeyIdx mx = ReduceKI(tmp.ki).Reduce(best, ValIdxMax());
  if (tid == 0) { s_f = mx.k; s_i = mx.i < V ? mx.i : 0; }
  __syncthreads();
  const float m = s_f;
  if (p.temperature == 0.f) {
    const int64_t am = s_i;
    for (int64_t v = tid; v < V; v += THREADS) out[v] = v == am ? 1.f : 0.f;
    return;
  }
  const float temp = p.temperature;
  auto y_of = [&](int64_t v) -> float { return __fdiv_rn(__fsub_rn(to_f32(x[v]), m), temp); };

  uint32_t tau = 0;  // keep = key >= tau (0: keep all)
  if (p.top_k > 0 && p.top_k < V) {  // radix select of the top_k-th largest key
    uint32_t prefix = 0, need = static_cast<uint32_t>(p.top_k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      const uint32_t hmask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
      for (int i = tid; i < 256; i += THREADS) s_cnt[i] = 0;
      __syncthreads();
      // a 4-slot register cache of (digit, count) per thread, spilled on a miss and at the end
      // (the digits of a row concentrate in a few values: few shared-memory atomics)
      int cb[4] = {-1, -1, -1, -1};
      uint32_t cc[4] = {0, 0, 0, 0};
      for (int64_t v = tid; v < V; v += THREADS) {
        const uint32_t k = okey(y_of(v));
        if ((k & hmask) == prefix) {
          const int d = static_cast<int>((k >> shift) & 255u);
          if (cb[0] == d) { ++cc[0]; }
          else if (cb[1] == d) { ++cc[1]; }
          else if (cb[2] == d) { ++cc[2]; }
          else if (cb[3] == d) { ++cc[3]; }
          else {
            if (cb[3] >= 0) atomicAdd(&s_cnt[cb[3]], cc[3]);
            cb[3] = cb[2]; cc[3] = cc[2];
            cb[2] = cb[1]; cc[2] = cc[1];
            cb[1] = cb[0]; cc[1] = cc[0];
            cb[0] = d; cc[0] = 1;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (cb[j] >= 0) atomicAdd(&s_cnt[cb[j]], cc[j]);
      __syncthreads();
      if (tid == 0) {  // the digit holding the need-th largest key of the bucket
        uint32_t above = 0;
        int d = 255;
        for (; d > 0; --d) {
          if (above + s_cnt[d] >= need) break;
          above += s_cnt[d];
        }
        s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
        s_cnt[0] = need - above;  // rank inside the chosen digit (read after the barrier)
      }
      __syncthreads();
      prefix = s_prefix;
      need = s_cnt[0];
      __syncthreads();  // s_cnt is cleared by the next pass
    }
    tau = prefix;
  }
  if (p.top_p < 1.0) {  // smallest key t with mass{key >= tau, key > t} < top_p * Z
    uint32_t prefix = 0;
    double above = 0.0, PZ = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      const uint32_t hmask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
      for (int i = tid; i < kWarps * 256; i += THREADS) (&s_wmass[0][0])[i] = 0.0;
      __syncthreads();
      double z = 0.0;
      // Each thread adds into a 4-slot register cache of (digit, mass) and spills a slot into its
      // warp's histogram only on a miss (and at the end): the masses of a row concentrate in a
      // few digits, so shared-memory atomics stay rare and contend within one warp at most.
      int cb[4] = {-1, -1, -1, -1};
      double cm[4] = {0.0, 0.0, 0.0, 0.0};
      double* wh = s_wmass[tid / 32];
      for (int64_t v = tid; v < V; v += THREADS) {
        const float y = y_of(v);
        const uint32_t k = okey(y);
        if (k >= tau && (k & hmask) == prefix) {
          const double e = static_cast<double>(expf(y));
          const int d = static_cast<int>((k >> shift) & 255u);
          z += e;
          if (cb[0] == d) { cm[0] += e; }
          else if (cb[1] == d) { cm[1] += e; }
          else if (cb[2] == d) { cm[2] += e; }
          else if (cb[3] == d) { cm[3] += e; }
          else {  // miss: spill the oldest slot, shift, insert
            if (cb[3] >= 0) atomicAdd(&wh[cb[3]], cm[3]);
            cb[3] = cb[2]; cm[3] = cm[2];
            cb[2] = cb[1]; cm[2] = cm[1];
            cb[1] = cb[0]; cm[1] = cm[0];
            cb[0] = d; cm[0] = e;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (cb[j] >= 0) atomicAdd(&wh[cb[j]], cm[j]);
      if (shift == 24) {  // first pass: every kept key matches the empty prefix, so z sums to Z
        const double Z = ReduceD(tmp.d).Sum(z);
        if (tid == 0) s_d = p.top_p * Z;
      }
      __syncthreads();
      for (int d = tid; d < 256; d += THREADS) {  // merge the warps' histograms, in warp order
        double h = 0.0;
        for (int w = 0; w < kWarps; ++w) h += s_wmass[w][d];
        s_mass[d] = h;
      }
      __syncthreads();
      PZ = s_d;
      if (tid == 0) {
        // F(top of digit d) = above + sum_{d' > d} h[d']; the smallest d with F < PZ
        double acc = above, f_at = above;
        int pick = 255;
        for (int d = 255; d >= 0; --d) {
          if (!(acc < PZ)) break;
          pick = d;
          f_at = acc;
          acc += s_mass[d];
        }
        s_prefix = prefix | (static_cast<uint32_t>(pick) << shift);
        s_mass[0] = f_at;  // read after the barrier
      }
      __syncthreads();
      prefix = s_prefix;
      above = s_mass[0];
      __syncthreads();
    }
    tau = prefix > tau ? prefix : tau;
  }
  // kept mass, then the write
  double z = 0.0;
  for (int64_t v = tid; v < V; v += THREADS) {
    const float y = y_of(v);
    if (okey(y) >= tau) z += static_cast<double>(expf(y));
  }
  const double Z = ReduceD(tmp.d).Sum(z);
  if (tid == 0) s_f = static_cast<float>(Z);
  __syncthreads();
  const float Zf = s_f;
  for (int64_t v = tid; v < V; v += THREADS) {
    const float y = y_of(v);
    out[v] = okey(y) >= tau ? __fdiv_rn(expf(y), Zf) : 0.f;
  }
}

__device__ __forceinline__ float child_key(float q, float u) {  // spec: +inf = not eligible
  return q > 0.f ? fminf(__fdiv_rn(-logf(u), q), FLT_MAX) : INFINITY;
}

__global__ void __launch_bounds__(kChildrenThreads) sample_children_kernel(SampleChildrenParams p) {
  constexpr int THREADS = kChildrenThreads;
  using Reduce = cub::BlockReduce<KeyIdx, THREADS>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ KeyIdx s_win;

  const int64_t r = blockIdx.x, V = p.V, K = p.K;
  const int tid = threadIdx.x;
  const float* q = p.q + r * p.s_q;
  const float* u = p.u + r * p.s_u;
  int64_t* out = p.out + r * p.s_o0;
  const int64_t nch = p.nch64 ? static_cast<const int64_t*>(p.nch)[r * p.s_n]
                              : static_cast<const int32_t*>(p.nch)[r * p.s_n];
  // thread t's elements are t, t + THREADS, ...: its head is its smallest eligible (key, index)
  KeyIdx head{INFINITY, V};
  for (int64_t v = tid; v < V; v += THREADS) {
    const float k = child_key(q[v], u[v]);
    if (k != INFINITY) head = KeyIdxMin()(head, KeyIdx{k, v});  // +inf: not eligible
  }
  bool done = false;
  for (int64_t i = 0; i < K; ++i) {
    int64_t tokn = -1;
    if (i < nch && !done) {  // block-uniform
      const KeyIdx w = Reduce(tmp).Reduce(head, KeyIdxMin());
      if (tid == 0) s_win = w;
      __syncthreads();
      const KeyIdx win = s_win;
      __syncthreads();  // s_win and tmp are reused below
      if (win.i < V) {
        tokn = win.i;
        // the owner's next head: its smallest pair strictly above the one it gave up, found
        // by the whole block (one of the owner's elements per thread, then a reduction)
        const int64_t o = win.i % THREADS;
        KeyIdx h{INFINITY, V};
        for (int64_t v = o + static_cast<int64_t>(tid) * THREADS; v < V; v += static_cast<int64_t>(THREADS) * THREADS) {
          const float k = child_key(q[v], u[v]);
          if (k != INFINITY && (k > win.k || (k == win.k && v > win.i))) h = KeyIdxMin()(h, KeyIdx{k, v});
        }
        const KeyIdx nh = Reduce(tmp).Reduce(h, KeyIdxMin());
        if (tid == 0) s_win = nh;
        __syncthreads();
        if (tid == o) head = s_win;
        __syncthreads();  // s_win and tmp are reused next round
      } else {
        done = true;  // fewer eligible tokens than children
      }
    }
    if (tid == 0) out[i * p.s_o1] = tokn;
  }
}

}  // namespace sequoia_kernels
