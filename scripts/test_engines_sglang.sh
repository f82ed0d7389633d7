#!/usr/bin/env bash
# SGLang integration tests on a real SGLang 0.5.23 engine (CPU, tiny model built at test time).
#
# Usage: bash scripts/test_engines_sglang.sh [pytest args]
#
# 1. the SGLang CPU venv (scripts/setup_sglang_venv.sh; idempotent, ~2-4 min the first time);
# 2. kvcached into it the way users get it: a wheel built with pip's build isolation
#    (so the kvcached_autopatch.pth hook and the sglang.srt.plugins entry point are installed);
# 3. pytest tests/engines/sglang with that venv's python, from tests/ so that the installed
#    package, not the source tree, is imported.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVCACHED_SGLANG_VENV:-.venvs/sglang}"
step() { printf '[test_engines_sglang %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

bash scripts/setup_sglang_venv.sh "$VENV"
PY="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")/bin/python"

step "building the kvcached wheel (build isolation)"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEELS" .
step "installing $(basename "$WHEELS"/kvcached-*.whl) into $VENV"
"$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEELS"/kvcached-*.whl

step "running tests/engines/sglang"
cd tests
export KVCACHED_REQUIRE_SGLANG=1 KVCACHED_EXPECT_AUTOPATCH=1
exec "$PY" -m pytest -q -p no:cacheprovider --durations=8 engines/sglang "$@"
