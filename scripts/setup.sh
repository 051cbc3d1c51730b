#!/usr/bin/env bash
# Sets up everything the demo and the tests need; idempotent and fast when already done.
#   1. a virtual environment (.venv, or $SEQUOIA_VENV) with the pinned requirements
#   2. sequoia_kernels._C, built in place (editable install): C++ CPU kernels always, CUDA kernels
#      when torch is a CUDA build and nvcc is found (no GPU needed). Rebuilt only when csrc/,
#      setup.py or the build settings change.
# Environment: SEQUOIA_KERNELS_NO_CUDA=1 (CPU kernels only), TORCH_CUDA_ARCH_LIST (default 8.0;9.0),
#              MAX_JOBS (default: all cores), PYTHON (interpreter for the venv, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SEQUOIA_VENV:-.venv}
STAMPS=.setup-stamps
mkdir -p "$STAMPS" build

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

req=$(sha256sum requirements.txt | cut -c1-16)
if [ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$req" ]; then
  echo "setup: installing requirements.txt into $VENV"
  # --no-compile: no bytecode for the ~20k modules of torch & co. now (108 s -> 70 s on 2 cores);
  # the ones a run imports are compiled once, below
  "$PY" -m pip install -q --disable-pip-version-check --no-compile -r requirements.txt 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$PY" -c "import torch, transformers, pytest" # fail here, clearly, if the install did not work
  echo "$req" > "$STAMPS/requirements"
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0"}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
src=$( (cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat;
        echo "$TORCH_CUDA_ARCH_LIST ${SEQUOIA_KERNELS_NO_CUDA:-0} ${CUDA_HOME:-}") | sha256sum | cut -c1-16)
# The editable install (packages, console script); the extension is compiled separately below so
# that ninja can recompile only what changed.
if ! "$PY" -c "import importlib.metadata as m; m.distribution('sequoia-kernels')" 2>/dev/null \
   || [ ! -x "$VENV/bin/sequoia-kernels" ]; then
  echo "setup: installing sequoia-kernels (editable) into $VENV"
  SEQUOIA_KERNELS_NO_EXT=1 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation \
    --no-deps -e . > build/setup-install.log 2>&1 || { tail -30 build/setup-install.log; exit 1; }
fi
if [ "$(cat "$STAMPS/build" 2>/dev/null)" != "$src" ] || ! ls sequoia_kernels/_C*.so >/dev/null 2>&1 \
   || ! "$PY" -c "import sequoia_kernels" 2>/dev/null; then
  echo "setup: building sequoia_kernels._C (CUDA_HOME=${CUDA_HOME:-none}, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
  start=$(date +%s)
  if ! "$PY" setup.py build_ext --inplace > build/setup-build.log 2>&1; then
    grep -E "error|Error" build/setup-build.log | head -30
    echo "setup: build failed; full log in build/setup-build.log" >&2
    exit 1
  fi
  grep -oE "sequoia-kernels: building.*CUDA=[a-z]+" build/setup-build.log | head -1 || true
  grep -oE "nvcc .* -c [^ ]+\.cu " build/setup-build.log | grep -oE "[^ /]+/[^ /]+\.cu" \
    | sed 's/^/setup: nvcc compiled csrc\//' | sort -u || true
  echo "setup: built in $(( $(date +%s) - start )) s"
  echo "$src" > "$STAMPS/build"
fi
# Bytecode of what a run imports, written once. pip installs with --no-compile (above), and
# environments that set PYTHONDONTWRITEBYTECODE (containers often do) never write it on import:
# every process then recompiles the ~3000 modules of torch, transformers & co. that it imports
# (~19 s instead of ~9 s to import the decoding loop, in each of the ~30 processes a `make test`
# starts). One import with writing allowed leaves their .pyc files in the venv.
if [ "$(cat "$STAMPS/bytecode" 2>/dev/null)" != "$req" ]; then
  echo "setup: writing the bytecode of the modules a run imports"
  env -u PYTHONDONTWRITEBYTECODE "$PY" -c "
import accelerate, hypothesis, matplotlib.pyplot, pytest, scipy.stats, torch.distributed.run, transformers
import sequoia_decoding.cli, sequoia_decoding.demo, sequoia_kernels.hf, sequoia_kernels.triton_kernels" \
    || { echo "setup: importing the package failed" >&2; exit 1; }
  echo "$req" > "$STAMPS/bytecode"
fi
