#!/usr/bin/env bash
# Here (a machine with PyPI): download vLLM 0.26.0 and the wheels the H200 image lacks
# (scripts/gpu_wheels_vllm_0.26.txt) for Python 3.12 x86_64, and pack them into folders
# s1..sN of at most 58 MiB each (a device call carries at most 64 MiB).
# Usage: bash scripts/gpu_fetch_wheels.sh [DEST]   (default .gpuw, git-ignored)
# Then, on the device, one call per slice (back to back: the machine goes back when idle):
#   mkdir -p /tmp/gw && cp .gpuw/sK/* /tmp/gw/          (carry .gpuw/sK)
# and in the call that runs the work: bash scripts/gpu_device_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
list="$PWD/scripts/gpu_wheels_vllm_0.26.txt"
dest=${1:-.gpuw}
mkdir -p "$dest/dl"
plat=""
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_31 manylinux_2_34 \
         manylinux_2_35 manylinux_2_24 manylinux_2_5 manylinux1; do plat="$plat --platform ${p}_x86_64"; done
# shellcheck disable=SC2046,SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$dest/dl" $(grep -v '^#' "$list")
cd "$dest"
rm -rf s[0-9]* && big=$(ls dl/vllm-0.26.0-*.whl)
sha256sum "$big" | cut -d' ' -f1 > vllm.sha256
split -b 58M -d -a 1 "$big" vllm.part.
n=0
for part in vllm.part.*; do n=$((n+1)); mkdir -p "s$n"; mv "$part" "s$n/"; done
n=$((n+1)); mkdir -p "s$n"; mv vllm.sha256 "s$n/"
find dl -name '*.whl' ! -name 'vllm-0.26.0-*' -exec cp {} "s$n/" \;
du -sh s*
echo "slices s1..s$n: carry one per device call, each copied to /tmp/gw there (scripts/gpu_device_install.sh)"
