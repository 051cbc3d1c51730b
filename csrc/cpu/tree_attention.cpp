// tree_attention CPU implementation: per batch row, the packed tree mask is expanded once into
// a boolean [T, prefix + tree_len] visibility mask and handed to ATen's fused, blocked CPU
// attention (flash-attention style online softmax, fp32 accumulation, GQA without copying K/V).
// Rows that see no key at all (prefix 0 and an empty mask row) are zeroed.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/tree_mask.h"
#include "tree_attention_params.h"

namespace sequoia_kernels {

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& prefix_len, const at::Tensor& mask_bits, int64_t tree_len,
                        double scale, at::Tensor& out, at::Tensor& partial_out,
                        at::Tensor& partial_lse) {
  TORCH_CHECK(q.device().is_cpu(), "tree_attention (cpu): tensors must be on the CPU");
  const TreeAttentionShape s = tree_attention_check(q, k_cache, v_cache, prefix_len, mask_bits,
                                                    tree_len, out, partial_out, partial_lse);
  const at::Tensor plen = prefix_len.to(at::kLong);
  const int64_t* plen_p = plen.const_data_ptr<int64_t>();
  const at::Tensor bits = mask_bits.contiguous();
  const int32_t* bits_p = bits.const_data_ptr<int32_t>();
  const int64_t T = s.T, Tk = s.Tk, W = s.W;

  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t P = plen_p[b];
    TORCH_CHECK(P >= 0 && P + Tk <= s.S, "tree_attention: prefix_len[", b, "] = ", P,
                " out of range for tree_len = ", Tk, " and cache length S = ", s.S);
    const int64_t L = P + Tk;
    at::Tensor visible = at::ones({T, L}, q.options().dtype(at::kBool));
    bool* vp = visible.data_ptr<bool>();
    const int32_t* rows = bits_p + (s.Bm == 1 ? 0 : b) * T * W;
    std::vector<int64_t> empty_rows;
    for (int64_t i = 0; i < T; ++i) {
      bool any = P > 0;
      for (int64_t j = 0; j < Tk; ++j) {
        const bool bit = tree_mask_bit(rows + i * W, j);
        vp[i * L + P + j] = bit;
        any = any || bit;
      }
      if (!any) {
        empty_rows.push_back(i);
        vp[i * L + P] = true;  // keep the kernel's softmax finite; the row is zeroed below
      }
    }
    at::Tensor ob = at::scaled_dot_product_attention(
        q.narrow(0, b, 1), k_cache.narrow(0, b, 1).narrow(2, 0, L),
        v_cache.narrow(0, b, 1).narrow(2, 0, L), visible, 0.0, false, scale,
        /*enable_gqa=*/s.Hq != s.Hkv);  // [1, Hq, T, D]
    at::Tensor dst = out.narrow(0, b, 1);
    dst.copy_(ob);
    for (int64_t i : empty_rows) dst.select(2, i).zero_();
  }
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace sequoia_kernels
