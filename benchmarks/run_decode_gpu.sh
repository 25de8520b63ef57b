#!/bin/bash
# One device call for issue 4: correctness matrix and compile warm-up in parallel processes
# (CPU-bound), then the timing run alone on the GPU. Logs go to $OUT (at most 8 files).
#   bash benchmarks/run_decode_gpu.sh [phase1_seconds] [phase2_seconds]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
LOGS=/tmp/kvc_logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
T1=${1:-130}
T2=${2:-140}
QUICK=${QUICK---quick}  # QUICK= (empty) runs the full matrix
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
start=$(date +%s)
NS=9
for i in $(seq 0 $((NS - 1))); do
  timeout "$T1" python3 benchmarks/gpu_check_decode.py $QUICK --shard "$i" --shards $NS > "$LOGS/check_$i.log" 2>&1 &
done
NW=6
for i in $(seq 0 $((NW - 1))); do
  timeout "$T1" python3 benchmarks/bench_decode.py warmup --part "$i" --parts $NW > "$LOGS/warm_$i.log" 2>&1 &
done
for i in 0 1 2 3; do
  timeout "$T1" python3 benchmarks/bench_decode.py flexwarm --part "$i" --parts 4 > "$LOGS/flex_$i.log" 2>&1 &
done
wait
echo "phase 1 (checks + compile) took $(( $(date +%s) - start ))s"
cat "$LOGS"/check_*.log > "$OUT/check.log"
cat "$LOGS"/warm_*.log "$LOGS"/flex_*.log > "$OUT/warm.log"
grep -h "^FAIL" "$OUT/check.log" | head -20
grep -h "^shard" "$OUT/check.log"
grep -h "done\|failed\|compiled\|Error" "$OUT/warm.log" | head -20
timeout "$T2" python3 benchmarks/bench_decode.py run --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start ))s"
grep -v "^{" "$OUT/bench.log" | tail -n 45
