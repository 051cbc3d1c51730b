"""compact_kv_ in Triton: one program per (n, b, head block); rows are copied in increasing
order, each element always by the same lane, so a row is read before any later copy of the
same program overwrites it (snapshot semantics, see csrc/kernels/compact_kv.h). Bounds are
checked on the device: never reads or writes outside the cache."""

import torch
import triton
import triton.language as tl

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _compact_kv_kernel(
    cache_ptr,  # [N, B, H, S, D] viewed as same-width integers
    src_ptr,  # [B, M]
    dst_ptr,  # [B]
    num_ptr,  # [B]
    B, H, S, D, M,
    stride_n, stride_b, stride_h, stride_s,
    stride_src_b, stride_src_m,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # n * B + b
    hb = tl.program_id(1)
    b = pid % B
    n = pid // B
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    base = cache_ptr + n.to(tl.int64) * stride_n + b.to(tl.int64) * stride_b
    tile = offs_h[:, None].to(tl.int64) * stride_h + offs_d[None, :]
    count = tl.load(num_ptr + b).to(tl.int64)
    count = tl.minimum(tl.maximum(count, 0), M)
    dst0 = tl.load(dst_ptr + b).to(tl.int64)
    for i in range(0, count):
        src = tl.load(src_ptr + b * stride_src_b + i * stride_src_m).to(tl.int64)
        dst = dst0 + i
        ok = (src >= 0) & (src < S) & (dst >= 0) & (dst < S) & (src != dst)
        m = mask_hd & ok
        rows = tl.load(base + src * stride_s + tile, mask=m)
        tl.store(base + dst * stride_s + tile, rows, mask=m)


def compact_kv_triton(
    cache: torch.Tensor,  # [N, B, H, S, D]
    src_pos: torch.Tensor,  # [B, M]
    dst_start: torch.Tensor,  # [B]
    num_accepted: torch.Tensor,  # [B]
) -> None:
    N, B, H, S, D = cache.shape
    if N * B * H * D == 0 or src_pos.shape[1] == 0:
        return
    bits = cache.view(_BITS[cache.element_size()])  # a bitwise copy: any dtype, bf16 too
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))
    grid = (N * B, triton.cdiv(H, block_h))
    _compact_kv_kernel[grid](
        bits, src_pos, dst_start, num_accepted,
        B, H, S, D, src_pos.shape[1],
        bits.stride(0), bits.stride(1), bits.stride(2), bits.stride(3),
        src_pos.stride(0), src_pos.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
