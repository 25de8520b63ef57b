#!/bin/bash
# Device calls of the thirty-third session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   s: the decode step's GEMMs separate or merged (gemm_merge.py), host_gap.py (the deferred
#      stop check's step against the graph's GPU time), then one decode step by part at
#      B16 x P4096 (bench_generate.py --step-profile, fp8 pages) with its top kernels, with
#      the projections merged (the default) and not (KVCOMPILE_MERGE_PROJECTIONS=0)
#   s2: the same step profile at B64 x P2048 and B1 x P32768 (issue 16 item 5's other rows)
#   n: (next session) merged / unmerged rows at B16 x P4096 and B16 x P32768 after v's copy
#   p: bench_append.py --sweep of the 4-bit rows (int4 token / channel, fp4 token / tensor)
#   a: session32's v (the FP8 prefill checks, table and prefill tests), then test_dense_gpu.py
#   other parts: session32_call.sh's (v: the FP8 prefill checks, table and GPU tests;
#      x: v, then prefill_attends="fresh_fp8" at B16 x P32768)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-s}" in
  s)
    timeout -k 5 ${S0_LIMIT:-90} python3 benchmarks/gemm_merge.py 2>&1 | tee "$OUT/s_gemm.txt"
    timeout -k 5 ${S1_LIMIT:-170} python3 benchmarks/host_gap.py --kv fp8_e4m3 --batch 16 \
      --prompt 4096 --new 32 2>&1 | grep -v "^USDT" | tee "$OUT/s_host_gap.txt" | tail -25
    SHAPES=16,4096,128 PART=s2 bash "$0"
    # the same row with the projections unmerged (KVConfig.merge_projections off)
    KVCOMPILE_MERGE_PROJECTIONS=0 SHAPES=16,4096,128 OUT=$OUT/nomerge PART=s2 bash "$0" ;;
  s2)
    for shape in ${SHAPES:-64,2048,128 1,32768,64}; do
      set -- ${shape//,/ }
      B=$1 P=$2 N=$3 E_ARGS="--step-profile" ROW_LIMIT=${ROW_LIMIT:-150} OUT=$OUT/s_b$1 \
        bash benchmarks/e2e_kv_rows.sh "${ROWS:-kvc_fp8:auto}" 2>&1 | tee -a "$OUT/s_rows.txt"
      grep -A14 "One decode step by part" "$OUT"/s_b$1/*/log.txt | tee -a "$OUT/s_rows.txt"
      python3 - "$OUT"/s_b$1/*/bench_generate.json <<'PY' | tee -a "$OUT/s_rows.txt"
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    for k, r in d["results"].items():
        if isinstance(r, dict) and r.get("step_profile"):
            print(k, "top kernels, ms a step:")
            for t, n in r["step_profile"]["top"]:
                print(f"  {t:.4f}  {n[:110]}")
PY
    done ;;
  n)
    # for the next session: v's contiguous copy (after this session's GPU calls) checked for
    # the prefill's peak and the decode step: B16 x P4096 merged / unmerged, then B16 x P32768
    # fp8 merged / unmerged (issue 16 item 0's peak), a process a row
    for m in 1 0; do
      KVCOMPILE_MERGE_PROJECTIONS=$m B=16 P=4096 N=64 ROW_LIMIT=${ROW_LIMIT:-100} \
        OUT=$OUT/n_m$m bash benchmarks/e2e_kv_rows.sh "kvc_fp8:auto" 2>&1 | tail -2
    done
    for m in 1 0; do
      KVCOMPILE_MERGE_PROJECTIONS=$m B=16 P=32768 N=16 ROW_LIMIT=${N_LIMIT:-150} \
        OUT=$OUT/n_long_m$m bash benchmarks/e2e_kv_rows.sh "kvc_fp8:auto" 2>&1 | tail -2
    done ;;
  p)
    # issue 16 item 3 (append at 0.7x copy): tile and warp sweeps of the 4-bit rows' kernels
    # (int4 token / channel tiles, the fp4 token / tensor row kernel's new ROW_TILE_WARPS)
    for sel in "int4" "e2m1 token" "e2m1 tensor"; do
      timeout -k 5 ${P_LIMIT:-150} python3 benchmarks/bench_append.py --sweep --only "$sel" \
        2>&1 | grep -E "^\||copy" | grep -v "decode step" | tee -a "$OUT/p_append.txt"
    done ;;
  a)
    # the thirty-second session's unchecked changes: the FP8 prefill checks and table (the
    # quantization's V stores, prefill_attention(fp8=True) with a bf16 q through the op, the
    # P-rounding reference), the prefill matrix tests, then the dense GPU tests (a stub fixed)
    PART=v bash benchmarks/session32_call.sh
    timeout -k 5 ${A2_LIMIT:-100} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      2>&1 | tail -4 | tee "$OUT/a_tests.txt" ;;
  *)
    PART=$PART bash benchmarks/session32_call.sh ;;
esac
