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

#include "cpu/dp_search.h"
#include "cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
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
// The candidates of every m at one s at a time (s ascending, a strict >: each m keeps its first
// maximising s, as a scan over s per m does), so the loop over m runs in vector lanes: 8 doubles
// on AVX-512, 4 on AVX2 (the same fp64 mul then add per candidate, no FMA: the same bits on every
// path, tests/test_planner.py). A re-plan around a 128-node offloaded tree (K = 16, the tables to
// 256 nodes, 7 levels; bench/replan_cost.py, 2-core Xeon with AMX, family 6 model 207): 8.6 ms with
// a scan over s per m, 4.1 in the baseline's 2 lanes, 2.0 on AVX2, 1.0-1.3 on AVX-512.
#if defined(__GNUC__)
#define SK_FORCE_INLINE inline __attribute__((always_inline))
#else
#define SK_FORCE_INLINE inline
#endif
SK_FORCE_INLINE void level_body(const double* pk, int64_t K, const double* gp, int64_t C, int64_t M, double* out_g,
                                int32_t* out_arg) {
  std::vector<double> S(M + 1, 0.0), next(M + 1);  // S_{k+1}(m), then S_k(m)
  for (int64_t k = K; k >= 1; --k) {
    const double pkv = pk[k - 1];
    int32_t* __restrict row = out_arg + (k - 1) * (M + 1);
    double* __restrict best = next.data();
    const double* __restrict prev = S.data();
    for (int64_t m = 0; m <= M; ++m) best[m] = 0.0, row[m] = 0;  // s = 0: no rank-k child
    for (int64_t s = 1; s <= std::min(M, C); ++s) {
      const double prod = pkv * gp[s];
      const int32_t si = static_cast<int32_t>(s);
      for (int64_t m = s; m <= M; ++m) {  // the candidate s of every m >= s
        const double v = prev[m - s] + prod;
        const bool better = v > best[m];
        best[m] = better ? v : best[m];
        row[m] = better ? si : row[m];
      }
    }
    S.swap(next);
  }
  out_g[0] = 0.0;
  for (int64_t m = 0; m <= M; ++m) out_g[m + 1] = 1.0 + S[m];
}

void level_default(const double* pk, int64_t K, const double* gp, int64_t C, int64_t M, double* g, int32_t* arg) {
  level_body(pk, K, gp, C, M, g, arg);
}
#ifdef SK_X86_AVX2_FMA
__attribute__((target("avx2"))) void level_avx2(const double* pk, int64_t K, const double* gp, int64_t C, int64_t M,
                                                double* g, int32_t* arg) {
  level_body(pk, K, gp, C, M, g, arg);
}
#endif
#ifdef SK_X86_AVX512
__attribute__((target("avx512f"))) void level_avx512(const double* pk, int64_t K, const double* gp, int64_t C,
                                                     int64_t M, double* g, int32_t* arg) {
  level_body(pk, K, gp, C, M, g, arg);
}
#endif

// The widest path this CPU runs, capped by ATEN_CPU_CAPABILITY (cpu/simd.h), as our other kernels.
void level(const double* pk, int64_t K, const double* gp, int64_t C, int64_t M, double* g, int32_t* arg) {
#ifdef SK_X86_AVX512
  if (cpu::have_avx512f()) return level_avx512(pk, K, gp, C, M, g, arg);
#endif
#ifdef SK_X86_AVX2_FMA
  if (cpu::have_avx2_fma()) return level_avx2(pk, K, gp, C, M, g, arg);
#endif
  level_default(pk, K, gp, C, M, g, arg);
}

// Every level of one DP (dp_tables' arithmetic): G [D + 1, N + 1], A [D + 1, K, N], RG and RA the
// root's (per_level), lv = (the p model's levels, the root's).
void build_tables(const double* pk, int64_t K, const double* p1k, int64_t K1, bool per_level, int64_t N, int64_t D,
                  double* G, int32_t* A, double* RG, int32_t* RA, int64_t* lv) {
  const int64_t M = N - 1, row_g = N + 1, row_a = K * N;
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
      level(p1k, K1, G + (d - 1) * row_g, std::min(M, fulls[d - 1]), M, RG + d * row_g, RA + d * K1 * N);
  }
  lv[0] = d_eff;
  lv[1] = top;
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
  int64_t* lv = levels.data_ptr<int64_t>();
  build_tables(p.const_data_ptr<double>(), K, p1.const_data_ptr<double>(), K1, per_level, N, D, g.data_ptr<double>(),
               arg.data_ptr<int32_t>(), root_g.data_ptr<double>(), root_arg.data_ptr<int32_t>(), lv);
}

}  // namespace

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) {
  m.impl("dp_level", &dp_level_cpu);
  m.impl("dp_tables", &dp_tables_cpu);
}

// ---- dp_search (cpu/dp_search.h): Replanner._solve's budget filters and _search_python's search.
namespace {

struct Searched {
  int64_t N = 0, K = 0, K1 = 0, d_eff = 1, top = 1;
  bool per_level = false;
  std::vector<double> G, RG;
  std::vector<int32_t> A, RA;
  double value(int64_t d, int64_t m) const {  // _Tables.value
    m = std::min(m, N);
    const int64_t dd = per_level ? std::min(d, top) : std::min(d, d_eff);
    return per_level && dd >= 2 ? RG[dd * (N + 1) + m] : G[dd * (N + 1) + m];
  }
  // _Tables.rebuild: parents, depth, rank of the best tree of n nodes and d levels, BFS order
  void rebuild(int64_t n, int64_t d, std::vector<int64_t>& parents, std::vector<int64_t>& depth,
               std::vector<int64_t>& rank) const {
    parents.assign(1, -1), depth.assign(1, 0), rank.assign(1, 0);
    struct Item { int64_t node, dd, m; };
    std::vector<Item> queue = {{0, std::min(d, per_level ? top : d_eff), n}};
    for (size_t head = 0; head < queue.size(); ++head) {
      const Item it = queue[head];
      if (it.dd <= 1) continue;
      const bool at_root = it.node == 0 && per_level;
      const int32_t* arg = at_root ? RA.data() + it.dd * K1 * N : A.data() + std::min(it.dd, d_eff) * K * N;
      int64_t mm = it.m - 1;
      for (int64_t k = 1; k <= (at_root ? K1 : K) && mm > 0; ++k) {
        const int64_t s = arg[(k - 1) * N + mm];
        if (s == 0) break;
        queue.push_back({static_cast<int64_t>(parents.size()), it.dd - 1, s});
        parents.push_back(it.node);
        depth.push_back(depth[it.node] + 1);
        rank.push_back(k);
        mm -= s;
      }
    }
  }
};

// LiveCosts.factor: exp of the log correction, piecewise linear in log2 n between the learnt node
// counts xs (ascending), the nearest one's beyond them.
double live_factor(const std::vector<int64_t>& xs, const std::vector<double>& ys, int64_t n) {
  if (n <= xs.front() || n >= xs.back()) return std::exp(n <= xs.front() ? ys.front() : ys.back());
  const size_t i = std::upper_bound(xs.begin(), xs.end(), n) - xs.begin();
  const double la = std::log2(static_cast<double>(xs[i - 1])), lb = std::log2(static_cast<double>(xs[i]));
  return std::exp(ys[i - 1] + (ys[i] - ys[i - 1]) * (std::log2(static_cast<double>(n)) - la) / (lb - la));
}

// adaptive._any_depth_values: E[m - 1] >= E of any tree of m nodes (1 + the m - 1 largest path
// products of the tree whose levels take their vectors sorted, found best first)
std::vector<double> any_depth_values(std::vector<double> first, std::vector<double> deep, int64_t n) {
  std::sort(first.rbegin(), first.rend());
  std::sort(deep.rbegin(), deep.rend());
  struct Node { double product; int64_t k; double parent; bool root; };
  auto lower = [](const Node& a, const Node& b) { return a.product < b.product; };
  std::priority_queue<Node, std::vector<Node>, decltype(lower)> heap(lower);
  if (!first.empty() && first[0] > 0) heap.push({first[0], 0, 1.0, true});
  std::vector<double> E = {1.0};
  while (static_cast<int64_t>(E.size()) < n) {
    if (heap.empty()) {
      E.push_back(E.back());
      continue;
    }
    const Node x = heap.top();
    heap.pop();
    E.push_back(E.back() + x.product);
    const std::vector<double>& vec = x.root ? first : deep;
    if (x.k + 1 < static_cast<int64_t>(vec.size()) && vec[x.k + 1] > 0)
      heap.push({x.parent * vec[x.k + 1], x.k + 1, x.parent, x.root});  // the next sibling
    if (!deep.empty() && deep[0] > 0) heap.push({x.product * deep[0], 0, x.product, false});  // the first child
  }
  return E;
}

std::vector<double> useful(const std::vector<double>& v) {  // dp._useful_acceptance: trailing zeros dropped
  size_t k = v.size();
  while (k && !(v[k - 1] > 0)) --k;
  return {v.begin(), v.begin() + k};
}

int64_t useful_budget(int64_t k, int64_t d, int64_t n, int64_t k1) {  // dp._useful_budget (k1 < 0: none)
  int64_t full = 1;
  for (int64_t level = d - 1; level > 0; --level) {
    full = 1 + (k1 >= 0 && level == 1 ? k1 : k) * full;
    if (full >= n) return n;
  }
  return std::min(n, full);
}

void check_search(const SearchInput& in) {
  auto fail = [](const char* what) { throw std::invalid_argument(std::string("dp_search: ") + what); };
  if (in.depth_limit < 1) fail("depth_limit must be >= 1");
  if (in.budgets.empty() || in.budgets[0] != 1 || in.target_s.size() != in.budgets.size())
    fail("budgets (ascending, the first 1) and target_s must have one length >= 1");
  for (size_t i = 1; i < in.budgets.size(); ++i)
    if (in.budgets[i] <= in.budgets[i - 1]) fail("budgets must ascend");
  const int64_t top = in.budgets.back();
  if (static_cast<int64_t>(in.draft_w.size()) < top + 2 || static_cast<int64_t>(in.overhead_s.size()) < top + 1)
    fail("draft_w needs the widths 0 .. max budget + 1, overhead_s the node counts 0 .. max budget");
  if (in.cost_nodes.empty() || in.cost_log.size() != in.cost_nodes.size())
    fail("cost_nodes and cost_log must have one length >= 1");
  for (size_t i = 1; i < in.cost_nodes.size(); ++i)
    if (in.cost_nodes[i] <= in.cost_nodes[i - 1]) fail("cost_nodes must ascend");
  for (double x : in.p)
    if (!(x >= 0.0 && x <= 1.0)) fail("p must be in [0, 1]");
  for (double x : in.p1)
    if (!(x >= 0.0 && x <= 1.0)) fail("p1 must be in [0, 1]");
  if (!in.per_level && !in.p1.empty()) fail("p1 only with per_level");
}

// Replanner._search_tables: the search over the first `count` budgets on the DP tables to the
// largest of them: (the best tree as dp_search returns it or [], its seconds per token or base)
std::pair<std::vector<int64_t>, double> search_tables(const SearchInput& in, const std::vector<int64_t>& budgets,
                                                      const std::vector<double>& target_s, size_t count,
                                                      double f_lo, double base) {
  const int64_t N_all = budgets[count - 1];
  // the DP tables (dp.tables_for's): budgets <= n_eff, levels <= min(D, n_eff)
  const std::vector<double> p = useful(in.p), p1 = in.per_level ? useful(in.p1) : std::vector<double>{};
  const int64_t N = useful_budget(static_cast<int64_t>(p.size()), in.depth_limit, N_all,
                                  in.per_level ? static_cast<int64_t>(p1.size()) : -1);
  if (N < 2) return {{}, base};
  const int64_t D = std::min(in.depth_limit, N);
  Searched t;
  t.N = N, t.per_level = in.per_level;
  t.K = std::min<int64_t>(p.size(), N - 1), t.K1 = in.per_level ? std::min<int64_t>(p1.size(), N - 1) : 0;
  t.G.assign((D + 1) * (N + 1), 0.0), t.RG.assign((D + 1) * (N + 1), 0.0);
  t.A.assign((D + 1) * t.K * N, 0), t.RA.assign((D + 1) * t.K1 * N, 0);
  int64_t lv[2];
  build_tables(p.data(), t.K, p1.data(), t.K1, in.per_level, N, D, t.G.data(), t.A.data(), t.RG.data(), t.RA.data(),
               lv);
  t.d_eff = lv[0], t.top = lv[1];
  // the candidates by their lower bounds (Replanner._search_python)
  std::vector<std::tuple<double, int64_t, int64_t>> bounds;  // (s/token at least, index of n, d)
  const int64_t d_hi = std::min(in.depth_limit, in.per_level ? t.top : t.d_eff);
  for (size_t i = 1; i < count; ++i)
    for (int64_t d = 2; d <= d_hi; ++d) {
      const double E = t.value(d, budgets[i]);
      if (E <= t.value(d - 1, budgets[i]) || E <= t.value(d, budgets[i - 1])) continue;
      const double lo = (target_s[i] + static_cast<double>(d - 1) * in.draft_lo + in.oh_lo) * f_lo / E;
      bounds.emplace_back(lo, static_cast<int64_t>(i), d);
    }
  std::sort(bounds.begin(), bounds.end());  // as Python sorts (lo, n, d): the index ascends with n
  double best_spt = base;  // plain decoding first: a tree must beat it
  std::vector<int64_t> parents, depth, rank, best;
  for (const auto& [lo, i, d] : bounds) {
    if (lo >= best_spt) break;
    const int64_t n = budgets[i];
    t.rebuild(std::min(n, N), d, parents, depth, rank);
    const int64_t nodes = static_cast<int64_t>(depth.size());
    if (nodes < 2) continue;
    const int64_t levels = *std::max_element(depth.begin(), depth.end()) + 1;
    std::vector<int64_t> widths(levels, 0);  // planner._level_widths: [root level + 1] + the inner levels
    for (int64_t x : depth) ++widths[x];
    double draft = 0.0;
    if (in.t_d >= 0.0) {
      draft = static_cast<double>(levels - 1) * in.t_d;
    } else {
      for (int64_t l = 0; l + 1 < levels; ++l) draft += in.draft_w[l == 0 ? widths[0] + 1 : widths[l]];
    }
    const double spt = (draft + target_s[i] + in.overhead_s[nodes]) * live_factor(in.cost_nodes, in.cost_log, nodes) /
                       t.value(d, n);
    if (spt < best_spt) {
      best_spt = spt;
      best = {n, d, nodes};
      best.insert(best.end(), parents.begin(), parents.end());
      best.insert(best.end(), depth.begin(), depth.end());
      best.insert(best.end(), rank.begin(), rank.end());
    }
  }
  return {best, best_spt};
}

}  // namespace

std::vector<int64_t> dp_search(const SearchInput& in) {
  check_search(in);
  const std::vector<double>& first = in.per_level ? in.p1 : in.p;
  double s1 = 0.0, s2 = 0.0;
  for (double x : first) s1 += x;
  for (double x : in.p) s2 += x;
  const double mass = std::max(s1, s2);
  const double base = (in.target_s[0] + in.overhead_s[1]) * live_factor(in.cost_nodes, in.cost_log, 1);
  double E_max = 0.0;  // E of the unbounded tree of D levels, at least
  for (int64_t j = 0; j < in.depth_limit; ++j) E_max += std::pow(mass, static_cast<double>(j));
  std::vector<int64_t> budgets;  // those whose trees could beat plain decoding (Replanner._solve)
  std::vector<double> target_s;
  for (size_t i = 0; i < in.budgets.size(); ++i)
    if (in.budgets[i] == 1 || in.target_s[i] < base * E_max) budgets.push_back(in.budgets[i]), target_s.push_back(in.target_s[i]);
  double f_lo = 0.0;
  for (double y : in.cost_log) f_lo = std::min(f_lo, y);
  f_lo = std::exp(f_lo);
  const std::vector<double> E_hi = any_depth_values(first, in.p, budgets.back());
  const double tree_lo = in.draft_lo + in.oh_lo;
  size_t kept = 0;
  for (size_t i = 0; i < budgets.size(); ++i)
    if (budgets[i] == 1 || (target_s[i] + tree_lo) * f_lo < base * E_hi[budgets[i] - 1])
      budgets[kept] = budgets[i], target_s[kept++] = target_s[i];
  budgets.resize(kept), target_s.resize(kept);
  if (budgets.back() <= 1 || !(mass > 0)) return {};
  if (budgets.size() > 2) {  // staged: the DP to the largest budget only where its trees could win
    auto [found, best_spt] = search_tables(in, budgets, target_s, budgets.size() - 1, f_lo, base);
    const int64_t n = budgets.back();
    if ((target_s.back() + tree_lo) * f_lo > best_spt * E_hi[n - 1]) return found;
  }
  return search_tables(in, budgets, target_s, budgets.size(), f_lo, base).first;
}

}  // namespace sequoia_kernels
