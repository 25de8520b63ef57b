#!/bin/bash
# One device call for issue 9's decode rows (int4 / int2 pages, K and V in different formats,
# page size 64), about 3 minutes: the correctness cases of the decode-only formats (int, channel
# scales, residual pages) and the compile warm-up in parallel processes (CPU-bound), then the
# timing run alone on the GPU. Logs go to $OUT.
#   bash benchmarks/run_decode_int_gpu.sh [phase1_seconds] [phase2_seconds]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
LOGS=/tmp/kvc_logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
T1=${1:-110}
T2=${2:-70}
ROWS=${ROWS:-"fp4_e2m1/page,int4/channel+int4/token@64,int4/channel+fp4_e2m1/page@64,int2/channel+int2/token@64"}
SHAPES=${SHAPES:-B64_L8k,B16_L32k,B1_L128k}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
NS=10
for i in $(seq 0 $((NS - 1))); do
  timeout "$T1" python3 benchmarks/gpu_check_decode.py --only decode-only-formats --quick \
    --shard "$i" --shards $NS > "$LOGS/check9_$i.log" 2>&1 &
done
NW=4
for i in $(seq 0 $((NW - 1))); do
  timeout "$T1" python3 benchmarks/bench_decode.py warmup --formats "$ROWS" --shapes "$SHAPES" \
    --waves 8 --part "$i" --parts $NW > "$LOGS/warm9_$i.log" 2>&1 &
done
wait
echo "phase 1 (checks + compile) took $(( $(date +%s) - start ))s"
cat "$LOGS"/check9_*.log > "$OUT/check9.log"
cat "$LOGS"/warm9_*.log > "$OUT/warm9.log"
grep -h "^FAIL" "$OUT/check9.log" | head -20
grep -h "^shard" "$OUT/check9.log"
grep -h "done\|failed\|Error" "$OUT/warm9.log" | head -10
timeout "$T2" python3 benchmarks/bench_decode.py run --no-sweep --no-flex --no-append --waves 8 \
  --formats "$ROWS" --shapes "$SHAPES" --out "$OUT" > "$OUT/bench9.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start ))s"
grep -v "^{" "$OUT/bench9.log" | tail -n 25
