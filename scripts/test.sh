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
bash scripts/cmake_build.sh

echo "== pytest"
# Without a GPU, Triton kernels run in Triton's CPU interpreter (tests/conftest.py sets it).
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero code.
"$PY" -m pytest "$@"

if [ $# -eq 0 ]; then
  echo "== pytest again with Triton's interpreter off (what a GPU machine sees, minus the GPU; not slow)"
  # every test must choose its CPU backends from what the machine offers (tests/conftest.py)
  TRITON_INTERPRET=0 "$PY" -m pytest -q -m "not slow" -p no:cacheprovider
fi
