#!/usr/bin/env bash
# The GPU proof run (on the lent H200 or any CUDA machine with torch):
# builds the extension in place, runs the whole test suite with the CUDA
# backend enabled, and runs the vmm benchmark on the GPU. Logs go to $OUT
# (or ./gpu-out). Usage: bash scripts/gpu_suite.sh [extra pytest args]
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "== $(date -Is) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
python3 setup.py -q build_ext --inplace -j 8 > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
# Test tools missing from the image can travel as wheels in .whl/ (carried).
if ! python3 -c "import hypothesis" 2>/dev/null && ls .whl/hypothesis-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -m pytest -q -rs -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
python3 -m kvcached.bench vmm --device cuda:0 2>&1 | tee "$OUT/bench_vmm_cuda.txt"
python3 -m kvcached.bench attention --device cuda:0 2>&1 | tee "$OUT/bench_attention_cuda.txt"
python3 -m kvcached.bench manager --device cuda:0 --layers 32 --repeats 3 2>&1 | tee "$OUT/bench_manager_cuda.txt"
exit $rc
