#!/bin/bash
# Device calls of the thirtieth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: the GPU tests of the last two sessions' CPU-tested changes (dense: sdpa_packed's batched
#      runs; append / append_int: TILE_SPLIT, the e2m1 rounding by exponent and the quotient's
#      single product; engine graphs), then bench_append's default rows, this tree against the
#      last commit's kernels (.oldpkg: `git archive HEAD kvcompile`, carried), new then old;
#      then the fp4 page row's tile sweep (16 x 128 tiles, 2 / 4 / 8 warps)
#   l: a, lean (little device time left): the append / dense GPU tests, then the fp4 / int4
#      default rows, new then old, and the fp4 page row's variants (the register cap both ways)
#   other parts: session29_call.sh's (b: tests + Engine prefill gaps + B16 x P4096 rows;
#      c: B64 x P2048 rows; d: B16 x P32768 rows; t: rows given in ROWS)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    timeout -k 5 ${A1_LIMIT:-160} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      tests/gpu/test_append_gpu.py tests/gpu/test_append_int_gpu.py \
      tests/gpu/test_engine_graphs_gpu.py 2>&1 | tail -4 | tee "$OUT/a_tests.txt"
    for who in new old; do
      root=.; [ "$who" = old ] && root=.oldpkg
      echo "## $who kernels ($root)" | tee -a "$OUT/a_bench.txt"
      timeout -k 5 ${A2_LIMIT:-110} python3 $root/benchmarks/bench_append.py --defaults \
        2>&1 | grep -E "^\||append bench|APPEND" | tee -a "$OUT/a_bench.txt"
    done
    timeout -k 5 ${A3_LIMIT:-100} python3 benchmarks/bench_append.py --sweep \
      --only "fp4_e2m1 page, grouped (no sort)" 2>&1 | grep -E "^\|" | tee "$OUT/a_sweep.txt" ;;
  l)
    timeout -k 5 ${L1_LIMIT:-120} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      tests/gpu/test_append_gpu.py tests/gpu/test_append_int_gpu.py 2>&1 | tail -4 \
      | tee "$OUT/l_tests.txt"
    for who in new old; do
      root=.; [ "$who" = old ] && root=.oldpkg
      for only in fp4_e2m1 int4; do
        echo "## $who kernels ($root), $only" | tee -a "$OUT/l_bench.txt"
        timeout -k 5 ${L2_LIMIT:-70} python3 $root/benchmarks/bench_append.py --defaults \
          --only "$only" 2>&1 | grep -E "^\||append bench" | tee -a "$OUT/l_bench.txt"
      done
    done
    timeout -k 5 ${L3_LIMIT:-60} python3 benchmarks/bench_append.py \
      --only "fp4_e2m1 page, grouped (no sort)" 2>&1 | grep -E "^\|" \
      | tee -a "$OUT/l_bench.txt" ;;
  *)
    PART=$PART bash benchmarks/session29_call.sh ;;
esac
