#!/usr/bin/env bash
# Measure the SmolLM2 pair for the model card, the demo and the README (run on an idle machine):
#   1. scripts/draft/eval_draft.py            -> <draft>/eval.json (greedy agreement, step-time ratio)
#   2. sequoia-kernels measure-acceptance at T = 0, 0.6, 1 on the held-out prompts
#                                        -> <draft>/acceptance-T<t>.json (the demo plans with these)
#   3. sequoia-kernels profile           -> build/pair/latency-<dtype>.json + .png (E2E_DTYPE, default float32)
#   4. bench/e2e.py on models/draft/demo_prompts.txt at the profiler's budget and 64 nodes
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
fi
"$CLI" profile --target "$TARGET" --draft "$DRAFT" --repeats 5 --dtype "${E2E_DTYPE:-float32}" \
  --out "$OUT/latency-${E2E_DTYPE:-float32}.json" --plot "$OUT/latency-${E2E_DTYPE:-float32}.png"
"$PY" bench/e2e.py --target "$TARGET" --draft "$DRAFT" --prompts models/draft/demo_prompts.txt \
  --num-prompts "${E2E_PROMPTS:-6}" --max-new-tokens "${E2E_TOKENS:-96}" --profile "$OUT/latency-${E2E_DTYPE:-float32}.json" \
  --budgets "${E2E_BUDGETS:-64}" --max-depth 16 --dtype "${E2E_DTYPE:-float32}" | tee "$OUT/e2e-${E2E_DTYPE:-float32}.md"
