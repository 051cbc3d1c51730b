#!/usr/bin/env bash
# Run as is on a machine with a GPU (e.g. a lent H200): builds with all cores, runs every test
# (GPU tests included), an end-to-end decoding table, and the kernel benchmark table last.
# Meant to finish in under 8 minutes.
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

echo "== end to end (Llama-2-7B-shaped target, 68M-shaped draft, random weights: timing only)"
timeout 120 "$PY" bench/e2e.py --gpu-shapes --max-new-tokens 32 --num-prompts 1 --temperatures 0,1.0 --budgets 16
e2e_rc=$?

echo "== benchmarks"
timeout 150 "$PY" bench/gpu_bench.py
bench_rc=$?
echo "tests rc=$test_rc e2e rc=$e2e_rc bench rc=$bench_rc"
exit $(( test_rc || e2e_rc || bench_rc ))
