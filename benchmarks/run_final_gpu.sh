#!/bin/bash
# One device call: the compiler end to end on CUDA (decode kernels; prefill through the
# reference so a prefill-kernel problem cannot take the run down), then the prefill kernels'
# own check and benchmark with deadlines.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvc_out}
KVCOMPILE_PREFILL=reference timeout ${E2E_S:-270} python3 benchmarks/gpu_check_e2e.py \
  > "$OUT/e2e.log" 2>&1
echo "e2e exit $?"
grep -v "Warning\|warn(" "$OUT/e2e.log" | grep -E "^\||counters|agreement|Error" | tail -30
SHARDS=8 bash benchmarks/run_prefill_gpu.sh ${PF1:-70} ${PF2:-80} 2>&1 | tail -60
