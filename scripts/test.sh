#!/usr/bin/env bash
# The whole test suite on a fresh machine: setup, pytest, the CMake build check.
# Extra arguments go to pytest (e.g. scripts/test.sh -k compact).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${SEQUOIA_VENV:-.venv}/bin/python

echo "== registered kernels of the sequoia_kernels ops"
"$PY" -c "import torch, sequoia_kernels; [print(torch._C._dispatch_dump(f'sequoia_kernels::{op}')) for op in ('compact_kv_', 'tree_attention', 'verify_tree')]"

cmake_check() {
  # one GPU architecture is enough to check the CMake build (setup.py's build has sm_80 and sm_90,
  # whose machine code the static tests inspect)
  TORCH_CUDA_ARCH_LIST=${SEQUOIA_CMAKE_CUDA_ARCHS:-9.0} bash scripts/cmake_build.sh
}

if [ $# -gt 0 ]; then
  echo "== CMake build of the same sources against libtorch"
  cmake_check
fi

echo "== pytest, Triton's interpreter off (what a GPU machine sees, minus the GPU): every test once"
# every test chooses its CPU backends from what the machine offers (tests/conftest.py); Triton
# kernels on CPU tensors need the interpreter and are skipped here, with the reason.
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero code.
if [ $# -gt 0 ]; then
  TRITON_INTERPRET=0 "$PY" -m pytest "$@"
else  # the multi-process tests run later, beside the CMake check
  TRITON_INTERPRET=0 "$PY" -m pytest -m "not multiprocess"
fi

if [ $# -eq 0 ]; then
  # the CMake build runs beside the interpreter pass (mostly one Python thread) with a job per
  # core: the build is the longer of the two (one nvcc job took ~185 s against the pass's ~95 s on
  # 2 cores), so it gets every core and shares them with the pass; the first pass ran alone (some
  # of its tests read the machine's load)
  echo "== CMake build of the same sources against libtorch (log: build/cmake-check.log), beside:"
  MAX_JOBS=$(nproc) cmake_check > build/cmake-check.log 2>&1 &
  cmake_pid=$!
  echo "== pytest again with Triton's CPU interpreter on: the tests that exercise Triton"
  pytest_rc=0
  TRITON_INTERPRET=1 SEQUOIA_TRITON_ONLY=1 "$PY" -m pytest -q -p no:cacheprovider || pytest_rc=$?
  # the AMX paths (bf16 linears, attention scores) on software tiles, as an AMX CPU takes them: on
  # a CPU without AMX the only run of their code (csrc/cpu/amx.h: EmuTiles), on one with AMX a run
  # of the emulation the tests check against the hardware
  echo "== pytest: the bf16 CPU kernels' and layers' tests on emulated AMX tiles (SEQUOIA_KERNELS_AMX=emulate)"
  SEQUOIA_KERNELS_AMX=emulate TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "not multiprocess" \
    tests/test_packed_linear_bf16.py tests/test_tree_attention.py tests/test_lean_layers.py \
    tests/test_fused_projections.py || pytest_rc=$?
  # the AVX2 proxy (docs/bf16_cpu.md): our kernels and oneDNN capped to AVX2, models decoding in
  # process as on an AVX2-only CPU (AMD Zen 3), prefills and offloaded targets included (the
  # kernels' own tests cross the paths in subprocesses in the first pass); ~40 s; on an AVX2-only
  # CPU the first pass was that run already
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    echo "== pytest: the bf16 layers, prefill and offloaded targets under the AVX2 proxy (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)"
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
      -m "not multiprocess" tests/test_lean_layers.py tests/test_fused_projections.py tests/test_prefill.py \
      tests/test_streaming.py || pytest_rc=$?
  fi
  # ranks under torchrun (two one-thread processes), while the CMake check's last nvcc job runs alone
  echo "== pytest: the multi-process tests (tensor-parallel ranks under torchrun)"
  TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m multiprocess || pytest_rc=$?
  cmake_rc=0
  wait "$cmake_pid" || cmake_rc=$?
  cat build/cmake-check.log
  echo "cmake check rc=$cmake_rc, interpreter, emulated-AMX, AVX2-proxy and multi-process passes rc=$pytest_rc"
  exit $(( cmake_rc || pytest_rc ))
fi
