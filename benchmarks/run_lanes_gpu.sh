#!/bin/bash
# Two device calls on a 2-GPU host (nvidia-h200-x2), each running two lanes at once, one per GPU:
#   call 1 (carry .kvc_gpu_a):  bash benchmarks/run_lanes_gpu.sh 1
#     GPU 0: the full decode correctness matrix, then the prefill matrix + kernel report +
#            append bandwidth (run_issue45_gpu.sh decode, prefill_report)          issues 4, 5
#     GPU 1: the quality harness canary (run_quality_gpu.sh canary), then the HF generate
#            CUDA-graph check (tests/gpu/test_hf_graphs_gpu.py)                              issues 7, 6
#   call 2 (carry .kvc_gpu_b, right after call 1 on the same warm machine):
#                               bash benchmarks/run_lanes_gpu.sh 2
#     GPU 0: bench_generate.py (HF StaticCache + inductor, kvcompile fp8 + HF generate, the
#            Engine rows and its concurrency curve)                                  issue 6
#     GPU 1: run_quality_gpu.sh run: passkey 7.5k, streaming over the whole corpus, RULER 2k/4k
#                                                                                    issue 7
# Each lane logs to its own folder; everything comes back as $OUT/lanes<call>.tar.gz, with the
# lanes' summaries printed here (and in $OUT/summary<call>.txt).
set -u
set -m   # background lanes get their own process groups (stopped whole at the deadline)
cd "$(dirname "$0")/.."
CALL=${1:-1}
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L0=/tmp/lane0_$CALL
L1=/tmp/lane1_$CALL
rm -rf "$L0" "$L1" && mkdir -p "$L0" "$L1"
start=$(date +%s)
DEADLINE=${DEADLINE:-545}   # lanes still running then are stopped, so the logs come back
waitlanes() {
  while kill -0 "$1" 2>/dev/null || kill -0 "$2" 2>/dev/null; do
    if [ $(( $(date +%s) - start )) -ge "$DEADLINE" ]; then
      echo "deadline ${DEADLINE}s: stopping the lanes still running"
      kill -TERM -- "-$1" "-$2" 2>/dev/null   # each lane is its own process group (set -m)
      sleep 5
      kill -KILL -- "-$1" "-$2" 2>/dev/null
      break
    fi
    sleep 5
  done
}
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
if [ "$CALL" = 1 ]; then
  (export CUDA_VISIBLE_DEVICES=0 OUT=$L0 DECODE_BUDGET=${DECODE_BUDGET:-300} \
     PREFILL_BUDGET=${PREFILL_BUDGET:-150}
   bash benchmarks/run_issue45_gpu.sh decode > "$L0/decode.out" 2>&1
   echo "decode exit $? at $(( $(date +%s) - start ))s" >> "$L0/lane.txt"
   bash benchmarks/run_issue45_gpu.sh prefill_report > "$L0/prefill_report.out" 2>&1
   echo "prefill_report exit $? at $(( $(date +%s) - start ))s" >> "$L0/lane.txt") &
  P0=$!
  (export CUDA_VISIBLE_DEVICES=1 OUT=$L1
   bash benchmarks/quality/gpu_stages.sh canary > "$L1/canary.out" 2>&1
   echo "canary exit $? at $(( $(date +%s) - start ))s" >> "$L1/lane.txt"
   timeout 240 python3 -m pytest -s -q -m gpu tests/gpu/test_hf_graphs_gpu.py -p no:cacheprovider > "$L1/hf_graphs_check.log" 2>&1
   echo "hf graph check exit $? at $(( $(date +%s) - start ))s" >> "$L1/lane.txt") &
  P1=$!
  waitlanes $P0 $P1
  {
    echo "### lane 0 (GPU 0)"; cat "$L0/lane.txt"
    tail -n 30 "$L0/decode.out"; tail -n 60 "$L0/prefill_report.out"
    echo "### lane 1 (GPU 1)"; cat "$L1/lane.txt"
    tail -n 25 "$L1/canary.out"
    grep -E "^\||passed|Error" "$L1/hf_graphs_check.log" | tail -n 20
  } > "$OUT/summary$CALL.txt"
else
  (export CUDA_VISIBLE_DEVICES=0 OUT=$L0
   timeout 400 python3 benchmarks/bench_generate.py --budget-s 360 --out "$L0" \
     --sections ${SECTIONS:-hf_static,kvc_fp8,kvc_bf16,engine_b,engine} > "$L0/bench_generate.log" 2>&1
   echo "bench_generate exit $? at $(( $(date +%s) - start ))s" >> "$L0/lane.txt") &
  P0=$!
  (export CUDA_VISIBLE_DEVICES=1 OUT=$L1
   bash benchmarks/quality/gpu_stages.sh run > "$L1/quality.out" 2>&1
   echo "quality exit $? at $(( $(date +%s) - start ))s" >> "$L1/lane.txt") &
  P1=$!
  waitlanes $P0 $P1
  {
    echo "### lane 0 (GPU 0)"; cat "$L0/lane.txt"
    grep -v "^{" "$L0/bench_generate.log" | grep -v "^  File\|^    \|Warning\|warn" | tail -n 45
    echo "### lane 1 (GPU 1)"; cat "$L1/lane.txt"
    tail -n 70 "$L1/quality.out"
  } > "$OUT/summary$CALL.txt"
  cp "$L0"/*.png "$L0"/bench_generate.json "$OUT/" 2>/dev/null
  cp "$L1"/quality_results*.json "$OUT/" 2>/dev/null
fi
tar czf "$OUT/lanes$CALL.tar.gz" -C /tmp "$(basename "$L0")" "$(basename "$L1")"
cat "$OUT/summary$CALL.txt"
echo "call $CALL done after $(( $(date +%s) - start ))s"
