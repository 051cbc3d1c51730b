// verify_tree: parameters shared by the C++ CPU and CUDA kernels (no torch headers).
//
// The algorithm is specified, with its exactness argument, in the module docstring of
// sequoia_kernels/reference/verify_tree.py; every backend follows it step by step:
// per sequence, walk the tree from the root with the current node's residual target
// p = P / Sp and remaining draft q = Q / Sq (unnormalised fp32 vectors); try each child x in
// order: skip it if q(x) == 0 (or x is -1 / out of range); accept it if f32(r * q(x)) < p(x)
// (r = uniforms[b, child]); otherwise reject: D = max(P / Sp - Q / Sq, 0), Zp = f32(sum D),
// Q[x] = 0, Sq = f32(sum Q), and P, Sp = D, Zp unless Zp == 0 (then P, Sp are kept). Sums
// over the vocabulary are accumulated in fp64 (any order), elementwise work is IEEE fp32.
// The bonus is the inverse CDF of P at uniforms[b, 0] * sum_fp64(P) with fp64 prefix sums
// (first j with P[j] > 0 and C_j > t; else the last j with P[j] > 0; else -1). Greedy: accept
// the child whose token is the first argmax of the target row; bonus = that argmax at the end.
#pragma once
#include <cstdint>

namespace sequoia_kernels {

struct VerifyTreeParams {
  const float* p;      // [B, T, V] target probabilities, rows contiguous
  const float* q;      // [B, T, V] draft probabilities
  const int64_t* tokens;   // [B, T]
  const int64_t* parents;  // [T]
  const float* uniforms;   // [B, T]
  int64_t* path;           // [B, T]
  int64_t* num_accepted;   // [B]
  int64_t* bonus;          // [B]
  float* workspace;        // [B, 2, V]: residual P and remaining Q after a rejection
  int64_t B, T, V;
  int64_t p_sb, p_st, q_sb, q_st;  // strides in elements (vocab stride 1)
  int64_t tok_sb, uni_sb, path_sb;
  bool greedy;
};

// Whether the launcher may pick the cluster kernel (csrc/cuda/verify_tree.cu): the device is
// sm_90+ AND the code the runtime loaded for the kernel was compiled for sm_90+. Its build below
// sm_90 is a __trap() (clusters need sm_90), and that is the code a binary without sm_90 code
// runs on an H100/H200: an 8.0+PTX build JIT-compiles the compute_80 PTX, whose
// cudaFuncAttributes report binaryVersion 90 but ptxVersion 80. Both versions are major * 10 +
// minor, as cudaFuncAttributes gives them.
inline bool verify_cluster_kernel_usable(int device_major, int ptx_version, int binary_version) {
  return device_major >= 9 && ptx_version >= 90 && binary_version >= 90;
}

}  // namespace sequoia_kernels
