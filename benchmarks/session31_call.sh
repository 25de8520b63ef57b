#!/bin/bash
# Device calls of the thirty-first session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   g: the append / append_int / dense GPU tests (the 2-warp fp4 tiles default's CUDA
#      bit-exactness has not run), then bench_append's fp4 / int4 default rows
#   f: FP8 prefill: bench_prefill_fp8.py (the Gluon kernel checked against the reference and
#      the Triton FP8 kernel, the fused quantization bit for bit, then timed beside cuDNN SDPA),
#      then part g
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
  *)
    PART=$PART bash benchmarks/session29_call.sh ;;
esac
