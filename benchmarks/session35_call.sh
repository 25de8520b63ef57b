#!/bin/bash
# Device calls of the thirty-fifth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   c: MLA prompt chunks over latent pages (bench_latent_chunk.py): folded kernel rows vs
#      expansion vs the reference, 128 heads then 16 (DeepSeek-V3 at TP 8), then the GPU test
#      of the folded chunk on the Triton and CUDA latent kernels
#   d: generate's device loop (integrations/hf_loop.py): its GPU tests (greedy, EOS, recapture,
#      streamers, sampling in graphs; the deferred-stop test on transformers' loop)
#   d2: fp8 rows with the loop on and off (KVCOMPILE_DEVICE_LOOP), a process a row, at
#      B16 x P4096 and B1 x P32768 (D_ROWS to pick: "BxP ...")
#   other parts: session34_call.sh's (v: the in-place gated product's peak, rows and tests)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-c}" in
  c)
    timeout -k 5 ${C_LIMIT:-200} python3 -m pytest -q -s -m gpu tests/gpu/test_latent_decode_gpu.py \
      -k folded 2>&1 | tail -3 | tee "$OUT/c_tests.txt"
    for h in 128 16; do
      timeout -k 5 ${C_LIMIT:-200} python3 benchmarks/bench_latent_chunk.py --heads $h \
        --shapes ${C_SHAPES:-B16_L8k,B4_L32k} 2>&1 | grep -vE "^\{" | tee "$OUT/c_h$h.txt"
    done ;;
  d)
    timeout -k 5 ${D_LIMIT:-400} python3 -m pytest -q -s -m gpu tests/gpu/test_hf_graphs_gpu.py \
      -k "device_loop or deferred" 2>&1 | tail -8 | tee "$OUT/d_tests.txt" ;;
  d2)
    for shape in ${D_ROWS:-16x4096 1x32768}; do
      for loop in 1 0; do
        KVCOMPILE_DEVICE_LOOP=$loop B=${shape%x*} P=${shape#*x} N=64 ROW_LIMIT=${ROW_LIMIT:-100} \
          OUT=$OUT/d_${shape}_l$loop bash benchmarks/e2e_kv_rows.sh "kvc_fp8:auto" 2>&1 | tail -2
      done
    done ;;
  *)
    PART=$PART bash benchmarks/session34_call.sh ;;
esac
