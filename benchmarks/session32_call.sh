#!/bin/bash
# Device calls of the thirty-second session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   v: after the vt8 lane order (V's tokens in the Hopper kernel's P order), the Gluon
#      kernel's serial order, tree reductions and Q quantized in the kernel:
#      bench_prefill_fp8.py (V_ARGS=--quick: two shapes; checks the Gluon and Triton FP8
#      kernels and the quantization bit for bit, then times beside cuDNN SDPA), then the
#      prefill GPU tests
#   w: bench_prefill_fp8.py on every shape (after v passed)
#   x: (not run this session) v's table after the session's later changes, then the first token
#      with prefill_attends="fresh_fp8" against "fresh" at B16 x P32768
#   other parts: session31_call.sh's (f, g, n) and through it session29_call.sh's (b: Engine,
#      c: B64 x P2048, d: B16 x P32768)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-v}" in
  v)
    timeout -k 5 ${V1_LIMIT:-330} python3 benchmarks/bench_prefill_fp8.py ${V_ARGS:-} \
      --json "$OUT/v_prefill_fp8.json" 2>&1 | grep -v "^{" | tee "$OUT/v_prefill_fp8.txt"
    timeout -k 5 ${V2_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_prefill_matrix_gpu.py 2>&1 | tail -4 | tee "$OUT/v_tests.txt" ;;
  x)
    # for the next session: the FP8 prefill table after this session's last changes (the V
    # stores of the quantization, prefill_attention(fp8=True)'s dispatch, the P-rounding
    # reference), then first token with prefill_attends="fresh_fp8" against "fresh"
    PART=v bash "$0"
    B=16 P=${P:-32768} N=${N:-64} ROWS="${ROWS:-kvc_fp8:auto kvc_fp8_pf8:auto}" \
      ROW_LIMIT=${ROW_LIMIT:-150} PART=t bash benchmarks/session28_call.sh ;;
  w)
    timeout -k 5 ${W_LIMIT:-400} python3 benchmarks/bench_prefill_fp8.py \
      --json "$OUT/w_prefill_fp8.json" 2>&1 | grep -v "^{" | tee "$OUT/w_prefill_fp8.txt" ;;
  *)
    PART=$PART bash benchmarks/session31_call.sh ;;
esac
