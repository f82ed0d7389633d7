#!/usr/bin/env bash
# Sets up a fresh environment, lints (ruff), and runs the whole test suite (host backend;
# GPU tests skip cleanly without a GPU), then the real-engine tests
# (scripts/test_engines.sh: vLLM, scripts/test_engines_sglang.sh: SGLang,
# scripts/test_engines_router.sh: the router in front of both;
# KVCACHED_ENGINE_TESTS=0 skips them).
# Usage: bash scripts/test.sh [pytest args for the main suite]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVCACHED_TEST_VENV:-.venvs/kvcached}"
bash scripts/setup_env.sh "$VENV"
# The engine venvs (cached outside the clone) are made in the background meanwhile: on a cold
# machine their downloads overlap the lint and the main suite (scripts/prepare_engine_venvs.sh;
# its own process group, ended with this script; a venv cut off half-way is made again).
if [ "${KVCACHED_ENGINE_TESTS:-1}" != "0" ]; then
  mkdir -p .venvs/logs
  setsid bash scripts/prepare_engine_venvs.sh > .venvs/logs/prepare_engine_venvs.log 2>&1 < /dev/null &
  prepare=$!
  trap 'kill -- -"$prepare" 2>/dev/null || true' EXIT
fi
# The Prometheus server for the metrics test (Debian package; the test skips without it).
bash scripts/setup_prometheus.sh || echo "[test] prometheus could not be installed: tests/metrics/test_metrics_prometheus.py skips"
echo "[test] ruff (lint + format)"
"$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check .
echo "[test] running pytest"
# The seam contracts read every supported engine release's source (downloaded once, ~20 s,
# cached outside the clone by scripts/engine_sources.py): required here, so a contract that
# cannot run fails instead of skipping (KVCACHED_REQUIRE_SEAM_SOURCES=0 lets them skip offline).
export KVCACHED_REQUIRE_SEAM_SOURCES="${KVCACHED_REQUIRE_SEAM_SOURCES:-1}"
# Run from tests/ so the installed package, not the source tree, is imported.
(cd tests && "../$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" .)
# Then the real engines, each in its own venv (KVCACHED_ENGINE_TESTS=0 skips them):
# vLLM (version matrix), SGLang (version matrix), the router in front of both. Every
# part runs even when one fails; the status is non-zero when any did.
if [ "${KVCACHED_ENGINE_TESTS:-1}" != "0" ]; then
  echo "[test] engine venvs made in the background: .venvs/logs/prepare_engine_venvs.log"
  failed=()
  for part in test_engines test_engines_sglang test_engines_router; do
    echo "[test] $(date +%H:%M:%S) scripts/$part.sh"
    bash "scripts/$part.sh" || failed+=("$part")
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "[test] engine tests failed: ${failed[*]}" >&2
    exit 1
  fi
fi
