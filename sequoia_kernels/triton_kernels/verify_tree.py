"""verify_tree in Triton: one program per sequence walks the tree (the spec is the docstring of
``sequoia_kernels/reference/verify_tree.py``); vocabulary-wide work in BLOCK_V chunks.

The unnormalised residual target P and remaining draft Q of the current node (p = P / Sp,
q = Q / Sq) live in the workspace ``[B, 2, V]`` fp32 only once they differ from the node's input
rows. A rejection is applied lazily: the pass that handles rejection k reads the materialised
(P, Q), applies the pending rejection k-1 elementwise (the exact fp32 operations of the spec),
writes the result to the workspace and accumulates the two fp64 sums for rejection k in the
same pass. So each rejection
costs one read (and, from the second rejection at a node on, one write) of two V-vectors, an
accept costs nothing over V, and the first rejection at a node writes nothing. The accept
test of the next child only needs p(x) and q(x), computed from the pending state as scalars.

The bonus is an inverse CDF searched in levels: one pass for the per-chunk fp64 sums, their
prefix, then one chunk split into GROUPS x GROUP_W tokens (group sums, their prefix, one
group's own prefix; the next chunks only if rounding leaves that chunk's prefix sums <= t).
Prefix sums are masked row sums of small square tiles, not tl.cumsum (see _incl_prefix).
Every element is stored once in ``path`` (no write-write ordering between threads).

Workspace ordering. A pass that rewrites the workspace (from a node's second rejection on) reads
and writes each element in one thread (the same ``offs`` tensor), but the value of ws[x] that
decided the try just before it was loaded by every thread (a scalar load), and the next try and
the bonus search read elements that other threads wrote. Triton orders its own shared memory,
not global memory, so the pass is fenced by a CTA barrier (``tl.debug_barrier``, a bar.sync:
all global accesses of the CTA before it are performed for every thread after it) on both
sides: every read of a value is ordered before its rewrite, and every rewrite before the reads
that follow. (Chosen over two workspaces used in turn: no extra V-vectors and no change of the
op's [B, 2, V] workspace; the two barriers cost ~1 us per rejection against a V-wide pass.)
A bar.sync orders one CTA only: the 8-CTA cluster build below has no such guarantee across its
CTAs, which is why it is off by default (``CLUSTER_CTAS = 1``) until a GPU run shows it right
under many rejections at one node (bench/gpu_check.sh's stress case).

Batch 1 on many SMs (opt-in, unverified): the launch sets Triton's ``num_ctas`` (:func:`cluster_ctas`: 8 on sm_90+
while B * 8 fits in the SMs), which runs each program on a thread-block cluster: every
block-level tensor (a BLOCK_V = 8 x 2048 chunk) is split over the 8 CTAs, and the reductions
(the rejection sums, the argmax, the bonus prefix) combine through distributed shared memory,
so a rejection is still one pass over the vocabulary, read by 8 SMs. The scalar walk is
replicated in every CTA (each computes the same values from the same reductions). Static
checks (tests/test_sm90_static_sampler.py): no spills, 128-bit loads, cluster barriers and
distributed shared memory present in the 8-CTA build. It runs only when asked for
(``num_ctas=8``, or ``CLUSTER_CTAS = None``: 8 where :func:`cluster_ctas` finds it fits), and a
Triton that fails to compile the cluster build falls back to one CTA with a warning.
"""

import warnings

import torch
import triton
import triton.language as tl


@triton.jit
def _rcp(s):
    """The spec's reciprocal f32(1 / max(s, FLT_MIN)) (IEEE division); 0 where s <= 0 (the
    guarded iq of an exhausted draft)."""
    return tl.where(s > 0, tl.math.div_rn(1.0, tl.maximum(s, 1.1754943508222875e-38)), 0.0)


@triton.jit
def _apply_pending(pv, qv, offs, pend, xp, Sp, Sq, Spn):
    """(P, Q) after the pending rejection of token xp (spec: D = max(P * rcp(Sp) - Q * rcp(Sq), 0);
    P = D if its sum Spn > 0; Q[xp] = 0), from the materialised (P, Q) with normalisers (Sp, Sq).
    Two products per token, no division (the kernel is launched with enable_fp_fusion=False, so
    the products are not contracted into an FMA with the subtraction)."""
    d = tl.maximum(pv * _rcp(Sp) - qv * _rcp(Sq), 0.0)
    pe = tl.where((pend != 0) & (Spn > 0), d, pv)
    qe = tl.where((pend != 0) & (offs == xp), 0.0, qv)
    return pe, qe


@triton.jit
def _load_pq(tp_row, dp_row, ws_p, ws_q, offs, mask, in_ws):
    """The materialised (p, q): the node's input rows, or the workspace."""
    a = mask & (in_ws == 0)
    w = mask & (in_ws != 0)
    pv = tl.where(w, tl.load(ws_p + offs, mask=w, other=0.0), tl.load(tp_row + offs, mask=a, other=0.0))
    qv = tl.where(w, tl.load(ws_q + offs, mask=w, other=0.0), tl.load(dp_row + offs, mask=a, other=0.0))
    return pv, qv


@triton.jit
def _incl_prefix(v, idx):
    """Inclusive prefix sums of a small 1-D tensor v (idx = its arange), as the masked row sums
    of a [N, N] tile: no tl.cumsum, whose lowering fails for tensors split over a cluster
    (num_ctas > 1; Triton 3.8 asserts in ScanOpToLLVM)."""
    return tl.sum(tl.where(idx[None, :] <= idx[:, None], v[None, :], 0.0), axis=1)


@triton.jit
def _row_argmax(row, V, BLOCK_V: tl.constexpr):
    """First index of the maximum of row[0:V] (fp32), as int64."""
    best_val = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    best_idx = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vals = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        cmax = tl.max(vals, axis=0)
        cidx = tl.argmax(vals, axis=0, tie_break_left=True).to(tl.int64) + v0
        better = cmax > best_val
        best_idx = tl.where(better, cidx, best_idx)
        best_val = tl.where(better, cmax, best_val)
    return best_idx


@triton.jit
def _verify_tree_kernel(
    tp_ptr,  # [B, T, V] fp32 target
    dp_ptr,  # [B, T, V] fp32 draft
    tok_ptr,  # [B, T] int64
    par_ptr,  # [T] int64
    u_ptr,  # [B, T] fp32
    path_ptr,  # [B, T] int64 out
    nacc_ptr,  # [B] int64 out
    bonus_ptr,  # [B] int64 out
    ws_ptr,  # [B, 2, V] fp32 scratch
    T, V,
    s_tp_b, s_tp_t, s_dp_b, s_dp_t, s_tok_b, s_tok_t, s_u_b, s_u_t,
    s_path_b, s_path_t, s_n, s_bonus, s_ws_b, s_ws_r,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NCHUNK: tl.constexpr,  # >= cdiv(V, BLOCK_V), a power of two
    GROUPS: tl.constexpr,  # the bonus search splits a chunk into GROUPS x GROUP_W (= BLOCK_V)
    GROUP_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    zero = b * 0  # int64 scalar 0 (loop-carried scalars keep this type)
    ws_p = ws_ptr + b * s_ws_b
    ws_q = ws_p + s_ws_r
    tp_b = tp_ptr + b * s_tp_b
    dp_b = dp_ptr + b * s_dp_b
    path_b = path_ptr + b * s_path_b
    # path: every element is stored exactly once (path[n] = c as the walk grows n, then path[0]
    # and the -1 tail at the end), so no two stores of one address need ordering. (Storing -1
    # everywhere first, by a block store, then path[n] by a scalar store, raced on a GPU: the
    # two stores may be issued by different threads with no barrier between them.)

    cur = zero  # current node
    n = zero + 1  # path length
    am = zero - 1  # greedy: argmax of the current node's p (-1: not computed yet)
    in_ws = zero  # 1: the materialised (P, Q) live in the workspace, 0: in cur's input rows
    Sp = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0) + 1.0  # normalisers of the materialised (P, Q)
    Sq = Sp
    pend = zero  # 1: a rejection is pending (applied lazily): token xp, new sums Spn, Sqn
    xp = zero - 1
    Spn = Sp
    Sqn = Sp
    for c in range(1, T):
        par = tl.load(par_ptr + c)
        x = tl.load(tok_ptr + b * s_tok_b + c * s_tok_t)
        if (par == cur) & (x >= 0) & (x < V):
            if GREEDY:
                if am < 0:
                    am = _row_argmax(tp_b + cur * s_tp_t, V, BLOCK_V)
                if x == am:
                    tl.store(path_b + n * s_path_t, zero + c)
                    n += 1
                    cur = zero + c
                    am = zero - 1
            else:
                tp_row = tp_b + cur * s_tp_t
                dp_row = dp_b + cur * s_dp_t
                # the current state (P, Sp, Q, Sq) = materialised state + pending rejection
                Sp_e = tl.where((pend != 0) & (Spn > 0), Spn, Sp)
                Sq_e = tl.where(pend != 0, Sqn, Sq)
                pxm, qxm = _load_pq(tp_row, dp_row, ws_p, ws_q, x, x >= 0, in_ws)
                Px, Qx = _apply_pending(pxm, qxm, x, pend, xp, Sp, Sq, Spn)
                qx = Qx * _rcp(Sq_e)  # (0 when Sq_e = 0)
                px = Px * _rcp(Sp_e)
                if qx > 0:  # (a) a token outside the remaining draft support is skipped
                    r = tl.load(u_ptr + b * s_u_b + c * s_u_t)
                    if r * qx < px:  # accept: move to child c
                        tl.store(path_b + n * s_path_t, zero + c)
                        n += 1
                        cur = zero + c
                        in_ws = zero
                        pend = zero
                        Sp = Sp * 0.0 + 1.0
                        Sq = Sp
                    else:  # reject: materialise the pending rejection, sum for this one
                        acc_p = tl.zeros([BLOCK_V], tl.float64)
                        acc_q = tl.zeros([BLOCK_V], tl.float64)
                        if pend == 0:
                            # the node's first rejection: (P, Q) are its input rows and Sp = Sq = 1,
                            # so D = max(P * 1 - Q * 1, 0) = max(P - Q, 0) bitwise: no products
                            for v0 in range(0, V, BLOCK_V):
                                offs = v0 + tl.arange(0, BLOCK_V)
                                m = offs < V
                                pv = tl.load(tp_row + offs, mask=m, other=0.0)
                                qv = tl.load(dp_row + offs, mask=m, other=0.0)
                                acc_p += tl.maximum(pv - qv, 0.0).to(tl.float64)
                                acc_q += tl.where(offs != x, qv, 0.0).to(tl.float64)
                        else:
                            # the pass rewrites the workspace (see "Workspace ordering" above):
                            # every thread's scalar read of ws[x] for this try happens before it
                            tl.debug_barrier()
                            for v0 in range(0, V, BLOCK_V):
                                offs = v0 + tl.arange(0, BLOCK_V)
                                m = offs < V
                                pv, qv = _load_pq(tp_row, dp_row, ws_p, ws_q, offs, m, in_ws)
                                pe, qe = _apply_pending(pv, qv, offs, pend, xp, Sp, Sq, Spn)
                                tl.store(ws_p + offs, pe, mask=m)
                                tl.store(ws_q + offs, qe, mask=m)
                                d = tl.maximum(pe * _rcp(Sp_e) - qe * _rcp(Sq_e), 0.0)
                                acc_p += tl.where(m, d, 0.0).to(tl.float64)
                                acc_q += tl.where(m & (offs != x), qe, 0.0).to(tl.float64)
                            # and every rewrite happens before the next try's scalar reads and
                            # the bonus search's reads (other threads, other tile layouts)
                            tl.debug_barrier()
                        in_ws = tl.where(pend != 0, zero + 1, in_ws)
                        Sp = Sp_e
                        Sq = Sq_e
                        pend = zero + 1
                        xp = x
                        Spn = tl.sum(acc_p, axis=0).to(tl.float32)
                        Sqn = tl.sum(acc_q, axis=0).to(tl.float32)

    if GREEDY:
        if am < 0:
            am = _row_argmax(tp_b + cur * s_tp_t, V, BLOCK_V)
        bon = am
    else:  # inverse CDF of the current P (unnormalised), fp64, searched in two levels
        tp_row = tp_b + cur * s_tp_t
        dp_row = dp_b + cur * s_dp_t
        # level 1: one pass for the per-chunk sums (and the last positive token)
        ch = tl.arange(0, NCHUNK)
        csum = tl.zeros([NCHUNK], tl.float64)
        last = zero - 1
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            pv, qv = _load_pq(tp_row, dp_row, ws_p, ws_q, offs, m, in_ws)
            pe, qe = _apply_pending(pv, qv, offs, pend, xp, Sp, Sq, Spn)
            csum = tl.where(ch == v0 // BLOCK_V, tl.sum(tl.where(m, pe, 0.0).to(tl.float64), axis=0), csum)
            last = tl.maximum(last, tl.max(tl.where(m & (pe > 0), offs, -1), axis=0))
        S = tl.sum(csum, axis=0)
        t = tl.load(u_ptr + b * s_u_b).to(tl.float64) * S
        # one scan of the chunk sums: the first chunk whose inclusive prefix exceeds t
        cc = _incl_prefix(csum, ch)
        k = tl.min(tl.where(cc > t, ch, NCHUNK), axis=0)
        carry = tl.sum(tl.where(ch < k, csum, 0.0), axis=0)
        # level 2: search that chunk as GROUPS groups of GROUP_W tokens: the group sums and
        # their prefix, then one group's own prefix (the loop goes on to the next chunks only
        # if rounding made the chunk's prefix sums stay <= t; none found: the last positive token)
        gi = tl.arange(0, GROUPS)
        wi = tl.arange(0, GROUP_W)
        found = zero - 1
        v0 = zero + k.to(tl.int64) * BLOCK_V
        while (v0 < V) & (found < 0):
            offs2 = v0 + gi[:, None] * GROUP_W + wi[None, :]  # [GROUPS, GROUP_W]
            m2 = offs2 < V
            pv2, qv2 = _load_pq(tp_row, dp_row, ws_p, ws_q, offs2, m2, in_ws)
            pe2, qe2 = _apply_pending(pv2, qv2, offs2, pend, xp, Sp, Sq, Spn)
            gs = tl.sum(tl.where(m2, pe2, 0.0).to(tl.float64), axis=1)  # [GROUPS]
            gpos = tl.max(tl.where(m2 & (pe2 > 0), 1, 0), axis=1) > 0
            gc = carry + _incl_prefix(gs, gi)
            kg = tl.min(tl.where(gpos & (gc > t), gi, GROUPS), axis=0)
            if kg < GROUPS:
                offs = v0 + kg * GROUP_W + wi  # [GROUP_W]
                m = offs < V
                pv, qv = _load_pq(tp_row, dp_row, ws_p, ws_q, offs, m, in_ws)
                pe, qe = _apply_pending(pv, qv, offs, pend, xp, Sp, Sq, Spn)
                pos = m & (pe > 0)
                cs = carry + tl.sum(tl.where(gi < kg, gs, 0.0), axis=0) + _incl_prefix(
                    tl.where(m, pe, 0.0).to(tl.float64), wi)
                first = tl.min(tl.where(pos & (cs > t), offs, V), axis=0)
                # (rounding: the group's own prefix stayed <= t) its last positive token
                found = tl.where(first < V, first, tl.max(tl.where(pos, offs, -1), axis=0))
            carry += tl.sum(gs, axis=0)
            v0 += BLOCK_V
        bon = tl.where(found >= 0, found, last)
    tl.store(path_b, zero)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tl.store(path_b + offs_t * s_path_t, tl.full([BLOCK_T], -1, tl.int64), mask=(offs_t >= n) & (offs_t < T))
    tl.store(nacc_ptr + b * s_n, n)
    tl.store(bonus_ptr + b * s_bonus, bon)


# Cluster launch (sm_90+): how many CTAs share one sequence's program (Triton's num_ctas splits
# each block-level tensor over a thread-block cluster, the reductions go through distributed
# shared memory). 1 (the default): one CTA per sequence, the build whose workspace ordering is
# guaranteed (module docstring). None: decided per launch by cluster_ctas() (8 on sm_90+ where it
# fits): opt-in until a GPU run shows the cluster build right under many rejections at one node.
CLUSTER_CTAS: int | None = 1
_CLUSTER_FAILED: set = set()  # (device index, greedy) whose cluster compile or launch failed


def cluster_build_supported() -> bool:
    """Triton >= 3.8 compiles the cluster build of this kernel; Triton 3.6 (the GPU device image's)
    fails in its TritonGPUPlanCTAPass (seen compiling for sm_90 ahead of time), so there the
    launch keeps one CTA per sequence."""
    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 8)


def cluster_ctas(B: int, device: torch.device) -> int:
    """CTAs per sequence: ``CLUSTER_CTAS`` when set (1 by default). With ``CLUSTER_CTAS = None``:
    8 on an sm_90+ GPU while B * 8 fits in the multiprocessors (batch 1 uses 8 SMs instead of 1),
    else 1; 1 in Triton's CPU interpreter, on older GPUs and with a Triton older than 3.8
    (:func:`cluster_build_supported`)."""
    if CLUSTER_CTAS is not None:
        return CLUSTER_CTAS
    if device.type != "cuda" or not cluster_build_supported():
        return 1
    props = torch.cuda.get_device_properties(device)
    if props.major < 9:
        return 1
    return 8 if B * 8 <= props.multi_processor_count else 1


def _launch_meta(T: int, V: int, greedy: bool, ctas: int, block_v: int | None) -> dict:
    """Constexprs and launch options for ``ctas`` CTAs per sequence: chunks of 2048 tokens per CTA
    (unless ``block_v``), the bonus search's groups about the square root of a chunk."""
    bv = block_v if block_v is not None else min(triton.next_power_of_2(V), 2048 * ctas)
    groups = 1 << ((max(bv.bit_length() - 1, 0) + 1) // 2)
    return dict(GREEDY=bool(greedy), BLOCK_V=bv, BLOCK_T=min(triton.next_power_of_2(T), 1024),
                NCHUNK=max(triton.next_power_of_2(triton.cdiv(V, bv)), 2), GROUPS=groups, GROUP_W=bv // groups,
                num_warps=8 if bv >= 2048 * ctas else 4,
                enable_fp_fusion=False)  # the spec's products and subtractions one by one (no FMA)


def verify_tree_triton(
    target_probs: torch.Tensor,  # [B, T, V] fp32, last dim contiguous
    draft_probs: torch.Tensor,  # [B, T, V] fp32, last dim contiguous
    tokens: torch.Tensor,  # [B, T] int64
    parents: torch.Tensor,  # [T] int64
    uniforms: torch.Tensor,  # [B, T] fp32 (ignored when greedy)
    greedy: bool,
    path: torch.Tensor,  # [B, T] int64 out
    num_accepted: torch.Tensor,  # [B] int64 out
    bonus: torch.Tensor,  # [B] int64 out
    workspace: torch.Tensor | None = None,  # [B, 2, V] fp32, last dim contiguous
    block_v: int | None = None,
    num_ctas: int | None = None,
) -> None:
    """One program per sequence; ``num_ctas`` (default :func:`cluster_ctas`) CTAs run it as a
    cluster, each with ``block_v / num_ctas`` tokens of every chunk. If a cluster launch fails
    to compile (a Triton without cluster support for this kernel), the launch is redone with one
    CTA, a warning says so once, and that device keeps one CTA."""
    B, T, V = target_probs.shape
    if B == 0:
        return
    if workspace is None:
        workspace = torch.empty((B, 2, V), dtype=torch.float32, device=target_probs.device)
    dev = target_probs.device
    ctas = cluster_ctas(B, dev) if num_ctas is None else int(num_ctas)
    key = (dev.index, bool(greedy))
    if ctas > 1 and key in _CLUSTER_FAILED and num_ctas is None:
        ctas = 1
    args = (target_probs, draft_probs, tokens, parents, uniforms, path, num_accepted, bonus, workspace,
            T, V,
            target_probs.stride(0), target_probs.stride(1), draft_probs.stride(0), draft_probs.stride(1),
            tokens.stride(0), tokens.stride(1), uniforms.stride(0), uniforms.stride(1),
            path.stride(0), path.stride(1), num_accepted.stride(0), bonus.stride(0),
            workspace.stride(0), workspace.stride(1))
    meta = _launch_meta(T, V, greedy, ctas, block_v)
    if ctas == 1:
        _verify_tree_kernel[(B,)](*args, **meta)
        return
    try:
        _verify_tree_kernel[(B,)](*args, **meta, num_ctas=ctas)
    except Exception as e:  # noqa: BLE001 - a compiler without clusters for this kernel
        if num_ctas is not None:
            raise
        _CLUSTER_FAILED.add(key)
        warnings.warn(f"verify_tree (triton): the {ctas}-CTA cluster launch failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); using one CTA per sequence on this device",
                      RuntimeWarning, stacklevel=2)
        _verify_tree_kernel[(B,)](*args, **_launch_meta(T, V, greedy, 1, block_v))
