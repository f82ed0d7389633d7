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
#   bash scripts/gpu_session.sh stop
#       ends the run now (its process group: every step and engine it started); what it wrote
#       stays, and the next start moves it aside (/tmp/gpu-session.N) instead of deleting it
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
    if [ -d "$RES" ]; then n=1; while [ -e "$RES.$n" ]; do n=$((n + 1)); done; mv "$RES" "$RES.$n"; fi
    rm -rf "$TREE" && mkdir -p "$RES/out" && cp -a . "$TREE"
    setsid nohup bash "$TREE/scripts/gpu_session.sh" run "$@" > "$RES/session.log" 2>&1 < /dev/null &
    echo "started: $* (bash scripts/gpu_session.sh wait SECONDS)" ;;
  run)
    shift
    echo $$ > "$RES/pid"  # started by setsid: this shell leads the run's process group (stop)
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
  stop)
    [ -f "$RES/pid" ] && ! [ -f "$RES/done" ] || { echo "no run under way" >&2; exit 0; }
    pg=$(cat "$RES/pid")
    kill -TERM -- "-$pg" 2>/dev/null
    for _ in $(seq 20); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pg" 2>/dev/null
    echo "== $(date -Is) stopped" >> "$RES/session.log"
    touch "$RES/done"
    echo "stopped; tables so far: bash scripts/gpu_session.sh wait 1" ;;
  *) echo "usage: bash scripts/gpu_session.sh start GROUP [GROUP ...] | wait SECONDS | stop" >&2; exit 2 ;;
esac
