#!/usr/bin/env bash
# Run as is on a machine with a GPU (e.g. a lent H200): builds with all cores, runs every test
# (GPU tests included), prints the benchmark table last. Meant to finish in under 8 minutes.
# Uses the machine's own python3 with torch; builds in place (no venv).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

echo "== build (MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
start=$(date +%s)
"$PY" setup.py -q build_ext --inplace > /tmp/sk-build.log 2>&1 || { tail -80 /tmp/sk-build.log; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$PWD:$PWD/python_api${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, sequoia_kernels as sk; assert sk.cuda_compiled(); print(sk.available_backends('cuda'))"

echo "== tests (GPU)"
timeout 300 "$PY" -m pytest tests -q -x -p no:cacheprovider -m "not slow" 2>&1 | tail -25
test_rc=${PIPESTATUS[0]}

echo "== benchmarks"
timeout 150 "$PY" bench/gpu_bench.py
bench_rc=$?
echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc || bench_rc ))
