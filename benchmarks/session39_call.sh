#!/bin/bash
# Device calls of the thirty-ninth session: several parts a call (PARTS="c h"), each part's
# output under $OUT; ends with the GPU's name and versions.
#   c: tests/gpu/test_dense_gpu.py (the lower-right causal route for a chunk after its prefix
#      among the reference attention's CUDA checks), then bench_latent_chunk.py's routes for
#      an MLA chunk (fold / expand under the lower-right bias / expand under the explicit
#      mask) at B16 x 8k and B4 x 32k, 128 heads, S from 64 to 2,048
#   other parts: session38_call.sh's (u, t, e3, h; and through it session37's and 36th's)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
for part in ${PARTS:-c}; do
  echo "== part $part =="
  case $part in
    c)
      timeout -k 5 ${C_TEST_LIMIT:-150} python3 -m pytest -q -m gpu tests/gpu/test_dense_gpu.py \
        2>&1 | tail -4 | tee "$OUT/c_tests.txt"
      timeout -k 5 ${C_LIMIT:-300} python3 benchmarks/bench_latent_chunk.py \
        --shapes ${C_SHAPES:-B16_L8k,B4_L32k} --queries ${C_QUERIES:-64,128,192,255,512,2048} \
        --formats bf16,fp8_e4m3 2>&1 | grep -vE "^\{" | tee "$OUT/c_chunk.txt" ;;
    *)
      PARTS=$part OUT=$OUT bash benchmarks/session38_call.sh | grep -v "^== part" \
        | grep -vE "^NVIDIA|^[0-9]+\.[0-9]+\.[0-9]+" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
