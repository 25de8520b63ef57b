#!/bin/bash
# Device calls of the twenty-ninth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: the append GPU tests and rows after the twenty-eighth session's last changes
#      (session28_call.sh c), then the Engine's prefill against generate's with the device's
#      idle gaps and the host work in them (profile_engine.py --prefill --gaps, B16 x P4096)
#   other parts: session28_call.sh's (t: first token and decode with HF static in one call)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    PART=c bash benchmarks/session28_call.sh
    timeout -k 5 ${A2_LIMIT:-240} python3 benchmarks/profile_engine.py --prefill --gaps \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" > "$OUT/a_gaps.txt"
    grep -E "^####|device idle|device busy" "$OUT/a_gaps.txt" ;;   # the rest: the file
  *)
    PART=$PART bash benchmarks/session28_call.sh ;;
esac
