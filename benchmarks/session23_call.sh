#!/bin/bash
# Device calls of the twenty-third session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary. Ran: q (RESULTS.md "Twenty-third session",
# on an H100). Still to run: t, h, e, m, p (t first: it checks this session's changes).
#   q: where a decode step's time goes at B16 x P32768 (8 layers), bf16 / fp8 (page scales) /
#      int4 (K channel, V token, P64) pages, each in its own process: profile_generate.py
#      --steps (device time by category over steps 2..16 of one generate call, against
#      their wall time) and the step time from a clock inside the call
#   e: issue 14's end-to-end rows again, decode timed inside the generate call (StepClock:
#      the two-call difference moved by 6% per 20 ms of prefill spread), with HF StaticCache
#      + inductor as the baseline row (E_ROWS; B / P / N from the environment), each row's
#      decode step by part (--step-profile; grep "One decode step" in $OUT/*/log.txt)
#   t: the GPU tests of generate's graphs (test_hf_graphs_gpu.py: the deferred stop check
#      against the per-step one, the two staging buffers, the skipped block-table gather)
#      and of the Engine's graphs (upload_plan is shared)
#   h: host_gap.py (fp8 / bf16, P4096 / P32768): the step's host parts under the per-step
#      stop check, the graph's GPU time, and the step under the deferred check (the default
#      since this session: KVConfig.deferred_stop)
#   m: session22_call.sh m (issue 22's MLA rows after the expanded prompt chunks)
#   p: session22_call.sh p (left-padded prompts' time to first token)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-q}" in
  q)
    for path in ${Q_PATHS:-bf16 fp8 int4}; do
      timeout -k 5 ${Q_LIMIT:-150} python3 benchmarks/profile_generate.py --paths "$path" \
        --prompt ${Q_PROMPT:-32768} --new 16 --steps > "$OUT/q_$path.txt" 2>&1 \
        || echo "$path: exit $?"
      grep -E "^== |^\| |top kernels" -A0 "$OUT/q_$path.txt" | grep -v "^| path\|^|---"
      grep -A8 "top kernels per step" "$OUT/q_$path.txt" | tail -8
    done ;;
  e)
    E_ARGS=${E_ARGS:---step-profile} ROW_LIMIT=${ROW_LIMIT:-160} bash benchmarks/e2e_kv_rows.sh \
      "${E_ROWS:-hf_static:auto kvc_bf16:auto kvc_fp8:auto kvc_int4:auto}" 2>&1 \
      | tee "$OUT/e_rows.txt" ;;
  t)
    timeout -k 5 ${T_LIMIT:-400} python3 -m pytest -q -m gpu tests/gpu/test_hf_graphs_gpu.py \
      tests/gpu/test_engine_graphs_gpu.py -x 2>&1 | tail -25 | tee "$OUT/t_tests.txt" ;;
  h)
    for kv in ${H_KV:-fp8_e4m3 bf16}; do
      for p in ${H_PROMPTS:-4096 32768}; do
        timeout -k 5 ${H_LIMIT:-140} python3 benchmarks/host_gap.py --kv $kv --prompt $p \
          > "$OUT/h_${kv}_$p.txt" 2>&1 || echo "$kv P$p: exit $?"
        tail -6 "$OUT/h_${kv}_$p.txt"
      done
    done ;;
  m|p)
    PART=$PART bash benchmarks/session22_call.sh ;;
esac
