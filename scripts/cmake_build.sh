#!/usr/bin/env bash
# Configure and build CMakeLists.txt (same sources as setup.py) against the venv's libtorch.
# Incremental: fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SEQUOIA_VENV:-.venv}
PY="$VENV/bin/python"
CMAKE="$VENV/bin/cmake"
[ -x "$CMAKE" ] || CMAKE=cmake
args=(-S . -B build/cmake -DPython3_EXECUTABLE="$PWD/$PY"
      -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')")
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda; fi
if [ -n "${CUDA_HOME:-}" ] && [ "${SEQUOIA_KERNELS_NO_CUDA:-0}" = "0" ] \
   && "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  # torch's CMake config looks for the toolkit through CUDAToolkit_ROOT / nvcc on PATH
  export PATH="$CUDA_HOME/bin:$PATH"
  args+=(-DSEQUOIA_KERNELS_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME")
else
  args+=(-DSEQUOIA_KERNELS_WITH_CUDA=OFF)
fi
"$CMAKE" "${args[@]}" > build/cmake-configure.log 2>&1 || { tail -40 build/cmake-configure.log; exit 1; }
"$CMAKE" --build build/cmake -j "${MAX_JOBS:-$(nproc)}" 2>&1 | grep -E "Building|Linking|Built target|error" || true
test -f build/cmake/_C.so && echo "cmake: built build/cmake/_C.so"
