// The one place where every sequoia_kernels op schema is declared, and the module's one Python
// function (dp_search: no tensors). CPU implementations live in csrc/cpu/*.cpp, CUDA
// implementations in csrc/cuda/*.cu, fake (meta) implementations in sequoia_kernels/ops/*.py.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu/dp_search.h"

namespace {

// A Python sequence of numbers as a vector (false, with a Python error set, when it is not one).
// The limited API (the extension is built for cp39's stable ABI): no PySequence_Fast macros.
template <typename T>
bool to_vector(PyObject* seq, const char* what, std::vector<T>& out) {
  const Py_ssize_t n = PySequence_Check(seq) ? PySequence_Size(seq) : -1;
  if (n < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, what);
    return false;
  }
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(seq, i);
    if (item == nullptr) return false;
    if constexpr (std::is_same_v<T, double>) {
      out[i] = PyFloat_AsDouble(item);
    } else {
      out[i] = PyLong_AsLongLong(item);
    }
    Py_DECREF(item);
    if (PyErr_Occurred()) return false;
  }
  return true;
}

// _C.dp_search(p, p1, per_level, depth_limit, budgets, target_s, draft_w, overhead_s, cost_nodes,
// cost_log, draft_lo, oh_lo, t_d) -> list[int] (csrc/cpu/dp_search.h; ValueError on bad input).
// A plain Python function, not an op: it takes no tensors, and it runs with cold caches, where
// the dispatcher's path alone cost ~57 us (sequoia_decoding/adaptive.py, Replanner._search).
PyObject* py_dp_search(PyObject*, PyObject* args) {
  PyObject *p, *p1, *budgets, *target_s, *draft_w, *overhead_s, *cost_nodes, *cost_log;
  int per_level = 0;
  long long depth_limit = 0;
  sequoia_kernels::SearchInput in;
  if (!PyArg_ParseTuple(args, "OOpLOOOOOOddd", &p, &p1, &per_level, &depth_limit, &budgets, &target_s, &draft_w,
                        &overhead_s, &cost_nodes, &cost_log, &in.draft_lo, &in.oh_lo, &in.t_d))
    return nullptr;
  in.per_level = per_level != 0, in.depth_limit = depth_limit;
  if (!to_vector(p, "dp_search: p must be a sequence", in.p) ||
      !to_vector(p1, "dp_search: p1 must be a sequence", in.p1) ||
      !to_vector(budgets, "dp_search: budgets must be a sequence", in.budgets) ||
      !to_vector(target_s, "dp_search: target_s must be a sequence", in.target_s) ||
      !to_vector(draft_w, "dp_search: draft_w must be a sequence", in.draft_w) ||
      !to_vector(overhead_s, "dp_search: overhead_s must be a sequence", in.overhead_s) ||
      !to_vector(cost_nodes, "dp_search: cost_nodes must be a sequence", in.cost_nodes) ||
      !to_vector(cost_log, "dp_search: cost_log must be a sequence", in.cost_log))
    return nullptr;
  std::vector<int64_t> found;
  try {
    found = sequoia_kernels::dp_search(in);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(found.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < found.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(found[i]);
    if (v == nullptr || PyList_SetItem(out, static_cast<Py_ssize_t>(i), v) < 0) {  // SetItem steals v
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

PyMethodDef methods[] = {
    {"dp_search", py_dp_search, METH_VARARGS, "A re-planner's search in one native call (csrc/cpu/dp_search.h)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
// Importing sequoia_kernels._C loads this library (and so registers the ops), as in
// pytorch/extension-cpp; its one Python function is dp_search (above).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}

namespace sequoia_kernels {
int64_t packed_linear_bf16_isa(int64_t isa);  // csrc/cpu/packed_linear_bf16.cpp
}

TORCH_LIBRARY(sequoia_kernels, m) {
  // cache [N, B, H, S, D] (N = 2 x layers), src_pos [B, M], dst_start [B], num_accepted [B].
  // cache[:, b, :, dst_start[b] + i] := cache[:, b, :, src_pos[b, i]] for i < num_accepted[b].
  m.def("compact_kv_(Tensor(a!) cache, Tensor src_pos, Tensor dst_start, Tensor num_accepted) -> ()");
  // q [B, Hq, T, D] (T query nodes), k_cache/v_cache [B, Hkv, S, D] with tree_len tree keys at
  // prefix_len[b] .., prefix_len [B], mask_bits int32 [1 or B, T, ceil(tree_len/32)] (bit j of
  // row i: query i sees tree key j); writes out [B, Hq, T, D]. The split-KV workspace
  // partial_out fp32 [B, Hq, T, splits, D], partial_lse fp32 [B, Hq, T, splits] is scratch (the
  // CPU kernel ignores it).
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_len, "
        "Tensor mask_bits, int tree_len, float scale, Tensor(a!) out, Tensor(b!) partial_out, "
        "Tensor(c!) partial_lse) -> ()");
  // target_probs/draft_probs fp32 [B, T, V], tokens int64 [B, T], parents int64 [T], uniforms
  // fp32 [B, T] (column c >= 1 decides child node c, column 0 the bonus token); writes path
  // int64 [B, T], num_accepted int64 [B], bonus int64 [B]; workspace fp32 [>= 2 * B * V] is
  // scratch for the residual distributions. Algorithm: csrc/kernels/verify_tree.h.
  m.def("verify_tree(Tensor target_probs, Tensor draft_probs, Tensor tokens, Tensor parents, "
        "Tensor uniforms, bool greedy, Tensor(a!) path, Tensor(b!) num_accepted, "
        "Tensor(c!) bonus, Tensor(d!) workspace) -> ()");
  // logits [R, V] fp16/bf16/fp32/fp64 (vocabulary contiguous) -> out fp32 [R, V]: temperature,
  // top-k, top-p as in sequoia_kernels/reference/sampling.py (temperature 0: one-hot argmax).
  m.def("sampling_probs(Tensor logits, float temperature, int top_k, float top_p, Tensor(a!) out) -> ()");
  // draft_probs fp32 [R, V], num_children int32/int64 [R], uniforms fp32 [R, V] -> out int64
  // [R, K]: each row's children without replacement (exponential race), -1 padded.
  m.def("sample_children(Tensor draft_probs, Tensor num_children, Tensor uniforms, Tensor(a!) out) -> ()");
  // p, q fp32 [R, V] (vocabulary contiguous), rows int64 [N] in [0, R) -> out fp32 [N]:
  // out[i] = sum_v min(p[rows[i], v], q[rows[i], v]) (a child drawn from q is accepted against p
  // with that probability: the adaptive loop's first-child acceptance). CPU only.
  m.def("overlap_rows(Tensor p, Tensor q, Tensor rows, Tensor(a!) out) -> ()");
  // x fp32 [M, K] (rows contiguous), w_packed fp32 [ceil(N / 16), K, 16] (pack_linear_weight of
  // a [N, K] weight) -> out fp32 [M, N] = x W^T. CPU only (few-row products of the decoding
  // loop on AVX2 CPUs; GPUs use cuBLAS).
  m.def("packed_linear(Tensor x, Tensor w_packed, int out_features, Tensor(a!) out) -> ()");
  // x bf16 [M, K] (rows contiguous), w_packed bf16 [4 ceil(N / 64), 16 ceil(K / 32), 16, 2]
  // (pack_linear_weight_bf16) -> out bf16 [M, N] = x W^T, fp32 chains, batch invariant. isa: 0 the
  // CPU's best, 1 scalar, 2 AVX2+FMA, 3 AVX-512-BF16, 4 AMX (csrc/cpu/packed_linear_bf16.cpp).
  // residual: [M, N] bf16 added to the product in its output store (each rounded to bf16, as torch's
  // add of the two: a decoder layer's residual add, fused); it may be out itself (each element is
  // read, then written, by the same task).
  // rope_cos / rope_sin [B or 1, T, D] bf16 (M = B x T rows), rope_cols > 0: the rotary embedding
  // applied in place to out's first rope_cols columns (heads of D, D dividing 64), as the rotary_bf16
  // op computes it, once each group of 64 columns is stored (a fused q / k projection's epilogue).
  // silu_out [M, N / 2] bf16: w is [gate; up] (N = 2 I, I a multiple of 32) and silu_out = the
  // silu_mul_bf16 op on out's two halves, computed group by group as they are stored (a fused
  // gate-up projection's epilogue); out still receives the product.
  m.def("packed_linear_bf16(Tensor x, Tensor w_packed, int out_features, Tensor(a!) out, int isa, "
        "Tensor? residual=None, Tensor? rope_cos=None, Tensor? rope_sin=None, int rope_cols=0, "
        "Tensor(b!)? silu_out=None) -> ()");
  // w bf16 [N, K] (rows contiguous) -> out bf16 [4 ceil(N / 64), 16 ceil(K / 32), 16, 2], the
  // layout packed_linear_bf16 reads (zero padded), in one pass (an offloaded layer is packed per forward).
  m.def("pack_linear_weight_bf16(Tensor w, Tensor(a!) out) -> ()");
  // x bf16 [..., H] (contiguous), weight bf16 [H] -> out bf16 [..., H]: Hugging Face's Llama
  // RMSNorm in bf16, one pass per row, batch invariant (csrc/cpu/fused_bf16.cpp). CPU only.
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  // gate, up bf16 [..., I] (contiguous) -> out = bf16(bf16(silu(gate)) * up): the Llama MLP's
  // activation in bf16, one pass (csrc/cpu/fused_bf16.cpp). CPU only.
  m.def("silu_mul_bf16(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  // x bf16 [B, H, T, D], cos/sin bf16 [B or 1, T, D] -> out bf16 [B, H, T, D] (contiguous) =
  // x * cos + rotate_half(x) * sin with Hugging Face's roundings, bitwise (csrc/cpu/fused_bf16.cpp).
  m.def("rotary_bf16(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
  // One level of Sequoia's tree DP (csrc/cpu/dp_level.cpp; reference: sequoia_decoding/dp.py
  // _level): p float64 [K], g_prev float64 [>= C + 1] -> g float64 [M + 2], arg int32 [K, M + 1]. CPU only.
  m.def("dp_level(Tensor p, Tensor g_prev, int C, int M, Tensor(a!) g, Tensor(b!) arg) -> ()");
  // Every level of one DP (csrc/cpu/dp_level.cpp; reference: sequoia_decoding/dp.py _Tables):
  // p [K], p1 [K1] float64 -> g [D + 1, N + 1], arg int32 [D + 1, K, N], root_g, root_arg
  // [D + 1, K1, N] (per_level), levels int64 [2] = (the p model's levels, the root's). CPU only.
  m.def("dp_tables(Tensor p, Tensor p1, bool per_level, int N, int D, Tensor(a!) g, Tensor(b!) arg, "
        "Tensor(c!) root_g, Tensor(d!) root_arg, Tensor(e!) levels) -> ()");
  // The isa a packed_linear_bf16 call with `isa` runs (0: this CPU's best), -1 if unavailable.
  m.def("packed_linear_bf16_isa(int isa) -> int", &sequoia_kernels::packed_linear_bf16_isa);
}
