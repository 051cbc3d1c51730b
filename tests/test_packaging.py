"""The package as a user installs it without the checkout: a source distribution that holds what
its build reads, built and imported from another directory, its ops right, and the demo's
defaults (which live in the checkout's ``models/draft/``) named when they are not there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _checkout_files() -> list[str]:
    """The checkout's files as git has them (tracked, and new ones not ignored), or a skip."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (its file list decides what the sdist must hold)")
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """``python setup.py sdist`` run on a copy of the checkout (the drafts left out: big, and
    never in the sdist), so that it writes nothing into the checkout."""
    src = tmp_path_factory.mktemp("checkout")
    for f in _checkout_files():
        if not f.startswith("models/"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=src, capture_output=True,
                       text=True, env={**os.environ, "SEQUOIA_KERNELS_NO_CUDA": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (tarball,) = dist.glob("sequoia_kernels-*.tar.gz")
    return tarball


def test_the_sdist_holds_every_file_the_build_and_the_packages_read(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = [f for f in _checkout_files()
              if f.startswith(("csrc/", "sequoia_kernels/", "python_api/")) and not f.endswith(".so")]
    assert any(f.endswith(".h") for f in wanted) and any(f.endswith(".cuh") for f in wanted)
    missing = sorted(set(wanted) - names)
    assert not missing, f"the sdist lacks {missing} (MANIFEST.in)"
    for f in ("setup.py", "pyproject.toml", "README.md", "requirements.txt"):
        assert f in names
    assert not [n for n in names if n.startswith(("tests/", "models/"))]  # they need the checkout


_SMOKE = r"""
import sys, torch
import sequoia_kernels as sk
from sequoia_kernels.ops.packed_linear import pack_linear_weight, packed_linear
assert sk.__file__.startswith(sys.argv[1]), sk.__file__  # the installed copy, not the checkout's
g = torch.Generator().manual_seed(7)
# tree attention: 5 tree nodes over a prefix of 13, GQA 6 / 2 heads, D = 40
B, Hq, Hkv, T, S, D = 2, 6, 2, 5, 29, 40
q = torch.randn(B, Hq, T, D, generator=g)
k, v = torch.randn(2, B, Hkv, S, D, generator=g)
prefix = torch.tensor([13, 9])
mask = torch.tril(torch.rand(T, T, generator=g) < 0.6) | torch.eye(T, dtype=torch.bool)
out = torch.full_like(q, float("nan"))
sk.tree_attention(q, k, v, prefix, mask, backend="cpu", out=out)
ref = sk.tree_attention(q.double(), k.double(), v.double(), prefix, mask, backend="reference")
torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
# KV compaction, against the reference on a copy
cache = torch.randn(4, B, Hkv, S, D, generator=g)
want = cache.clone()
src, dst, n = torch.tensor([[14, 16, 17], [10, 12, 15]]), torch.tensor([13, 9]), torch.tensor([3, 2])
sk.compact_kv_(cache, src, dst, n, backend="cpu")
sk.compact_kv_(want, src, dst, n, backend="reference")
assert torch.equal(cache, want)
# few-row packed linear, against an fp64 product
x, w = torch.randn(3, 72, generator=g), torch.randn(37, 72, generator=g)
y = packed_linear(x, pack_linear_weight(w), 37)
torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)
import sequoia_decoding.cli, sequoia_decoding.hf_generate  # the Python layer imports from the install
print("installed package ok")
"""


@pytest.mark.slow
def test_a_package_built_from_the_sdist_runs_outside_the_checkout(sdist, tmp_path):
    """``pip install`` of the sdist (CPU kernels: the CUDA build is the checkout's tests' job),
    then the ops and the demo's error from a directory that is not the checkout."""
    site = tmp_path / "site"
    env = {**os.environ, "SEQUOIA_KERNELS_NO_CUDA": "1", "MAX_JOBS": str(os.cpu_count() or 1)}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check", "--target", str(site), str(sdist)],
                       cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list((site / "sequoia_kernels").glob("_C*.so"))
    run_env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", _SMOKE, str(site)], cwd=tmp_path, capture_output=True, text=True,
                       env=run_env)
    assert r.returncode == 0 and "installed package ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    draft = str(REPO / "models" / "draft" / "smollm2-draft")
    for argv, named, option in ((["demo"], "no draft given", "--draft DIR"),
                                (["demo", "--draft", draft], "no prompts given", "--prompts FILE")):
        r = subprocess.run([sys.executable, "-m", "sequoia_decoding", *argv], cwd=tmp_path, capture_output=True,
                           text=True, env=run_env, timeout=300)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert named in r.stderr and option in r.stderr and "make demo" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
