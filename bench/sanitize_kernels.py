"""Small launches of every CUDA kernel of sequoia_kernels._C, for compute-sanitizer (bench/gpu_check.sh).

    python bench/sanitize_kernels.py                  # run every case once (under compute-sanitizer)
    python bench/sanitize_kernels.py --verdicts LOG.. # one verdict line per kernel from the logs
                                                      # (file names contain memcheck / racecheck / synccheck)

Each case names the kernel template instantiations it launches (demangled, without spaces, as
tests/sm90.py prints them). Every case also checks its result against the reference, so a run
without the sanitizer is a small GPU correctness test of the same launches. A kernel of the
built extension that no case launches gets the verdict "NOT RUN" (add a case for it).
"""

from __future__ import annotations

import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

CASES: dict[str, tuple] = {}  # name -> (function, [kernel names it launches])


def case(name: str, kernels: list[str]):
    def wrap(fn):
        CASES[name] = (fn, kernels)
        return fn
    return wrap


# -------------------------------------------------------------------------- tree_attention


def _tree_attention_case(dtype, D, Hq, Hkv, T, splits):
    from sequoia_kernels.ops.tree_attention import pack_tree_mask, tree_attention
    from sequoia_kernels.reference.tree_attention import tree_attention_reference

    g = torch.Generator(device="cuda").manual_seed(D + T)
    B, S = 2, 150
    prefix = torch.tensor([0, 101], dtype=torch.int32, device="cuda")  # ragged; row 0 has no prefix
    q = torch.randn(B, Hq, T, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, device="cuda", generator=g).to(dtype)
    mask = torch.rand(T, T, device="cuda", generator=g) < 0.5
    mask[0] = False  # a fully masked row (zeros in row 0)
    out = torch.full_like(q, float("nan"))
    tree_attention(q, k, v, prefix, pack_tree_mask(mask), backend="cuda", out=out, num_splits=splits)
    torch.cuda.synchronize()
    ref = tree_attention_reference(q, k, v, prefix, mask).float()
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, f"tree_attention cuda {dtype} D={D} Hq={Hq} T={T} splits={splits}: max err {err}"


for _dt, _tn in ((torch.float16, "__half"), (torch.bfloat16, "__nv_bfloat16")):
    for _D in (64, 128):
        # M = G * T = 10 rows: the 4-warp kernel, one split, output written directly
        case(f"tree_attention {_tn} D{_D} M10", [f"tree_attention_mma_kernel<{_tn},{_D},4>"])(
            lambda dt=_dt, D=_D: _tree_attention_case(dt, D, 2, 1, 5, 1))
        # M = 4 x 20 = 80 rows: the 8-warp kernel, 3 splits and the merge kernel
        case(f"tree_attention {_tn} D{_D} M80 split", [f"tree_attention_mma_kernel<{_tn},{_D},8>",
                                                       f"tree_attention_merge_kernel<{_tn}>"])(
            lambda dt=_dt, D=_D: _tree_attention_case(dt, D, 4, 1, 20, 3))
    case(f"tree_attention {_tn} T1", [f"tree_attention_mma_kernel<{_tn},128,4>"])(
        lambda dt=_dt: _tree_attention_case(dt, 128, 4, 4, 1, 1))


# ------------------------------------------------------------------------------ compact_kv


def _compact_case(dtype, D):
    import sequoia_kernels as sk
    from sequoia_kernels.reference.compact_kv import compact_kv_reference

    g = torch.Generator(device="cuda").manual_seed(D)
    cache = torch.randn(4, 2, 2, 40, D, device="cuda", generator=g).to(dtype)
    src = torch.tensor([[10, 12, 15], [20, 21, 30]], device="cuda")
    dst = torch.tensor([10, 18], device="cuda")
    num = torch.tensor([3, 2], device="cuda")
    want = cache.clone()
    compact_kv_reference(want, src, dst, num)  # in place
    sk.compact_kv_(cache, src, dst, num, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(cache, want), f"compact_kv_ cuda {dtype} D={D} differs from the reference"


for _dt, _D, _vec in ((torch.float16, 1, "unsignedshort"), (torch.float32, 1, "unsignedint"),
                      (torch.float32, 2, "uint2"), (torch.float16, 64, "uint4")):
    case(f"compact_kv {_dt} D{_D}", [f"compact_kv_kernel<{_vec},8>"])(lambda dt=_dt, D=_D: _compact_case(dt, D))


# ----------------------------------------------------------------------------- verify_tree


def _verify_tree_case(V: int, B: int):
    """The stress input of tests/test_verify_tree.py (24 rejections at the root, the residual
    rewritten each time): the cluster kernel's shared-memory passes and remote reads (V = 1000),
    the one-block kernel's workspace (V = 300001, too large for a cluster). Checked against the
    reference bit for bit."""
    import sequoia_kernels as sk
    from test_verify_tree import many_rejections_case, run_reference

    p, q, tokens, parents, u, _ = many_rejections_case(B, V, seed=V + B, device="cuda")
    ref, _ = run_reference(p, q, tokens, parents, u)
    got = sk.verify_tree(p, q, tokens, parents, uniforms=u, backend="cuda")
    torch.cuda.synchronize()
    for a, b in zip(ref, got):
        assert torch.equal(a, b.cpu()), f"verify_tree cuda V={V} B={B} differs from the reference"


case("verify_tree cluster", ["verify_tree_cluster_kernel"])(lambda: _verify_tree_case(1000, 2))
case("verify_tree block", ["verify_tree_block_kernel<512>"])(lambda: _verify_tree_case(300001, 1))


# -------------------------------------------------------------------------------- verdicts


def _norm(name: str) -> str:
    return name.replace(" ", "").replace("sequoia_kernels::", "").removeprefix("void").split("(")[0]


def verdicts(logs: list[str]) -> int:
    kernels = set()
    try:
        import sm90

        kernels = {_norm(n) for n in sm90.cuda_kernels()}
    except Exception as e:  # no cuobjdump on the machine: the kernels the cases name
        print(f"(kernel list from the cases: {e})")
    launched = {k for _, ks in CASES.values() for k in ks}
    kernels |= launched
    results: dict[str, dict[str, str]] = {k: {} for k in kernels}
    bad = 0
    for log in logs:
        tool = next((t for t in ("memcheck", "racecheck", "synccheck") if t in os.path.basename(log)), log)
        text = open(log, errors="replace").read()
        m = re.search(r"ERROR SUMMARY: (\d+) error", text)
        ran = "CASES OK" in text
        blocks = re.split(r"\n(?========= \S)", text)
        for k in kernels:
            if k not in launched:
                results[k][tool] = "NOT RUN"
                continue
            hits = [b for b in blocks if k in b.replace(" ", "").replace("sequoia_kernels::", "")]
            if hits:
                results[k][tool] = f"FAIL ({len(hits)} reports)"
            elif m is None or not ran:
                results[k][tool] = "NO RESULT (sanitizer or cases did not finish)"
            else:
                results[k][tool] = "OK"
    print("\n## compute-sanitizer, one line per CUDA kernel\n")
    for k in sorted(results):
        line = " | ".join(f"{t} {v}" for t, v in results[k].items())
        print(f"{k}: {line}")
        bad += any(v.startswith(("FAIL", "NO RESULT")) for v in results[k].values())
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--verdicts":
        return verdicts(sys.argv[2:])
    import sequoia_kernels  # noqa: F401

    failed = []
    for name, (fn, _) in CASES.items():
        try:
            fn()
            print(f"case ok: {name}", flush=True)
        except Exception as e:  # keep going: the verdicts say which kernel
            failed.append(name)
            print(f"case FAILED: {name}: {type(e).__name__}: {e}", flush=True)
    print("CASES OK" if not failed else f"CASES FAILED: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
