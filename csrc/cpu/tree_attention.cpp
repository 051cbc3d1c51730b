// tree_attention CPU implementation: per batch row, one batched GEMM per KV head group
// (scores for the G query heads x T nodes that share a KV head against the prefix and the
// tree), the tree mask applied to the last T columns, softmax in fp32, one GEMM with V.
// Uses ATen's BLAS-backed bmm; fp16/bf16 inputs are computed in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/tree_mask.h"
#include "tree_attention_params.h"

namespace sequoia_kernels {

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& prefix_len, const at::Tensor& mask_bits, double scale,
                        at::Tensor& out, at::Tensor& partial_out, at::Tensor& partial_lse) {
  TORCH_CHECK(q.device().is_cpu(), "tree_attention (cpu): tensors must be on the CPU");
  const TreeAttentionShape s = tree_attention_check(q, k_cache, v_cache, prefix_len, mask_bits,
                                                    out, partial_out, partial_lse);
  (void)partial_out;
  (void)partial_lse;  // the CPU kernel needs no split-KV workspace
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor plen = prefix_len.to(at::kLong);
  const int64_t* plen_p = plen.const_data_ptr<int64_t>();
  const at::Tensor bits = mask_bits.contiguous();
  const int32_t* bits_p = bits.const_data_ptr<int32_t>();
  const int64_t T = s.T, G = s.Hq / s.Hkv, W = s.W;

  // tree mask as an additive bias [Bm, T, T]: 0 where visible, -inf where hidden
  at::Tensor bias = at::empty({s.Bm, T, T}, q.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(bias.scalar_type(), "tree_attention_bias", [&] {
    scalar_t* bp = bias.data_ptr<scalar_t>();
    for (int64_t m = 0; m < s.Bm; ++m)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = 0; j < T; ++j)
          bp[(m * T + i) * T + j] = tree_mask_bit(bits_p + (m * T + i) * W, j)
                                        ? scalar_t(0)
                                        : -std::numeric_limits<scalar_t>::infinity();
  });

  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t P = plen_p[b];
    TORCH_CHECK(P >= 0 && P + T <= s.S, "tree_attention: prefix_len[", b, "] = ", P,
                " out of range for T = ", T, " and cache length S = ", s.S);
    const int64_t L = P + T;
    // [Hkv, G*T, D]: the G query heads of a KV head, node-major within a head
    at::Tensor qb = q[b].to(acc).reshape({s.Hkv, G * T, s.D});
    at::Tensor kb = k_cache[b].narrow(1, 0, L).to(acc);  // [Hkv, L, D]
    at::Tensor vb = v_cache[b].narrow(1, 0, L).to(acc);  // [Hkv, L, D]
    at::Tensor scores = at::bmm(qb, kb.transpose(1, 2)).mul_(scale);  // [Hkv, G*T, L]
    at::Tensor tree = scores.narrow(2, P, T).view({s.Hkv, G, T, T});
    tree.add_(bias[s.Bm == 1 ? 0 : b]);
    // softmax with fully hidden rows -> zeros (only possible when P == 0)
    at::Tensor mx = std::get<0>(scores.max(2, /*keepdim=*/true));
    mx.masked_fill_(mx.isneginf(), 0);
    at::Tensor p = (scores - mx).exp_();
    at::Tensor denom = p.sum(2, true);
    denom.masked_fill_(denom == 0, 1);
    p.div_(denom);
    at::Tensor ob = at::bmm(p, vb).view({s.Hq, T, s.D});  // [Hkv*G, T, D]
    out[b].copy_(ob);
  }
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace sequoia_kernels
