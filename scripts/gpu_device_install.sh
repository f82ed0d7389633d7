#!/usr/bin/env bash
# On the device, after every slice of scripts/gpu_fetch_wheels.sh was copied to /tmp/gw:
# join the vLLM wheel, check it, install every wheel into /tmp/site, make /tmp/site a site
# directory of every Python process (vLLM's workers too, so kvcached_autopatch.pth and the
# vllm.general_plugins entry point work as in a normal install), and install kvcached from
# this checkout there (the extension is built against the image's torch-free CUDA headers).
# Usage (in the repository root on the device): source scripts/gpu_device_install.sh
set -euo pipefail
root=$PWD
if ! [ -f /tmp/site/.vllm-installed ]; then
  cd /tmp/gw
  cat $(ls vllm.part.* | sort -t. -k3 -n) > /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
  [ "$(sha256sum /tmp/vllm-0.26.0-*.whl | cut -d' ' -f1)" = "$(cat vllm.sha256)" ] || { echo "vLLM wheel corrupt: copy the slices again" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/vllm-0.26.0-*.whl ./*.whl
  touch /tmp/site/.vllm-installed
  cd "$root"
fi
mkdir -p /tmp/sc && printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py
# kvcached again only when this tree's sources differ from what was installed (~25 s).
stamp=$(cd "$root" && find kvcached csrc setup.py pyproject.toml -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.toml' \) | sort | xargs sha1sum | sha1sum | cut -c1-16)
if [ "$(cat /tmp/site/.kvcached-stamp 2>/dev/null)" != "$stamp" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site "$root" > /tmp/kvcached-install.log 2>&1 \
    || { tail -30 /tmp/kvcached-install.log; exit 1; }
  echo "$stamp" > /tmp/site/.kvcached-stamp
fi
set +eu
export PYTHONPATH=/tmp/sc
echo "[gpu] vLLM $(python3 -c 'import vllm; print(vllm.__version__)') and kvcached installed in /tmp/site"
