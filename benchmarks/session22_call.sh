#!/bin/bash
# Device calls of the twenty-second session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary. Ran: a, e (twenty-second session: RESULTS.md
# "Twenty-second session"); still to run: m, q, p.
#   a: session21_call.sh part a (the GPU tests of the CUDA latent kernel's key mask and of
#      dense.sdpa_rows, then issue 22's B64 x 8k MLA rows)
#   e: issue 14's end-to-end rows, B16 x P32768, 64 new, 8 layers, each row in its own
#      process: bf16, fp8 (page scales) and int4 (K channel / V token, pages of 64) pages
#      (targets: fp8 decode >= 1.5x bf16's, int4 >= 2.0x; the int4 row ran eagerly, 0.18x,
#      before its append kernel existed)
#   p: left-padded prompts' time to first token (bench_generate --pad 0.5: rows of 4,096 down
#      to 2,048 tokens), HF static + inductor, kvc fp8, kvc bf16, each in its own process
#      (the prefill now attends each row's own K/V: dense.sdpa_rows)
#   m: issue 22's MLA rows (M_SHAPE, M_ROWS) after the expanded prompt chunks
#   q: the fp8 decode step at B16 x P32768 under the profiler, by category
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    PART=a bash benchmarks/session21_call.sh ;;
  e)
    ROW_LIMIT=${ROW_LIMIT:-185} bash benchmarks/e2e_kv_rows.sh \
      "${E_ROWS:-kvc_bf16:auto kvc_fp8:auto kvc_int4:auto}" 2>&1 | tee "$OUT/e_rows.txt" ;;
  p)
    for s in hf_static kvc_fp8 kvc_bf16; do
      timeout -k 5 ${P_LIMIT:-150} python3 benchmarks/bench_generate.py --batch 16 \
        --prompt 4096 --new 8 --pad 0.5 --sections $s --budget-s ${P_LIMIT:-150} \
        --out "$OUT/p_$s" > "$OUT/p_$s.txt" 2>&1 || echo "$s: exit $?"
      grep -E "^\| (HF|kvcompile)" "$OUT/p_$s.txt" | cut -d'|' -f1-7
    done ;;
  m)
    # issue 22's MLA rows after the expanded prompt chunks (B64 x 8k is prefilled in two
    # chunks; the second absorbed 128 heads x 4,096 queries x 64 rows at once and ran out of
    # memory on the first call): M_SHAPE "--batch 64 --prompt 8192" or "--batch 16 --prompt 32768"
    for r in ${M_ROWS:-kvc_fp8_e4m3 kvc_bf16 hf_static}; do
      timeout -k 5 ${M_LIMIT:-150} python3 benchmarks/bench_latent_generate.py --rows $r \
        ${M_SHAPE:---batch 64 --prompt 8192} --new 32 --repeats 2 || echo "| $r | exit $? |"
    done > "$OUT/m_latent.txt" 2>&1
    grep -E "^\| [hk]|^# Deep|^\| .* exit" "$OUT/m_latent.txt" ;;
  q)
    # the fp8 decode step at B16 x P32768 by category (part e's fp8 row reached 53% of its
    # roofline, bf16 78%: where the rest goes)
    timeout -k 5 ${Q_LIMIT:-170} python3 benchmarks/profile_generate.py --paths ${Q_PATHS:-fp8} \
      --prompt 32768 --new 16 --steps > "$OUT/q_profile.txt" 2>&1 || echo "profile: exit $?"
    grep -E "^\||^==|top device" -A0 "$OUT/q_profile.txt" | head -60 ;;
esac
