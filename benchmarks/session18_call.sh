#!/bin/bash
# Eighteenth session's next device calls, one part a call (PART=a, b or c), each under 600 s;
# every part writes $OUT/<part>*.txt and prints a summary.
#   a: generate with eviction over fp8 page scales (the prompt-end re-encode whose cell
#      statistics were cut on the CPU: first token 1.347 s against 0.418 s on the H200 before),
#      then the MLA end-to-end rows with HF's own static compile and evictions every 64 steps
#   b: the MLA eviction rows at interval 1 under the profiler (23 ms a step against 3.4 ms
#      without eviction on the H200: where it goes)
#   c: capacity at 32k with 48 requests (cases 7 and 9: where issue 19's targets are met on
#      the CPU's schedule)
#   e: kernels/move_cells.py on CUDA (tests/gpu/test_move_cells_gpu.py: bit for bit the
#      PyTorch moves; if it passes set compaction.CELL_KERNEL["cuda"] = True), then the fp8
#      page-scale eviction row with it (--move-kernel) beside the same row without
#   d: where fp8 page scales' eviction time goes (profile_generate.py, +snapkv paths: the
#      prompt-end and decode-step evictions inside the profiled call), page then token scales
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    timeout -k 5 200 python3 benchmarks/bench_generate.py --budget-s 180 --out "$OUT/gen" \
      --sections kvc_fp8,kvc_fp8_evict_snapkv_hold --evict-interval 64 > "$OUT/a_gen.txt" 2>&1
    for r in hf_eager hf_static kvc_fp8_e4m3 kvc_fp8_e4m3+snapkv; do
      timeout -k 5 150 python3 benchmarks/bench_latent_generate.py --ref "$OUT/latent_ref.pt" \
        --rows $r --batch 16 --prompt 8192 --new 32 --repeats 2 --evict-interval 64
    done > "$OUT/a_latent.txt" 2>&1
    grep -E "^\|" "$OUT/a_gen.txt" | cut -c1-200; grep -E "^\| [hk]" "$OUT/a_latent.txt" ;;
  b)
    timeout -k 5 280 python3 benchmarks/bench_latent_generate.py --rows kvc_fp8_e4m3+snapkv \
      --batch 16 --prompt 8192 --new 16 --repeats 1 --evict-interval 1 --profile 8 \
      > "$OUT/b_profile.txt" 2>&1
    grep -E "^####|^\|" "$OUT/b_profile.txt"; grep -A14 "top device kernels" "$OUT/b_profile.txt" ;;
  c)
    for c in 7 9; do
      CAP_LIMIT=260 CAP_REQ=48 CAP_CASES=$c \
        CAP_ARGS="--decompose --swap-aside --step-tokens 4224" bash benchmarks/gpu_jobs.sh capacity32k
    done > "$OUT/c_capacity.txt" 2>&1
    grep -E "^\| (fp8|int4)" "$OUT/c_capacity.txt" ;;
  e)
    timeout -k 5 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
      tests/gpu/test_move_cells_gpu.py > "$OUT/e_test.txt" 2>&1
    for mk in "" "--move-kernel"; do
      timeout -k 5 190 python3 benchmarks/bench_generate.py --budget-s 170 --out "$OUT/gen_e$mk" \
        --sections kvc_fp8_evict_snapkv_hold --evict-interval 64 $mk
    done > "$OUT/e_gen.txt" 2>&1
    grep -E "passed|failed|^E  " "$OUT/e_test.txt" | head; grep -E "^\||move_kernel" "$OUT/e_gen.txt" | cut -c1-220 ;;
  d)
    for sc in page token; do
      timeout -k 5 250 python3 benchmarks/profile_generate.py --paths fp8,fp8+snapkv \
        --scale $sc --new 16 --evict-interval 8 > "$OUT/d_profile_$sc.txt" 2>&1
    done
    for sc in page token; do
      echo "== $sc"; grep -E "^==|^\|" "$OUT/d_profile_$sc.txt"
      grep -A16 "fp8+snapkv: top device kernels" "$OUT/d_profile_$sc.txt"
    done ;;
esac
