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
//
// dp_tables: every level of a DP in one call (dp.py: _Tables, the reference): a re-plan runs
// right after the target's forward has evicted every cache, where each op call's glue (numpy
// allocations, views, the dispatch) cost tens of microseconds, and a table took 5-7 of them.
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

// One level: S_{K+1} = 0, S_k from S_{k+1} for k = K..1 (the first maximising s), g(m + 1) = 1 + S_1(m).
void level(const double* pk, int64_t K, const double* gp, int64_t C, int64_t M, double* out_g, int32_t* out_arg) {
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
  out_g[0] = 0.0;
  for (int64_t m = 0; m <= M; ++m) out_g[m + 1] = 1.0 + S[m];
}

void check_f64(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.is_contiguous(), what,
              " must be a contiguous float64 CPU tensor");
}

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
  level(p.const_data_ptr<double>(), K, g_prev.const_data_ptr<double>(), C, M, g.data_ptr<double>(),
        arg.data_ptr<int32_t>());
}

// p [K], p1 [K1] (per_level: the root's children's vector), both already cut to <= N - 1 ranks;
// g [D + 1, N + 1], arg [D + 1, K, N]: the p model's levels 1..levels[0] (row 1: g_1 = 1 but g(0));
// root_g [D + 1, N + 1], root_arg [D + 1, K1, N]: per_level, the root's tables 2..levels[1].
void dp_tables_cpu(const at::Tensor& p, const at::Tensor& p1, bool per_level, int64_t N, int64_t D, at::Tensor& g,
                   at::Tensor& arg, at::Tensor& root_g, at::Tensor& root_arg, at::Tensor& levels) {
  TORCH_CHECK(N >= 1 && D >= 1, "dp_tables: N and D must be >= 1, got ", N, " and ", D);
  check_f64(p, "dp_tables: p");
  check_f64(p1, "dp_tables: p1");
  check_f64(g, "dp_tables: g");
  check_f64(root_g, "dp_tables: root_g");
  const int64_t M = N - 1, K = p.size(0), K1 = p1.size(0);
  TORCH_CHECK(p.dim() == 1 && K <= M && p1.dim() == 1 && K1 <= M && (per_level || K1 == 0),
              "dp_tables: p [K] and p1 [K1] must have K, K1 <= N - 1 (K1 = 0 unless per_level)");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == D + 1 && g.size(1) == N + 1, "dp_tables: g must be [D + 1, N + 1]");
  TORCH_CHECK(root_g.sizes() == g.sizes(), "dp_tables: root_g must be [D + 1, N + 1]");
  TORCH_CHECK(arg.device().is_cpu() && arg.scalar_type() == at::kInt && arg.is_contiguous() && arg.dim() == 3 &&
                  arg.size(0) == D + 1 && arg.size(1) == K && arg.size(2) == N,
              "dp_tables: arg must be a contiguous int32 [D + 1, K, N]");
  TORCH_CHECK(root_arg.device().is_cpu() && root_arg.scalar_type() == at::kInt && root_arg.is_contiguous() &&
                  root_arg.dim() == 3 && root_arg.size(0) == D + 1 && root_arg.size(1) == K1 && root_arg.size(2) == N,
              "dp_tables: root_arg must be a contiguous int32 [D + 1, K1, N]");
  TORCH_CHECK(levels.device().is_cpu() && levels.scalar_type() == at::kLong && levels.numel() == 2 &&
                  levels.is_contiguous(),
              "dp_tables: levels must be a contiguous int64 [2]");
  const double* pk = p.const_data_ptr<double>();
  double* G = g.data_ptr<double>();
  int32_t* A = arg.data_ptr<int32_t>();
  const int64_t row_g = N + 1, row_a = K * N;
  G[row_g] = 0.0;
  for (int64_t m = 1; m <= N; ++m) G[row_g + m] = 1.0;
  std::vector<int64_t> fulls = {0, 1};  // nodes of the full K-ary tree with d levels, capped at M
  int64_t d_eff = 1;
  for (int64_t d = 2; K > 0 && d <= (per_level ? D - 1 : D); ++d) {
    const int64_t C = std::min(M, fulls[d - 1]);
    fulls.push_back(std::min(M, 1 + K * fulls[d - 1]));
    level(pk, K, G + (d - 1) * row_g, C, M, G + d * row_g, A + d * row_a);
    if (std::equal(G + d * row_g, G + (d + 1) * row_g, G + (d - 1) * row_g)) break;  // deeper helps no budget
    d_eff = d;
  }
  int64_t top = d_eff;
  if (per_level) {
    top = K1 > 0 ? std::min(D, d_eff + 1) : 1;
    for (int64_t d = 2; d <= top; ++d)
      level(p1.const_data_ptr<double>(), K1, G + (d - 1) * row_g, std::min(M, fulls[d - 1]), M,
            root_g.data_ptr<double>() + d * row_g, root_arg.data_ptr<int32_t>() + d * K1 * N);
  }
  levels.data_ptr<int64_t>()[0] = d_eff;
  levels.data_ptr<int64_t>()[1] = top;
}

}  // namespace

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) {
  m.impl("dp_level", &dp_level_cpu);
  m.impl("dp_tables", &dp_tables_cpu);
}

}  // namespace sequoia_kernels
