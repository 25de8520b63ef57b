#!/bin/bash
# One device call for issue 5: the prefill correctness matrix in parallel shards (which also
# compiles every benchmark tile config into triton's cache) with FlexAttention compiling beside
# it, then the timing run alone on the GPU. Logs go to $OUT (at most 8 files).
#   bash benchmarks/run_prefill_gpu.sh [check_seconds] [bench_seconds]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T1=${1:-150}
T2=${2:-150}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv,noheader
start=$(date +%s)
timeout "$T1" python3 benchmarks/bench_prefill.py --warm-flex --budget "$T1" > "$OUT/flexwarm.log" 2>&1 &
FW=$!
timeout $((T1 + 90)) python3 benchmarks/gpu_check_prefill.py --shards ${SHARDS:-12} \
  --budget "$T1" --log "$OUT/check.log" > "$OUT/check.out" 2>&1
echo "check exit $? after $(( $(date +%s) - start ))s"
wait $FW
echo "flex warm exit $? after $(( $(date +%s) - start ))s"
tail -n 40 "$OUT/check.out"
timeout $((T2 + 20)) python3 benchmarks/bench_prefill.py --budget "$T2" --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start ))s"
grep -v "^{" "$OUT/bench.log" | tail -n 45
