#!/bin/bash
# The KV-dominated end-to-end rows of issue 14 (B16, prompt 32,768, 64 new tokens, 8-layer
# Llama-3-8B shape; B / P / N / KV_GIB from the environment): each row in its own process, bench_generate.py's kvc_* section, then one
# line per row (decode tok/s, first token s, which decode kernel ran). E_ARGS: more
# bench_generate.py arguments (e.g. --step-profile).
#   bash benchmarks/e2e_kv_rows.sh "kvc_bf16:auto kvc_fp8:auto kvc_fp8:triton"
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
ROWS=${1:-"kvc_bf16:auto kvc_fp8:auto kvc_fp8:triton"}
for r in $ROWS; do
  sec=${r%%:*}; k=${r#*:}
  mkdir -p "$OUT/$sec-$k"
  timeout -k 5 "${ROW_LIMIT:-170}" python3 benchmarks/bench_generate.py --batch "${B:-16}" \
    --prompt "${P:-32768}" --new "${N:-64}" --sections "$sec" --kernels "$k" \
    --kv-gib "${KV_GIB:-24}" --budget-s "${ROW_LIMIT:-170}" --out "$OUT/$sec-$k" ${E_ARGS:-} \
    > "$OUT/$sec-$k/log.txt" 2>&1
  echo "$sec $k: exit $?"
  python3 - "$OUT/$sec-$k/bench_generate.json" <<'PY' || tail -5 "$OUT/$sec-$k/log.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for k, r in d["results"].items():
    if k != "env" and isinstance(r, dict) and "decode_tok_s" in r:
        pct = f"{r['pct_roofline']:.0f}%" if r.get("pct_roofline") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        print(f"  {k}: decode {r['decode_tok_s']:.0f} tok/s, first token {r['first_token_s']:.3f} s,"
              f" total {r['total_s']:.2f} s, roofline {pct}, peak {peak} GiB,"
              f" kernels {r.get('decode_kernel_calls')}, merged GEMMs {r.get('projections_merged')},"
              f" skinny GEMMs {r.get('decode_gemms_triton')} / auto {r.get('decode_gemms_auto')},"
              f" device-loop steps {r.get('device_loop_steps')}")
print("  errors:", d["errors"]) if d["errors"] else None
PY
done
