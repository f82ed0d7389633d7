#!/usr/bin/env bash
# The GPU engine proof (issue: vLLM on the H200 with kvcached), on any CUDA machine whose
# python3 has vLLM and kvcached (on the lent H200: source scripts/gpu_device_install.sh first).
#   model        random-weight Llama-3-8B and Llama-3.2-1B shapes in bf16, drawn on the GPU,
#                word-level tokenizer (kvcached.testing.tiny_model --preset)
#   correctness  greedy tokens with and without kvcached, defaults and under a small limit
#   overhead     vllm bench serve native vs kvcached, paired rounds; then the limit lowered
#                and raised while decoding (step 4)
#   three        three models, one budget vs a static split; TTFT and want -> give-back
# Usage: bash scripts/gpu_engines.sh [model] [correctness] [overhead] [three]   (default: all)
# Logs and JSON go to a work folder (KVCACHED_PROOF_WORK, default /tmp/kvcached-proof); each
# step's table to $OUT/<step>.txt and its files to $OUT/<step>.tgz (a device call brings back
# few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
WORK="${KVCACHED_PROOF_WORK:-/tmp/kvcached-proof}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(model correctness overhead three)
big="$WORK/models/llama3-8b"
small="$WORK/models/llama3-1b"
rc=0
for step in "${steps[@]}"; do
  echo "== $(date -Is) $step" | tee -a "$OUT/steps.txt"
  t0=$(date +%s)
  case "$step" in
    model)
      for m in "$big:llama3-8b" "$small:llama3-1b"; do
        dir=${m%%:*}
        [ -f "$dir/config.json" ] || python3 -m kvcached.testing.tiny_model "$dir" --preset "${m##*:}" \
          --device cuda --dtype bfloat16 --layers-per-shard 4 || rc=1
      done
      du -sh "$WORK/models"/* | tee -a "$OUT/steps.txt" ;;
    correctness)
      python3 scripts/gpu_proof/correctness.py --model "$big" --out "$WORK/correctness" 2>&1 | tee "$OUT/correctness.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    overhead)
      python3 scripts/gpu_proof/overhead.py --model "$big" --out "$WORK/overhead" --limits 2>&1 | tee "$OUT/overhead.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    three)
      python3 scripts/gpu_proof/three_models.py --model "$small" --out "$WORK/three" \
        --plot "$OUT/gpu_three_models.png" 2>&1 | tee "$OUT/three.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    *) echo "unknown step $step (model, correctness, overhead, three)" >&2; exit 2 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s, rc so far $rc" | tee -a "$OUT/steps.txt"
  [ -d "$WORK/$step" ] && tar czf "$OUT/$step.tgz" -C "$WORK" --exclude='prompts.json' "$step"
done
exit $rc
