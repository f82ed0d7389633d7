#!/usr/bin/env bash
# Runs steps of scripts/gpu_engines.sh on the lent device detached from the calls that watch
# them: one device call starts the run (setsid, so it outlives the call) and returns; later
# calls wait on it for up to their 10 minutes each and bring back its tables. The run uses a
# copy of this tree, because every call replaces the tree on the device. Issue the next `wait`
# as soon as one returns: a machine without a call for 30 s is given back, the run with it.
# Usage, in the repository root on the device (every slice of scripts/gpu_fetch_wheels.sh in /tmp/gw):
#   bash scripts/gpu_session.sh start GROUP [GROUP ...]
#       GROUP: steps joined by '+', run side by side; the groups run one after another
#       (e.g. model mla+hybrid correctness overhead)
#   bash scripts/gpu_session.sh wait SECONDS
#       until the run has ended or SECONDS have passed: its progress and the tables of the
#       steps done so far; $OUT/session.tgz holds the tables and logs, $OUT/work.tgz the steps'
#       work folders (JSON, schedule traces), the running ones' too
set -uo pipefail
RES=/tmp/gpu-session
TREE=/tmp/gpu-session-tree
case "${1:-}" in
  start)
    shift
    [ $# -gt 0 ] || { echo "name the groups of steps to run (e.g. model mla+hybrid correctness)" >&2; exit 2; }
    [ -f "$RES/done" ] || ! [ -d "$RES" ] || { echo "a run is under way: bash scripts/gpu_session.sh wait 500" >&2; exit 2; }
    # shellcheck disable=SC1091
    source scripts/gpu_device_install.sh || exit 1
    rm -rf "$TREE" "$RES" && mkdir -p "$RES/out" && cp -a . "$TREE"
    setsid nohup bash "$TREE/scripts/gpu_session.sh" run "$@" > "$RES/session.log" 2>&1 < /dev/null &
    echo "started: $* (bash scripts/gpu_session.sh wait SECONDS)" ;;
  run)
    shift
    cd "$TREE" || exit 1
    for group in "$@"; do
      echo "== $(date -Is) $group"
      IFS=+ read -ra steps <<< "$group"
      pids=()
      for s in "${steps[@]}"; do
        OUT="$RES/out" bash scripts/gpu_engines.sh "$s" > "$RES/$s.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || echo "== a step of $group ended with rc $?"; done
    done
    echo "== $(date -Is) done"
    touch "$RES/done" ;;
  wait)
    limit=${2:-540}
    t0=$(date +%s)
    while ! [ -f "$RES/done" ] && (( $(date +%s) - t0 < limit )); do sleep 3; done
    cat "$RES/session.log"
    for f in "$RES"/out/*.txt; do
      [ -f "$f" ] && [ "$(basename "$f")" != steps.txt ] && { echo "--- $(basename "$f")"; tail -n 25 "$f"; }
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    if [ -n "${OUT:-}" ]; then
      tar czf "$OUT/session.tgz" -C "$RES" --exclude='*.tgz' .
      tar czf "$OUT/work.tgz" -C /tmp/kvcached-proof --exclude=models --exclude=prompts.json .
    fi
    [ -f "$RES/done" ] ;;
  *) echo "usage: bash scripts/gpu_session.sh start GROUP [GROUP ...] | wait SECONDS" >&2; exit 2 ;;
esac
