#!/usr/bin/env bash
# On the device, after the slices of scripts/gpu_fetch_wheels.sh were copied to /tmp/gw/<set>:
# unpack each set (vllm, sglang, optional vllm029) into its own site directory /tmp/site-<set> (their pins clash:
# transformers, xgrammar, flashinfer), install kvcached from this checkout into /tmp/site-kvcached
# (the extension built against the image's torch), and write /tmp/sc-<set>/sitecustomize.py,
# which makes both site directories of every Python process that has /tmp/sc-<set> on
# PYTHONPATH (the engines' spawned schedulers and workers too, so kvcached_autopatch.pth and the
# plugin entry points work as in a normal install). A set's packages go before the image's own
# (SGLang's transformers pin must win over the image's).
# Usage (in the repository root on the device): source scripts/gpu_device_install.sh
# Afterwards PYTHONPATH=/tmp/sc-vllm (or /tmp/sc-sglang when only that set is there);
# gpu_env SET prints the PYTHONPATH of a set's processes.
set -euo pipefail
root=$PWD
sets=()
# write_sitecustomize DIR KVCACHED_SITE SET_SITE: DIR/sitecustomize.py puts both site directories
# ahead of the image's packages in every process that has DIR on PYTHONPATH.
write_sitecustomize() {
  mkdir -p "$1"
  cat > "$1/sitecustomize.py" <<EOF
import site, sys
n = len(sys.path)
for d in ("$2", "$3"):
    site.addsitedir(d)
new = sys.path[n:]
del sys.path[n:]
at = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))), len(sys.path))
sys.path[at:at] = new
EOF
}
for d in /tmp/gw/*/; do
  [ -d "$d" ] || continue
  set=$(basename "$d")
  site=/tmp/site-$set
  if ! [ -f "$site/.installed" ]; then
    parts=$(ls "$d"part.* 2>/dev/null | sort)
    [ -n "$parts" ] && [ -f "$d/sha256" ] || { echo "set $set: slices missing in $d (copy every .gpuw/$set/sK)" >&2; exit 1; }
    # shellcheck disable=SC2086
    [ "$(cat $parts | sha256sum | cut -d' ' -f1)" = "$(cat "$d/sha256")" ] \
      || { echo "set $set: slices incomplete or corrupt: copy them again" >&2; exit 1; }
    rm -rf "$site" && mkdir -p "$site"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    if command -v xz > /dev/null; then cat $parts | xz -dc -T0 | tar -x -C "$site"
    else cat $parts | python3 -c 'import lzma,sys,tarfile; tarfile.open(fileobj=lzma.open(sys.stdin.buffer), mode="r|").extractall(sys.argv[1])' "$site"; fi
    touch "$site/.installed"
    echo "[gpu] set $set unpacked into $site in $(( $(date +%s) - t0 )) s"
  fi
  sets+=("$set")
  write_sitecustomize "/tmp/sc-$set" /tmp/site-kvcached "$site"
done
[ ${#sets[@]} -gt 0 ] || { echo "no engine set in /tmp/gw: copy the slices of scripts/gpu_fetch_wheels.sh first" >&2; exit 1; }
# kvcached again only when this tree's sources differ from what was installed (~25 s).
stamp=$(cd "$root" && find kvcached csrc setup.py pyproject.toml -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.toml' \) | sort | xargs sha1sum | sha1sum | cut -c1-16)
if [ "$(cat /tmp/site-kvcached/.kvcached-stamp 2>/dev/null)" != "$stamp" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site-kvcached "$root" > /tmp/kvcached-install.log 2>&1 \
    || { tail -30 /tmp/kvcached-install.log; exit 1; }
  echo "$stamp" > /tmp/site-kvcached/.kvcached-stamp
fi
# Earlier commits packed by scripts/gpu_pack_tree.sh (.gpuw/tree/REV.tgz, carried): each into
# /tmp/site-kvcached-REV, and /tmp/sc-SET-REV runs set SET with it (STEP@SET-REV).
for t in "$root"/.gpuw/tree/*.tgz; do
  [ -f "$t" ] || continue
  rev=$(basename "$t" .tgz)
  if ! [ -f "/tmp/site-kvcached-$rev/.installed" ]; then
    src=$(mktemp -d) && tar xzf "$t" -C "$src"
    python3 -m pip install -q --no-deps --no-build-isolation --target "/tmp/site-kvcached-$rev" "$src" \
      > "/tmp/kvcached-install-$rev.log" 2>&1 || { tail -30 "/tmp/kvcached-install-$rev.log"; exit 1; }
    touch "/tmp/site-kvcached-$rev/.installed"
    echo "[gpu] kvcached at $rev installed into /tmp/site-kvcached-$rev"
  fi
  for s in "${sets[@]}"; do write_sitecustomize "/tmp/sc-$s-$rev" "/tmp/site-kvcached-$rev" "/tmp/site-$s"; done
done
set +eu
gpu_env() { echo "/tmp/sc-$1"; }
if [ -d /tmp/sc-vllm ]; then export PYTHONPATH=/tmp/sc-vllm; else export PYTHONPATH=/tmp/sc-${sets[0]}; fi
for s in "${sets[@]}"; do
  dist=${s%%[0-9]*}  # set vllm029 holds the distribution vllm
  echo "[gpu] $s: $dist $(PYTHONPATH=/tmp/sc-$s python3 -c "import importlib.metadata as m; print(m.version('$dist'))" 2>&1 | tail -1) and kvcached in /tmp/site-$s (PYTHONPATH=/tmp/sc-$s)"
done
