#!/usr/bin/env bash
# Create a CPU-only SGLang 0.5.23 venv for kvcached's SGLang integration tests.
#
# usage: scripts/setup_sglang_venv.sh [VENV_DIR]     (default: <repo>/.venvs/sglang)
#
# SGLang publishes no CPU build on PyPI; its wheel pins torch==2.14.1 and ~70 GPU-only
# dependencies (flashinfer, sglang-kernel, deep-gemm, ...). We install torch 2.14.1 +
# torchvision 0.29.1 (on this machine's disk through pip's configured wheel folder), then
# `sglang==0.5.23 --no-deps`, then only the dependencies that the CPU path
# (Engine / launch_server, torch_native attention, pytorch sampling) really imports.
#
# Idempotent: a stamp file records the requirement set; a second run with the same set and a
# working import does nothing. Set KVCACHED_SGLANG_VENV_FORCE=1 to reinstall anyway.
#
# The test-only stub for `vllm._custom_ops.rotary_embedding` lives in
# tests/engines/sglang_stubs/ and is put on PYTHONPATH by the SGLang tests only; it is not
# installed into the venv.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venvs/sglang}"
PYTHON="${PYTHON:-python3}"

TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_PIN="sglang==0.5.23"
# Light dependencies that the CPU path (Engine and launch_server) imports; found by running
# both on a tiny Llama. Versions pinned where sglang 0.5.23 pins them.
# jsonschema + soundfile: imported at module level by launch_server's OpenAI routes.
# zstandard, watchfiles: declared by sglang, cheap, keep `pip check` quieter.
LIGHT_DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
  tqdm IPython aiohttp "transformers==5.19.0" "tokenizers==0.23.2" dill
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" gguf "compressed-tensors==0.18.0" triton
  uvloop fastapi "uvicorn>=0.51" setproctitle xxhash partial_json_parser safetensors einops
  "openai==2.8.0" "xgrammar==0.2.7" python-multipart prometheus-client interegular
  "python-dateutil<3" regex scipy pyyaml jsonschema "soundfile==0.13.1" zstandard watchfiles
  pytest  # test runner for the SGLang integration tests that run inside this venv
)

log() { printf '[setup_sglang_venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

STAMP_CONTENT="$(printf '%s\n' "$SGLANG_PIN" "${TORCH_PINS[@]}" "${LIGHT_DEPS[@]}")"
STAMP="$VENV/.kvcached_sglang_stamp"
VPY="$VENV/bin/python"

check_import() {
  "$VPY" - <<'EOF' >/dev/null 2>&1
import torch, sglang, transformers
from sglang.srt.entrypoints.engine import Engine  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (launch_server's import chain)
assert torch.__version__.startswith("2.14.1"), torch.__version__
EOF
}

if [[ "${KVCACHED_SGLANG_VENV_FORCE:-0}" != "1" && -x "$VPY" && -f "$STAMP" ]] \
   && [[ "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] && check_import; then
  log "venv $VENV is up to date (sglang 0.5.23, torch 2.14.1); nothing to do"
  exit 0
fi

START=$SECONDS
if [[ ! -x "$VPY" ]]; then
  log "creating venv at $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
else
  log "reusing venv at $VENV"
fi
rm -f "$STAMP"

# Keep torch where SGLang pins it, whatever a dependency asks for. (pip's own configured
# constraint file, if any, still applies to the torch cap on this machine.)
CONSTRAINTS="$VENV/kvcached-sglang-constraints.txt"
printf '%s\n' "${TORCH_PINS[@]}" > "$CONSTRAINTS"

PIP=("$VPY" -m pip --disable-pip-version-check)
# pip's output goes to a log in the venv: the resolver lists every GPU-only dependency of
# sglang that we deliberately leave out ("sglang 0.5.23 requires ..., which is not
# installed"); that is expected. The log's tail is shown if a step fails.
PIP_LOG="$VENV/kvcached-setup-pip.log"
: > "$PIP_LOG"
pip_q() {
  if ! "${PIP[@]}" "$@" >>"$PIP_LOG" 2>&1; then
    tail -n 40 "$PIP_LOG" >&2
    log "pip $* FAILED (full log: $PIP_LOG)"
    exit 1
  fi
}

log "step 1/4: torch 2.14.1 + torchvision 0.29.1 (CUDA build from the local wheel folder; runs on CPU)"
pip_q install -c "$CONSTRAINTS" "${TORCH_PINS[@]}"

log "step 2/4: $SGLANG_PIN without its (GPU) dependencies"
pip_q install --no-deps "$SGLANG_PIN"

log "step 3/4: light dependencies (${#LIGHT_DEPS[@]} packages)"
pip_q install -c "$CONSTRAINTS" "${LIGHT_DEPS[@]}"

# The PyPI torchaudio/torchcodec builds break transformers on CPU; never keep them.
for p in torchaudio torchcodec; do
  if "${PIP[@]}" show -q "$p" >/dev/null 2>&1; then
    log "removing $p"
    pip_q uninstall -y "$p"
  fi
done

log "step 4/4: import check"
if ! check_import; then
  "$VPY" -c 'import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server' || true
  log "import check FAILED"
  exit 1
fi
printf '%s\n' "$STAMP_CONTENT" > "$STAMP"
log "done in $((SECONDS - START)) s; venv size $(du -sh "$VENV" 2>/dev/null | cut -f1)"
