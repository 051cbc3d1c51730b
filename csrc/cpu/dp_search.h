// dp_search: a re-planner's whole search in one native call, framework-free (no torch, no Python
// headers; csrc/ops.cpp binds it as sequoia_kernels._C.dp_search). Its reference, and the meaning
// of every field: Replanner._solve and _search_python (python_api/sequoia_decoding/adaptive.py),
// whose arithmetic it repeats in the same order (the same plans, bitwise: tests/test_adaptive.py).
//
// Why native and not a torch op: the re-planner runs right after the target's forward, whose
// weight stream leaves every cache cold; there each numpy or torch call of the Python search cost
// 10-40 us, and even the dispatcher's path to an op taking no tensors ~57 us (0.8 us warm).
#pragma once

#include <cstdint>
#include <vector>

namespace sequoia_kernels {

struct SearchInput {
  std::vector<double> p;   // the acceptance vector of every node below the root's children (deep_of)
  std::vector<double> p1;  // per_level: the root's children's vector (LevelAcceptance's first level)
  bool per_level = false;
  int64_t depth_limit = 1;               // the most levels of a candidate (D)
  std::vector<int64_t> budgets;          // candidate budgets, ascending, the first 1 (plain decoding)
  std::vector<double> target_s;          // T(n) at each budget
  std::vector<double> draft_w;           // a draft forward's charge by width, 0 .. max budget + 1
  std::vector<double> overhead_s;        // the loop's time outside the forwards by node count, 0 .. max budget
  std::vector<int64_t> cost_nodes;       // the live costs' learnt node counts (ascending) ...
  std::vector<double> cost_log;          // ... and their log corrections (LiveCosts.points)
  double draft_lo = 0, oh_lo = 0;        // the least draft forward and the least overhead of any tree
  double t_d = -1;                       // >= 0: no draft curve, each level charged t_d (draft_w unused)
};

// [] when no tree beats plain decoding, else [n, d, nodes, parents[nodes], depth[nodes],
// rank[nodes]] (BFS order). Throws std::invalid_argument on input that does not fit.
std::vector<int64_t> dp_search(const SearchInput& in);

}  // namespace sequoia_kernels
