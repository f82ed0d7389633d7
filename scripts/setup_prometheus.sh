#!/usr/bin/env bash
# Installs the Prometheus server (Debian's `prometheus` package) for
# tests/metrics/test_metrics_prometheus.py, which skips when the binary is absent.
# Idempotent: does nothing when `prometheus` is already on PATH. Only the
# binary is used; the package's own service is not started by the tests
# (on a machine with systemd the package enables one: stop it if unwanted).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  prometheus --version 2>&1 | head -1
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
timeout 600 $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus --version 2>&1 | head -1
