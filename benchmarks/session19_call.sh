#!/bin/bash
# Nineteenth session's next device calls, one part a call (PART=b, c, d or f), each under
# 600 s; every part writes $OUT/<part>*.txt and prints a summary. (a and e ran on H100s on
# 2026-12-05: RESULTS.md "Nineteenth session".)
#   b: the MLA eviction rows at interval 1 under the profiler (23 ms a step against 3.4 ms
#      without eviction on the H200: where it goes; the fp8 latent pages are page-scaled, so
#      their moves now take kernels/move_cells.py)
#   c: capacity at 32k with 48 requests (cases 7 and 9: where issue 19's targets are met on
#      the CPU's schedule)
#   c0: the bf16 baseline of c (48 requests, admitted by its whole life, no eviction)
#   d: where fp8 page scales' eviction time goes (profile_generate.py, +snapkv paths: the
#      prompt-end and decode-step evictions inside the profiled call), page then token scales
#   f: MLA rows with eviction every 64 steps (hf_eager for the reference, then fp8 + SnapKV
#      hold and fp8 + H2O), teacher-forced against HF eager
#   g: issue 19's KV-dominated generate rows: B16 x P32768, fp8 page scales without eviction,
#      with SnapKV(hold) and with SinkWindow at 50% every 64 steps (one process, in order)
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
  g)
    timeout -k 5 580 python3 benchmarks/bench_generate.py --budget-s 560 --out "$OUT/gen32k" \
      --prompt 32768 --new 64 --evict-interval 64 --kv-gib 12 \
      --sections kvc_fp8,kvc_fp8_evict_snapkv_hold,kvc_fp8_evict_sink > "$OUT/g_gen32k.txt" 2>&1
    grep -E "^\||^== " "$OUT/g_gen32k.txt" | cut -c1-220 ;;
esac
