#!/bin/bash
# One device call for issue 19's graph-replayed eviction: the engine eviction GPU tests (H2O and
# re-rotated SinkWindow under CUDA graphs, against eager steps and the host path), then the
# generation benchmark's engine rows with eviction at 50% of the prompt. Logs to $OUT.
#   bash benchmarks/run_eviction_aside_gpu.sh [check_seconds] [bench_seconds]
# K=... picks the tests (default: the new cases; K="" runs all 50, about two device calls).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T1=${1:-280}
T2=${2:-260}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
timeout "$T1" python3 -m pytest -s -q -m gpu tests/gpu/test_engine_eviction_gpu.py -k "${K:-H2O or rerotated or host_path}" -p no:cacheprovider > "$OUT/engine_eviction_check.log" 2>&1
echo "check exit $? after $(( $(date +%s) - start ))s"
grep -E "^\{|passed|failed|Error|error" "$OUT/engine_eviction_check.log" | tail -n 40
timeout $((T2 + 30)) python3 benchmarks/bench_generate.py --budget-s "$T2" --out "$OUT" \
  --evict-interval ${INTERVAL:-64} --engine-scale ${SCALE:-token} \
  --sections ${SECTIONS:-engine_b,engine_evict_sink,engine_evict_sink_rot,engine_evict_h2o,engine_evict_snapkv} \
  > "$OUT/bench_eviction.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start ))s"
grep -v "^{" "$OUT/bench_eviction.log" | grep -v "^  File\|^    " | tail -n 40
