// verify_tree CUDA kernel: one block per sequence walks its tree (algorithm:
// csrc/kernels/verify_tree.h); vocabulary-wide work (rejection residuals, argmax, the bonus
// inverse CDF) is spread over the block with fp64 block reductions and scans. No host sync;
// the residual vectors live in the caller's workspace.
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
struct ArgMaxOp {  // larger value, then lower index
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
  }
};
struct Sum2 {
  double a, b;
};
struct Sum2Op {
  __device__ __forceinline__ Sum2 operator()(const Sum2& x, const Sum2& y) const {
    return Sum2{x.a + y.a, x.b + y.b};
  }
};
struct MinOp {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

template <int THREADS>
__global__ void __launch_bounds__(THREADS) verify_tree_kernel(VerifyTreeParams p) {
  using ReduceArg = cub::BlockReduce<ArgMax, THREADS>;
  using Reduce2 = cub::BlockReduce<Sum2, THREADS>;
  using ReduceD = cub::BlockReduce<double, THREADS>;
  using ReduceI = cub::BlockReduce<int64_t, THREADS>;
  using Scan = cub::BlockScan<double, THREADS>;
  __shared__ union {
    typename ReduceArg::TempStorage arg;
    typename Reduce2::TempStorage sum2;
    typename ReduceD::TempStorage sumd;
    typename ReduceI::TempStorage red_i;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t s_i64;
  __shared__ double s_d0, s_d1;

  const int64_t b = blockIdx.x, V = p.V, T = p.T;
  const int tid = threadIdx.x;
  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  float* wP = p.workspace + b * 2 * V;
  float* wQ = wP + V;
  for (int64_t i = tid; i < T; i += THREADS) path[i] = i == 0 ? 0 : -1;

  // every thread keeps the same (block-uniform) copies of the walk's scalars
  auto block_argmax = [&](const float* x) -> int64_t {
    ArgMax best{-INFINITY, V};
    for (int64_t i = tid; i < V; i += THREADS) best = ArgMaxOp()(best, ArgMax{x[i], i});
    const ArgMax r = ReduceArg(tmp.arg).Reduce(best, ArgMaxOp());
    if (tid == 0) s_i64 = r.i < V ? r.i : 0;
    __syncthreads();
    const int64_t a = s_i64;
    __syncthreads();
    return a;
  };

  const float* P = p.p + b * p.p_sb;
  const float* Q = p.q + b * p.q_sb;
  float Sp = 1.f, Sq = 1.f;
  int64_t cur = 0, n = 1;
  int64_t amax = p.greedy ? block_argmax(P) : -1;
  for (int64_t c = 1; c < T; ++c) {
    if (p.parents[c] != cur) continue;
    const int64_t x = tok[c];
    if (x < 0 || x >= V) continue;
    bool accept;
    if (p.greedy) {
      accept = x == amax;
    } else {
      const float qx = Sq > 0.f ? __fdiv_rn(Q[x], Sq) : 0.f;
      const float px = __fdiv_rn(P[x], Sp);
      if (!(qx > 0.f)) continue;  // (a)
      accept = __fmul_rn(uni[c], qx) < px;
      if (!accept) {  // reject x
        const float sp = Sp, sq = Sq;
        Sum2 part{0.0, 0.0};
        for (int64_t i = tid; i < V; i += THREADS) {
          part.a += static_cast<double>(fmaxf(__fsub_rn(__fdiv_rn(P[i], sp), __fdiv_rn(Q[i], sq)), 0.f));
          part.b += static_cast<double>(i == x ? 0.f : Q[i]);
        }
        const Sum2 tot = Reduce2(tmp.sum2).Reduce(part, Sum2Op());
        if (tid == 0) { s_d0 = tot.a; s_d1 = tot.b; }
        __syncthreads();
        const double zp = s_d0, zq = s_d1;
        if (zp > 0.0) {  // (c) otherwise keep P, Sp
          for (int64_t i = tid; i < V; i += THREADS)
            wP[i] = fmaxf(__fsub_rn(__fdiv_rn(P[i], sp), __fdiv_rn(Q[i], sq)), 0.f);
          P = wP;
          Sp = static_cast<float>(zp);
        }
        for (int64_t i = tid; i < V; i += THREADS) wQ[i] = i == x ? 0.f : Q[i];
        Q = wQ;
        Sq = static_cast<float>(zq);  // (b)
        __syncthreads();  // workspace writes visible before the next pass reads them
        continue;
      }
    }
    cur = c;
    if (tid == 0) path[n] = c;
    ++n;
    P = p.p + b * p.p_sb + c * p.p_st;
    Q = p.q + b * p.q_sb + c * p.q_st;
    Sp = Sq = 1.f;
    if (p.greedy) amax = block_argmax(P);
  }
  if (tid == 0) p.num_accepted[b] = n;
  if (p.greedy) {
    if (tid == 0) p.bonus[b] = amax;
    return;
  }
  // bonus: inverse CDF of P at uni[0] * sum_fp64(P), fp64 prefix sums, chunk by chunk
  double part = 0.0;
  for (int64_t i = tid; i < V; i += THREADS) part += static_cast<double>(P[i]);
  const double S = ReduceD(tmp.sumd).Sum(part);
  if (tid == 0) s_d0 = S;
  __syncthreads();
  const double t = static_cast<double>(uni[0]) * s_d0;
  double running = 0.0;
  int64_t pick = V, last = -1;
  for (int64_t base = 0; base < V; base += THREADS) {
    const int64_t i = base + tid;
    const float x = i < V ? P[i] : 0.f;
    if (x > 0.f) last = i;
    double incl, total;
    __syncthreads();
    Scan(tmp.scan).InclusiveSum(static_cast<double>(x), incl, total);
    const int64_t cand = (x > 0.f && running + incl > t) ? i : V;
    __syncthreads();
    const int64_t hit = ReduceI(tmp.red_i).Reduce(cand, MinOp());
    if (tid == 0) s_i64 = hit;
    __syncthreads();
    pick = s_i64;
    running += total;
    if (pick < V) break;
  }
  __syncthreads();
  const int64_t last_pos = ReduceI(tmp.red_i).Reduce(last, MaxOp());
  if (tid == 0) p.bonus[b] = pick < V ? pick : last_pos;
}

}  // namespace sequoia_kernels
