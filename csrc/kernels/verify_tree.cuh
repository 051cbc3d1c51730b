// verify_tree CUDA kernels (algorithm: csrc/kernels/verify_tree.h; spec and exactness argument:
// sequoia_kernels/reference/verify_tree.py). Two kernels, same results:
//
// verify_tree_cluster_kernel (sm_90, the default there): a thread-block CLUSTER of 8 or 16 blocks
//   per sequence, each block owning a slice of L = ceil4(V / cluster) vocabulary entries. The
//   current node's residual target P and remaining draft Q live ON CHIP, in each block's shared
//   memory (P double-buffered: 3 * L floats), so the input rows of a node are read once, with
//   128-bit loads, when the walk enters it; a rejection is ONE pass over shared memory (D =
//   max(P * ip - Q * iq, 0) with the reciprocals ip, iq of Sp, Sq: no division in the pass;
//   written to the spare P buffer, Q[x] = 0 applied lazily in the next pass,
//   both fp64 sums in the same pass)
//   and one cluster barrier; the bonus is a parallel two-level inverse CDF (per-thread runs, a
//   block scan, a scan of the cluster's block totals, each thread searching its own run).
// verify_tree_block_kernel (sm_80, or a vocabulary too large for the cluster's shared memory):
//   one block per sequence, the residuals in the caller's global workspace.
//
// Synchronisation of the cluster kernel (every rule below is a barrier, no flags or atomics):
// * Every branch that decides the walk (accept / reject / skip, which node is current, the
//   pending P buffer) depends only on values that are bitwise identical in every thread of every
//   block of the cluster: the node tables (read from the same global inputs), and values read
//   from the cluster's shared memory after a cluster barrier (remote P[x], Q[x]; the block
//   partial sums combined in rank order by every thread). So every thread executes the same
//   sequence of barriers (no divergent barrier).
// * Exchange slots are double-buffered by the parity of a round counter that every thread
//   advances identically, with exactly one cluster barrier per exchange round: the slot of
//   round k is rewritten in round k + 2 only after the writer passed the barrier of round k + 1,
//   which every reader of round k reached only after its reads (program order + the barrier's
//   release/acquire).
// * P/Q writes: a rejection pass writes the spare P buffer (read by nobody: its last remote
//   reads, as the current buffer, preceded the previous exchange barrier) and Q[pend] = 0 for the
//   PREVIOUS rejection at this node (by the thread that owns pend). Other blocks may still be
//   reading this block's P[x] and Q[x] for the decision being taken (no barrier between a try
//   and the pass): P[x] lives in the other P buffer, and Q[y] is written only for y = pend, whose
//   remote value no reader uses (a try of y = pend takes q = 0 without it). Everything a pass
//   writes is published by the exchange barrier that ends it. Entering a node overwrites the
//   buffers, so it is fenced by a cluster barrier before (the last remote reads of the old values
//   are done) and one after (the new values are visible).
// * A block's shared memory must outlive the remote reads of it: every block ends with a cluster
//   barrier after its last remote read.
// * path: every element is written exactly once (path[n] = c by one thread as the walk grows n,
//   path[0] = 0 and path[n_final..T) = -1 at the end), so no ordering between those stores is
//   needed. (The previous kernel wrote -1 everywhere first and then path[n] from another thread
//   with no barrier in between: a write-write race.)
#pragma once
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "verify_tree.h"

namespace sequoia_kernels {

// The spec's reciprocal rcp(s) = f32(1 / max(s, FLT_MIN)): __frcp_rn is the IEEE round-to-nearest
// reciprocal, bitwise 1.f / x (never the approximate MUFU.RCP of --use_fast_math).
__device__ __forceinline__ float verify_rcp(float s) { return __frcp_rn(fmaxf(s, 1.17549435e-38f)); }

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

// --------------------------------------------------------------------------- fallback kernel

__device__ __forceinline__ bool aligned16(const void* a) {
  return (reinterpret_cast<uintptr_t>(a) & 15) == 0;
}
__device__ __forceinline__ float lane(const float4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
// Lane j of v set to 0 (no lane when j is outside [0, 4)).
__device__ __forceinline__ void zero_lane(float4& v, int64_t j) {
  if (j == 0) v.x = 0.f;
  if (j == 1) v.y = 0.f;
  if (j == 2) v.z = 0.f;
  if (j == 3) v.w = 0.f;
}

// D = max(P * ip - Q * iq, 0) in IEEE fp32 (spec: ip, iq the reciprocals of Sp, Sq; no FMA);
// when ip == iq == 1 (the first rejection at a node) x * 1 == x exactly, so the products are
// skipped with bitwise the same result.
template <bool MUL>
__device__ __forceinline__ float residual(float pv, float qv, float ip, float iq) {
  return MUL ? fmaxf(__fsub_rn(__fmul_rn(pv, ip), __fmul_rn(qv, iq)), 0.f)
             : fmaxf(__fsub_rn(pv, qv), 0.f);
}


// One block-strided sweep over the vocabulary: f4(i) for the float4 groups [4i, 4i + 4) of
// [0, V) while every row the sweep touches is 16-byte aligned (VEC: 128-bit loads and stores),
// then f1(i) for the tokens left (all of them when not aligned). Each token is visited by one
// thread, the same thread in every sweep with the same VEC (no cross-thread reuse to order).
template <int THREADS, class F4, class F1>
__device__ __forceinline__ void vocab_sweep(int64_t V, bool vec, F4&& f4, F1&& f1) {
  const int64_t n4 = vec ? V / 4 : 0;
  for (int64_t i = threadIdx.x; i < n4; i += THREADS) f4(i);
  for (int64_t i = 4 * n4 + threadIdx.x; i < V; i += THREADS) f1(i);
}

// The A100 path (and any V too large for the cluster's shared memory): one block per sequence,
// the residuals in the caller's global workspace. Every sweep over the vocabulary reads with
// 128-bit loads where its rows are 16-byte aligned (V % 4 == 0 and 4-aligned strides, as the
// loop's tensors are), so a pass runs at HBM bandwidth. Ordering of the workspace: a token's
// workspace entries are written only in the rewrite sweep after a rejection's sums, by the thread
// that owns the token; the scalar reads P[x], Q[x] of every try are separated from that rewrite
// by the __syncthreads of the sum's broadcast (before) and the one that ends the rejection (after).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) verify_tree_block_kernel(VerifyTreeParams p) {
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

  // every thread keeps the same (block-uniform) copies of the walk's scalars
  auto block_argmax = [&](const float* x) -> int64_t {
    ArgMax best{-INFINITY, V};
    vocab_sweep<THREADS>(V, aligned16(x),
        [&](int64_t i) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(x) + i);
          for (int j = 0; j < 4; ++j) best = ArgMaxOp()(best, ArgMax{lane(v, j), 4 * i + j});
        },
        [&](int64_t i) { best = ArgMaxOp()(best, ArgMax{x[i], i}); });
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
      const float ip = verify_rcp(Sp), iq = Sq > 0.f ? verify_rcp(Sq) : 0.f;
      const float qx = __fmul_rn(Q[x], iq);
      const float px = __fmul_rn(P[x], ip);
      if (!(qx > 0.f)) continue;  // (a)
      accept = __fmul_rn(uni[c], qx) < px;
      if (!accept) {  // reject x
        auto d_of = [&](float pv, float qv) { return residual<true>(pv, qv, ip, iq); };
        const bool vec = aligned16(P) && aligned16(Q) && aligned16(wP) && aligned16(wQ);
        Sum2 part{0.0, 0.0};
        vocab_sweep<THREADS>(V, vec,
            [&](int64_t i) {
              const float4 pv = *(reinterpret_cast<const float4*>(P) + i);
              const float4 qv = *(reinterpret_cast<const float4*>(Q) + i);
              for (int j = 0; j < 4; ++j) {
                part.a += static_cast<double>(d_of(lane(pv, j), lane(qv, j)));
                part.b += static_cast<double>(4 * i + j == x ? 0.f : lane(qv, j));
              }
            },
            [&](int64_t i) {
              part.a += static_cast<double>(d_of(P[i], Q[i]));
              part.b += static_cast<double>(i == x ? 0.f : Q[i]);
            });
        const Sum2 tot = Reduce2(tmp.sum2).Reduce(part, Sum2Op());
        if (tid == 0) { s_d0 = tot.a; s_d1 = tot.b; }
        __syncthreads();  // also: every thread's reads of P[x], Q[x] precede the rewrite below
        const double zp = s_d0, zq = s_d1;
        const bool keep_p = !(zp > 0.0);  // (c) zp == 0: keep P, Sp
        vocab_sweep<THREADS>(V, vec,
            [&](int64_t i) {
              const float4 pv = *(reinterpret_cast<const float4*>(P) + i);
              float4 qv = *(reinterpret_cast<const float4*>(Q) + i);
              if (!keep_p)
                reinterpret_cast<float4*>(wP)[i] = make_float4(d_of(pv.x, qv.x), d_of(pv.y, qv.y),
                                                               d_of(pv.z, qv.z), d_of(pv.w, qv.w));
              zero_lane(qv, x - 4 * i);
              reinterpret_cast<float4*>(wQ)[i] = qv;
            },
            [&](int64_t i) {
              const float pv = P[i], qv = Q[i];
              if (!keep_p) wP[i] = d_of(pv, qv);
              wQ[i] = i == x ? 0.f : qv;
            });
        if (!keep_p) {
          P = wP;
          Sp = static_cast<float>(zp);
        }
        Q = wQ;
        Sq = static_cast<float>(zq);  // (b)
        __syncthreads();  // workspace writes visible before the next try and pass read them
        continue;
      }
    }
    cur = c;
    if (tid == 0) path[n] = c;  // each path element is written once (see the top of the file)
    ++n;
    P = p.p + b * p.p_sb + c * p.p_st;
    Q = p.q + b * p.q_sb + c * p.q_st;
    Sp = Sq = 1.f;
    if (p.greedy) amax = block_argmax(P);
  }
  if (tid == 0) path[0] = 0;
  for (int64_t i = n + tid; i < T; i += THREADS) path[i] = -1;
  if (tid == 0) p.num_accepted[b] = n;
  if (p.greedy) {
    if (tid == 0) p.bonus[b] = amax;
    return;
  }
  // bonus: inverse CDF of P at uni[0] * sum_fp64(P), fp64 prefix sums, 4 * THREADS tokens per
  // step (each thread a float4 group when P is aligned, its 4 tokens in order after the block's
  // exclusive prefix of the group sums), then the tail one token per thread
  const bool vec = aligned16(P);
  double part = 0.0;
  vocab_sweep<THREADS>(V, vec,
      [&](int64_t i) {
        const float4 v = *(reinterpret_cast<const float4*>(P) + i);
        for (int j = 0; j < 4; ++j) part += static_cast<double>(lane(v, j));
      },
      [&](int64_t i) { part += static_cast<double>(P[i]); });
  const double S = ReduceD(tmp.sumd).Sum(part);
  if (tid == 0) s_d0 = S;
  __syncthreads();
  const double t = static_cast<double>(uni[0]) * s_d0;
  double running = 0.0;
  int64_t pick = V, last = -1;
  const int64_t n4 = vec ? V / 4 : 0;
  // one step: `width` tokens per thread starting at token i0 (width 4: a float4 group, 1: a token)
  auto scan_step = [&](int64_t i0, int width, bool valid) -> bool {
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (valid) {
      if (width == 4) {
        const float4 v = *(reinterpret_cast<const float4*>(P + i0));
        x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
      } else {
        x[0] = P[i0];
      }
    }
    double own = 0.0;
    for (int j = 0; j < width; ++j) {
      own += static_cast<double>(x[j]);
      if (x[j] > 0.f) last = i0 + j;
    }
    double excl, total;
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(own, excl, total);
    int64_t cand = V;
    double acc = running + excl;
    for (int j = 0; j < width; ++j) {
      acc += static_cast<double>(x[j]);
      if (x[j] > 0.f && acc > t) { cand = i0 + j; break; }
    }
    __syncthreads();
    const int64_t hit = ReduceI(tmp.red_i).Reduce(cand, MinOp());
    if (tid == 0) s_i64 = hit;
    __syncthreads();
    pick = s_i64;
    running += total;
    return pick < V;
  };
  bool done = false;
  for (int64_t g = 0; g < n4 && !done; g += THREADS) {
    const int64_t i = g + tid;
    done = scan_step(4 * i, 4, i < n4);
  }
  for (int64_t base = 4 * n4; base < V && !done; base += THREADS) {
    const int64_t i = base + tid;
    done = scan_step(i, 1, i < V);
  }
  __syncthreads();
  const int64_t last_pos = ReduceI(tmp.red_i).Reduce(last, MaxOp());
  if (tid == 0) p.bonus[b] = pick < V ? pick : last_pos;
}

// ---------------------------------------------------------------------------- cluster kernel

// Launch configuration of the cluster kernel (static; csrc/cuda/verify_tree.cu picks the
// cluster size): kVerifyThreads threads per block, the node tables of the first kVerifyMaxT
// nodes cached in shared memory, dynamic shared memory = verify_cluster_smem_bytes(V, cluster).
constexpr int kVerifyThreads = 512;
constexpr int kVerifyMaxT = 1024;

__host__ __device__ inline int64_t verify_cluster_slice(int64_t V, int cluster) {
  return ((V + cluster - 1) / cluster + 3) / 4 * 4;  // L: a multiple of 4 floats
}
__host__ __device__ inline int64_t verify_cluster_smem_bytes(int64_t V, int cluster) {
  return 3 * verify_cluster_slice(V, cluster) * static_cast<int64_t>(sizeof(float));
}

// One rejection pass over a block's slice (float4 i covers tokens lo + 4i .. lo + 4i + 3).
// Q[pend] = 0 for the PREVIOUS rejection at this node is applied here, by the thread that owns
// pend, in place (spec order: D uses Q with the earlier rejected tokens zeroed, then Q[x] = 0);
// the current x is only left out of the sum and becomes the next pending token. Q[x] is not
// written while other blocks may still read it for the same try (they read P[x], Q[x] remotely
// to take the decision this block has already taken).
template <bool MUL>
__device__ __forceinline__ void reject_pass(const float4* __restrict__ P4, float4* __restrict__ D4,
                                            float4* __restrict__ Q4, int n4, int64_t lo, int64_t x,
                                            int64_t pend, float ip, float iq, double& acc_p,
                                            double& acc_q) {
  for (int i = threadIdx.x; i < n4; i += kVerifyThreads) {
    const int64_t base = lo + 4 * static_cast<int64_t>(i);
    const float4 pv = P4[i];
    float4 qv = Q4[i];
    const int64_t jp = pend - base;
    if (jp >= 0 && jp < 4) {  // this thread owns the pending token: Q[pend] = 0
      zero_lane(qv, jp);
      // one 32-bit store of that token alone: its three neighbours in the float4 may be being
      // read by other blocks for the current try (racecheck-clean: no bytes written that
      // another thread may read in this phase)
      reinterpret_cast<float*>(Q4 + i)[jp] = 0.f;
    }
    float4 d;
    d.x = residual<MUL>(pv.x, qv.x, ip, iq);
    d.y = residual<MUL>(pv.y, qv.y, ip, iq);
    d.z = residual<MUL>(pv.z, qv.z, ip, iq);
    d.w = residual<MUL>(pv.w, qv.w, ip, iq);
    D4[i] = d;
    acc_p += static_cast<double>(d.x);
    acc_p += static_cast<double>(d.y);
    acc_p += static_cast<double>(d.z);
    acc_p += static_cast<double>(d.w);
    const int64_t jx = x - base;  // the rejected token is left out of the remaining mass
    acc_q += static_cast<double>(jx == 0 ? 0.f : qv.x);
    acc_q += static_cast<double>(jx == 1 ? 0.f : qv.y);
    acc_q += static_cast<double>(jx == 2 ? 0.f : qv.z);
    acc_q += static_cast<double>(jx == 3 ? 0.f : qv.w);
  }
}

__global__ void __launch_bounds__(kVerifyThreads, 1) verify_tree_cluster_kernel(VerifyTreeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the launcher never picks this kernel below it
#else
  namespace cg = cooperative_groups;
  constexpr int THREADS = kVerifyThreads;
  using ReduceArg = cub::BlockReduce<ArgMax, THREADS>;
  using Reduce2 = cub::BlockReduce<Sum2, THREADS>;
  using ReduceI = cub::BlockReduce<int64_t, THREADS>;
  using Scan = cub::BlockScan<double, THREADS>;
  __shared__ union {
    typename ReduceArg::TempStorage arg;
    typename Reduce2::TempStorage sum2;
    typename ReduceI::TempStorage red_i;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int32_t s_par[kVerifyMaxT];  // parents (-2: not a valid parent)
  __shared__ int32_t s_tok[kVerifyMaxT];  // tokens (-1: no child or out of range)
  __shared__ float s_uni[kVerifyMaxT];
  __shared__ double s_xd[2][2];    // exchange slots [parity][value]
  __shared__ float s_xf[2];
  __shared__ int64_t s_xi[2][2];
  extern __shared__ float4 s_dyn4[];  // [3][L]: P buffer 0, P buffer 1, Q

  cg::cluster_group cl = cg::this_cluster();
  const int C = static_cast<int>(cl.num_blocks());
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t b = blockIdx.x / C, V = p.V, T = p.T;
  const int tid = threadIdx.x;
  const int64_t L = verify_cluster_slice(V, C);
  const int n4 = static_cast<int>(L / 4);
  const int64_t lo = rank * L < V ? rank * L : V;
  const int64_t hi = lo + L < V ? lo + L : V;
  float* s_dyn = reinterpret_cast<float*>(s_dyn4);
  float* sQ = s_dyn + 2 * L;

  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  for (int64_t i = tid; i < T && i < kVerifyMaxT; i += THREADS) {
    const int64_t par = p.parents[i], x = tok[i];
    s_par[i] = (par >= 0 && par < T) ? static_cast<int32_t>(par) : -2;
    s_tok[i] = (x >= 0 && x < V) ? static_cast<int32_t>(x) : -1;
    s_uni[i] = p.greedy ? 0.f : uni[i];
  }
  auto node_parent = [&](int64_t c) -> int64_t {
    if (c < kVerifyMaxT) return s_par[c];
    const int64_t par = p.parents[c];
    return (par >= 0 && par < T) ? par : -2;
  };
  auto node_token = [&](int64_t c) -> int64_t {
    if (c < kVerifyMaxT) return s_tok[c];
    const int64_t x = tok[c];
    return (x >= 0 && x < V) ? x : -1;
  };
  auto node_uniform = [&](int64_t c) -> float { return c < kVerifyMaxT ? s_uni[c] : uni[c]; };

  int round = 0;  // exchange rounds (identical in every thread)
  // Cluster sums of (a, b) given in thread 0 of each block, added in rank order: the same bits
  // in every thread. Contains the round's one cluster barrier.
  auto cluster_sum2 = [&](Sum2 v) -> Sum2 {
    const int par = round++ & 1;
    if (tid == 0) { s_xd[par][0] = v.a; s_xd[par][1] = v.b; }
    cl.sync();
    Sum2 tot{0.0, 0.0};
    for (int r = 0; r < C; ++r) {
      const double* rem = cl.map_shared_rank(&s_xd[par][0], r);
      tot.a += rem[0];
      tot.b += rem[1];
    }
    return tot;
  };
  // Cluster argmax (first index of the maximum) of a global row, 128-bit loads where aligned.
  auto cluster_argmax = [&](const float* row) -> int64_t {
    ArgMax best{-INFINITY, V};
    const float* s = row + lo;
    const int64_t n = hi - lo;
    if (aligned16(s)) {
      const float4* s4 = reinterpret_cast<const float4*>(s);
      for (int64_t i = tid; i < n / 4; i += THREADS) {
        const float4 v = __ldg(s4 + i);
        const int64_t j = lo + 4 * i;
        best = ArgMaxOp()(best, ArgMax{v.x, j});
        best = ArgMaxOp()(best, ArgMax{v.y, j + 1});
        best = ArgMaxOp()(best, ArgMax{v.z, j + 2});
        best = ArgMaxOp()(best, ArgMax{v.w, j + 3});
      }
      for (int64_t i = n / 4 * 4 + tid; i < n; i += THREADS) best = ArgMaxOp()(best, ArgMax{s[i], lo + i});
    } else {
      for (int64_t i = tid; i < n; i += THREADS) best = ArgMaxOp()(best, ArgMax{s[i], lo + i});
    }
    const ArgMax r = ReduceArg(tmp.arg).Reduce(best, ArgMaxOp());
    const int par = round++ & 1;
    if (tid == 0) { s_xf[par] = r.v; s_xi[par][0] = r.i; }
    cl.sync();
    ArgMax all{-INFINITY, V};
    for (int q = 0; q < C; ++q)
      all = ArgMaxOp()(all, ArgMax{*cl.map_shared_rank(&s_xf[par], q), *cl.map_shared_rank(&s_xi[par][0], q)});
    return all.i < V ? all.i : 0;
  };
  // Copy this block's slice of node c's p and q rows into P buffer 0 and Q (zero padded to L).
  auto load_node = [&](int64_t c) {
    const float* gp = p.p + b * p.p_sb + c * p.p_st + lo;
    const float* gq = p.q + b * p.q_sb + c * p.q_st + lo;
    const int64_t n = hi - lo;
    if (aligned16(gp) && aligned16(gq)) {
      const float4* gp4 = reinterpret_cast<const float4*>(gp);
      const float4* gq4 = reinterpret_cast<const float4*>(gq);
      float4* sP4 = s_dyn4;
      float4* sQ4 = s_dyn4 + 2 * n4;
      const int full = static_cast<int>(n / 4);
#pragma unroll 4
      for (int i = tid; i < full; i += THREADS) {
        sP4[i] = __ldg(gp4 + i);
        sQ4[i] = __ldg(gq4 + i);
      }
      for (int64_t i = 4 * static_cast<int64_t>(full) + tid; i < L; i += THREADS) {
        s_dyn[i] = i < n ? gp[i] : 0.f;
        sQ[i] = i < n ? gq[i] : 0.f;
      }
    } else {
      for (int64_t i = tid; i < L; i += THREADS) {
        s_dyn[i] = i < n ? gp[i] : 0.f;
        sQ[i] = i < n ? gq[i] : 0.f;
      }
    }
  };

  int64_t cur = 0, n = 1;
  if (p.greedy) {
    __syncthreads();  // node tables
    int64_t amax = cluster_argmax(p.p + b * p.p_sb);
    for (int64_t c = 1; c < T; ++c) {
      if (node_parent(c) != cur) continue;
      const int64_t x = node_token(c);
      if (x < 0 || x != amax) continue;
      cur = c;
      if (rank == 0 && tid == 0) path[n] = c;
      ++n;
      amax = cluster_argmax(p.p + b * p.p_sb + c * p.p_st);
    }
    if (rank == 0) {
      if (tid == 0) { path[0] = 0; p.num_accepted[b] = n; p.bonus[b] = amax; }
      for (int64_t i = n + tid; i < T; i += THREADS) path[i] = -1;
    }
    cl.sync();  // no block exits while another may still read its exchange slots
    return;
  }

  int pb = 0;         // which P buffer holds the current P
  int64_t pend = -1;  // token of the last rejection at this node: Q[pend] = 0 not yet stored
  float Sp = 1.f, Sq = 1.f;
  load_node(0);
  cl.sync();  // node tables and the root's slices visible cluster-wide
  for (int64_t c = 1; c < T; ++c) {
    if (node_parent(c) != cur) continue;
    const int64_t x = node_token(c);
    if (x < 0) continue;
    const int owner = static_cast<int>(x / L);
    const int64_t xl = x - owner * L;
    const float Px = *cl.map_shared_rank(s_dyn + pb * L + xl, owner);
    // Q[pend] may be being zeroed by its owner right now: its value is 0 whatever is read
    const float Qx = x == pend ? 0.f : *cl.map_shared_rank(sQ + xl, owner);
    const float ip = verify_rcp(Sp), iq = Sq > 0.f ? verify_rcp(Sq) : 0.f;
    const float qx = __fmul_rn(Qx, iq);
    const float px = __fmul_rn(Px, ip);
    if (!(qx > 0.f)) continue;  // (a)
    if (__fmul_rn(node_uniform(c), qx) < px) {  // accept: enter node c
      cur = c;
      if (rank == 0 && tid == 0) path[n] = c;
      ++n;
      cl.sync();  // every block has read P[x], Q[x] before the slices are overwritten
      load_node(c);
      pb = 0;
      pend = -1;
      Sp = Sq = 1.f;
      cl.sync();  // the new slices visible cluster-wide
    } else {  // reject x: one pass over the slice, then one exchange
      const float4* P4 = s_dyn4 + pb * n4;
      float4* D4 = s_dyn4 + (pb ^ 1) * n4;
      float4* Q4 = s_dyn4 + 2 * n4;
      double acc_p = 0.0, acc_q = 0.0;
      if (ip == 1.f && iq == 1.f)
        reject_pass<false>(P4, D4, Q4, n4, lo, x, pend, ip, iq, acc_p, acc_q);
      else
        reject_pass<true>(P4, D4, Q4, n4, lo, x, pend, ip, iq, acc_p, acc_q);
      const Sum2 part = Reduce2(tmp.sum2).Reduce(Sum2{acc_p, acc_q}, Sum2Op());
      const Sum2 tot = cluster_sum2(part);  // its barrier publishes D and Q[old pend] = 0
      if (tot.a > 0.0) {  // (c) otherwise keep P, Sp
        pb ^= 1;
        Sp = static_cast<float>(tot.a);
      }
      Sq = static_cast<float>(tot.b);  // (b)
      pend = x;
    }
  }

  // bonus: inverse CDF of the current P (on chip). Thread t owns the contiguous run of float4s
  // [t * R, (t + 1) * R) of its block's slice; C_j = base_rank + (block-exclusive prefix of the
  // thread sums + the thread's running sum), fp64 (a summation order the spec allows).
  // Bank conflicts: the run is read one float4 (LDS.128) at a time; the 8 threads of a
  // quarter-warp then start at word 4 * R * t, i.e. at bank group R * t mod 8, all distinct when
  // R is odd: conflict-free (R even, e.g. 2 at V = 128256 / 16 blocks, was 2-way per float4
  // and 8-way with the scalar reads before).
  const float4* P4 = s_dyn4 + pb * n4;
  const int R = ((n4 + THREADS - 1) / THREADS) | 1;
  const int i0 = tid * R < n4 ? tid * R : n4;
  const int i1 = i0 + R < n4 ? i0 + R : n4;
  double run = 0.0;
  int64_t last = -1;
  for (int i = i0; i < i1; ++i) {
    const float4 v4 = P4[i];
    const float vs[4] = {v4.x, v4.y, v4.z, v4.w};
    for (int j = 0; j < 4; ++j) {
      run += static_cast<double>(vs[j]);
      if (vs[j] > 0.f) last = lo + 4 * i + j;
    }
  }
  double excl, block_total;
  Scan(tmp.scan).ExclusiveSum(run, excl, block_total);
  const int par = round++ & 1;
  if (tid == 0) s_xd[par][0] = block_total;
  cl.sync();
  double base = 0.0, S = 0.0;
  for (int r = 0; r < C; ++r) {
    if (r == rank) base = S;
    S += *cl.map_shared_rank(&s_xd[par][0], r);
  }
  const double t = static_cast<double>(node_uniform(0)) * S;
  int64_t cand = V;
  double acc = excl;
  for (int i = i0; i < i1 && cand == V; ++i) {
    const float4 v4 = P4[i];
    const float vs[4] = {v4.x, v4.y, v4.z, v4.w};
    for (int j = 0; j < 4; ++j) {
      acc += static_cast<double>(vs[j]);
      if (vs[j] > 0.f && base + acc > t) {
        cand = lo + 4 * i + j;
        break;
      }
    }
  }
  const int64_t bcand = ReduceI(tmp.red_i).Reduce(cand, MinOp());
  __syncthreads();
  const int64_t blast = ReduceI(tmp.red_i).Reduce(last, MaxOp());
  const int par2 = round++ & 1;
  if (tid == 0) { s_xi[par2][0] = bcand; s_xi[par2][1] = blast; }
  cl.sync();
  if (rank == 0) {
    if (tid == 0) {
      int64_t pick = V, lastpos = -1;
      for (int r = 0; r < C; ++r) {
        const int64_t* rem = cl.map_shared_rank(&s_xi[par2][0], r);
        pick = rem[0] < pick ? rem[0] : pick;
        lastpos = rem[1] > lastpos ? rem[1] : lastpos;
      }
      path[0] = 0;
      p.num_accepted[b] = n;
      p.bonus[b] = pick < V ? pick : lastpos;
    }
    for (int64_t i = n + tid; i < T; i += THREADS) path[i] = -1;
  }
  cl.sync();  // no block exits while rank 0 may still read its exchange slots
#endif
}

}  // namespace sequoia_kernels
