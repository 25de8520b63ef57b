#!/bin/bash
# Device calls of the twenty-ninth session, one part a call, each under 600 s; every part
# writes $OUT/<part>*.txt and prints a summary.
#   a: the append GPU tests and rows after the twenty-eighth session's last changes
#      (session28_call.sh c), then the Engine's prefill against generate's with the device's
#      idle gaps and the host work in them (profile_engine.py --prefill --gaps, B16 x P4096)
#   b: after this session's last changes (not run on a GPU yet): the dense / append / engine
#      GPU tests (sdpa_packed's batched runs, TILE_SPLIT on), the Engine's prefill with its
#      gaps, then the B16 x P4096 rows with HF static (the Engine's peak now from its timed
#      calls)
#   c: the issue's other shapes, a process a row: B64 x P2048 (HF static, generate fp8 /
#      int4, the Engine), about 400 s with a start
#   d: B16 x P32768 (generate fp8 / int4, the Engine, then HF static: its 78 GiB peak on the
#      H200 may not fit an H100's 80 GB)
#   other parts: session28_call.sh's (t: first token and decode with HF static in one call)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
case "${PART:-a}" in
  a)
    PART=c bash benchmarks/session28_call.sh
    timeout -k 5 ${A2_LIMIT:-240} python3 benchmarks/profile_engine.py --prefill --gaps \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" > "$OUT/a_gaps.txt"
    grep -E "^####|device idle|device busy" "$OUT/a_gaps.txt" ;;   # the rest: the file
  b)
    timeout -k 5 ${B1_LIMIT:-150} python3 -m pytest -q -n 8 -m gpu tests/gpu/test_dense_gpu.py \
      tests/gpu/test_append_gpu.py tests/gpu/test_append_int_gpu.py \
      tests/gpu/test_engine_graphs_gpu.py 2>&1 | tail -3 | tee "$OUT/b_tests.txt"
    timeout -k 5 ${B2_LIMIT:-200} python3 benchmarks/profile_engine.py --prefill --gaps \
      --batch ${B:-16} --prompt ${P:-4096} 2>&1 | grep -v "^USDT" > "$OUT/b_gaps.txt"
    grep -E "^####|device idle|device busy|device: attention" "$OUT/b_gaps.txt"
    ROWS="${ROWS:-hf_static:auto engine_b:auto}" ROW_LIMIT=${ROW_LIMIT:-120} \
      PART=t bash benchmarks/session28_call.sh ;;
  c)
    B=64 P=2048 N=${N:-128} ROWS="${ROWS:-hf_static:auto kvc_fp8:auto kvc_int4:auto engine_b:auto}" \
      ROW_LIMIT=${ROW_LIMIT:-120} PART=t bash benchmarks/session28_call.sh ;;
  d)
    B=16 P=32768 N=${N:-64} ROWS="${ROWS:-kvc_fp8:auto kvc_int4:auto engine_b:auto hf_static:auto}" \
      ROW_LIMIT=${ROW_LIMIT:-140} PART=t bash benchmarks/session28_call.sh ;;
  *)
    PART=$PART bash benchmarks/session28_call.sh ;;
esac
