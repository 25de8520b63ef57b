#!/bin/bash
# Device calls of the twenty-fifth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: the int4 decode kernel's per-page issue (paged_decode.cuh PGZ: a block-table load, the
#      page's row and its channel-scale copy once a page) on the GPU: its int4 and key-mask
#      cases, with the twenty-fourth session's unrun checks beside them (generate's deferred
#      stop case, the int gather route on CUDA); then issue 14's kernel table at the four
#      shapes without a mask (int4, fp8 page scales, bf16), and int4 with the all-True mask
#      generate passes, before (benchmarks/_orig_paged_decode.cuh, untracked, where present)
#      and after
#   h: issue 14's kernel table for the H200 (any card: it prints which): the four shapes, the
#      CUDA and Triton rows of int4 / fp8 page scales / bf16 pages (Triton is bf16's default),
#      without a mask, then int4 and fp8 with generate's all-True key mask
#   r: issue 16's rows not yet run on this code: B64 x P2048 (HF static, kvcompile bf16 / fp8
#      pages, the Engine) and the Engine at B16 x P4096, a process a row (ROW_LIMIT each)
#   e, g, k and the earlier parts: session24_call.sh's
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
SHAPES=${K_SHAPES:-B64_L8k,B16_L32k,B1_L128k,D64_B64_L8k}
bench() {  # label, extra args
  local label=$1; shift
  timeout -k 5 ${K_LIMIT:-110} python3 benchmarks/gpu_decode_fast.py --no-triton --waves '' \
    --shapes "$SHAPES" --out "$OUT" "$@" > "$OUT/a_$label.txt" 2>&1 || echo "$label: exit $?"
  echo "== $label"; grep -E "sdpa|cuda|error|Error" "$OUT/a_$label.txt" | head -40
}
case "${PART:-a}" in
  a)
    (timeout -k 5 ${A1_LIMIT:-240} python3 -m pytest -q -m gpu tests/gpu/test_decode_sm90_gpu.py \
       -k "int4 or kmask" 2>&1 | tail -4 > "$OUT/a_int4_tests.txt") &
    (timeout -k 5 150 python3 -m pytest -q -m gpu tests/gpu/test_hf_graphs_gpu.py \
       -k deferred_stop 2>&1 | tail -3 > "$OUT/a_defer.txt") &
    (timeout -k 5 150 python3 -m pytest -q tests/kernels/test_prefill_gather.py \
       tests/runtime/test_chunk_route.py 2>&1 | tail -3 > "$OUT/a_gather.txt") &
    wait
    for f in int4_tests defer gather; do echo "== $f"; cat "$OUT/a_$f.txt"; done
    bench nomask --formats int4/channel,fp8_e4m3/page,bf16/page
    bench mask_i4 --formats int4/channel --key-mask
    if [ -f benchmarks/_orig_paged_decode.cuh ]; then
      cp benchmarks/_orig_paged_decode.cuh kvcompile/kernels/cuda/paged_decode.cuh
      bench before_nomask_i4 --formats int4/channel
      bench before_mask_i4 --formats int4/channel --key-mask
    fi ;;
  h)
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout -k 5 ${H_LIMIT:-300} python3 benchmarks/gpu_decode_fast.py --waves '' \
      --shapes "$SHAPES" --formats int4/channel,fp8_e4m3/page,bf16/page --out "$OUT" \
      > "$OUT/h_nomask.txt" 2>&1 || echo "h: exit $?"
    grep -E "sdpa|cuda|triton|error|Error" "$OUT/h_nomask.txt" | head -60
    bench h_mask --formats int4/channel,fp8_e4m3/page --key-mask ;;
  r)
    B=64 P=2048 N=128 E_ARGS=" " ROW_LIMIT=${ROW_LIMIT:-110} OUT=$OUT/b64 bash \
      benchmarks/e2e_kv_rows.sh "hf_static:auto kvc_bf16:auto kvc_fp8:auto engine_b:auto" 2>&1 \
      | tee "$OUT/r_b64.txt"
    B=16 P=4096 N=128 E_ARGS=" " ROW_LIMIT=${ROW_LIMIT:-110} OUT=$OUT/b16 bash \
      benchmarks/e2e_kv_rows.sh "engine_b:auto" 2>&1 | tee "$OUT/r_b16.txt" ;;
  *)
    PART=$PART bash benchmarks/session24_call.sh ;;
esac
