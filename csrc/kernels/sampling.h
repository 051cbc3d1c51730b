// sampling_probs / sample_children: the CUDA kernels' parameters, and the framework-free pieces
// of the C++ CPU kernels (no torch headers): float keys, the radix threshold searches of top-k and top-p, and the per-row top-K
// selection of the exponential race. The spec (every rule, every tie) is the docstring of
// sequoia_kernels/reference/sampling.py; csrc/cpu/sampling.cpp runs these per row.
//
// Threshold searches without a sort. On a row y <= 0 (y = (x - max) / T) larger y means a smaller
// magnitude, and for floats >= 0 the bit pattern orders like the value, so
//     mag(y) = bits(y) & 0x7fffffff      (-0 and +0 both 0; -inf the largest key but NaN's)
// ranks the tokens exactly as y does, ties included. Both top-k ("the k-th largest y, every
// token tied with it kept") and top-p ("keep a token iff the mass of the tokens strictly more
// likely is < top_p * Z", ties kept or dropped together) are thresholds on mag: keep iff
// mag <= tau. tau is found by a most-significant-digit radix descent over 31 key bits in three
// digits (9, 11, 11 bits; the first is the exponent and one mantissa bit): one histogram pass
// over the row for the first digit (four interleaved histograms, so that runs of one bucket do
// not serialise on store-to-load forwarding), then one pass that gathers the tokens in the
// critical bucket (branch-free when it is dense); the last two digits run on those candidates
// only. After the third digit a bucket holds one key value, i.e. one tie group, so the rules are
// applied group by group exactly as written in the spec. Counts are exact; masses are fp64 sums
// (in bucket order: "any order" in the spec's words).
//
// mag(-inf) = 0x7f800000 and NaN (only with validate=False) ranks below -inf; order_key is used
// for the exponential-race keys, which can be any float.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace sequoia_kernels {

// The CUDA kernels' parameters and block sizes (sampling.cuh; filled by csrc/cuda/bindings.cpp).
struct SamplingProbsParams {
  const void* logits;  // [R, V] (row stride s_x, vocab stride 1)
  float* out;          // [R, V] fp32 (row stride s_o)
  int64_t R, V, s_x, s_o;
  float temperature;  // 0: one-hot argmax
  int64_t top_k;      // applied when 0 < top_k < V
  double top_p;       // applied when < 1
};

struct SampleChildrenParams {
  const float* q;         // [R, V] draft probabilities (row stride s_q)
  const float* u;         // [R, V] uniforms in (0, 1] (row stride s_u)
  const void* nch;        // [R] int32 or int64 (stride s_n)
  bool nch64;
  int64_t* out;           // [R, K] int64 (strides s_o0, s_o1)
  int64_t R, V, K, s_q, s_u, s_n, s_o0, s_o1;
};

constexpr int kSamplingThreads = 512;
constexpr int kChildrenThreads = 256;

}  // namespace sequoia_kernels

namespace sequoia_kernels::sampling {

inline uint32_t f32_bits(float f) { return std::bit_cast<uint32_t>(f); }

// Magnitude key of y <= 0 (see above): smaller key <=> larger y.
inline uint32_t mag_key(float y) { return f32_bits(y) & 0x7fffffffu; }

// Ascending unsigned order = ascending float order, -0 == +0, every NaN above +inf (as
// torch.sort orders floats).
inline uint32_t order_key(float f) {
  uint32_t b = f32_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffc00000u;  // NaN
  if (b == 0x80000000u) b = 0u;                             // -0 -> +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
constexpr uint32_t kOrderKeyInf = 0xff800000u;  // order_key(+inf)

// The three digits of a 31-bit key.
constexpr int kShift1 = 22, kShift2 = 11;
constexpr uint32_t kBins1 = 512, kBins2 = 2048, kBins3 = 2048;
inline uint32_t digit1(uint32_t k) { return k >> kShift1; }
inline uint32_t digit2(uint32_t k) { return (k >> kShift2) & (kBins2 - 1); }
inline uint32_t digit3(uint32_t k) { return k & (kBins3 - 1); }

// Calls f(i) for every i in [0, n) with pred(i), testing blocks of 16 with a vectorisable OR
// first: the gather passes below mostly find nothing, and skip a block in a few instructions.
template <class Pred, class F>
inline void for_each_match(int64_t n, Pred pred, F f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t j = i; j < i + 16; ++j) any |= static_cast<int>(pred(j));
    if (any)
      for (int64_t j = i; j < i + 16; ++j)
        if (pred(j)) f(j);
  }
  for (; i < n; ++i)
    if (pred(i)) f(i);
}

// ----------------------------------------------------------------------------------- top-k

// The k-th smallest mag key of y[0..V) (1 <= k <= V, counted with multiplicity): keep iff
// mag_key(y) <= result keeps exactly the tokens with y >= the k-th largest y. Two passes over y
// (histogram, gather), then the candidates only. cand: scratch.
inline uint32_t kth_smallest_mag(const float* y, int64_t V, int64_t k, std::vector<uint32_t>& cand) {
  uint32_t h4[4][kBins1];
  std::memset(h4, 0, sizeof(h4));
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) ++h4[j][digit1(mag_key(y[i + j]))];
  for (; i < V; ++i) ++h4[0][digit1(mag_key(y[i]))];
  uint32_t h[kBins1];
  for (uint32_t b = 0; b < kBins1; ++b) h[b] = h4[0][b] + h4[1][b] + h4[2][b] + h4[3][b];
  uint32_t b1 = 0;
  for (; b1 + 1 < kBins1 && static_cast<int64_t>(h[b1]) < k; ++b1) k -= h[b1];
  cand.clear();
  if (static_cast<int64_t>(h[b1]) * 16 > V) {  // a dense bucket: branch-free compaction
    cand.resize(V);
    int64_t n = 0;
    for (i = 0; i < V; ++i) {
      const uint32_t m = mag_key(y[i]);
      cand[n] = m;
      n += digit1(m) == b1;
    }
    cand.resize(n);
  } else {
    cand.reserve(h[b1]);
    for_each_match(
        V, [&](int64_t j) { return digit1(mag_key(y[j])) == b1; },
        [&](int64_t j) { cand.push_back(mag_key(y[j])); });
  }
  uint32_t h2[kBins2];
  std::memset(h2, 0, sizeof(h2));
  for (const uint32_t m : cand) ++h2[digit2(m)];
  uint32_t b2 = 0;
  for (; b2 + 1 < kBins2 && static_cast<int64_t>(h2[b2]) < k; ++b2) k -= h2[b2];
  uint32_t h3[kBins3];
  std::memset(h3, 0, sizeof(h3));
  for (const uint32_t m : cand)
    if (digit2(m) == b2) ++h3[digit3(m)];
  uint32_t b3 = 0;
  for (; b3 + 1 < kBins3 && static_cast<int64_t>(h3[b3]) < k; ++b3) k -= h3[b3];
  return (b1 << kShift1) | (b2 << kShift2) | b3;
}

// ----------------------------------------------------------------------------------- top-p

// e[i] >= 0: the (top-k filtered) unnormalised probabilities of tokens with y[i]; P = top_p * Z
// (fp64, Z = the fp64 sum of e). Returns tau such that keep iff mag_key(y) <= tau is the spec's
// rule: a token is kept iff the mass of the tokens with strictly larger y is < P (tokens with
// e = 0 are immaterial: their probability is 0 either way). Two passes over the row, then the
// candidates only. cm, ce: scratch (candidate keys and masses).
inline uint32_t top_p_mag(const float* y, const float* e, int64_t V, double P, std::vector<uint32_t>& cm,
                          std::vector<float>& ce) {
  double m4[4][kBins1];
  std::fill(&m4[0][0], &m4[0][0] + 4 * kBins1, 0.0);
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)  // (e = 0 adds 0: no branch)
    for (int j = 0; j < 4; ++j) m4[j][digit1(mag_key(y[i + j]))] += static_cast<double>(e[i + j]);
  for (; i < V; ++i) m4[0][digit1(mag_key(y[i]))] += static_cast<double>(e[i]);
  double mass[kBins1];
  for (uint32_t b = 0; b < kBins1; ++b) mass[b] = (m4[0][b] + m4[1][b]) + (m4[2][b] + m4[3][b]);
  double A = 0.0;  // mass of the buckets before (tokens strictly more likely)
  uint32_t b1 = 0;
  for (; b1 < kBins1 && !(A + mass[b1] >= P); ++b1) A += mass[b1];
  if (b1 == kBins1) return 0xffffffffu;  // (P = Z up to rounding) every token kept
  // Every token in an earlier bucket is kept (mass above < A + its bucket < P), every token in
  // a later one dropped (mass above >= A + mass[b1] >= P); bucket b1 is resolved below.
  // The critical bucket of a top-p search is often dense (a quarter of the row): branch-free
  // compaction.
  cm.resize(V);
  ce.resize(V);
  int64_t n = 0;
  for (i = 0; i < V; ++i) {
    const uint32_t m = mag_key(y[i]);
    cm[n] = m;
    ce[n] = e[i];
    n += (digit1(m) == b1) & (e[i] > 0.f);
  }
  double m2[kBins2];
  std::fill(m2, m2 + kBins2, 0.0);
  for (int64_t c = 0; c < n; ++c) m2[digit2(cm[c])] += static_cast<double>(ce[c]);
  uint32_t b2 = 0;
  for (; b2 < kBins2 && !(A + m2[b2] >= P); ++b2) A += m2[b2];
  if (b2 == kBins2) return (b1 << kShift1) | ((1u << kShift1) - 1);  // (rounding) all of b1 kept
  double m3[kBins3];
  std::fill(m3, m3 + kBins3, 0.0);
  for (int64_t c = 0; c < n; ++c)
    if (digit2(cm[c]) == b2) m3[digit3(cm[c])] += static_cast<double>(ce[c]);
  // One bucket = one tie group now: keep groups while the mass strictly above them is < P.
  uint32_t last = 0;
  for (uint32_t b3 = 0; b3 < kBins3; ++b3) {
    if (m3[b3] == 0.0) continue;
    if (!(A < P)) break;
    last = b3;
    A += m3[b3];
  }
  return (b1 << kShift1) | (b2 << kShift2) | last;
}

// --------------------------------------------------------------------------- top-K selection

// The K smallest (key, index) pairs of keys[0..V) in increasing order (ties: lower index
// first), K <= V: a max-heap of K composite 64-bit keys; a token enters only if its key is
// below the heap's largest (equal keys lose: their index is larger). heap: scratch, holds the
// result (indices in the low 32 bits) on return.
inline void smallest_k(const uint32_t* keys, int64_t V, int64_t K, std::vector<uint64_t>& heap) {
  heap.resize(K);
  for (int64_t i = 0; i < K; ++i) heap[i] = (static_cast<uint64_t>(keys[i]) << 32) | static_cast<uint64_t>(i);
  std::make_heap(heap.begin(), heap.end());
  uint32_t top = static_cast<uint32_t>(heap.front() >> 32);
  for (int64_t i = K; i < V; ++i) {
    if (keys[i] >= top) continue;
    std::pop_heap(heap.begin(), heap.end());
    heap.back() = (static_cast<uint64_t>(keys[i]) << 32) | static_cast<uint64_t>(i);
    std::push_heap(heap.begin(), heap.end());
    top = static_cast<uint32_t>(heap.front() >> 32);
  }
  std::sort_heap(heap.begin(), heap.end());
}

}  // namespace sequoia_kernels::sampling
