#!/bin/bash
# Device calls of the thirty-fifth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   c: MLA prompt chunks over latent pages (bench_latent_chunk.py): folded kernel rows vs
#      expansion vs the reference, 128 heads then 16 (DeepSeek-V3 at TP 8), then the GPU test
#      of the folded chunk on the Triton and CUDA latent kernels
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
  *)
    PART=$PART bash benchmarks/session34_call.sh ;;
esac
