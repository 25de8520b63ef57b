#!/bin/bash
# Device calls of the thirty-seventh session: session36_call.sh's parts, several a call
# (PARTS="p m"), each part's output under $OUT; ends with the GPU's name and versions.
#   on an H200 first: PARTS=b (B16 x P4096), then B=64 P=2048 and B=1 P=32768 (B_ROWS to pick)
#   on any Hopper: PARTS="p" (piped FP8 prefill), PARTS="m e" (MLA tests, split rows)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
for part in ${PARTS:-p}; do
  echo "== part $part =="
  PART=$part OUT=$OUT bash benchmarks/session36_call.sh
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
