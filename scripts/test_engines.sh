#!/usr/bin/env bash
# Real-engine tests: vLLM (CPU build) on a tiny model built at test time, with
# kvcached installed into the engine's own venv as a wheel (build isolation),
# and tests/engines/vllm run from tests/ so the installed package is imported.
# Usage: bash scripts/test_engines.sh [pytest args]
# Env: KVCACHED_VLLM_VENV (default .venvs/vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVCACHED_VLLM_VENV:-.venvs/vllm}"
step() { printf '[engines %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

T0=$(date +%s)
step "vLLM venv $VENV"
bash scripts/setup_vllm_venv.sh "$VENV"
PY="$(cd "$VENV" && pwd)/bin/python"
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  step "installing pytest into $VENV"
  "$PY" -m pip install -q pytest
fi
step "building and installing kvcached into $VENV as a wheel (build isolation)"
"$PY" -m pip install -q --force-reinstall --no-deps .
(cd / && "$PY" -c 'import kvcached, kvcached._C, vllm; print("[engines] kvcached", kvcached.__version__, "from", kvcached.__file__, "| vllm", vllm.__version__)')
step "running tests/engines/vllm (real engines; a few minutes)"
cd tests
set +e
KVCACHED_REQUIRE_ENGINES=1 "$PY" -m pytest -q -p no:cacheprovider -o console_output_style=classic --durations=0 engines/vllm "$@"
rc=$?
set -e
step "engine tests finished in $(( $(date +%s) - T0 )) s (rc=$rc)"
exit $rc
