// verify_tree CUDA kernel: one block per sequence walks its tree (csrc/kernels/verify_tree.h
// gives the algorithm); vocabulary-wide work (rejection residuals, argmax, the bonus inverse CDF)
// is spread over the block. No host sync; the residual lives in the caller's workspace.
#pragma once
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "verify_tree.h"

namespace sequoia_kernels {

struct ArgMax {
  float v;
  int64_t i;
};
struct ArgMaxOp {
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
  }
};
struct Float2Sum {
  __device__ __forceinline__ float2 operator()(const float2& a, const float2& b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};

template <int THREADS>
__global__ void __launch_bounds__(THREADS) verify_tree_kernel(VerifyTreeParams p) {
  using ReduceArg = cub::BlockReduce<ArgMax, THREADS>;
  using Reduce2 = cub::BlockReduce<float2, THREADS>;
  using ReduceI = cub::BlockReduce<int64_t, THREADS>;
  using Scan = cub::BlockScan<float, THREADS>;
  __shared__ union {
    typename ReduceArg::TempStorage arg;
    typename Reduce2::TempStorage sum2;
    typename ReduceI::TempStorage red_i;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t s_next, s_x, s_amax, s_pick, s_last;
  __shared__ float s_sp, s_sq, s_qx_raw, s_running;

  const int64_t b = blockIdx.x, V = p.V, T = p.T;
  const int tid = threadIdx.x;
  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  float* wP = p.workspace + b * 2 * V;
  float* wQ = wP + V;
  for (int64_t i = tid; i < T; i += THREADS) path[i] = -1;

  const float* P = p.p + b * p.p_sb;
  const float* Q = p.q + b * p.q_sb;
  float Sp = 1.f, Sq = 1.f;  // block-uniform copies
  int64_t u = 0, n = 1, first = 1;

  auto block_argmax = [&](const float* x) -> int64_t {
    ArgMax best{-INFINITY, V};
    for (int64_t i = tid; i < V; i += THREADS) best = ArgMaxOp()(best, ArgMax{x[i], i});
    const ArgMax r = ReduceArg(tmp.arg).Reduce(best, ArgMaxOp());
    if (tid == 0) s_amax = r.i < V ? r.i : 0;
    __syncthreads();
    const int64_t a = s_amax;
    __syncthreads();
    return a;
  };

  while (true) {
    while (first < T && p.parents[first] != u) ++first;  // every thread, same answer
    const int64_t amax = p.greedy ? block_argmax(P) : -1;
    int64_t next = -1;
    for (int64_t c = first; c < T && p.parents[c] == u; ++c) {
      const int64_t x = tok[c];
      if (x < 0 || x >= V) continue;
      if (p.greedy) {
        if (x == amax) { next = c; break; }
        continue;
      }
      const float qx = Q[x] / Sq, px = P[x] / Sp;
      if (!(qx > 0.f)) continue;
      if (uni[c] * qx < px) { next = c; break; }
      const float qx_raw = Q[x];
      float2 part = make_float2(0.f, 0.f);
      for (int64_t i = tid; i < V; i += THREADS) {
        const float r = fmaxf(P[i] / Sp - Q[i] / Sq, 0.f);
        const float qi = i == x ? 0.f : Q[i];
        wP[i] = r;
        wQ[i] = qi;
        part.x += r;
        part.y += qi;
      }
      const float2 tot = Reduce2(tmp.sum2).Reduce(part, Float2Sum());
      if (tid == 0) { s_sp = tot.x; s_sq = tot.y; }
      __syncthreads();  // also orders the workspace writes before the next reads
      float sp = s_sp;
      const float sq = s_sq;
      if (!(sp > 0.f)) {  // rounding only: keep the old target (== old q)
        for (int64_t i = tid; i < V; i += THREADS) wP[i] = i == x ? qx_raw : wQ[i];
        sp = Sq;
        __syncthreads();
      }
      P = wP; Q = wQ; Sp = sp; Sq = sq;
    }
    if (next < 0) break;
    u = next;
    if (tid == 0) path[n] = u;
    ++n;
    P = p.p + b * p.p_sb + u * p.p_st;
    Q = p.q + b * p.q_sb + u * p.q_st;
    Sp = Sq = 1.f;
    first = u + 1;
  }
  if (tid == 0) { p.num_accepted[b] = n; path[0] = 0; }

  if (p.greedy) {
    const int64_t a = block_argmax(P);
    if (tid == 0) p.bonus[b] = a;
    return;
  }
  // inverse CDF: first i with cumsum(P)[i] > uni[0] * Sp and P[i] > 0, chunk by chunk
  const float target = uni[0] * Sp;
  if (tid == 0) { s_running = 0.f; s_pick = V; s_last = 0; }
  __syncthreads();
  int64_t last = 0;
  for (int64_t base = 0; base < V; base += THREADS) {
    const int64_t i = base + tid;
    const float x = i < V ? P[i] : 0.f;
    if (x > 0.f) last = i;
    float incl, total;
    Scan(tmp.scan).InclusiveSum(x, incl, total);
    const float running = s_running;
    const int64_t cand = (x > 0.f && running + incl > target) ? i : V;
    __syncthreads();
    const int64_t first_hit = ReduceI(tmp.red_i).Reduce(cand, [](int64_t a, int64_t c) { return a < c ? a : c; });
    if (tid == 0) { s_pick = first_hit; s_running = running + total; }
    __syncthreads();
    if (s_pick < V) break;
  }
  const int64_t last_pos = ReduceI(tmp.red_i).Reduce(last, [](int64_t a, int64_t c) { return a > c ? a : c; });
  if (tid == 0) p.bonus[b] = s_pick < V ? s_pick : last_pos;
}

}  // namespace sequoia_kernels
