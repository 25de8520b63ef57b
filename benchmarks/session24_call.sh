#!/bin/bash
# Device calls of the twenty-fourth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   k: the decode kernels alone on this machine at B16 L32k (the end-to-end profile's shape:
#      int4 K channel / V token P64, fp8 e4m3 page scales, bf16 pages; x SDPA over bf16),
#      then the same launches reading an all-True key mask (what a decode step of HF generate
#      passes): is the int4 kernel's 48% of HBM in generate (RESULTS.md, twenty-third session)
#      the kernel's own speed on this card, or the step's (the mask)? With the kernel before
#      mask_step_all_seen (all-True mask steps read as unmasked) where its copy is present
#      (benchmarks/_orig_paged_decode.cuh, untracked), and the key-mask GPU cases first
#   g: the GPU checks of this session's changes not yet run (call 1's mask cases printed
#      nothing within their limit; the deferred-stop EOS case's new input; the int gather)
#   t, h, e, m, p: session23_call.sh's parts (t: the GPU tests of generate's changed graph
#      paths; h: host_gap.py; e: issue 14's end-to-end rows; m: MLA rows; p: padded TTFT)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-k}" in
  k)
    # the key-mask GPU cases (random masks; left padding + a hole among all-True steps)
    timeout -k 5 ${KT_LIMIT:-150} python3 -m pytest -q -m gpu tests/gpu/test_decode_sm90_gpu.py \
      -k kmask 2>&1 | tail -4 | tee "$OUT/k_tests.txt"
    for km in "" --key-mask; do
      timeout -k 5 ${K_LIMIT:-150} python3 benchmarks/gpu_decode_fast.py --no-triton \
        --waves '' --shapes ${K_SHAPES:-B16_L32k} \
        --formats ${K_FORMATS:-int4/channel,fp8_e4m3/page,bf16/page} $km --out "$OUT" \
        > "$OUT/k${km:+_mask}.txt" 2>&1 || echo "k $km: exit $?"
      grep -E "sdpa|cuda|key mask" "$OUT/k${km:+_mask}.txt"
    done
    # the kernel before mask_step_all_seen (an untracked copy, where present): its mask cost
    if [ -f benchmarks/_orig_paged_decode.cuh ]; then
      cp benchmarks/_orig_paged_decode.cuh kvcompile/kernels/cuda/paged_decode.cuh
      echo "== the kernel before mask_step_all_seen, with the mask"
      timeout -k 5 ${K_LIMIT:-150} python3 benchmarks/gpu_decode_fast.py --no-triton \
        --waves '' --shapes ${K_SHAPES:-B16_L32k} \
        --formats ${K_FORMATS:-int4/channel,fp8_e4m3/page,bf16/page} --key-mask --out "$OUT" \
        > "$OUT/k_mask_before.txt" 2>&1 || echo "k before: exit $?"
      grep -E "sdpa|cuda|key mask" "$OUT/k_mask_before.txt"
    fi ;;
  g)
    # this session's GPU checks not yet run: the mask cases of the CUDA decode kernel (left
    # padding and a hole among all-True steps), generate's deferred stop check (its EOS case
    # failed once on a test input whose EOS came first), and the int gather route on CUDA
    timeout -k 5 ${G1_LIMIT:-240} python3 -m pytest -q -m gpu tests/gpu/test_decode_sm90_gpu.py \
      -k kmask 2>&1 | tail -3 | tee "$OUT/g_mask.txt"
    timeout -k 5 ${G2_LIMIT:-150} python3 -m pytest -q -m gpu tests/gpu/test_hf_graphs_gpu.py \
      -k deferred_stop 2>&1 | tail -3 | tee "$OUT/g_defer.txt"
    timeout -k 5 ${G3_LIMIT:-150} python3 -m pytest -q tests/kernels/test_prefill_gather.py \
      tests/runtime/test_chunk_route.py 2>&1 | tail -3 | tee "$OUT/g_gather.txt" ;;
  *)
    PART=$PART bash benchmarks/session23_call.sh ;;
esac
