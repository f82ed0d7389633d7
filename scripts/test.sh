#!/usr/bin/env bash
# Sets up a fresh environment and runs the whole test suite (host backend;
# GPU tests skip cleanly without a GPU). Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVCACHED_TEST_VENV:-.venvs/kvcached}"
bash scripts/setup_env.sh "$VENV"
echo "[test] running pytest"
# Run from tests/ so the installed package, not the source tree, is imported.
cd tests
exec "../$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" .
