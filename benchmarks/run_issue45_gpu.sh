#!/bin/bash
# Issues 4 and 5 on the H200, one device call per PART (each well under 9 minutes):
#   bash benchmarks/run_issue45_gpu.sh decode0          # first half of the full decode matrix
#   bash benchmarks/run_issue45_gpu.sh decode1          # second half
#   bash benchmarks/run_issue45_gpu.sh decode           # the whole decode matrix in one call
#   bash benchmarks/run_issue45_gpu.sh prefill_report   # full prefill matrix, then the SASS /
#                                                       # resource report, then append bandwidth
# Each stage runs under its own `timeout`; a final summary table says what passed. Logs go to
# $OUT (at most 8 files). TRITON_CACHE_DIR is fixed, so calls on the same warm machine (and the
# kernel report after the prefill check) reuse compiled kernels.
# Knobs: DECODE_BUDGET (s, default 330), PREFILL_BUDGET (200), NS (shards, 16); extra
# arguments for a CPU try of this script: EXTRA (decode, e.g. "--cpu-smoke 1"), PREFILL_ARGS
# ("--tiny"), REPORT_ARGS ("--stand-in --decode fp8_e4m3/page --prefill paged_fp8"),
# APPEND_ARGS ("--dry").
set -u
cd "$(dirname "$0")/.."
PART=${1:-}
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvc_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
PY=${PYTHON:-python3}
NS=${NS:-16}
SUMMARY="$OUT/summary.txt"
T0=$(date +%s)
rows=()
bad=0

stage() {  # stage NAME TIMEOUT_S LOGFILE command... : run, record status and wall time
  local name=$1 limit=$2 log=$3
  shift 3
  local s rc
  s=$(date +%s)
  echo "== $name (limit ${limit}s) =="
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  local st="ok"
  [ $rc -ne 0 ] && st="exit $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && st="TIMEOUT (killed at ${limit}s)"
  [ $rc -ne 0 ] && bad=$((bad + 1))
  rows+=("| $name | $st | $(( $(date +%s) - s )) | $(grep -h -m1 -E "$KEYLINE" "$log" | cut -c1-170) |")
  return $rc
}

section() {  # section FILE HEADING: print a report's section from HEADING to the next '## '
  awk -v h="$2" 'index($0, h) == 1 {on = 1; print; next} on && /^## / {exit} on {print}' "$1"
}

$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw \
  --format=csv,noheader 2>/dev/null

case "$PART" in
  decode0 | decode1 | decode)
    set=${PART#decode}
    set=${set:-all}
    KEYLINE="^DECODE CHECK"
    B=${DECODE_BUDGET:-330}
    # the runner stops starting cases at B s and kills shards at B + 90 s
    stage "decode matrix, SHARDSET=$set, $NS shards" $((B + 120)) "$OUT/decode_run_$set.txt" \
      env SHARDSET="$set" NS="$NS" OUT="$OUT" PYTHON="$PY" \
      bash benchmarks/run_decode_check_gpu.sh "$B"
    grep -v "^== " "$OUT/decode_run_$set.txt" | tail -n 80
    ;;
  prefill_report)
    B=${PREFILL_BUDGET:-200}
    KEYLINE="^PREFILL CHECK"
    stage "prefill matrix ($NS shards)" $((B + 90)) "$OUT/prefill_check.txt" \
      $PY benchmarks/gpu_check_prefill.py --shards "$NS" --budget "$B" \
      --log "$OUT/prefill_check_rows.log" ${PREFILL_ARGS:-}
    sed -n '/^PREFILL CHECK/,$p' "$OUT/prefill_check.txt" | head -n 45
    KEYLINE="^kernel report: [0-9]+ kernels"
    stage "kernel report (regs, smem, SASS mix)" 130 "$OUT/kernel_report.txt" \
      $PY benchmarks/kernel_report.py --out "$OUT" ${REPORT_ARGS:-}
    section "$OUT/kernel_report.txt" "## Resources"
    section "$OUT/kernel_report.txt" "## Cycle budget"
    grep -E "FAILED|Error" "$OUT/kernel_report.txt" | head -5
    KEYLINE="^APPEND:"
    stage "append bandwidth (bulk prefill)" 100 "$OUT/bench_append.txt" \
      $PY benchmarks/bench_append.py --json "$OUT/bench_append.json" ${APPEND_ARGS:-}
    grep -E "^\||^append bench|^APPEND|FAILED" "$OUT/bench_append.txt"
    ;;
  *)
    echo "usage: bash benchmarks/run_issue45_gpu.sh decode0|decode1|decode|prefill_report"
    exit 2
    ;;
esac

{
  echo
  echo "## run_issue45_gpu.sh $PART: $(( $(date +%s) - T0 )) s in all"
  echo "| stage | status | wall s | result |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$SUMMARY"
[ $bad -eq 0 ]
