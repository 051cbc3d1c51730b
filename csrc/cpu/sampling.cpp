// sampling_probs and sample_children CPU implementations: rows in parallel (at::parallel_for),
// each row a few SIMD passes over a row-sized scratch that stays in L2. Spec:
// sequoia_kernels/reference/sampling.py; the threshold searches and the top-K selection are in
// csrc/kernels/sampling.h.
//
// Agreement with the reference: every elementwise step is the spec's IEEE fp32 operation (no
// FMA contraction: the SIMD clones target "avx2" without "fma"), sums are fp64 (in another
// order: the spec allows any), except exp: the spec's "fp32 exp" is torch's (SLEEF) in the
// reference and csrc/cpu/vec_math.h's polynomial here (<= 1 ulp from the correctly rounded exp,
// fused into the pass that scales the logits; torch's alone cost more than the rest of the
// row). So sampling_probs agrees with the reference to a few ulp (tests/test_sampling.py bounds
// it), like the GPU kernels; top-k survivors are identical (decided on y, before exp) and a
// top-p decision can differ only for a token whose mass-above lies within rounding of top_p.
// sample_children is bitwise the reference's: its log is at::log_out on the row (torch.log's
// function), and its keys decide which tokens are drawn.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <ATen/ops/from_blob.h>
#include <ATen/ops/log.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cmath>
#include <utility>
#include <vector>

#include "cpu/simd.h"
#include "cpu/vec_math.h"
#include "kernels/sampling.h"

namespace sequoia_kernels {

namespace {

using sampling::mag_key;

// ------------------------------------------------------------------------------ SIMD passes

// max of x (NaN-propagating like torch.amax).
SK_SIMD_CLONES
float row_max(const float* __restrict x, int64_t V) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  return nan ? NAN : m;
}

// Whether x[0..n) holds m (NaN: a NaN), one vector pass.
SK_SIMD_CLONES
bool holds(const float* __restrict x, int64_t n, float m, bool nan) {
  int hit = 0;
#pragma omp simd reduction(| : hit)
  for (int64_t i = 0; i < n; ++i) hit |= nan ? x[i] != x[i] : x[i] == m;
  return hit != 0;
}

// torch.argmax of x: the first index of the maximum, the first NaN's if any. row_max's vector
// pass, then the first block of 64 holding the maximum, searched in order (a scalar scan of the
// row cost ~50 us at V = 49152, more than the whole unfiltered softmax). Not
// sampling::for_each_match: it visits every match and so the whole row (8 rows: 191 us against
// 135 for this early exit).
int64_t row_argmax(const float* x, int64_t V) {
  const float m = row_max(x, V);
  const bool nan = m != m;
  for (int64_t i0 = 0; i0 < V; i0 += 64) {
    const int64_t n = std::min<int64_t>(64, V - i0);
    if (!holds(x + i0, n, m, nan)) continue;
    for (int64_t i = i0; i < i0 + n; ++i)
      if (nan ? x[i] != x[i] : x[i] == m) return i;
  }
  return 0;  // (not reached: m is one of x's values)
}

// y = (x - m) / t (the division skipped when t = 1: x / 1 == x).
SK_SIMD_CLONES
void scale_row(const float* __restrict x, int64_t V, float m, float t, float* __restrict y) {
  if (t == 1.f) {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) y[i] = x[i] - m;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) y[i] = (x[i] - m) / t;
  }
}

// e[i] = mag(y[i]) <= tau ? e[i] : 0 (tau = ~0u: no mask); returns the fp64 sum of e.
SK_SIMD_CLONES
double mask_and_sum(const float* __restrict y, int64_t V, uint32_t tau, float* __restrict e) {
  double z = 0.0;
  if (tau == 0xffffffffu) {
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < V; ++i) z += static_cast<double>(e[i]);
  } else {
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < V; ++i) {
      const float v = mag_key(y[i]) <= tau ? e[i] : 0.f;
      e[i] = v;
      z += static_cast<double>(v);
    }
  }
  return z;
}

// Exponential-race keys as order keys: q > 0: order_key(min(-l / q, FLT_MAX)), else +inf.
SK_SIMD_CLONES
void race_keys(const float* __restrict l, const float* __restrict q, int64_t V, uint32_t* __restrict k) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    float v = -l[i] / q[i];
    v = v > FLT_MAX ? FLT_MAX : v;  // torch.clamp(max=): NaN stays NaN
    uint32_t b = sampling::f32_bits(v);
    b = (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : b;  // NaN above +inf
    b = b == 0x80000000u ? 0u : b;                          // -0 == +0
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    k[i] = q[i] > 0.f ? b : sampling::kOrderKeyInf;
  }
}

SK_SIMD_CLONES
int64_t count_positive(const float* __restrict q, int64_t V) {
  int64_t n = 0;
#pragma omp simd reduction(+ : n)
  for (int64_t i = 0; i < V; ++i) n += q[i] > 0.f;
  return n;
}

// torch.log of a contiguous fp32 row into another (the reference's function).
void torch_log(const float* in, float* out, int64_t V) {
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  at::Tensor o = at::from_blob(out, {V}, opt);
  at::log_out(o, at::from_blob(const_cast<float*>(in), {V}, opt));
}

// ------------------------------------------------------------------------- sampling_probs

struct ProbsScratch {
  std::vector<float> x, y, yc, ec;
  std::vector<int64_t> idx;
  std::vector<uint32_t> cand_k;
  std::vector<uint32_t> cand_pm;
  std::vector<float> cand_pe;
  std::vector<std::pair<uint32_t, int64_t>> nucleus;
};

// Top-p alone (no top-k). The nucleus usually holds a few tokens near the row's maximum (y = 0):
// when the tokens with y > kNucleusCut (e > 1.2e-4 of the maximum's) hold at least P = top_p Z,
// the boundary is among them (any other token has at least their mass above it: dropped), so
// the spec's search runs on them alone, sorted by y, tie groups together. Passes over the row:
// e and Z (the unfiltered path's), the candidates gathered from x (y recomputed with the same
// IEEE ops), out written; against top_p_mag's path's six. Z of the kept tokens is their fp64 sum
// in another order (the spec allows any). Returns false, out untouched, when more than
// kNucleusMax tokens pass the cut or they hold less than P: then the general path.
constexpr float kNucleusCut = -9.0f;
constexpr size_t kNucleusMax = 2048;

inline float scaled(float x, float m, float t) { return t != 1.f ? (x - m) / t : x - m; }  // scale_row's y

bool nucleus_row(const float* x, int64_t V, float m, float t, double top_p, float* out, ProbsScratch& s) {
  s.y.resize(V);
  float* e = s.y.data();
  const double P = top_p * cpu::scale_exp_sum(x, V, m, t, e);
  auto& c = s.nucleus;  // (mag key of y, index)
  c.clear();
  bool many = false;
  sampling::for_each_match(
      V, [&](int64_t i) { return scaled(x[i], m, t) > kNucleusCut && e[i] > 0.f; },
      [&](int64_t i) {
        if (c.size() < kNucleusMax) c.emplace_back(mag_key(scaled(x[i], m, t)), i);
        else many = true;
      });
  double A = 0.0;
  for (const auto& k : c) A += static_cast<double>(e[k.second]);
  if (many || !(A >= P)) return false;
  std::sort(c.begin(), c.end());  // the most likely first (y <= 0: the smallest magnitude), ties by index
  A = 0.0;
  size_t kept = 0;
  while (kept < c.size() && A < P) {  // a tie group is kept while the mass strictly above it is < P
    const uint32_t key = c[kept].first;
    for (; kept < c.size() && c[kept].first == key; ++kept) A += static_cast<double>(e[c[kept].second]);
  }
  const float Zf = static_cast<float>(A);
  std::fill(out, out + V, 0.f);
  for (size_t j = 0; j < kept; ++j) out[c[j].second] = e[c[j].second] / Zf;
  return true;
}

// One row: x fp32 [V] -> out fp32 [V] (out may not alias x).
void probs_row(const float* x, int64_t V, double temperature, int64_t top_k, double top_p,
               float* out, ProbsScratch& s) {
  if (temperature == 0.0) {  // one-hot at the first index of the maximum (torch.argmax: NaN wins)
    const int64_t best = row_argmax(x, V);
    std::fill(out, out + V, 0.f);
    out[best] = 1.f;
    return;
  }
  const float m = row_max(x, V);
  s.y.resize(V);
  float* y = s.y.data();
  if ((top_k <= 0 || top_k >= V) && top_p >= 1.0) {
    // no filter (the decoding default): e = exp(y) and its sum in one pass into the row
    // scratch (x and it stay in L2), then out = e / Z streamed to memory: the row costs one
    // read of x and one write of out in memory traffic (no read-for-ownership of out)
    const double Z = cpu::scale_exp_sum(x, V, m, static_cast<float>(temperature), y);
    cpu::divide_row_to(y, V, static_cast<float>(Z), out);
    return;
  }
  if ((top_k <= 0 || top_k >= V) && nucleus_row(x, V, m, static_cast<float>(temperature), top_p, out, s)) return;
  scale_row(x, V, m, static_cast<float>(temperature), y);
  uint32_t tau = 0xffffffffu;
  if (top_k > 0 && top_k < V) {
    tau = sampling::kth_smallest_mag(y, V, top_k, s.cand_k);
    if (top_k <= V / 8) {  // few survivors: gather them, exp and top-p on the compact row only
      s.idx.clear();
      s.yc.clear();
      sampling::for_each_match(
          V, [&](int64_t i) { return mag_key(y[i]) <= tau; },
          [&](int64_t i) {
            s.idx.push_back(i);
            s.yc.push_back(y[i]);
          });
      const int64_t n = static_cast<int64_t>(s.idx.size());
      s.ec.resize(n);
      float* ec = s.ec.data();
      cpu::exp_row(s.yc.data(), ec, n);
      double Z = mask_and_sum(s.yc.data(), n, 0xffffffffu, ec);
      if (top_p < 1.0) {
        const uint32_t tp = sampling::top_p_mag(s.yc.data(), ec, n, top_p * Z, s.cand_pm, s.cand_pe);
        Z = mask_and_sum(s.yc.data(), n, tp, ec);
      }
      const float Zf = static_cast<float>(Z);
      std::fill(out, out + V, 0.f);
      for (int64_t j = 0; j < n; ++j) out[s.idx[j]] = ec[j] / Zf;
      return;
    }
  }
  cpu::exp_row(y, out, V);
  double Z = mask_and_sum(y, V, tau, out);
  if (top_p < 1.0) {
    const uint32_t tp = sampling::top_p_mag(y, out, V, top_p * Z, s.cand_pm, s.cand_pe);
    Z = mask_and_sum(y, V, tp, out);
  }
  cpu::divide_row_to(out, V, static_cast<float>(Z), out);
}

template <typename T>
void to_float(const T* in, int64_t V, float* out) {
  for (int64_t i = 0; i < V; ++i) out[i] = static_cast<float>(in[i]);
}

void sampling_probs_cpu(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                        at::Tensor& out) {
  TORCH_CHECK(logits.device().is_cpu() && out.device().is_cpu(),
              "sampling_probs (cpu): tensors must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1,
              "sampling_probs: logits must be [R, V] with V >= 1, got ", logits.sizes());
  const int64_t R = logits.size(0), V = logits.size(1);
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
              "sampling_probs: logits must be float16/bfloat16/float32/float64, got ", dt);
  TORCH_CHECK(V == 1 || logits.stride(1) == 1, "sampling_probs: the vocabulary dimension of logits must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == R && out.size(1) == V &&
                  (V == 1 || out.stride(1) == 1),
              "sampling_probs: out must be float32 [R, V] = [", R, ", ", V,
              "] with a contiguous last dimension, got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0.0, "sampling_probs: temperature must be finite and >= 0");
  TORCH_CHECK(top_k >= 0, "sampling_probs: top_k must be >= 0");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "sampling_probs: top_p must be in (0, 1]");
  if (R == 0) return;
  const int64_t xs = logits.stride(0), os = out.stride(0);
  const char* xbase = static_cast<const char*>(logits.const_data_ptr());
  const int64_t esize = logits.element_size();
  float* obase = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / V), [&](int64_t begin, int64_t end) {
    ProbsScratch s;
    for (int64_t r = begin; r < end; ++r) {
      const void* row = xbase + r * xs * esize;
      const float* x;
      if (dt == at::kFloat) {
        x = static_cast<const float*>(row);
      } else {
        s.x.resize(V);
        if (dt == at::kHalf) to_float(static_cast<const at::Half*>(row), V, s.x.data());
        else if (dt == at::kBFloat16) to_float(static_cast<const at::BFloat16*>(row), V, s.x.data());
        else to_float(static_cast<const double*>(row), V, s.x.data());
        x = s.x.data();
      }
      probs_row(x, V, temperature, top_k, top_p, obase + r * os, s);
    }
  });
}

// ------------------------------------------------------------------------ sample_children

void sample_children_cpu(const at::Tensor& draft_probs, const at::Tensor& num_children,
                         const at::Tensor& uniforms, at::Tensor& out) {
  TORCH_CHECK(draft_probs.device().is_cpu() && num_children.device().is_cpu() && uniforms.device().is_cpu() &&
                  out.device().is_cpu(),
              "sample_children (cpu): tensors must be on the CPU");
  TORCH_CHECK(draft_probs.dim() == 2 && draft_probs.size(1) >= 1 && draft_probs.scalar_type() == at::kFloat,
              "sample_children: draft_probs must be float32 [R, V] with V >= 1, got ", draft_probs.scalar_type(),
              " ", draft_probs.sizes());
  const int64_t R = draft_probs.size(0), V = draft_probs.size(1);
  TORCH_CHECK(V <= INT32_MAX, "sample_children: V must be < 2**31");
  TORCH_CHECK(V == 1 || draft_probs.stride(1) == 1, "sample_children: the vocabulary dimension of draft_probs must be contiguous");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.dim() == 2 && uniforms.size(0) == R &&
                  uniforms.size(1) == V && (V == 1 || uniforms.stride(1) == 1),
              "sample_children: uniforms must be float32 [R, V] = [", R, ", ", V, "] with a contiguous last dimension");
  TORCH_CHECK((num_children.scalar_type() == at::kLong || num_children.scalar_type() == at::kInt) &&
                  num_children.dim() == 1 && num_children.size(0) == R,
              "sample_children: num_children must be int32/int64 [R] = [", R, "]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 2 && out.size(0) == R,
              "sample_children: out must be int64 [R, K] with R = ", R);
  const int64_t K = out.size(1);
  if (R == 0 || K == 0) return;
  const at::Tensor counts = num_children.to(at::kLong).contiguous();
  const int64_t* cnt = counts.const_data_ptr<int64_t>();
  const float* q0 = draft_probs.const_data_ptr<float>();
  const float* u0 = uniforms.const_data_ptr<float>();
  const int64_t qs = draft_probs.stride(0), us = uniforms.stride(0);
  int64_t* o0 = out.data_ptr<int64_t>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t Kv = std::min(K, V);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / V), [&](int64_t begin, int64_t end) {
    std::vector<float> l(V);
    std::vector<uint32_t> keys(V);
    std::vector<uint64_t> heap;
    for (int64_t r = begin; r < end; ++r) {
      const float* q = q0 + r * qs;
      torch_log(u0 + r * us, l.data(), V);
      race_keys(l.data(), q, V, keys.data());
      sampling::smallest_k(keys.data(), V, Kv, heap);
      const int64_t live = std::min(cnt[r], count_positive(q, V));
      int64_t* o = o0 + r * os0;
      for (int64_t j = 0; j < K; ++j)
        o[j * os1] = j < live ? static_cast<int64_t>(heap[j] & 0xffffffffu) : -1;
    }
  });
}

// ------------------------------------------------------------------------ overlap_rows

// sum_v min(p[v], q[v]) of one row pair: fp64 lanes (the fp64 reference within ~1e-12 at V = 49152).
SK_SIMD_CLONES
double row_overlap(const float* __restrict p, const float* __restrict q, int64_t V) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t v = 0; v < V; ++v) s += static_cast<double>(p[v] < q[v] ? p[v] : q[v]);
  return s;
}

// out[i] = sum_v min(p[rows[i], v], q[rows[i], v]): the chance a child drawn from q is accepted
// against p at each node of an accepted path (the adaptive loop's first-child acceptance, every
// sampled step). One pass over the rows read, nothing gathered: 3 rows of 49152 in 0.05 ms with
// the loop's glue, where torch's gather, minimum and sum took 0.13-0.15 (2-core Xeon, AMX, warm).
void overlap_rows_cpu(const at::Tensor& p, const at::Tensor& q, const at::Tensor& rows, at::Tensor& out) {
  TORCH_CHECK(p.device().is_cpu() && q.device().is_cpu() && rows.device().is_cpu() && out.device().is_cpu(),
              "overlap_rows (cpu): tensors must be on the CPU");
  TORCH_CHECK(p.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat && p.dim() == 2 && q.sizes() == p.sizes(),
              "overlap_rows: p and q must be float32 [R, V] of one shape, got ", p.sizes(), " and ", q.sizes());
  const int64_t R = p.size(0), V = p.size(1);
  TORCH_CHECK(V <= 1 || (p.stride(1) == 1 && q.stride(1) == 1), "overlap_rows: the last dimension must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "overlap_rows: rows must be int64 [N]");
  const int64_t N = rows.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.size(0) == N, "overlap_rows: out must be float32 [N] = [", N, "]");
  const at::Tensor idx = rows.contiguous();
  const int64_t* r0 = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(r0[i] >= 0 && r0[i] < R, "overlap_rows: rows[", i, "] = ", r0[i], " is outside [0, ", R, ")");
  const float* p0 = p.const_data_ptr<float>();
  const float* q0 = q.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ps = p.stride(0), qs = q.stride(0), ostr = out.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      o[i * ostr] = static_cast<float>(row_overlap(p0 + r0[i] * ps, q0 + r0[i] * qs, V));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) {
  m.impl("sampling_probs", &sampling_probs_cpu);
  m.impl("sample_children", &sample_children_cpu);
  m.impl("overlap_rows", &overlap_rows_cpu);
}

}  // namespace sequoia_kernels
