#!/usr/bin/env bash
# Here (a machine with PyPI): make the engine sets for the lent H200 (Python 3.12 x86_64, torch
# 2.11 in the image). A set is the wheels the image lacks (scripts/gpu_wheels_<set>_<version>.txt:
# vLLM 0.26 or SGLang 0.5.17, which pin the image's torch), installed here into a folder as pip
# would install them there, packed as one tar.xz (about half the size of the wheels: SGLang's
# sglang-kernel is 383 MB of wheel, 150 MB of xz) and cut into slices of at most 58 MiB (a
# device call carries at most 64 MiB with the tree).
# Usage: bash scripts/gpu_fetch_wheels.sh [SET ...]   (SET: vllm, sglang; default both)
#   optional SET vllm029: vLLM 0.29.0 on the image's torch 2.11 (its pin says 2.13.0; its compiled
#   extensions target the stable ABI of 2.11: docs/GPU.md, "Newer vLLM on the GPU"), never in the
#   default; on the device: KVCACHED_VLLM_PYTHONPATH=/tmp/sc-vllm029 for scripts/gpu_engines.sh
#   GPUW=DIR  where the slices go (default .gpuw, git-ignored): DIR/<set>/s1 ... sN
# A set whose list did not change since it was packed is kept (the pack takes minutes).
# Then, on the device, one call per slice, back to back (the machine goes back when idle):
#   mkdir -p /tmp/gw/SET && cp .gpuw/SET/sK/* /tmp/gw/SET/          (carry .gpuw/SET/sK)
# and in the call that runs the work: source scripts/gpu_device_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${GPUW:-.gpuw}
sets=("$@")
[ ${#sets[@]} -eq 0 ] && sets=(vllm sglang)
plat="--python-version 3.12 --implementation cp --only-binary=:all:"
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_31 manylinux_2_34 \
         manylinux_2_35 manylinux_2_24 manylinux_2_5 manylinux1; do plat="$plat --platform ${p}_x86_64"; done
mkdir -p "$dest/dl"
for set in "${sets[@]}"; do
  list=$(ls scripts/gpu_wheels_"$set"_*.txt 2>/dev/null | head -1)
  [ -n "$list" ] || { echo "no wheel list scripts/gpu_wheels_${set}_*.txt (sets: vllm, sglang, vllm029)" >&2; exit 2; }
  stamp=$(sha1sum "$list" | cut -c1-16)
  if [ "$(cat "$dest/$set/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "$set: packed already for $list"; du -sh "$dest/$set"/s*; continue
  fi
  reqs=$(grep -v '^#' "$list" | grep .)
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $plat -d "$dest/dl" $reqs
  site=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-index --no-compile --find-links "$dest/dl" $plat --target "$site" $reqs
  rm -rf "$site/bin"  # console scripts name this machine's python; the proof runs python -m
  rm -rf "${dest:?}/$set" && mkdir -p "$dest/$set"
  echo "$set: packing $(du -sh "$site" | cut -f1) (xz, a few minutes)"
  tar -C "$site" -cf - . | xz -T0 -6 > "$dest/$set/site.tar.xz"
  rm -rf "$site"
  (cd "$dest/$set" && sha256sum site.tar.xz | cut -d' ' -f1 > sha256 && split -b 58M -d -a 2 site.tar.xz part. && rm site.tar.xz)
  n=0
  for part in "$dest/$set"/part.*; do n=$((n+1)); mkdir -p "$dest/$set/s$n"; mv "$part" "$dest/$set/s$n/"; done
  mv "$dest/$set/sha256" "$dest/$set/s$n/"
  echo "$stamp" > "$dest/$set/stamp"
  du -sh "$dest/$set"/s*
  echo "$set: slices s1..s$n; carry one per device call: mkdir -p /tmp/gw/$set && cp .gpuw/$set/sK/* /tmp/gw/$set/"
done
