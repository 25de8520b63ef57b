#!/bin/bash
# Device calls of the twenty-eighth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: the append kernels under Nsight Compute (ncu_append.py: int4 channel / token, fp4 page;
#      ncu_stalls.py per kernel), the fixed dense GPU test, then bench_append's int / fp4 rows
#   b: the int append rows after the division / cheap path / split launches (GPU tests, bench
#      rows with sweeps, P16 and P64), the fp4 page rows' tile sweep
#   c: b, lean: the GPU tests, the int4 rows, the fp page rows in grouped order
#   t: first token and decode at B16 x P4096, a process a row (session27_call.sh t)
#   other parts: session27_call.sh's
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
NCU=${NCU:-ncu}
case "${PART:-a}" in
  a)
    timeout -k 5 ${A1_LIMIT:-120} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      tests/gpu/test_append_int_gpu.py 2>&1 | tail -3 | tee "$OUT/a_tests.txt"
    label=append
    # each row's third launch (two warm writes come first): one profiled kernel a row
    for sel in "--kernel-id ::regex:_append:3" "-k regex:_append"; do
      timeout -k 5 ${A2_LIMIT:-200} $NCU --clock-control none $sel --set full \
        --import-source no -f -o "$OUT/a_$label" python3 benchmarks/ncu_append.py \
        --rows "${ROWS:-int4/channel,int4/token,fp4_e2m1/page}" ${A_ARGS:-} \
        > "$OUT/a_${label}_run.txt" 2>&1 || echo "$label ($sel): exit $?"
      [ -f "$OUT/a_$label.ncu-rep" ] && break
      tail -3 "$OUT/a_${label}_run.txt"
    done
    tail -5 "$OUT/a_${label}_run.txt"
    if [ -f "$OUT/a_$label.ncu-rep" ]; then
      $NCU -i "$OUT/a_$label.ncu-rep" --page details --print-details all \
        > "$OUT/a_${label}_details.txt" 2>&1
      $NCU -i "$OUT/a_$label.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/a_${label}_sass.csv" 2>&1
      rm -f "$OUT/a_$label.ncu-rep"
      nk=$(grep -c '^"Kernel Name"' "$OUT/a_${label}_sass.csv")
      for ((kk = 0; kk < nk; kk++)); do
        python3 benchmarks/ncu_stalls.py "$OUT/a_${label}_sass.csv" --kernel $kk --top 10
      done > "$OUT/a_${label}_stalls.txt" 2>&1
      cat "$OUT/a_${label}_stalls.txt"
      grep -E "^  [a-z_]|DRAM Throughput|Memory Throughput|Duration|Issue Slots Busy|Achieved Occupancy|No Eligible|Registers Per|Warp Cycles Per Issued|Eligible Warps|Executed Ipc|Theoretical Occupancy|Block Limit" \
        "$OUT/a_${label}_details.txt" | head -90
      gzip -9 "$OUT/a_${label}_sass.csv"
    fi
    timeout -k 5 ${A3_LIMIT:-120} python3 benchmarks/bench_append.py --only "int4" \
      2>&1 | grep -E "^\||append bench" | tee "$OUT/a_bench.txt" ;;
  b)
    # the append rows after the int kernels' changes: GPU bit-exactness, then the int rows
    # and the fp4 page rows with their tile sweeps
    timeout -k 5 ${B1_LIMIT:-120} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_append_int_gpu.py tests/gpu/test_append_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/b_tests.txt"
    for only in int4 "fp4_e2m1 page" "fp8_e4m3 page"; do
      timeout -k 5 ${B2_LIMIT:-150} python3 benchmarks/bench_append.py --sweep --only "$only" \
        2>&1 | grep -E "^\||append bench" | tee -a "$OUT/b_bench.txt"
    done
    timeout -k 5 ${B3_LIMIT:-100} python3 benchmarks/bench_append.py --page 64 --only int4 \
      2>&1 | grep -E "^\|" | tee -a "$OUT/b_bench.txt" ;;
  c)
    # b, lean (little device time left): the append GPU tests, the int4 rows, the fp4 / fp8
    # page rows in the runtime's grouped order (x read before / after the page test)
    timeout -k 5 ${C1_LIMIT:-100} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_append_int_gpu.py tests/gpu/test_append_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/c_tests.txt"
    timeout -k 5 ${C2_LIMIT:-60} python3 benchmarks/bench_append.py --only int4 \
      2>&1 | grep -E "^\||append bench" | tee -a "$OUT/c_bench.txt"
    timeout -k 5 ${C3_LIMIT:-60} python3 benchmarks/bench_append.py --only "e2m1 page, grouped (" \
      2>&1 | grep -E "^\|" | grep -v "prompts of" | tee -a "$OUT/c_bench.txt" ;;
  *)
    PART=$PART bash benchmarks/session27_call.sh ;;
esac
