#!/bin/bash
# Device calls of the twenty-seventh session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   g: the engine's graphs without the model's mask (passes/mask_inputs.py drop_masks): the
#      engine's GPU graph tests, then the Engine's prefill against generate's by part
#      (profile_engine.py --prefill, B16 x P4096); the split sweep at B1 L128k and D64;
#      the int4 decode-step append into filled pages
#   t: first token and decode at B16 x P4096, a process a row: HF static + inductor, the
#      Engine (fp8 pages), generate through kvcompile (fp8 pages)
#   gt: g's GPU tests, then t; g2: g without its tests
#   l: the op's [B, S, H, Dv] output layout: GPU tests, the Engine's prefill by part
#   p: the int4 decode step by kernel at B64 x P2048 and B16 x P4096 (profile_generate --steps)
#   other parts: session26_call.sh's
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-g}" in
  g)
    [ "${G1_LIMIT:-150}" = 0 ] || timeout -k 5 ${G1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_engine_graphs_gpu.py 2>&1 | tail -3 | tee "$OUT/g_tests.txt"
    timeout -k 5 ${G2_LIMIT:-150} python3 benchmarks/profile_engine.py --prefill \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" > "$OUT/g_prefill.txt"
    grep -E "^####|device busy|attention|pointwise|memcpy|GEMM" "$OUT/g_prefill.txt"
    # the decode kernel against its split count where the tables miss most (B1 L128k, D64)
    timeout -k 5 ${G3_LIMIT:-90} python3 benchmarks/split_sweep.py --shapes B1_L128k \
      --splits 24,32,40,48,56,64,66,80,96,132 2>&1 | grep -E "^\||H100|H200" | tee "$OUT/g_split.txt"
    timeout -k 5 ${G4_LIMIT:-60} python3 benchmarks/split_sweep.py --shapes D64_B64_L8k \
      --splits 1,2,3,4,6 2>&1 | grep -E "^\|" | tee -a "$OUT/g_split.txt"
    # the int4 decode-step append into filled pages (session26_call.sh s, not run yet)
    timeout -k 5 ${G5_LIMIT:-70} python3 benchmarks/bench_append.py --page 64 \
      --only "pages of" 2>&1 | grep -E "copy|decode" | tee "$OUT/g_append.txt" ;;
  gt)
    timeout -k 5 ${G1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_engine_graphs_gpu.py 2>&1 | tail -3 | tee "$OUT/g_tests.txt"
    ROW_LIMIT=${ROW_LIMIT:-130} PART=t bash "$0" ;;
  g2)
    G1_LIMIT=0 PART=g bash "$0" ;;
  t)
    B=${B:-16} P=${P:-4096} N=${N:-128} E_ARGS=" " ROW_LIMIT=${ROW_LIMIT:-150} OUT=$OUT/t \
      bash benchmarks/e2e_kv_rows.sh "${ROWS:-hf_static:auto engine_b:auto kvc_fp8:auto}" \
      2>&1 | tee "$OUT/t_rows.txt" ;;
  l)
    # the attention op's [B, S, H, Dv] output layout (not run on a GPU yet): the GPU graph
    # and dense tests, then the Engine's prefill by part (were 6.6 + 10.7 ms of output copies)
    timeout -k 5 ${L1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_engine_graphs_gpu.py \
      tests/gpu/test_hf_graphs_gpu.py tests/gpu/test_dense_gpu.py 2>&1 | tail -3 | tee "$OUT/l_tests.txt"
    timeout -k 5 ${L2_LIMIT:-150} python3 benchmarks/profile_engine.py --prefill \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" > "$OUT/l_prefill.txt"
    grep -E "^####|^\| |  ms  " "$OUT/l_prefill.txt" | head -45 ;;
  p)
    # where the int4 decode step's time goes (issue 16's 60% of roofline: int4 at 54% at
    # B64 x P2048, 58% at B16 x P4096), kernel by kernel (memcpy / memset included)
    for shape in "64 2048" "16 4096"; do
      set -- $shape
      timeout -k 5 ${P_LIMIT:-170} python3 benchmarks/profile_generate.py --paths int4 \
        --batch $1 --prompt $2 --new 16 --steps 2>&1 | grep -v "^USDT" > "$OUT/p_b$1.txt"
      grep -E "^==|^\||^####|ms  " "$OUT/p_b$1.txt" | head -45
    done ;;
  *)
    PART=$PART bash benchmarks/session26_call.sh ;;
esac
