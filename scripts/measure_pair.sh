#!/usr/bin/env bash
# Measure the SmolLM2 pair for the model card, the demo and the README (run on an idle machine):
#   1. scripts/draft/eval_draft.py            -> <draft>/eval.json (greedy agreement, step-time ratio)
#   2. sequoia-kernels measure-acceptance at T = 0, 0.6, 1 on the held-out prompts, and at T = 0.6 with
#      top-p 0.9 (the demo's filtered row)
#                                        -> <draft>/acceptance-T<t>[-topp0.9].json (the demo plans with these)
#   3. sequoia-kernels profile           -> build/pair/latency-<dtype>.json + .png (E2E_DTYPE, default float32)
#   4. bench/e2e.py on models/draft/demo_prompts.txt at the planner's choice and 16 nodes, every row
#      with the calibrated planner's prediction (its profile: the demo's cache at the prompts' context)
#                                        -> build/pair/e2e-<dtype>.md
# Usage: [E2E_DTYPE=bfloat16] [SKIP_EVAL=1] bash scripts/measure_pair.sh [DRAFT_DIR]   (default models/draft/smollm2-draft)
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFT=${1:-models/draft/smollm2-draft}
PY=${SEQUOIA_VENV:-.venv}/bin/python
CLI=${SEQUOIA_VENV:-.venv}/bin/sequoia-kernels
OUT=build/pair
mkdir -p "$OUT"
TARGET=$("$PY" -c "from sequoia_decoding.modeling.smollm2 import ensure_target; print(ensure_target())")
if [ -z "${SKIP_EVAL:-}" ]; then  # SKIP_EVAL=1: steps 3 and 4 only
  "$PY" scripts/draft/eval_draft.py --draft "$DRAFT" --threads "${EVAL_THREADS:-1}"
  for T in 0 0.6 1; do
    "$CLI" measure-acceptance --target "$TARGET" --draft "$DRAFT" --prompts models/draft/heldout_prompts.txt \
      --temperature "$T" --width 16 --max-new-tokens 64 --out "$DRAFT/acceptance-T$T.json" > /dev/null
  done
  "$CLI" measure-acceptance --target "$TARGET" --draft "$DRAFT" --prompts models/draft/heldout_prompts.txt \
    --temperature 0.6 --top-p 0.9 --width 16 --max-new-tokens 64 --out "$DRAFT/acceptance-T0.6-topp0.9.json" > /dev/null
fi
"$CLI" profile --target "$TARGET" --draft "$DRAFT" --repeats 5 --dtype "${E2E_DTYPE:-float32}" \
  --out "$OUT/latency-${E2E_DTYPE:-float32}.json" --plot "$OUT/latency-${E2E_DTYPE:-float32}.png"
"$PY" bench/e2e.py --target "$TARGET" --draft "$DRAFT" --prompts models/draft/demo_prompts.txt \
  --num-prompts "${E2E_PROMPTS:-4}" --max-new-tokens "${E2E_TOKENS:-64}" \
  --budgets "${E2E_BUDGETS:-16}" --max-depth 16 --dtype "${E2E_DTYPE:-float32}" | tee "$OUT/e2e-${E2E_DTYPE:-float32}.md"
