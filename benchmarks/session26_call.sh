#!/bin/bash
# Device calls of the twenty-sixth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   n: Nsight Compute over the CUDA decode kernel (issue 14's limiter from hardware counters,
#      not from the SASS alone): one launch each of int4 K channel / V token P64 (pvt4sp),
#      fp8 e4m3 page scales (pvt4h) and bf16 pages at B16 L32k, and int4 at B1 L128k and
#      D64 B64 L8k; the full section set, details and raw metrics to $OUT, the SASS with its
#      stall samples per instruction; then the append kernels' bandwidth (bench_append.py,
#      the "split" page-scale kernel beside the default "tiles")
#   p: the block-table prefetch (paged_decode.cuh BTPF, variants base_pf / pvt4h_pf /
#      pvt4sp_pf): its GPU cases (test_decode_sm90_variants_gpu.py -k _pf), then issue 14's
#      kernel table at the four shapes with the _pf rows beside the defaults (and the Triton
#      rows), generate's all-True key mask at B16 L32k, and Nsight Compute's stall samples of
#      the _pf variants at B16 L32k
#   a: the int append's tiles kernel: its GPU bit-exactness cases, the append bench at P16 / P64
#   s: the int4 decode-step append into filled pages; the decode kernel against its split count
#   v: pvt5sp (int4 at 5 CTAs a SM): GPU cases, kernel table, and the split sweep
#   f: the Engine's prefill against generate's, by part (profile_engine.py --prefill)
#   other parts: session25_call.sh's
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
NCU=${NCU:-ncu}
prof() {  # label, shape, formats
  local label=$1 shape=$2 formats=$3
  timeout -k 5 ${N_LIMIT:-150} $NCU --clock-control none -k regex:kvc_paged_decode --set full \
    --import-source no -f -o "$OUT/n_$label" python3 benchmarks/ncu_decode.py --shape "$shape" \
    --formats "$formats" ${N_ARGS:-} > "$OUT/n_${label}_run.txt" 2>&1 || echo "$label: exit $?"
  tail -5 "$OUT/n_${label}_run.txt"
  if [ -f "$OUT/n_$label.ncu-rep" ]; then
    $NCU -i "$OUT/n_$label.ncu-rep" --page details --print-details all > "$OUT/n_${label}_details.txt" 2>&1
    $NCU -i "$OUT/n_$label.ncu-rep" --page raw --csv > "$OUT/n_${label}_raw.csv" 2>&1
    $NCU -i "$OUT/n_$label.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/n_${label}_sass.csv" 2>&1
    rm -f "$OUT/n_$label.ncu-rep"
    # each kernel's stall samples by reason and its top instructions (benchmarks/ncu_stalls.py)
    local nk; nk=$(grep -c '^"Kernel Name"' "$OUT/n_${label}_sass.csv")
    for ((kk = 0; kk < nk; kk++)); do
      python3 benchmarks/ncu_stalls.py "$OUT/n_${label}_sass.csv" --kernel $kk --top 8
    done > "$OUT/n_${label}_stalls.txt" 2>&1
    cat "$OUT/n_${label}_stalls.txt"
    grep -E "^  [a-z_]|DRAM Throughput|Memory Throughput|Duration|Issue Slots Busy|Achieved Occupancy|No Eligible|Registers Per|Warp Cycles Per Issued|Eligible Warps|L2 Hit|L1/TEX Hit" \
      "$OUT/n_${label}_details.txt" | head -60
  fi
}
case "${PART:-n}" in
  n)
    which $NCU || ls /opt/nvidia/nsight-compute/*/ncu
    python3 benchmarks/ncu_decode.py --shape B16_L32k --launches 20 2>&1 | tail -4
    prof b16 B16_L32k int4/channel,fp8_e4m3/page,bf16/page
    prof b1 B1_L128k int4/channel
    prof d64 D64_B64_L8k int4/channel
    timeout -k 5 ${AB_LIMIT:-150} python3 benchmarks/bench_append.py --json "$OUT/bench_append.json" \
      > "$OUT/n_append.txt" 2>&1 || echo "append: exit $?"
    cat "$OUT/n_append.txt" | tail -40 ;;
  p)
    timeout -k 5 ${P1_LIMIT:-200} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_decode_sm90_variants_gpu.py -k "_pf" 2>&1 | tail -5 | tee "$OUT/p_tests.txt"
    timeout -k 5 ${P2_LIMIT:-240} python3 benchmarks/gpu_decode_fast.py --waves '' \
      --variants base,base_pf,pvt4h_pf,pvt4sp_pf --shapes "$SHAPES" \
      --formats int4/channel,fp8_e4m3/page,bf16/page --out "$OUT" > "$OUT/p_bench.txt" 2>&1 \
      || echo "bench: exit $?"
    grep -E "sdpa|cuda|triton|rror" "$OUT/p_bench.txt" | grep -v "pvt4sp_pf.*fp8\|fp8.*pvt4sp_pf" | head -80
    timeout -k 5 ${P3_LIMIT:-120} python3 benchmarks/gpu_decode_fast.py --waves '' --no-triton \
      --variants base,pvt4h_pf,pvt4sp_pf --shapes B16_L32k --formats int4/channel,fp8_e4m3/page \
      --key-mask --out "$OUT" > "$OUT/p_mask.txt" 2>&1 || echo "mask: exit $?"
    grep -E "sdpa|cuda" "$OUT/p_mask.txt" | head -20
    N_ARGS="--variants pvt4sp_pf,pvt4h_pf,base_pf" prof pf B16_L32k int4/channel,fp8_e4m3/page,bf16/page ;;
  a)
    # the int append's tiles kernel (append_int.PAGE_BULK "tiles"): bit-exactness on CUDA,
    # then the append bench at pages of 16 (the bench's) and 64 (the 4-bit format's)
    timeout -k 5 ${A1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_append_int_gpu.py 2>&1 | tail -3 | tee "$OUT/a_tests.txt"
    for pg in 16 64; do
      timeout -k 5 ${AB_LIMIT:-150} python3 benchmarks/bench_append.py --page $pg \
        --json "$OUT/bench_append_p$pg.json" > "$OUT/a_append_p$pg.txt" 2>&1 \
        || echo "append P$pg: exit $?"
      grep -E "copy|int4|fp4|fp8_e4m3 page, grouped \(|APPEND" "$OUT/a_append_p$pg.txt" | head -30
    done ;;
  s)
    # the int4 decode-step append into filled pages (chunk of rows / warps variants), then
    # the decode kernel's time against its split count at B16 L32k
    timeout -k 5 ${S1_LIMIT:-70} python3 benchmarks/bench_append.py --page 64 \
      --only "pages of" 2>&1 | grep -E "copy|decode" | tee "$OUT/s_append.txt"
    timeout -k 5 ${S2_LIMIT:-90} python3 benchmarks/split_sweep.py --shapes B16_L32k \
      --splits 2,3,4,5,6,8 2>&1 | grep -E "^\||H100|H200" | tee "$OUT/s_split.txt" ;;
  v)
    # pvt5sp (int4 at 5 CTAs a SM, 96 registers, 3 stages; not run yet): its GPU cases, then
    # issue 14's kernel table with it beside the default, and the split sweep
    timeout -k 5 ${V1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu \
      tests/gpu/test_decode_sm90_variants_gpu.py -k "pvt5sp" 2>&1 | tail -3 | tee "$OUT/v_tests.txt"
    timeout -k 5 ${V2_LIMIT:-200} python3 benchmarks/gpu_decode_fast.py --waves '' --no-triton \
      --variants base,pvt5sp --shapes "$SHAPES" --formats int4/channel --out "$OUT" \
      > "$OUT/v_bench.txt" 2>&1 || echo "bench: exit $?"
    grep -E "sdpa|cuda" "$OUT/v_bench.txt"
    timeout -k 5 ${V3_LIMIT:-120} python3 benchmarks/split_sweep.py --shapes B16_L32k,B64_L8k \
      --splits 2,3,4,5,6,8 2>&1 | grep -E "^\||H100|H200" | tee "$OUT/v_split.txt" ;;
  f)
    # the Engine's first token (1.23x HF static's at B16 x P4096 on an H100): its packed
    # prefill against generate's through kvcompile, by part (not run yet)
    # sdpa_packed on CUDA, and the engine's steps (ids / positions built as arrays) there
    timeout -k 5 90 python3 -m pytest -q -m gpu tests/gpu/test_dense_gpu.py -k packed 2>&1 \
      | tail -2
    timeout -k 5 120 python3 -m pytest -q tests/engine/test_engine.py 2>&1 | tail -2
    timeout -k 5 ${F_LIMIT:-300} python3 benchmarks/profile_engine.py --prefill \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" | tee "$OUT/f_prefill.txt" ;;
  *)
    PART=$PART bash benchmarks/session25_call.sh ;;
esac
