#!/usr/bin/env bash
# The main job. Until the decoding loop lands: plan the Sequoia tree for the built-in acceptance
# vector and print it with its expected tokens per step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${SEQUOIA_VENV:-.venv}/bin/sequoia-kernels" plan --budget 64 --max-depth 8 "$@"
