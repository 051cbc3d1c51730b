#!/usr/bin/env bash
# Run as is on a machine with a GPU (e.g. a lent H200): builds with all cores, runs the test files
# that hold CUDA cases, compute-sanitizer over every CUDA kernel, an end-to-end decoding table, and
# the kernel benchmark table last. Meant to finish within one device call (10 minutes): the build
# (~1.5 min on 16 cores) plus the step timeouts (125 + 40 + 3 x 35 + 30 + 50 + 20 + 60 + 70 = 500 s) stay
# below it even when every step runs to its limit.
# Uses the machine's own python3 with torch; builds in place (no venv).
#
# Supported combinations (what this script has been written against):
#   - the device image: python3 with torch 2.11+cu130, triton 3.6, transformers 5.17, numpy 2.5,
#     nvcc 13.0, compute-sanitizer from the CUDA toolkit; sm_90 (H100/H200) builds.
#   - the development venv: torch 2.14.1+cu130, triton 3.8, transformers 5.18 (requirements.txt).
#   Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) breaks on numpy >= 2.4 (runtime loop
#   bounds; fixed in triton 3.8): on the device image the Triton kernels run compiled on the GPU,
#   and the CPU-interpreter tests need triton >= 3.8 or numpy < 2.4.
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

echo "== tests (GPU): the files with CUDA cases (CI runs the CPU-only files on every commit)"
t0=$(date +%s)
timeout 125 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_sampling_gpu.py tests/test_verify_tree.py \
  tests/test_tree_attention.py tests/test_compact_kv.py tests/test_hf_llama.py tests/test_generate.py \
  tests/test_feature_drafter.py 2>&1 | tail -25
test_rc=${PIPESTATUS[0]}

echo "== verifier stress: >= 24 rejections at one node, every GPU verifier, B in {1, 8}, bit for bit vs the reference"
# (issue 21) the CUDA cluster kernel, the CUDA one-block kernel (V = 300001 / 524288), Triton with
# one CTA and as an 8-CTA cluster where this Triton builds it; also part of the test step above
timeout 40 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_verify_tree.py -k "many_rejections" 2>&1 | tail -6
stress_rc=${PIPESTATUS[0]}

echo "== compute-sanitizer (memcheck, racecheck, synccheck) over a small launch of every CUDA kernel"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
san_rc=0
if [ -n "$SAN" ]; then
  logs=()
  for tool in memcheck racecheck synccheck; do
    log=/tmp/sk-sanitizer-$tool.log
    # only our kernels are instrumented (namespace sequoia_kernels): torch's own launches run plain
    timeout 35 "$SAN" --tool "$tool" --kernel-name kns=sequoia_kernels --print-limit 50 \
      "$PY" bench/sanitize_kernels.py > "$log" 2>&1
    echo "$tool: rc=$? ($(grep -o 'ERROR SUMMARY: [0-9]* error[s]*' "$log" | tail -1))"
    logs+=("$log")
  done
  "$PY" bench/sanitize_kernels.py --verdicts "${logs[@]}"
  san_rc=$?
else
  echo "compute-sanitizer not found: skipped"
fi

echo "== the tensor-parallel code path on one GPU (NCCL, a one-rank mesh; bench/tp_check.py)"
timeout 30 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/tp_check.py 2>&1 | grep -v "^W[0-9]"
tp_rc=${PIPESTATUS[0]}

echo "== end to end (Llama-2-7B-shaped target, 68M-shaped draft, random weights: timing only)"
timeout 50 "$PY" bench/e2e.py --gpu-shapes --max-new-tokens 32 --num-prompts 1 --temperatures 0,1.0 --budgets 16
e2e_rc=$?

echo "== offloading: the target's layers in pinned host memory, copied a layer ahead (issue 28)"
timeout 20 "$PY" -m pytest -q -p no:cacheprovider tests/test_streaming.py -k "gpu" 2>&1 | tail -3
offload_rc=${PIPESTATUS[0]}
timeout 60 "$PY" bench/offload_gpu_check.py 2>&1 | grep -v "it/s\]"
offload_rc=$(( offload_rc || PIPESTATUS[0] ))

echo "== benchmarks"
timeout 70 "$PY" bench/gpu_bench.py
bench_rc=$?
echo "tests rc=$test_rc stress rc=$stress_rc sanitizer rc=$san_rc tp rc=$tp_rc e2e rc=$e2e_rc offload rc=$offload_rc" \
  "bench rc=$bench_rc; $(( $(date +%s) - t0 )) s after the build"
exit $(( test_rc || stress_rc || san_rc || tp_rc || e2e_rc || offload_rc || bench_rc ))
