"""Build sequoia-kernels.

The compiled extension ``sequoia_kernels._C`` always contains the C++ CPU kernels.
It also contains the CUDA kernels when the installed torch is a CUDA build and nvcc
is found; no GPU is needed to compile them.

Environment:
  SEQUOIA_KERNELS_NO_CUDA=1   build the CPU kernels only
  TORCH_CUDA_ARCH_LIST        CUDA architectures (default "8.0;9.0": A100, H100/H200)
  MAX_JOBS                    parallel compile jobs (default: all cores)
  SEQUOIA_KERNELS_NO_EXT=1    install the Python packages only (scripts/setup.sh then compiles
                              the extension in place with `setup.py build_ext --inplace`, which
                              recompiles only what changed)
"""

import glob
import os

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_wanted() -> bool:
    if os.environ.get("SEQUOIA_KERNELS_NO_CUDA", "0") not in ("", "0"):
        return False
    if torch.version.cuda is None:
        return False
    return cpp_extension.CUDA_HOME is not None and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )


def _extension():
    with_cuda = _cuda_wanted()
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-std=c++20", "-fopenmp"]
    define_macros = [("Py_LIMITED_API", "0x03090000")]
    include_dirs = [os.path.join(ROOT, "csrc")]
    extra = {"cxx": cxx}
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        # nvcc: the framework-free kernels and launchers (*.cu); the host compiler: their torch side
        sources += sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
        # torch's CUDA wheels ship the CUDA headers (cccl etc.) under nvidia/cu13/include
        nv = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
        include_dirs += sorted(glob.glob(os.path.join(nv, "cu*", "include")))
        define_macros.append(("SEQUOIA_WITH_CUDA", "1"))
        extra["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo",
                         "-diag-suppress=20013,20015"]
        cls = cpp_extension.CUDAExtension
    else:
        cls = cpp_extension.CppExtension
    print(f"sequoia-kernels: building _C with CUDA={'yes' if with_cuda else 'no'}: {sources}")
    return cls(
        "sequoia_kernels._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )


os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

setup(
    name="sequoia-kernels",
    version="0.1.0",
    description="Exact, fast Sequoia speculative decoding kernels (tree attention, KV compaction, tree verification)",
    python_requires=">=3.10",
    packages=find_packages(include=["sequoia_kernels", "sequoia_kernels.*"])
    + find_packages("python_api", include=["sequoia_decoding", "sequoia_decoding.*"]),
    package_dir={"sequoia_decoding": "python_api/sequoia_decoding"},
    ext_modules=[] if os.environ.get("SEQUOIA_KERNELS_NO_EXT", "0") not in ("", "0") else [_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    # torch >= 2.6: torch.library.register_fake / opcheck and the limited-API CppExtension.
    # Triton >= 3.4 (Linux, where the Triton kernels run): the Philox stream relies on the
    # tl.randint4x semantics of 3.4+; with older Triton the uniforms can leave (0, 1). torch takes
    # Triton 3.4 from 2.8 on; torch 2.6's compiler fails with Triton 3.4 (docs/build.md): Linux needs 2.8.
    install_requires=["torch>=2.8; platform_system == 'Linux'", "torch>=2.6; platform_system != 'Linux'",
                      "triton>=3.4; platform_system == 'Linux'", "numpy"],
    extras_require={"hf": ["transformers>=5.4"], "plot": ["matplotlib"]},
    entry_points={"console_scripts": ["sequoia-kernels=sequoia_decoding.cli:main"]},
)
