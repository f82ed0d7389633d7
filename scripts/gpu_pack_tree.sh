#!/usr/bin/env bash
# Here: pack an earlier commit of this repository for the lent GPU, to run a step against the
# kvcached of that commit beside this one's (a bisect: did a difference come with a change?).
# Usage: bash scripts/gpu_pack_tree.sh REV      -> .gpuw/tree/<short rev>.tgz (~1.2 MB, git-ignored)
# On the device, carry .gpuw/tree with the call that sources scripts/gpu_device_install.sh: it
# installs each packed tree into /tmp/site-kvcached-<rev> and makes /tmp/sc-<set>-<rev> for every
# engine set, so `bash scripts/gpu_engines.sh gemma3-limit@vllm-<rev>` runs this tree's step
# with that commit's kvcached (STEP@SET).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_pack_tree.sh REV (a commit of this repository)" >&2; exit 2; }
rev=$(git rev-parse --short=7 "$1^{commit}") || { echo "no commit $1 here: git log names them" >&2; exit 2; }
# The step's scripts and engines run with that commit's kvcached, helpers included: it must have
# the ones scripts/gpu_proof imports (all there from 2026-12-05 on).
for m in kvcached/units.py kvcached/testing/vllm_server.py kvcached/testing/sglang_server.py \
         kvcached/testing/record_sampler.py; do
  git cat-file -e "$rev:$m" 2>/dev/null \
    || { echo "$rev lacks $m, which scripts/gpu_proof imports: pick a later commit" >&2; exit 2; }
done
mkdir -p .gpuw/tree
git archive --format=tar "$rev" | gzip -9 > ".gpuw/tree/$rev.tgz"
echo ".gpuw/tree/$rev.tgz ($(du -h ".gpuw/tree/$rev.tgz" | cut -f1)): carry .gpuw/tree; steps STEP@<set>-$rev"
