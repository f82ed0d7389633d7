#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with kvcached installed from this
# checkout with build isolation (the real wheel path: no torch or CUDA toolkit
# needed to build), plus torch (CPU) and the test tools.
# Usage: bash scripts/setup_env.sh [VENV_DIR]   (default .venvs/kvcached)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venvs/kvcached}"
step() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# pip, minus the per-package notes about this machine's local index folders.
pipq() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating venv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  # The CPU build of torch 2.13.0 is in pip's configured local wheel folder on
  # this kind of machine; elsewhere pip fetches it.
  step "installing torch 2.13.0"
  pipq install -q "torch==2.13.0"
fi
step "building and installing kvcached (build isolation)"
pipq install -q ".[test]"
step "ready: $("$PY" -c 'import kvcached, kvcached._C, torch; print("kvcached", kvcached.__version__, "torch", torch.__version__)')"
