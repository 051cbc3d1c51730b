"""Triton kernels for the sampling ops (specs: ``sequoia_kernels/reference/sampling.py``) and a
Philox uniform generator bitwise identical to ``sequoia_kernels.random.philox_uniforms``.

sampling_probs: one program per row, no sort, a bounded number of passes over the row (at most
16: max, 4 top-k, 1 mass, 8 top-p, kept mass, write). Thresholds live on the order-preserving
int32 image of the fp32 values y. Top-k is a radix select, 8 bits per pass with a 256-bin count
histogram (tl.histogram), 4 passes: the k-th largest key tau exactly (ties included). Top-p is
a 16-ary search (8 passes, 15 candidate thresholds per pass; Triton has no weighted histogram,
and a 256-candidate mass tile per chunk would cost 256 compares per element): the
smallest key t with mass{key > t} < top_p * Z (exactly the spec's "mass strictly above <
top_p * Z" set). Results equal the reference's up to the fp32 exp (tl.exp vs torch.exp) and
fp64 summation order.

sample_children: one program per row and ONE pass over the row: the K best (key, index) pairs
seen so far are kept on chip (an unsorted list of K slots and its worst entry); each chunk's keys
replace the worst entry while the chunk's best key beats it (a handful of replacements per chunk
after the first), and the K survivors are emitted in (key, index) order at the end. With
``PHILOX`` the uniforms are generated in registers from (seed, offset), identical to
``philox_uniforms(seed, offset, (R, V))``, four per Philox call: chunks start on a multiple of 4
in the flat [R, V] index, so word j of counter ``offset + flat // 4`` is element ``4 * c + j`` of
the chunk. K > 64 falls back to the K-pass kernel (pass i: the smallest pair above pass i-1's).
"""

import torch
import triton
import triton.language as tl

_NS = 16  # thresholds per search pass (15 new candidates)
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # float32 max


@triton.jit
def _philox_u01(seed, offset, idx):
    """float32 uniforms of flat indices idx (int64) of the Philox stream at (seed, offset):
    word idx % 4 of counter offset + idx // 4, as (2 * (w >> 9) + 1) * 2**-24."""
    w0, w1, w2, w3 = tl.randint4x(seed, offset + idx // 4)
    j = idx % 4
    w = tl.where(j == 0, w0, tl.where(j == 1, w1, tl.where(j == 2, w2, w3)))
    m = (w >> 9).to(tl.int32)
    return (m * 2 + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _philox_uniform_kernel(seed_ptr, off_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr)
    off = tl.load(off_ptr)
    tl.store(out_ptr + i, _philox_u01(seed, off, i), mask=i < n)


def philox_uniforms_triton(seed: torch.Tensor, offset: torch.Tensor, n: int) -> torch.Tensor:
    """[n] float32, bitwise equal to sequoia_kernels.random.philox_uniforms(seed, offset, (n,))."""
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n:
        block = 1024
        _philox_uniform_kernel[(triton.cdiv(n, block),)](seed, offset, out, n, BLOCK=block)
    return out


# ----------------------------------------------------------------------------- sampling_probs


@triton.jit
def _okey(y):
    """Order-preserving int64 image of fp32 values (-0.0 maps to +0.0's key)."""
    b = y.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    k = tl.where(k == -1, 0, k)
    return k.to(tl.int64)


@triton.jit
def _topk_digit(xr, V, m, temperature, pre, need, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """One radix-select pass: among keys whose bits above SHIFT + 8 equal `pre`'s, the 8-bit
    digit at SHIFT holding the need-th largest key (a 256-bin count histogram). Returns the
    prefix extended by that digit and the rank left inside it."""
    counts = tl.zeros([256], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        msk = offs < V
        x = tl.load(xr + offs, mask=msk, other=0.0).to(tl.float32)
        uk = _okey(tl.math.div_rn(x - m, temperature)) + 2147483648  # [0, 2**32)
        if SHIFT == 24:
            match = msk
        else:
            match = msk & ((uk >> (SHIFT + 8)) == (pre >> (SHIFT + 8)))
        counts += tl.histogram(((uk >> SHIFT) & 255).to(tl.int32), 256, mask=match)
    d = tl.arange(0, 256)
    at_or_above = tl.cumsum(counts, axis=0, reverse=True)  # keys with digit >= d
    dsel = tl.max(tl.where(at_or_above >= need, d, 0), axis=0)
    above = tl.sum(tl.where(d > dsel, counts, 0), axis=0)
    return pre + (dsel.to(tl.int64) << SHIFT), need - above


@triton.jit
def _sampling_probs_kernel(
    x_ptr, out_ptr, topp_ptr,
    V, s_x, s_o,
    temperature, top_k,
    GREEDY: tl.constexpr, DO_TOPK: tl.constexpr, DO_TOPP: tl.constexpr,
    BLOCK_V: tl.constexpr, NS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * s_x
    orow = out_ptr + row * s_o
    # pass: max and first argmax
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    am = row * 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(xr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(x, axis=0)
        ci = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + v0
        am = tl.where(cm > m, ci, am)
        m = tl.maximum(m, cm)
    if GREEDY:
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            tl.store(orow + offs, tl.where(offs == am, 1.0, 0.0), mask=offs < V)
    else:
        tau = row * 0 - 2147483648  # keep-all key threshold
        if DO_TOPK:  # radix select: the top_k-th largest key, 8 bits per pass (4 passes)
            need = row * 0 + top_k
            pre = row * 0  # unsigned image (key + 2**31) of the prefix found so far
            pre, need = _topk_digit(xr, V, m, temperature, pre, need, 24, BLOCK_V)
            pre, need = _topk_digit(xr, V, m, temperature, pre, need, 16, BLOCK_V)
            pre, need = _topk_digit(xr, V, m, temperature, pre, need, 8, BLOCK_V)
            pre, need = _topk_digit(xr, V, m, temperature, pre, need, 0, BLOCK_V)
            tau = pre - 2147483648
        if DO_TOPP:  # smallest key t with mass{kept, key > t} < top_p * Z
            Zacc = tl.zeros([BLOCK_V], tl.float64)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                msk = offs < V
                x = tl.load(xr + offs, mask=msk, other=0.0).to(tl.float32)
                y = tl.math.div_rn(x - m, temperature)
                keep = msk & (_okey(y) >= tau)
                Zacc += tl.where(keep, tl.exp(y), 0.0).to(tl.float64)
            PZ = tl.load(topp_ptr) * tl.sum(Zacc, axis=0)
            lo = tau - 1  # mass above = Z >= top_p * Z: not good
            hi = row * 0  # mass above key(0) = 0 < top_p * Z: good
            j = tl.arange(0, NS).to(tl.int64)
            while hi - lo > 1:
                step = (hi - lo + NS - 1) // NS
                th = lo + j * step  # [NS]; th[0] = lo is known not good
                F = tl.zeros([NS], tl.float64)
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + tl.arange(0, BLOCK_V)
                    msk = offs < V
                    x = tl.load(xr + offs, mask=msk, other=0.0).to(tl.float32)
                    y = tl.math.div_rn(x - m, temperature)
                    k = _okey(y)
                    e = tl.where(msk & (k >= tau), tl.exp(y), 0.0).to(tl.float64)
                    gt = k[None, :] > th[:, None]
                    F += tl.sum(tl.where(gt, e[None, :], 0.0), axis=1)
                good = (F < PZ) & (j > 0)
                g = tl.min(tl.where(good, j, NS), axis=0)
                new_lo = lo + (g - 1) * step
                hi = tl.minimum(hi, lo + g * step)
                lo = new_lo
            tau = hi
        Zacc = tl.zeros([BLOCK_V], tl.float64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            msk = offs < V
            x = tl.load(xr + offs, mask=msk, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x - m, temperature)
            Zacc += tl.where(msk & (_okey(y) >= tau), tl.exp(y), 0.0).to(tl.float64)
        Zf = tl.sum(Zacc, axis=0).to(tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            msk = offs < V
            x = tl.load(xr + offs, mask=msk, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x - m, temperature)
            e = tl.where(_okey(y) >= tau, tl.exp(y), 0.0)
            tl.store(orow + offs, tl.math.div_rn(e, Zf), mask=msk)


def sampling_probs_triton(
    logits: torch.Tensor,  # [R, V] any float dtype, last dim contiguous
    out: torch.Tensor,  # [R, V] fp32, last dim contiguous
    temperature: float,
    top_k: int,
    top_p: float,
) -> None:
    R, V = logits.shape
    if R == 0:
        return
    greedy = temperature == 0
    do_topk = 0 < top_k < V
    do_topp = top_p < 1.0
    topp = torch.full((1,), float(top_p), dtype=torch.float64, device=logits.device)
    block_v = min(triton.next_power_of_2(V), 1024)
    _sampling_probs_kernel[(R,)](
        logits, out, topp, V, logits.stride(0), out.stride(0),
        float(temperature) if not greedy else 1.0, int(top_k),
        GREEDY=greedy, DO_TOPK=do_topk, DO_TOPP=do_topp, BLOCK_V=block_v, NS=_NS,
        num_warps=8 if block_v >= 1024 else 4,
    )


# ----------------------------------------------------------------------------- sample_children


@triton.jit
def _sample_children_kernel(
    q_ptr, u_ptr, seed_ptr, off_ptr, nch_ptr, out_ptr,
    V, K, s_q, s_u, s_n, s_o,
    PHILOX: tl.constexpr, BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    zero = r * 0
    nch = tl.load(nch_ptr + r * s_n).to(tl.int64)
    if PHILOX:
        seed = tl.load(seed_ptr)
        off = tl.load(off_ptr)
    pk = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)  # previous key
    pi = zero - 1  # previous index
    done = zero
    for i in range(0, K):
        tok = zero - 1
        if (i < nch) & (done == 0):
            bk = tl.max(tl.full([BLOCK_V], float("inf"), tl.float32), axis=0)
            bi = zero + V
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                msk = offs < V
                qv = tl.load(q_ptr + r * s_q + offs, mask=msk, other=0.0)
                if PHILOX:
                    u = _philox_u01(seed, off, r * V + offs)
                else:
                    u = tl.load(u_ptr + r * s_u + offs, mask=msk, other=0.5)
                elig = msk & (qv > 0)
                key = tl.math.div_rn(-tl.log(u), tl.where(elig, qv, 1.0))
                key = tl.minimum(key, FLT_MAX)
                cand = elig & ((key > pk) | ((key == pk) & (offs > pi)))
                ck = tl.where(cand, key, float("inf"))
                cmin = tl.min(ck, axis=0)
                cidx = tl.min(tl.where(cand & (ck == cmin), offs, V), axis=0)
                better = cmin < bk  # chunks come in increasing index order
                bi = tl.where(better, cidx, bi)
                bk = tl.where(better, cmin, bk)
            found = bi < V
            tok = tl.where(found, bi, zero - 1)
            done = tl.where(found, done, zero + 1)
            pk = bk
            pi = bi
        tl.store(out_ptr + r * s_o + i, tok)


@triton.jit
def _uniforms4(seed, ctr0, BLOCK: tl.constexpr):
    """[BLOCK] float32 uniforms of the flat indices 4 * ctr0 .. 4 * ctr0 + BLOCK - 1 (relative to
    the stream's offset, already in ctr0): BLOCK // 4 Philox calls, all four words used."""
    w0, w1, w2, w3 = tl.randint4x(seed, ctr0 + tl.arange(0, BLOCK // 4))
    w = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))  # w0_0 w1_0 w2_0 w3_0 w0_1 ...
    m = (w >> 9).to(tl.int32)
    return (m * 2 + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _sample_children_onepass_kernel(
    q_ptr, u_ptr, seed_ptr, off_ptr, nch_ptr, out_ptr,
    V, K, s_q, s_u, s_n, s_o, s_o1,
    PHILOX: tl.constexpr, BLOCK_V: tl.constexpr, KP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    zero = r * 0
    nch = tl.load(nch_ptr + r * s_n).to(tl.int64)
    slot = tl.arange(0, KP).to(tl.int64)
    valid = slot < K
    lk = tl.full([KP], float("inf"), tl.float32)  # the best keys so far (unsorted)
    li = V + slot  # their indices; sentinels are distinct and above every token
    shift = zero
    if PHILOX:
        seed = tl.load(seed_ptr)
        off = tl.load(off_ptr)
        shift = (r * V) % 4  # chunks start on a multiple of 4 in the flat index
    # the worst (largest (key, index)) valid slot
    mk = tl.max(tl.where(valid, lk, float("-inf")), axis=0)
    mi = tl.max(tl.where(valid & (lk == mk), li, -1), axis=0)
    for c0 in range(0, V + shift, BLOCK_V):
        offs = c0 - shift + tl.arange(0, BLOCK_V)  # token index in the row
        msk = (offs >= 0) & (offs < V)
        qv = tl.load(q_ptr + r * s_q + offs, mask=msk, other=0.0)
        if PHILOX:
            u = _uniforms4(seed, off + (r * V - shift + c0) // 4, BLOCK_V)
        else:
            u = tl.load(u_ptr + r * s_u + offs, mask=msk, other=0.5)
        elig = msk & (qv > 0)
        key = tl.math.div_rn(-tl.log(u), tl.where(elig, qv, 1.0))
        key = tl.where(elig, tl.minimum(key, FLT_MAX), float("inf"))
        cmin = tl.min(key, axis=0)
        # chunk tokens have larger indices than every listed one, so a chunk key beats the
        # worst listed pair iff it is strictly smaller; inside the chunk the pairs are taken
        # in (key, index) order, so the same holds for the ones taken before
        while cmin < mk:
            ci = tl.argmin(key, axis=0, tie_break_left=True)
            lane = tl.arange(0, BLOCK_V) == ci
            j = tl.min(tl.where(valid & (lk == mk) & (li == mi), slot, KP), axis=0)
            lk = tl.where(slot == j, cmin, lk)
            li = tl.where(slot == j, c0 - shift + ci.to(tl.int64), li)
            key = tl.where(lane, float("inf"), key)
            cmin = tl.min(key, axis=0)
            mk = tl.max(tl.where(valid, lk, float("-inf")), axis=0)
            mi = tl.max(tl.where(valid & (lk == mk), li, -1), axis=0)
    left = valid
    for i in range(0, K):  # emit in (key, index) order
        bk = tl.min(tl.where(left, lk, float("inf")), axis=0)
        bi = tl.min(tl.where(left & (lk == bk), li, V + KP), axis=0)
        left = left & (li != bi)
        tok = tl.where((i < nch) & (bk < float("inf")) & (bi < V), bi, zero - 1)
        tl.store(out_ptr + r * s_o + i * s_o1, tok)


_ONEPASS_MAX_K = 64


def sample_children_triton(
    draft_probs: torch.Tensor,  # [R, V] fp32, last dim contiguous
    num_children: torch.Tensor,  # [R] int
    out: torch.Tensor,  # [R, K] int64
    uniforms: torch.Tensor | None = None,  # [R, V] fp32, last dim contiguous
    seed: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    block_v: int | None = None,  # chunk width (tests); default min(next_pow2(V + 3), 1024)
) -> None:
    R, V = draft_probs.shape
    K = out.shape[1]
    if R == 0 or K == 0:
        return
    philox = uniforms is None
    dummy = draft_probs
    if K <= _ONEPASS_MAX_K:
        if block_v is None:
            block_v = max(min(triton.next_power_of_2(V + 3), 1024), 16)
        _sample_children_onepass_kernel[(R,)](
            draft_probs, dummy if philox else uniforms, seed if philox else num_children,
            offset if philox else num_children, num_children, out,
            V, K, draft_probs.stride(0), 0 if philox else uniforms.stride(0), num_children.stride(0),
            out.stride(0), out.stride(1),
            PHILOX=philox, BLOCK_V=block_v, KP=max(triton.next_power_of_2(K), 2),
            num_warps=8 if block_v >= 1024 else 4,  # 4 warps at 1024 spill (tests/test_sm90_static_sampler.py)
        )
        return
    block_v = min(triton.next_power_of_2(V), 2048)
    _sample_children_kernel[(R,)](
        draft_probs, dummy if philox else uniforms, seed if philox else num_children,
        offset if philox else num_children, num_children, out,
        V, K, draft_probs.stride(0), 0 if philox else uniforms.stride(0), num_children.stride(0), out.stride(0),
        PHILOX=philox, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )
