#!/bin/bash
# Device calls of the thirty-sixth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: generate's device loop GPU tests (session35's d) and the folded MLA chunk's GPU test
#   b: rows at B x P (default 16 x 4096, N 64), a process a row: HF static + inductor, fp8
#      pages with the device loop on and off, bf16 pages with it on (B_ROWS to pick)
#   p: bench_prefill_fp8.py --quick: the Gluon FP8 prefill's checks (the lazy rescale and
#      the piped 64-key builds included) and its table beside cuDNN
#   m: the MLA latent GPU tests (the fold included) and bench_latent_chunk at 16 heads
#   e: MLA rows (bench_latent_generate.py, DeepSeek-V3-shaped, 4 layers), a process a row:
#      generate over fp8 latent pages and the Engine in 2,048-token prefill chunks (its long
#      chunks expanded beside the other rows since this session), B x P = 16 x 8192
# The next session's calls, in order: p (the piped build: correct? faster?), m, e, then on
# an H200 the issue-16 rows
# (B=16 P=4096, B=64 P=2048, B=1 P=32768 with PART=b) for the 60% roofline.
#   other parts: session35_call.sh's (d2, c, v, ...)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    timeout -k 5 ${A_LIMIT:-380} python3 -m pytest -q -s -m gpu tests/gpu/test_hf_graphs_gpu.py \
      -k "device_loop or deferred" 2>&1 | tail -8 | tee "$OUT/a_loop_tests.txt"
    timeout -k 5 ${C_LIMIT:-150} python3 -m pytest -q -s -m gpu tests/gpu/test_latent_decode_gpu.py \
      -k folded 2>&1 | tail -4 | tee "$OUT/a_fold_tests.txt" ;;
  b)
    for row in ${B_ROWS:-hf_static:auto:1 kvc_fp8:auto:1 kvc_fp8:auto:0 kvc_bf16:auto:1}; do
      loop=${row##*:}; r=${row%:*}
      KVCOMPILE_DEVICE_LOOP=$loop B=${B:-16} P=${P:-4096} N=${N:-64} ROW_LIMIT=${ROW_LIMIT:-110} \
        OUT=$OUT/b_${B:-16}x${P:-4096}_l$loop bash benchmarks/e2e_kv_rows.sh "$r" 2>&1 | tail -2
    done ;;
  p)
    timeout -k 5 ${P_LIMIT:-300} python3 benchmarks/bench_prefill_fp8.py --quick \
      --json "$OUT/p_prefill.json" 2>&1 | grep -vE "^\{" | tee "$OUT/p_prefill.txt" ;;
  m)
    timeout -k 5 ${M_LIMIT:-300} python3 -m pytest -q -s -m gpu \
      tests/gpu/test_latent_decode_gpu.py 2>&1 | tail -3 | tee "$OUT/m_gpu.txt"
    timeout -k 5 200 python3 benchmarks/bench_latent_chunk.py --heads 16 2>&1 \
      | grep -vE "^\{" | tee "$OUT/m_chunk_h16.txt" | tail -12 ;;
  e)
    for row in ${E_ROWS:-kvc_fp8_e4m3 engine_fp8_e4m3}; do
      timeout -k 5 ${E_LIMIT:-200} python3 benchmarks/bench_latent_generate.py \
        --batch ${B:-16} --prompt ${P:-8192} --new 16 --repeats 2 --rows "$row" 2>&1 \
        | grep -E "^\| |^# " | tail -3 | tee -a "$OUT/e_rows.txt"
    done ;;
  *)
    PART=$PART bash benchmarks/session35_call.sh ;;
esac
