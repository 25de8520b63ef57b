#!/bin/bash
# One device call for issue 6: the engine's and HF generate's CUDA-graph decode steps against
# eager steps (correctness, tiny Llama), then the generation benchmark's rows that share one run:
# HF StaticCache + inductor (baseline), kvcompile fp8 + HF generate, and the same B prompts
# through the Engine with and without CUDA graphs. Logs to $OUT.
#   bash benchmarks/run_engine_graphs_gpu.sh [check_seconds] [bench_seconds]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T1=${1:-200}
T2=${2:-330}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
timeout "$T1" python3 -m pytest -s -q -m gpu tests/gpu/test_engine_graphs_gpu.py -p no:cacheprovider > "$OUT/engine_graphs_check.log" 2>&1
echo "check exit $? after $(( $(date +%s) - start ))s"
grep -E "^\{|passed|failed|Error|error" "$OUT/engine_graphs_check.log" | tail -n 25
timeout "$T1" python3 -m pytest -s -q -m gpu tests/gpu/test_hf_graphs_gpu.py -p no:cacheprovider > "$OUT/hf_graphs_check.log" 2>&1
echo "hf check exit $? after $(( $(date +%s) - start ))s"
grep -E "^\{|passed|failed|Error|error" "$OUT/hf_graphs_check.log" | tail -n 25
timeout $((T2 + 30)) python3 benchmarks/bench_generate.py --budget-s "$T2" --out "$OUT" \
  --sections ${SECTIONS:-hf_static,kvc_fp8,engine_b,engine_b_nograph} > "$OUT/bench_generate.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start ))s"
grep -v "^{" "$OUT/bench_generate.log" | grep -v "^  File\|^    " | tail -n 40
