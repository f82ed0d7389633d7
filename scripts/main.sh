#!/usr/bin/env bash
# Main job on a fresh machine: set up kvcached and run the data-plane benchmark,
# kvcached's map/unmap path beside the raw backend calls in the same run
# (host backend here; pass --device cuda:0 on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVCACHED_VENV:-.venvs/kvcached}"
bash scripts/setup_env.sh "$VENV"
echo "[main] python -m kvcached.bench vmm $*"
exec "$VENV/bin/python" -m kvcached.bench vmm "$@"
