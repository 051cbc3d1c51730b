#!/usr/bin/env bash
# The whole test suite on a fresh machine: setup, the CMake build check, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k compact).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${SEQUOIA_VENV:-.venv}/bin/python

echo "== registered kernels of the sequoia_kernels ops"
"$PY" -c "import torch, sequoia_kernels; [print(torch._C._dispatch_dump(f'sequoia_kernels::{op}')) for op in ('compact_kv_', 'tree_attention', 'verify_tree')]"

echo "== CMake build of the same sources against libtorch"
# one GPU architecture is enough to check the CMake build (setup.py's build has sm_80 and sm_90,
# whose machine code the static tests inspect); saves ~30 s of nvcc
TORCH_CUDA_ARCH_LIST=${SEQUOIA_CMAKE_CUDA_ARCHS:-9.0} bash scripts/cmake_build.sh

echo "== pytest, Triton's interpreter off (what a GPU machine sees, minus the GPU): every test once"
# every test chooses its CPU backends from what the machine offers (tests/conftest.py); Triton
# kernels on CPU tensors need the interpreter and are skipped here, with the reason.
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero code.
TRITON_INTERPRET=0 "$PY" -m pytest "$@"

if [ $# -eq 0 ]; then
  echo "== pytest again with Triton's CPU interpreter on: the tests that exercise Triton"
  TRITON_INTERPRET=1 SEQUOIA_TRITON_ONLY=1 "$PY" -m pytest -q -p no:cacheprovider
fi
