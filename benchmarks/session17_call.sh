#!/bin/bash
# Seventeenth session's device call: the GPU tests of the new paths in parallel (correctness),
# then one timing job alone. Each part writes $OUT/<part>.txt; a summary at the end.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
PT="python3 -m pytest -q -m gpu -p no:cacheprovider -rA"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
python3 -c 'import torch,triton,transformers as t;print(torch.__version__,triton.__version__,t.__version__)' >> "$OUT/env.txt" 2>&1
timeout -k 5 ${T1:-300} $PT tests/gpu/test_hf_graphs_gpu.py -k "latent" > "$OUT/hf_latent.txt" 2>&1 &
timeout -k 5 ${T1:-300} $PT tests/gpu/test_hf_graphs_gpu.py -k "not latent" > "$OUT/hf_other.txt" 2>&1 &
timeout -k 5 ${T1:-300} $PT tests/gpu/test_engine_eviction_gpu.py -k "hold or swap_aside" > "$OUT/evict.txt" 2>&1 &
timeout -k 5 ${T1:-300} $PT tests/gpu/test_latent_decode_gpu.py tests/gpu/test_prompt_mass_gpu.py -k "kernel_matches_reference or mass" > "$OUT/latent.txt" 2>&1 &
wait
if [ -n "${GEN:-1}" ]; then
  timeout -k 5 ${T2:-230} python3 benchmarks/bench_generate.py --budget-s $(( ${T2:-230} - 20 )) \
    --out "$OUT/gen" --sections ${GEN_SECTIONS:-kvc_fp8,kvc_fp8_evict_snapkv_hold} \
    --evict-interval 64 > "$OUT/gen.txt" 2>&1
fi
cat "$OUT/env.txt"
for f in hf_latent hf_other evict latent; do
  echo "== $f"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E  |^\{" "$OUT/$f.txt" | cut -c1-260 | head -50
done
echo "== gen"; tail -25 "$OUT/gen.txt"
