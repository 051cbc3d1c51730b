// dp_level: one level of Sequoia's tree DP (python_api/sequoia_decoding/dp.py: _level, the
// reference), for the planner's and the online re-planner's small DPs, where numpy's per-call
// overhead was most of a re-plan (a 2-level solve near a 4-node plan: ~5 levels x K ranks of
// 4 numpy calls each).
//
//   S_{K+1}(m) = 0;  S_k(m) = max(0, max_{1 <= s <= min(m, C)} p_k g_prev(s) + S_{k+1}(m - s))
//   arg[k-1, m] = the first maximising s (0: no rank-k child), g(0) = 0, g(m + 1) = 1 + S_1(m)
//
// Bitwise the numpy reference: each candidate is one fp64 product then one fp64 add (no FMA
// contraction), and the first maximum wins (numpy's argmax over s = 0 .. C, with s = 0 worth 0).
// Cost: K (M + 1) min(M, C) / 2 multiply-adds; the re-planner's levels are a few hundred.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace sequoia_kernels {

namespace {

void dp_level_cpu(const at::Tensor& p, const at::Tensor& g_prev, int64_t C, int64_t M, at::Tensor& g,
                  at::Tensor& arg) {
  TORCH_CHECK(p.device().is_cpu() && g_prev.device().is_cpu() && g.device().is_cpu() && arg.device().is_cpu(),
              "dp_level: tensors must be on the CPU");
  TORCH_CHECK(C >= 0 && M >= 0, "dp_level: C and M must be >= 0, got ", C, " and ", M);
  TORCH_CHECK(p.scalar_type() == at::kDouble && p.dim() == 1 && p.is_contiguous(),
              "dp_level: p must be a contiguous float64 [K]");
  const int64_t K = p.size(0);
  TORCH_CHECK(g_prev.scalar_type() == at::kDouble && g_prev.dim() == 1 && g_prev.is_contiguous() &&
                  g_prev.size(0) >= C + 1,
              "dp_level: g_prev must be a contiguous float64 [>= C + 1 = ", C + 1, "]");
  TORCH_CHECK(g.scalar_type() == at::kDouble && g.dim() == 1 && g.is_contiguous() && g.size(0) == M + 2,
              "dp_level: g must be a contiguous float64 [M + 2 = ", M + 2, "]");
  TORCH_CHECK(arg.scalar_type() == at::kInt && arg.dim() == 2 && arg.is_contiguous() && arg.size(0) == K &&
                  arg.size(1) == M + 1,
              "dp_level: arg must be a contiguous int32 [K, M + 1] = [", K, ", ", M + 1, "]");
  const double* pk = p.const_data_ptr<double>();
  const double* gp = g_prev.const_data_ptr<double>();
  int32_t* out_arg = arg.data_ptr<int32_t>();
  std::vector<double> S(M + 1, 0.0), next(M + 1);  // S_{k+1}(m), then S_k(m)
  for (int64_t k = K; k >= 1; --k) {
    const double pkv = pk[k - 1];
    int32_t* row = out_arg + (k - 1) * (M + 1);
    for (int64_t m = 0; m <= M; ++m) {
      double best = 0.0;  // s = 0: no rank-k child
      int32_t best_s = 0;
      const int64_t top = std::min(m, C);
      for (int64_t s = 1; s <= top; ++s) {
        const double prod = pkv * gp[s];
        const double v = S[m - s] + prod;
        if (v > best) {
          best = v;
          best_s = static_cast<int32_t>(s);
        }
      }
      next[m] = best;
      row[m] = best_s;
    }
    S.swap(next);
  }
  double* out_g = g.data_ptr<double>();
  out_g[0] = 0.0;
  for (int64_t m = 0; m <= M; ++m) out_g[m + 1] = 1.0 + S[m];
}

}  // namespace

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("dp_level", &dp_level_cpu); }

}  // namespace sequoia_kernels
