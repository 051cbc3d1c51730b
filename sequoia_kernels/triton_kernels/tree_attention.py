"""Tree attention in Triton, flash-decoding style.

Grid ``(B * Hkv, M blocks, num_splits)``. One program owns one kv head of one row: its M
dimension packs the ``G = Hq / Hkv`` query heads that share the kv head times the T tree
nodes (row r = g * T + i), so each K/V tile is read once for all of them. M is padded to at
least 16 rows, so decode-sized trees (T <= 16) still multiply with ``tl.dot`` on tensor cores.
The readable KV length of row b, ``L = prefix_len[b] + tree_len``, is cut into ``num_splits``
equal chunks (a multiple of BLOCK_N, computed on the device: no host sync). Each program runs
an online softmax (fp32, exp2) over its chunk in two loops: whole tiles of prefix keys with no
bounds and no mask work, then the tiles that reach the tree keys (packed mask) or the chunk's
end. It writes a normalised partial output and its log-sum-exp; a second kernel merges the
splits. With one split the first kernel writes ``out`` directly.

Block sizes, warps and stages come from :func:`fwd_config` per (D, dtype, M), chosen so that
nothing spills on sm_90; :func:`plan_tree_attention` is the launcher's plan, which the static
checks (tests/test_sm90_static.py) compile ahead of time.

Visibility of cache position n for node i: ``n < prefix_len[b]``, or ``0 <= n - prefix_len[b]
< tree_len`` and bit ``(n - p) % 32`` of word ``(n - p) // 32`` of packed mask row i is set.
Positions at or beyond ``prefix_len[b] + tree_len`` are never read, and a garbage prefix_len
(``validate=False``) is clamped to ``[0, S - tree_len]`` so that nothing outside the cache is
read. Rows that see nothing get zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _tree_attn_tile(
    acc, m_i, l_i, q, k_base, v_base, start, hi, p, sks, svs, mask_rows, row_ok, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key tile of the online softmax. MASKED=False: a tile of prefix keys, all visible and
    all inside the split (no bounds, no mask work); MASKED=True: keys past ``hi`` are not read,
    tree keys apply the packed mask rows."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = k_base + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None].to(tl.int64) * svs + offs_d[None, :]
    if MASKED:
        n_ok = offs_n < hi
        kv_mask = n_ok[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D == D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(offs_d < D)[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        rel = offs_n - p  # tree node index of position n (negative: prefix)
        in_tree = (rel >= 0) & n_ok
        rel_c = tl.maximum(rel, 0)
        word = tl.load(mask_rows[:, None] + (rel_c // 32)[None, :], mask=row_ok[:, None] & in_tree[None, :], other=0)
        bit = (word >> (rel_c % 32)[None, :]) & 1
        vis = ((rel < 0) & n_ok)[None, :] | (in_tree[None, :] & (bit != 0))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new  # every key of a prefix tile is visible: finite
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if MASKED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D == D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=(offs_d < D)[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tree_attn_fwd_kernel(
    Q, K, V, PREFIX, MASK, OUT, PO, PL,
    qk_scale,  # scale * log2(e)
    Hkv, T, TK, S, G, M, NUM_SPLITS,
    sqb, sqh, sqt,
    skb, skh, sks,
    svb, svh, svs,
    smb, smt,
    sob, soh, sot,
    spob, spoh, spot, spos,
    splb, splh, splt,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (Triton's CPU interpreter multiplies bf16 bits as integers)
):
    pid_bh = tl.program_id(0)
    mb = tl.program_id(1)
    sp = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    g = rows // T
    i = rows % T
    h = (kvh * G + g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * sqb + h[:, None] * sqh + i[:, None].to(tl.int64) * sqt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    p = tl.load(PREFIX + b)
    p = tl.minimum(tl.maximum(p, 0), S - TK)  # nothing outside the cache, even unvalidated
    L = p + TK  # readable length of this row (prefix + tree keys)
    chunk = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, L)
    # [lo, mid): whole tiles of prefix keys (no mask work); [mid, hi): the tiles that reach the
    # tree keys or the end of the split
    mid = lo + tl.maximum(tl.minimum(p, hi) - lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + b64 * skb + kvh.to(tl.int64) * skh
    v_base = V + b64 * svb + kvh.to(tl.int64) * svh
    mask_rows = MASK + b64 * smb + i.to(tl.int64) * smt  # [BLOCK_M] pointers to packed rows

    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _tree_attn_tile(acc, m_i, l_i, q, k_base, v_base, start, hi, p, sks, svs, mask_rows,
                                        row_ok, qk_scale, BLOCK_N, BLOCK_D, D, False, PRECISION, UPCAST)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _tree_attn_tile(acc, m_i, l_i, q, k_base, v_base, start, hi, p, sks, svs, mask_rows,
                                        row_ok, qk_scale, BLOCK_N, BLOCK_D, D, True, PRECISION, UPCAST)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    st_mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT:
        o_ptrs = OUT + b64 * sob + h[:, None] * soh + i[:, None].to(tl.int64) * sot + offs_d[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=st_mask)
    else:
        po_ptrs = (PO + b64 * spob + h[:, None] * spoh + i[:, None].to(tl.int64) * spot
                   + sp.to(tl.int64) * spos + offs_d[None, :])
        tl.store(po_ptrs, o, mask=st_mask)
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        pl_ptrs = PL + b64 * splb + h * splh + i.to(tl.int64) * splt + sp
        tl.store(pl_ptrs, lse, mask=row_ok)


@triton.jit
def _tree_attn_merge_kernel(
    PO, PL, OUT,
    Hq, T, NUM_SPLITS,
    spob, spoh, spot, spos,
    splb, splh, splt,
    sob, soh, sot,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid % T
    h = (pid // T) % Hq
    b = pid // (T * Hq)
    b64, h64, i64 = b.to(tl.int64), h.to(tl.int64), i.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lse = tl.load(PL + b64 * splb + h64 * splh + i64 * splt + offs_s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lse - mx)  # 0 for empty splits
    denom = tl.sum(w, axis=0)
    po = tl.load(PO + b64 * spob + h64 * spoh + i64 * spot + offs_s[:, None].to(tl.int64) * spos + offs_d[None, :],
                 mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    po = tl.where(w[:, None] > 0, po, 0.0)
    o = tl.sum(w[:, None] * po, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + b64 * sob + h64 * soh + i64 * sot + offs_d, o.to(OUT.dtype.element_ty), mask=d_ok)


class FwdConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def fwd_config(M: int, D: int, dtype: torch.dtype) -> FwdConfig:
    """Block sizes, warps and pipeline stages of the forward kernel for M = G * T packed rows.

    Chosen so that no configuration spills on sm_90 (checked ahead of time by
    tests/test_sm90_static.py for fp16/bf16/fp32, D 64 and 128, T 1/16/64/128, G 1 and 4): the
    fp32 accumulator [BLOCK_M, D] and the score tile [BLOCK_M, BLOCK_N] must fit in the
    registers of num_warps warps next to the operands. M is padded to at least 16 rows, so
    decode-sized trees (T <= 16) still run tl.dot on tensor cores.
    """
    block_d = max(16, triton.next_power_of_2(D))
    block_m = min(max(16, triton.next_power_of_2(M)), 64 if block_d <= 128 else 32)
    if dtype == torch.float32:  # exact fp32 dot (FMA, no TF32): 16-key tiles, 2 stages, and at
        if block_d > 64:  # D = 128 at most 32 rows (64 rows spill 344 B a thread, even with 8 warps)
            block_m = min(block_m, 32)
        return FwdConfig(block_m, 16, 8 if block_m >= 32 else 4, 2)
    if block_d <= 64:
        return FwdConfig(block_m, 64, 4, 3)
    if block_d <= 128:
        return FwdConfig(block_m, 64, 4 if block_m <= 32 else 8, 3)
    return FwdConfig(block_m, 32, 4 if block_m <= 16 else 8, 2)


def _blocks(M: int, D: int, dtype: torch.dtype = torch.float16) -> tuple[int, int]:
    """BLOCK_M, BLOCK_N (for the split heuristic)."""
    c = fwd_config(M, D, dtype)
    return c.block_m, c.block_n


class Launch(NamedTuple):
    """One kernel launch of the Triton path: ``fn[grid](*args, **constexprs, num_warps=..., num_stages=...)``."""

    fn: object
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int


def plan_tree_attention(
    q: torch.Tensor,  # [B, Hq, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], last dim contiguous
    v_cache: torch.Tensor,  # [B, Hkv, S, D], last dim contiguous
    prefix_len: torch.Tensor,  # [B] int32 or int64
    mask_bits: torch.Tensor,  # [Bm, T, W] int32, Bm in {1, B}, W = ceil(tree_len / 32)
    tree_len: int,
    scale: float,
    out: torch.Tensor,  # [B, Hq, T, D]
    partial_out: torch.Tensor,  # [B, Hq, T, num_splits, D] fp32
    partial_lse: torch.Tensor,  # [B, Hq, T, num_splits] fp32
    interpret: bool | None = None,
) -> list[Launch]:
    """The launches tree_attention_triton makes for these tensors (any device, ``meta``
    included: nothing is read). The static checks compile exactly these ahead of time."""
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if B * Hq * T * D == 0:
        return []
    G = Hq // Hkv
    M = G * T
    ns = partial_lse.shape[-1]
    cfg = fwd_config(M, D, q.dtype)
    block_d = max(16, triton.next_power_of_2(D))
    if interpret is None:
        interpret = q.device.type == "cpu"
    upcast = q.dtype == torch.bfloat16 and interpret  # only under TRITON_INTERPRET
    precision = "ieee" if q.dtype == torch.float32 or upcast else None  # fp32: no TF32 rounding
    smb = mask_bits.stride(0) if mask_bits.shape[0] > 1 else 0
    direct = ns == 1
    launches = [Launch(
        _tree_attn_fwd_kernel, (B * Hkv, triton.cdiv(M, cfg.block_m), ns),
        (q, k_cache, v_cache, prefix_len, mask_bits, out, partial_out, partial_lse,
         float(scale) * _LOG2E,
         Hkv, T, int(tree_len), S, G, M, ns,
         q.stride(0), q.stride(1), q.stride(2),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         smb, mask_bits.stride(1),
         out.stride(0), out.stride(1), out.stride(2),
         partial_out.stride(0), partial_out.stride(1), partial_out.stride(2), partial_out.stride(3),
         partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2)),
        dict(D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, PRECISION=precision,
             DIRECT=direct, UPCAST=upcast),
        cfg.num_warps, cfg.num_stages)]
    if not direct:
        launches.append(Launch(
            _tree_attn_merge_kernel, (B * Hq * T,),
            (partial_out, partial_lse, out,
             Hq, T, ns,
             partial_out.stride(0), partial_out.stride(1), partial_out.stride(2), partial_out.stride(3),
             partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2),
             out.stride(0), out.stride(1), out.stride(2)),
            dict(D=D, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(ns))),
            4 if D > 64 else 2, 1))
    return launches


def default_num_splits(B: int, Hq: int, Hkv: int, T: int, D: int, S: int, dtype: torch.dtype, sm_count: int) -> int:
    """KV splits of the Triton kernel: split only when the programs of one split would fill
    fewer than 2 waves of ``sm_count`` SMs, each split covering >= 256 positions of the cache
    capacity S, at most 64."""
    block_m = fwd_config((Hq // Hkv) * T, D, dtype).block_m
    programs = B * Hkv * -(-(Hq // Hkv) * T // block_m)
    if programs >= 2 * sm_count:
        return 1
    want = -(-2 * sm_count // programs)
    return int(max(1, min(want, -(-S // 256), 64)))


def tree_attention_triton(
    q: torch.Tensor,  # [B, Hq, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], last dim contiguous
    v_cache: torch.Tensor,  # [B, Hkv, S, D], last dim contiguous
    prefix_len: torch.Tensor,  # [B] int32 or int64
    mask_bits: torch.Tensor,  # [Bm, T, W] int32, Bm in {1, B}, W = ceil(tree_len / 32)
    tree_len: int,  # tree keys at prefix_len[b] .. prefix_len[b] + tree_len - 1
    scale: float,
    out: torch.Tensor,  # [B, Hq, T, D] q's dtype, last dim contiguous; written
    partial_out: torch.Tensor,  # [B, Hq, T, num_splits, D] fp32, last dim contiguous
    partial_lse: torch.Tensor,  # [B, Hq, T, num_splits] fp32, last dim contiguous
) -> None:
    """Same arguments as torch.ops.sequoia_kernels.tree_attention; no host sync, no allocation."""
    for ln in plan_tree_attention(q, k_cache, v_cache, prefix_len, mask_bits, tree_len, scale, out, partial_out,
                                  partial_lse):
        ln.fn[ln.grid](*ln.args, **ln.constexprs, num_warps=ln.num_warps, num_stages=ln.num_stages)
