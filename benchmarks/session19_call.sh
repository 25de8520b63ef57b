#!/bin/bash
# Device calls of the nineteenth and twentieth sessions, one part a call, each under 600 s;
# every part writes $OUT/<part>*.txt and prints a summary. Ran: a, e (nineteenth); c, c0, f, g
# (twentieth: RESULTS.md "Twentieth session"). Still to run: b, d, h, i, j (i and j through
# session21_call.sh parts a and j, after the twenty-first session's GPU tests).
#   b: the MLA eviction rows at interval 1 under the profiler (5.5 ms of eviction a step at 4
#      layers on an H100 in the nineteenth session: where it goes)
#   c: capacity at 32k with 48 requests (cases 7 and 9: issue 19's rows)
#   c0: the bf16 baseline of c (48 requests, admitted by its whole life, no eviction; on CUDA
#      1.00 at this exact budget: the decode graphs' scratch pages, RESULTS.md)
#   d: where fp8 page scales' eviction time goes (profile_generate.py, +snapkv paths: the
#      prompt-end and decode-step evictions inside the profiled call), page then token scales
#   f: MLA rows with eviction every 64 steps (F_ROWS: hf_eager for the reference, fp8, fp8 +
#      SnapKV hold, fp8 + H2O), teacher-forced against HF eager; peak memory per row
#   g: issue 19's KV-dominated generate rows: B16 x P32768, fp8 page scales without eviction,
#      with SnapKV(hold) and with SinkWindow at 50% every 64 steps (one process, in order)
#   h: the MLA rows after the blocked absorption (twentieth session) in one call: fp8, fp8 +
#      SnapKV hold, fp8 + H2O (H2O read 1.39x fp8 on an H100, 0.85x before the change:
#      then the H2O row again under the profiler, to see where the old 0.85x went)
#   i: issue 22's B64 x 8k rows (hf_eager, kvc bf16, kvc fp8; a row that runs out of memory
#      says so in its line), j: its B16 x 32k rows, the same three
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-c}" in
  b)
    timeout -k 5 ${B_LIMIT:-280} python3 benchmarks/bench_latent_generate.py --rows kvc_fp8_e4m3+snapkv \
      --batch 16 --prompt 8192 --new 16 --repeats 1 --evict-interval 1 --profile 8 \
      > "$OUT/b_profile.txt" 2>&1
    grep -E "^####|^\|" "$OUT/b_profile.txt"; grep -A14 "top device kernels" "$OUT/b_profile.txt" ;;
  c0)
    CAP_LIMIT=200 CAP_REQ=48 CAP_CASES=0 CAP_ARGS="--decompose --plain-admission lifetime --step-tokens 4224" \
      bash benchmarks/gpu_jobs.sh capacity32k > "$OUT/c0_capacity.txt" 2>&1
    grep -E "^\| bf16" "$OUT/c0_capacity.txt" ;;
  c)
    for c in 7 9; do
      CAP_LIMIT=260 CAP_REQ=48 CAP_CASES=$c \
        CAP_ARGS="--decompose --swap-aside --step-tokens 4224" bash benchmarks/gpu_jobs.sh capacity32k
    done > "$OUT/c_capacity.txt" 2>&1
    grep -E "^\| (fp8|int4)" "$OUT/c_capacity.txt" ;;
  d)
    for sc in page token; do
      timeout -k 5 250 python3 benchmarks/profile_generate.py --paths fp8,fp8+snapkv \
        --scale $sc --new 16 --evict-interval 8 > "$OUT/d_profile_$sc.txt" 2>&1
    done
    for sc in page token; do
      echo "== $sc"; grep -E "^==|^\|" "$OUT/d_profile_$sc.txt"
      grep -A16 "fp8+snapkv: top device kernels" "$OUT/d_profile_$sc.txt"
    done ;;
  f)
    for r in ${F_ROWS:-hf_eager kvc_fp8_e4m3 kvc_fp8_e4m3+snapkv kvc_fp8_e4m3+h2o}; do
      timeout -k 5 ${F_LIMIT:-150} python3 benchmarks/bench_latent_generate.py --ref "$OUT/latent_ref.pt" \
        --rows $r --batch 16 --prompt 8192 --new 160 --repeats 2 --evict-interval 64
    done > "$OUT/f_latent.txt" 2>&1
    rm -f "$OUT/latent_ref.pt"
    grep -E "^\| [hk]" "$OUT/f_latent.txt" ;;
  h)
    F_ROWS="kvc_fp8_e4m3 kvc_fp8_e4m3+snapkv kvc_fp8_e4m3+h2o" F_LIMIT=110 PART=f bash "$0"
    timeout -k 5 150 python3 benchmarks/bench_latent_generate.py --rows kvc_fp8_e4m3+h2o \
      --batch 16 --prompt 8192 --new 160 --repeats 1 --evict-interval 64 --profile 96 \
      > "$OUT/h_profile.txt" 2>&1
    grep -A14 "top device kernels" "$OUT/h_profile.txt" ;;
  i|j)
    if [ "$PART" = i ]; then shape="--batch 64 --prompt 8192"; else shape="--batch 16 --prompt 32768"; fi
    for r in hf_eager kvc_bf16 kvc_fp8_e4m3; do
      timeout -k 5 ${IJ_LIMIT:-170} python3 benchmarks/bench_latent_generate.py \
        --ref "$OUT/ref_$PART.pt" --rows $r $shape --new 32 --repeats 2 || echo "| $r | exit $? |"
    done > "$OUT/${PART}_latent.txt" 2>&1
    rm -f "$OUT/ref_$PART.pt"
    grep -E "^\| [hk]|^# Deep" "$OUT/${PART}_latent.txt" ;;
  g)
    timeout -k 5 580 python3 benchmarks/bench_generate.py --budget-s 560 --out "$OUT/gen32k" \
      --prompt 32768 --new 64 --evict-interval 64 --kv-gib 12 \
      --sections kvc_fp8,kvc_fp8_evict_snapkv_hold,kvc_fp8_evict_sink > "$OUT/g_gen32k.txt" 2>&1
    grep -E "^\||^== " "$OUT/g_gen32k.txt" | cut -c1-220 ;;
esac
