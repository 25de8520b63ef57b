#!/bin/bash
# Device calls of the thirty-first session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   g: the append / append_int / dense GPU tests (the 2-warp fp4 tiles default's CUDA
#      bit-exactness has not run), then bench_append's fp4 / int4 default rows
#   f: FP8 prefill: bench_prefill_fp8.py (the Gluon kernel checked against the reference and
#      the Triton FP8 kernel, the fused quantization bit for bit, then timed beside cuDNN SDPA),
#      then part g
#   n: Nsight Compute on the Gluon FP8 prefill kernel (8 and 4 warps): stall reasons, top
#      instructions and the details page's limiters
#   other parts: session29_call.sh's (b: tests + Engine prefill gaps + B16 x P4096 rows;
#      c: B64 x P2048 rows; d: B16 x P32768 rows; t: rows given in ROWS)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-g}" in
  g)
    timeout -k 5 ${G1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      tests/gpu/test_append_gpu.py tests/gpu/test_append_int_gpu.py 2>&1 | tail -4 \
      | tee "$OUT/g_tests.txt"
    for only in fp4_e2m1 int4; do
      timeout -k 5 ${G2_LIMIT:-70} python3 benchmarks/bench_append.py --defaults \
        --only "$only" 2>&1 | grep -E "^\||append bench" | tee -a "$OUT/g_bench.txt"
    done ;;
  f)
    timeout -k 5 ${F1_LIMIT:-240} python3 benchmarks/bench_prefill_fp8.py --quick \
      --json "$OUT/f_prefill_fp8.json" 2>&1 | grep -v "^{" | tee "$OUT/f_prefill_fp8.txt"
    PART=g bash "$0" ;;
  n)
    timeout -k 5 ${N_LIMIT:-240} ncu --clock-control none -k regex:prefill_fp8_sm90 --set full \
      --import-source no -f -o "$OUT/n_pf" python3 benchmarks/ncu_prefill_fp8.py \
      > "$OUT/n_run.txt" 2>&1 || echo "ncu: exit $?"
    tail -3 "$OUT/n_run.txt"
    ncu -i "$OUT/n_pf.ncu-rep" --page details --print-details all > "$OUT/n_details.txt" 2>&1
    ncu -i "$OUT/n_pf.ncu-rep" --page source --csv --print-source sass > "$OUT/n_sass.csv" 2>&1
    rm -f "$OUT/n_pf.ncu-rep"
    for kk in 0 1; do
      python3 benchmarks/ncu_stalls.py "$OUT/n_sass.csv" --kernel $kk --top 12
    done > "$OUT/n_stalls.txt" 2>&1
    cat "$OUT/n_stalls.txt" | head -80
    grep -E "Duration|Issue Slots Busy|Achieved Occupancy|No Eligible|Registers Per|Warp Cycles Per Issued|Eligible Warps|L2 Hit|Memory Throughput|Compute \(SM\) Throughput|Tensor|Executed Ipc" \
      "$OUT/n_details.txt" | head -50 ;;
  *)
    PART=$PART bash benchmarks/session29_call.sh ;;
esac
