#!/bin/bash
# Device calls of the twenty-first session, one part a call, each under 600 s; every part writes
# $OUT/<part>*.txt and prints a summary. Ran: a (twenty-second session); still to run: j, k.
#   a: the CUDA latent kernel's key mask (GPU tests: the kernel against the Triton kernel's
#      masked output, a left-padded generate routed to it; the twenty-second session's
#      dense.sdpa_rows on CUDA), then issue 22's B64 x 8k MLA rows
#      (session19_call.sh part i: hf_eager, kvc bf16, kvc fp8; generate's decode steps carry a
#      key mask, which now lets them take the CUDA kernel at this size)
#   j: issue 22's B16 x 32k rows (session19_call.sh part j)
#   k: the latent kernel at 16 heads (gpu_jobs.sh latent22k_bench, the mla22k variants never
#      timed) at B64 x 8k and B16 x 32k
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    timeout -k 5 ${A_TEST_LIMIT:-170} python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_latent_sm90_gpu.py tests/gpu/test_dense_gpu.py \
      -k "key_mask or left_padded or routes_decode_steps or sdpa_rows or padded_rows" \
      > "$OUT/a_tests.txt" 2>&1; echo "tests exit $?"; tail -4 "$OUT/a_tests.txt"
    IJ_LIMIT=${IJ_LIMIT:-130} PART=i bash benchmarks/session19_call.sh ;;
  j)
    PART=j bash benchmarks/session19_call.sh ;;
  k)
    LK_SHAPES=B64_L8k,B16_L32k DEADLINE=560 LK_LIMIT=550 bash benchmarks/gpu_jobs.sh latent22k_bench ;;
esac
