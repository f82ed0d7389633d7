#!/usr/bin/env bash
# Create a CPU-only SGLang venv for kvcached's SGLang integration tests.
#
# usage: scripts/setup_sglang_venv.sh [VENV_DIR]     (default: <repo>/.venvs/sglang)
# env:   SGLANG_VERSION   the sglang release (default 0.5.23); scripts/test_engines_sglang.sh
#                         passes one cached venv per version,
#                         ${KVCACHED_ENGINE_VENVS:-~/.cache/kvcached/venvs}/sglang-<version>
#        PYTHON           interpreter that creates the venv (default python3.11, else python3)
#
# SGLang publishes no CPU build on PyPI; its wheel pins torch and ~70 GPU-only dependencies
# (flashinfer, sglang-kernel, deep-gemm, ...). We install:
#   1. torch 2.14.1 + torchvision 0.29.1 for every version. 0.5.22/0.5.23 pin exactly that;
#      0.5.15-0.5.17 pin torch 2.11.0 and 0.5.18-0.5.21 torch 2.13.0, which exist here only
#      as PyPI CUDA builds (~3 GB of downloads with their nvidia libraries) or as a CPU torch
#      without a matching torchvision (SGLang < 0.5.22 imports torchvision.io at start-up,
#      and a CUDA torchvision refuses a CPU torch). 2.14.1 and 0.29.1 lie in pip's configured
#      local wheel folder; the CPU path of the older releases runs on it (the engine tests
#      prove 0.5.15 on it, see docs/notes/sglang_seams.md);
#   2. `sglang==$SGLANG_VERSION --no-deps`;
#   3. only the light dependencies the CPU path (Engine / launch_server, torch_native
#      attention, pytorch sampling) really imports, each at the version this sglang release
#      pins in its own metadata (transformers, tokenizers, xgrammar, openai, ... differ
#      between releases), unpinned otherwise.
#
# Idempotent: does nothing when the venv is complete (its completion marker names this
# version and dependency set, and Engine + launch_server import). A venv that is not
# complete (an interrupted install, another version, a broken import) is deleted and
# created again, never patched up in place. Concurrent runs on one venv are serialised with
# flock where it exists. KVCACHED_SGLANG_VENV_FORCE=1 rebuilds anyway.
#
# The test-only stub for `vllm._custom_ops.rotary_embedding` lives in
# tests/engines/sglang_stubs/ and is put on PYTHONPATH by the SGLang tests only; it is not
# installed into the venv.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venvs/sglang}"
case "$VENV" in
  /*) ;;
  *) VENV="$REPO_ROOT/$VENV" ;;
esac
VENV="${VENV%/}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_PIN="sglang==${SGLANG_VERSION}"
# What the CPU path imports; found by running Engine and launch_server on a tiny Llama
# (0.5.15 and 0.5.23). Pinned below where the sglang release pins them.
# jsonschema + soundfile: imported at module level by launch_server's OpenAI routes.
# zstandard, watchfiles: declared by sglang, cheap, keep `pip check` quieter.
LIGHT_DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
  tqdm IPython aiohttp transformers tokenizers dill apache-tvm-ffi sentencepiece gguf
  compressed-tensors triton uvloop fastapi uvicorn setproctitle xxhash partial_json_parser
  safetensors einops openai xgrammar python-multipart prometheus-client interegular
  python-dateutil regex scipy pyyaml jsonschema soundfile zstandard watchfiles
  pytest  # test runner for the SGLang integration tests that run inside this venv
)
# Floors sglang does not state but its code needs (older uvicorns lack what the server uses).
EXTRA_CONSTRAINTS=("uvicorn>=0.51" "python-dateutil<3")

log() { printf '[setup_sglang_venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

VPY="$VENV/bin/python"
# Written last, only after the import check passed: its absence means the venv was never
# finished (or was made by an older version of this script).
MARKER="$VENV/.kvcached-sglang-complete"
MARKER_CONTENT="$(printf '%s\n' "$SGLANG_PIN" "${TORCH_PINS[@]}" "${LIGHT_DEPS[@]}" "${EXTRA_CONSTRAINTS[@]}")"

mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null 2>&1; then
  exec 9>"${VENV}.lock"
  if ! flock -n 9; then
    log "waiting for another setup of $VENV"
    flock 9
  fi
fi

check_import() {
  # From a neutral directory, with the test stub, as the tests import it.
  (cd / && PYTHONPATH="$REPO_ROOT/tests/engines/sglang_stubs" "$VPY" - "$SGLANG_VERSION" <<'EOF' >/dev/null 2>&1
import sys
import importlib.metadata as md
import torch, sglang, transformers  # noqa: E401
from sglang.srt.entrypoints.engine import Engine  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (launch_server's import chain)
assert md.version("sglang") == sys.argv[1], md.version("sglang")
assert torch.__version__.startswith("2.14.1"), torch.__version__
EOF
  )
}

if [[ "${KVCACHED_SGLANG_VENV_FORCE:-0}" != "1" && -x "$VPY" && -f "$MARKER" ]] \
   && [[ "$(cat "$MARKER")" == "$MARKER_CONTENT" ]] && check_import; then
  log "sglang $SGLANG_VERSION already complete in $VENV; nothing to do"
  exit 0
fi

START=$SECONDS
if [[ -e "$VENV" ]]; then
  # Half-installed (interrupted), another version, or broken: start over. Only a directory
  # that is a venv (pyvenv.cfg) or empty is ever deleted.
  if [[ -f "$VENV/pyvenv.cfg" ]] || [[ -d "$VENV" && -z "$(ls -A "$VENV")" ]]; then
    why="not complete"
    if [[ -f "$MARKER" ]]; then why="made for another version or dependency set, or does not import"; fi
    log "$VENV is $why: deleting it and creating it again"
    rm -rf "$VENV"
  else
    log "ERROR: $VENV exists and is not a venv; refusing to delete it"
    exit 1
  fi
fi

log "creating venv $VENV with $($PYTHON --version 2>&1)"
"$PYTHON" -m venv "$VENV"

# Keep torch where we put it, whatever a dependency asks for.
CONSTRAINTS="$VENV/kvcached-sglang-constraints.txt"
printf '%s\n' "${TORCH_PINS[@]}" "${EXTRA_CONSTRAINTS[@]}" >"$CONSTRAINTS"

PIP=("$VPY" -m pip --disable-pip-version-check)
# pip's output goes to a log in the venv: the resolver lists every GPU-only dependency of
# sglang that we deliberately leave out ("sglang X requires ..., which is not installed");
# that is expected. The log's tail is shown if a step fails.
PIP_LOG="$VENV/kvcached-setup-pip.log"
: >"$PIP_LOG"
pip_q() {
  if ! "${PIP[@]}" "$@" >>"$PIP_LOG" 2>&1; then
    tail -n 40 "$PIP_LOG" >&2
    log "pip $* FAILED (full log: $PIP_LOG)"
    exit 1
  fi
}

log "step 1/4: ${TORCH_PINS[*]} (from pip's configured local wheel folder; runs on CPU)"
pip_q install -c "$CONSTRAINTS" "${TORCH_PINS[@]}"

log "step 2/4: $SGLANG_PIN without its (GPU) dependencies"
pip_q install --no-deps "$SGLANG_PIN"

# Each light dependency at the version this release pins (its metadata), else unpinned.
mapfile -t PINNED < <("$VPY" - "${LIGHT_DEPS[@]}" <<'EOF'
import sys
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

wanted = {canonicalize_name(n): n for n in sys.argv[1:]}
pins = {}
for text in md.requires("sglang") or ():
    r = Requirement(text)
    name = canonicalize_name(r.name)
    if name not in wanted or not r.specifier:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # an extra (test, diffusion, ...), or another platform
    pins[name] = f"{r.name}{r.specifier}"
for name, given in wanted.items():
    print(pins.get(name, given))
EOF
)
log "step 3/4: light dependencies (${#PINNED[@]} packages; pinned by sglang: $(printf '%s\n' "${PINNED[@]}" | grep -c '[=<>]'))"
pip_q install -c "$CONSTRAINTS" "${PINNED[@]}"

# The PyPI torchaudio/torchcodec builds break transformers on CPU; never keep them.
for p in torchaudio torchcodec; do
  if "${PIP[@]}" show -q "$p" >/dev/null 2>&1; then
    log "removing $p"
    pip_q uninstall -y "$p"
  fi
done

log "step 4/4: import check"
if ! check_import; then
  (cd / && PYTHONPATH="$REPO_ROOT/tests/engines/sglang_stubs" "$VPY" -c \
    'import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server') || true
  log "import check FAILED"
  exit 1
fi
printf '%s\n' "$MARKER_CONTENT" >"$MARKER"
log "sglang $SGLANG_VERSION done in $((SECONDS - START)) s; venv size $(du -sh "$VENV" 2>/dev/null | cut -f1)"
