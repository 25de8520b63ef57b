#!/bin/bash
# Device calls of the thirty-fourth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   n: session33's n (merged / unmerged rows at B16 x P4096 and B16 x P32768, fp8 pages, a
#      process a row: v's contiguous copy, the prefill's peak with the merge)
#   m1 / m2: issue 22's MLA rows (bench_latent_generate.py, DeepSeek-V3-shaped, 4 layers),
#      B64 x 8k (m1) and B16 x 32k (m2), a process a row: HF eager (writes the reference
#      tokens), HF static, kvcompile bf16 and fp8_e4m3 latent pages
#   k: what is live at the prefill's peak (peak_live.py), merged and unmerged, B16 x P4096
#   v: after the in-place gated product (kernels/gated.py): peak_live.py merged, the merged
#      rows at B16 x P4096 and B16 x P32768, then generate's graph tests (the op in graphs)
#   g: gemm_merge.py through engine/cudagraph.capture, host_gap.py (deferred stop)
#   other parts: session33_call.sh's
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
mla_rows() {   # $1 batch, $2 prompt, $3 tag
  for row in ${M_ROWS:-hf_eager hf_static kvc_bf16 kvc_fp8_e4m3}; do
    timeout -k 5 ${M_LIMIT:-170} python3 benchmarks/bench_latent_generate.py --batch "$1" \
      --prompt "$2" --new ${M_NEW:-16} --repeats ${M_REPEATS:-2} --rows "$row" \
      --ref "$OUT/$3_ref.pt" > "$OUT/$3_$row.txt" 2>&1
    echo "== $3 $row: exit $?"
    grep -E "^\| |Error|error:" "$OUT/$3_$row.txt" | tail -4
  done
}
case "${PART:-n}" in
  n)
    PART=n bash benchmarks/session33_call.sh ;;
  m1)
    mla_rows 64 8192 m1 ;;
  m2)
    mla_rows 16 32768 m2 ;;
  k)
    for m in 1 0; do
      KVCOMPILE_MERGE_PROJECTIONS=$m timeout -k 5 ${K_LIMIT:-150} python3 benchmarks/peak_live.py \
        --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -E "^#|^\|" | tee "$OUT/k_m$m.txt"
    done ;;
  v)
    KVCOMPILE_MERGE_PROJECTIONS=1 timeout -k 5 ${K_LIMIT:-150} python3 benchmarks/peak_live.py \
      --batch 16 --prompt 4096 2>&1 | grep -E "^#|^\|" | head -8 | tee "$OUT/v_peak.txt"
    B=16 P=4096 N=64 ROW_LIMIT=100 OUT=$OUT/v_m1 bash benchmarks/e2e_kv_rows.sh "kvc_fp8:auto" \
      2>&1 | tail -2
    B=16 P=32768 N=16 ROW_LIMIT=150 OUT=$OUT/v_long bash benchmarks/e2e_kv_rows.sh \
      "kvc_fp8:auto" 2>&1 | tail -2
    timeout -k 5 ${V_LIMIT:-150} python3 -m pytest -q -s -m gpu tests/gpu/test_gated_gpu.py \
      tests/gpu/test_hf_graphs_gpu.py \
      2>&1 | tail -4 | tee "$OUT/v_tests.txt" ;;
  g)
    timeout -k 5 ${G0_LIMIT:-90} python3 benchmarks/gemm_merge.py 2>&1 | tee "$OUT/g_gemm.txt"
    timeout -k 5 ${G1_LIMIT:-170} python3 benchmarks/host_gap.py --kv fp8_e4m3 --batch 16 \
      --prompt 4096 --new 32 2>&1 | grep -v "^USDT" | tee "$OUT/g_host_gap.txt" | tail -25 ;;
  *)
    PART=$PART bash benchmarks/session33_call.sh ;;
esac
