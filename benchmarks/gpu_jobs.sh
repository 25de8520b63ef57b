#!/bin/bash
# One device call, a list of named jobs run one after another, each with its own time limit and
# log ($OUT/<job>.log); a PASS/FAIL/TIMEOUT line per job at the end (also $OUT/summary.txt).
# The one runner for the device: GPU correctness tests (tests/gpu/, pytest -m gpu), the
# benchmarks, and the quality harness's device stages.
#
#   bash benchmarks/gpu_jobs.sh env decode_fast memory nan dense
#   bash benchmarks/gpu_jobs.sh gpu_tests          # every pytest test marked gpu (tests/gpu/)
#   bash benchmarks/gpu_jobs.sh decode_matrix append_matrix prefill_matrix sinks e2e decode_check
#   KVC_GPU_FULL=1 bash benchmarks/gpu_jobs.sh decode_matrix   # the full matrix (quick otherwise)
#   DM_K=donly bash benchmarks/gpu_jobs.sh decode_matrix       # decode-only formats (int, channel)
#   NAN_KINDS=prefill bash benchmarks/gpu_jobs.sh nan   # a -k selection of tests/gpu/test_nan_gpu.py
#   DEADLINE=560 bash benchmarks/gpu_jobs.sh prefill_memory
#   EC_K=rerotated bash benchmarks/gpu_jobs.sh evict_check evict_bench   # eviction in the Engine
#   bash benchmarks/gpu_jobs.sh prompt_mass        # H2O's prompt-mass kernels: test + timing
#   bash benchmarks/gpu_jobs.sh rot_bench   # one decode layer with re-rotated sinks in the kernel
#   bash benchmarks/gpu_jobs.sh window_bench   # one decode layer: full / half / SinkWindow's mask
#   bash benchmarks/gpu_jobs.sh engine_graphs hf_graphs gen e2e prefill_matrix
#   bash benchmarks/gpu_jobs.sh triton_decode prefill_bench kernel_report append_bench
#   bash benchmarks/gpu_jobs.sh qk8_check qk8_bench   # the opt-in qk_fp8 decode variant vs default
#   bash benchmarks/gpu_jobs.sh var14_check var14_bench   # issue-14 decode variants (nocap, alu*,
#                                                         # chain, pvt, pvt4(h), pvt5h, cta4; V14C_K, V14B_VARIANTS)
#   bash benchmarks/gpu_jobs.sh append_int int_graphs # int pages' append kernel; the 4-bit format graphed
#   bash benchmarks/gpu_jobs.sh int4_check int4_bench # int4 pages (K channel / V token) in the CUDA decode kernel
#   bash benchmarks/gpu_jobs.sh i4v_check i4v_bench   # cuda14h: int4 variants (pvt4n, pvt4nz, pvt4s, pvt4sz, pvt4sp) vs base / pvt4h
#                                                     # (I4V_K, I4V_VARIANTS, I4V_FORMATS)
#   PROF_ARGS="--steps" bash benchmarks/gpu_jobs.sh profile   # a decode step by part
#   bash benchmarks/gpu_jobs.sh engine_overlap engine_profile engine_sync_bench   # Engine steps
#                                   # overlapped vs synchronous (EP_ARGS="--batch 64 --prompt 2048")
#   PB_ARGS=--quick bash benchmarks/gpu_jobs.sh prefill_bench  # the prefill matrix (bench_prefill)
#   bash benchmarks/gpu_jobs.sh chunk_route   # gathered vs paged chunk route: tests + --chunk-only
#   LQ_ARGS="--heads 16 --shapes B16_L8k,B64_L32k" bash benchmarks/gpu_jobs.sh latent_quick
#   LC_K=tensor_parallel bash benchmarks/gpu_jobs.sh latent_check   # MLA decode, 16 / 32 heads
#   LB_ARGS="--heads 16 --shapes B16_L8k,B16_L32k" bash benchmarks/gpu_jobs.sh latent_bench
#   bash benchmarks/gpu_jobs.sh latent_tp16   # 16 heads: rule vs copy (the prefetch variants are refused on CUDA), then
#                                             # the tensor-parallel GPU tests (mla22h)
#   bash benchmarks/gpu_jobs.sh latent_cuda   # the CUDA latent kernel (opt-in, mla22i): 16 heads,
#                                             # rule vs cuda base / base 8 warps / aluk / alu /
#                                             # alu 2 CTAs an SM
#                                             # vs copy, then its GPU tests (LX_HEADS, LX_CUDA,
#                                             # LX_SHAPES, LX_SPLITS, LX_K, LX_LIMIT)
#   bash benchmarks/gpu_jobs.sh latent22j_check  # mla22j: the CUDA latent kernel's GPU tests (q in
#                                             # fragment order, every variant, 2 CTAs/SM base/aluv),
#                                             # the one-launch merge under the Triton route, -v
#   bash benchmarks/gpu_jobs.sh latent22j_bench  # mla22j: 16 heads, rule vs cuda variants vs copy,
#                                             # each row also as a CUDA graph (--graph); base:nm =
#                                             # no merge, base:ml = the old loop merge (LJ_SHAPES,
#                                             # LJ_CUDA, LJ_LIMIT)
#   bash benchmarks/gpu_jobs.sh latent22k_check  # mla22k: the CUDA latent kernel's GPU tests incl. the
#                                             # fused merge (3 launches: counters reset), the per-CTA
#                                             # timers, two 8-warp CTAs an SM (fp8); -vv
#   bash benchmarks/gpu_jobs.sh latent22k_bench  # mla22k: 16 heads, rule vs cuda: base (O rescaled only
#                                             # when a max grows), :rs (every tile, as before), :fm (fused
#                                             # merge), :s4 / :s4:w8 (fp8 two CTAs an SM, 4 / 8 warps),
#                                             # ksplit (scores split over warps by k, q in registers),
#                                             # ostage (O out through shared memory, whole rows);
#                                             # ':prof' rows add a '# prof' line (where a launch's time
#                                             # goes: start skew, q, tile 0, loop a tile, stores, merge)
#                                             # (LK_SHAPES, LK_CUDA, LK_SPLITS, LK_LIMIT)
#   LG_ARGS="--batch 16 --prompt 8192 --new 32 --repeats 2" bash benchmarks/gpu_jobs.sh latent_gen
#       # MLA generate (bench_latent_generate.py), DeepSeek-V3-shaped, each row in its own process
#       # (LG_ROWS: hf_eager first, it writes the tokens the others compare with)
#   bash benchmarks/gpu_jobs.sh capacity32k   # Engine capacity, 32k-token requests, 1 layer x 1 kv head of 128
#                                             # (per layer and head: the same schedule; CAP_LAYERS=2 CAP_HEADS=8: 16x the work)
#   bash benchmarks/gpu_jobs.sh capacity32k_pe  # the same, prompts evicted every 4,096 tokens (evict19f)
#   CAP_CASES=2 CAP_CHUNK=1024 CAP_ARGS=--decompose bash benchmarks/gpu_jobs.sh capacity32k_pe
#       # cap19h: fp8 with 1,024-token eviction chunks, and where the sequences go step by step;
#       # CAP_CASES=0 CAP_ARGS="--decompose --plain-admission lifetime" ... capacity32k: the bf16
#       # baseline admitted by its whole life (never preempted), as the evicting rows are
#   bash benchmarks/gpu_jobs.sh quality_canary     # then, same warm machine: quality (see
#                                                  # benchmarks/quality/gpu_stages.sh: the model
#                                                  # travels in two halves, .kvc_gpu_a / _b)
#   ... quality_cap (instead of quality): issue 19's capacity settings, passkey 7.5k and the
#                                                  # multi-key needle, SnapKV@50 on fp8 and the 4-bit format
# Two GPUs (nvidia-h200-x2): one runner per GPU, each with its own OUT, e.g.
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 bash benchmarks/gpu_jobs.sh decode_matrix prefill_matrix &
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 bash benchmarks/gpu_jobs.sh gen; wait
# The matrix jobs run pytest-xdist with one worker per core (NPROC, 16) when it is installed
# (compiles dominate; serially they take 10+ minutes).
#
# A job still running at its own limit, or at DEADLINE seconds after the start, is stopped so
# that the logs come back. Jobs (name: command, limit in seconds):
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-570}
start=$(date +%s)
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider"
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${NPROC:-16}")   # pytest-xdist workers
PAR="env OMP_NUM_THREADS=1 $PYTEST $XD"                                # compile-bound test files
MATRICES="tests/gpu/test_decode_matrix_gpu.py tests/gpu/test_append_gpu.py tests/gpu/test_prefill_matrix_gpu.py"
DI_ROWS=${DI_ROWS:-fp4_e2m1/page,int4/channel+int4/token@64,int4/channel+fp4_e2m1/page@64,int2/channel+int2/token@64}
DI_SHAPES=${DI_SHAPES:-B64_L8k,B16_L32k,B1_L128k}

job() {   # job NAME -> "LIMIT COMMAND"
  case "$1" in
    env)            echo "20 nvidia-smi; python3 -c 'import torch,triton,transformers as t;print(torch.__version__,triton.__version__,t.__version__,torch.cuda.get_device_name())'; nvcc --version | tail -1" ;;
    decode_fast)    echo "300 python3 benchmarks/gpu_decode_fast.py --out $OUT" ;;
    decode_check)   echo "${DC_LIMIT:-200} $PYTEST tests/gpu/test_decode_sm90_gpu.py" ;;
    int4_check)     echo "${I4C_LIMIT:-200} $PYTEST tests/gpu/test_decode_sm90_gpu.py -k 'int4 or wrong_output'" ;;
    int4_bench)     echo "${I4B_LIMIT:-300} python3 benchmarks/gpu_decode_fast.py --formats ${I4B_FORMATS:-int4/channel,fp8_e4m3/page} --int4-pages ${I4B_PAGES:-16,64} --waves '${I4B_WAVES:-}' --out $OUT" ;;
    i4v_check)      echo "${I4V_LIMIT:-200} $PYTEST -v tests/gpu/test_decode_sm90_variants_gpu.py -k '${I4V_K:-int4 or sixteen}'" ;;
    i4v_bench)      echo "${I4VB_LIMIT:-300} python3 benchmarks/gpu_decode_fast.py --variants ${I4V_VARIANTS:-base,pvt4h,pvt4n,pvt4nz,pvt4s,pvt4sz,pvt4sp} --no-triton --waves '' --formats ${I4V_FORMATS:-int4/channel,bf16/page} --int4-pages 64 --out $OUT" ;;
    qk8_check)      echo "${Q8C_LIMIT:-200} $PYTEST tests/gpu/test_decode_sm90_gpu.py -k 'qk8 or wrong_output'" ;;
    qk8_bench)      echo "${Q8B_LIMIT:-300} python3 benchmarks/gpu_decode_fast.py --variants base,qk8 --no-triton --waves '' --formats ${Q8B_FORMATS:-fp8_e4m3/page,fp8_e4m3/token,fp8_e4m3/tensor} --out $OUT" ;;
    var14_check)    echo "${V14C_LIMIT:-200} $PYTEST tests/gpu/test_decode_sm90_variants_gpu.py ${V14C_K:+-k $V14C_K}" ;;
    var14_bench)    echo "${V14B_LIMIT:-330} python3 benchmarks/gpu_decode_fast.py --variants ${V14B_VARIANTS:-base,nocap,chain,pvt,pvt4,pvt4h,pvt5h,cta4} --no-triton --waves '' --formats ${V14B_FORMATS:-fp8_e4m3/page,fp8_e4m3/tensor,fp8_e5m2/page} --out $OUT" ;;
    decode_matrix)  echo "${DM_LIMIT:-240} $PAR tests/gpu/test_decode_matrix_gpu.py ${DM_K:+-k $DM_K}" ;;
    append_matrix)  echo "${AM_LIMIT:-150} $PAR tests/gpu/test_append_gpu.py" ;;
    append_int)     echo "${AI_LIMIT:-200} $PAR tests/gpu/test_append_int_gpu.py" ;;   # append14i: int pages' append kernel
    int_graphs)     echo "${IG_LIMIT:-200} python3 -m pytest -s -q -m gpu tests/gpu/test_int_graphs_gpu.py -p no:cacheprovider" ;;   # append14i: the 4-bit format graphed
    prefill_matrix) echo "${PC_LIMIT:-240} $PAR tests/gpu/test_prefill_matrix_gpu.py ${PC_K:+-k $PC_K}" ;;
    sinks)          echo "${SK_LIMIT:-120} $PYTEST tests/gpu/test_sinks_gpu.py" ;;
    e2e)            echo "${E2E_LIMIT:-240} $PYTEST tests/gpu/test_e2e_gpu.py" ;;
    triton_decode)  echo "${TD_LIMIT:-300} for i in 0 1 2 3 4 5; do python3 benchmarks/bench_decode.py warmup --part \$i --parts 6 ${TD_WARM:-} & done; for i in 0 1 2 3; do python3 benchmarks/bench_decode.py flexwarm --part \$i --parts 4 & done; wait; python3 benchmarks/bench_decode.py run --out $OUT ${TD_RUN:-}" ;;
    decode_int_bench) echo "${DI_LIMIT:-200} for i in 0 1 2 3; do python3 benchmarks/bench_decode.py warmup --formats $DI_ROWS --shapes $DI_SHAPES --waves 8 --part \$i --parts 4 & done; wait; python3 benchmarks/bench_decode.py run --no-sweep --no-flex --no-append --waves 8 --formats $DI_ROWS --shapes $DI_SHAPES --out $OUT" ;;
    prefill_bench)  echo "${PB_LIMIT:-330} python3 benchmarks/bench_prefill.py --warm-flex --budget ${PB_WARM:-150} && python3 benchmarks/bench_prefill.py --budget ${PB_BUDGET:-150} --json $OUT/bench_prefill.json ${PB_ARGS:-}" ;;
    chunk_route)    echo "${CR_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_gather.py tests/runtime/test_chunk_route.py; r=\$?; python3 benchmarks/bench_prefill.py --chunk-only --budget ${CR_BUDGET:-170} --json $OUT/bench_chunk.json; exit \$(( r | \$? ))" ;;
    kernel_report)  echo "${KR_LIMIT:-130} python3 benchmarks/kernel_report.py --out $OUT ${KR_ARGS:-}" ;;
    quality_canary) echo "${QC_LIMIT:-320} bash benchmarks/quality/gpu_stages.sh canary" ;;
    quality)        echo "${Q_LIMIT:-260} bash benchmarks/quality/gpu_stages.sh run" ;;
    quality_cap)    echo "${Q_LIMIT:-260} bash benchmarks/quality/gpu_stages.sh cap" ;;   # issue 19: passkey 7.5k + multi-key at SnapKV@50, fp8 and 4-bit
    memory)         echo "${MEM_LIMIT:-200} python3 -m pytest -s -q -m gpu tests/gpu/test_memory_gpu.py -p no:cacheprovider" ;;
    nan)            echo "${NAN_LIMIT:-240} python3 -m pytest -q -m gpu tests/gpu/test_nan_gpu.py -p no:cacheprovider ${NAN_KINDS:+-k $NAN_KINDS}" ;;
    dense)          echo "60 python3 -m pytest -q -m gpu tests/gpu/test_dense_gpu.py -p no:cacheprovider" ;;
    engine_graphs)  echo "${EG_LIMIT:-240} python3 -m pytest -s -q -m gpu tests/gpu/test_engine_graphs_gpu.py -p no:cacheprovider" ;;
    hf_graphs)      echo "${HG_LIMIT:-240} python3 -m pytest -s -q -m gpu tests/gpu/test_hf_graphs_gpu.py -p no:cacheprovider" ;;
    kernels)        echo "${K_LIMIT:-300} python3 -m pytest -q ${K_TESTS:-tests/kernels/test_decode.py tests/kernels/test_prefill.py tests/kernels/test_append.py} -p no:cacheprovider" ;;
    gpu_tests)      echo "${GPU_TESTS_LIMIT:-540} $PAR $MATRICES; r=\$?; $PYTEST tests/gpu $(printf -- '--ignore=%s ' $MATRICES); s=\$?; exit \$(( r | s ))" ;;
    prefill_memory) echo "${PM_BUDGET:-540} python3 benchmarks/bench_prefill_memory.py --budget-s $(( ${PM_BUDGET:-540} - 15 )) --rows ${PM_ROWS:-mask_analysis,hf_static,fp8_e4m3,bf16,fp4_e2m1,bf16_whole} --json $OUT/prefill_memory.json ${PM_ARGS:-}" ;;
    pm32k)          echo "${PM_BUDGET:-400} python3 benchmarks/bench_prefill_memory.py --budget-s $(( ${PM_BUDGET:-400} - 15 )) --rows ${PM_ROWS:-hf_static,fp8_e4m3,bf16,fp4_e2m1} --json $OUT/pm32k.json" ;;
    ttft4k)         echo "${TT_BUDGET:-240} python3 benchmarks/bench_prefill_memory.py --batch 16 --prompt 4096 --budget-s $(( ${TT_BUDGET:-240} - 10 )) --rows ${TT_ROWS:-hf_static,fp8_e4m3,fp8_e4m3_stored,bf16,fp4_e2m1} --json $OUT/ttft4k.json" ;;
    ttft32k1)       echo "${TT1_BUDGET:-200} python3 benchmarks/bench_prefill_memory.py --batch 1 --prompt 32768 --budget-s $(( ${TT1_BUDGET:-200} - 10 )) --rows ${TT1_ROWS:-hf_static,fp8_e4m3,bf16} --json $OUT/ttft32k1.json" ;;
    evict_check)    echo "${EC_LIMIT:-200} python3 -m pytest -s -q -m gpu tests/gpu/test_engine_eviction_gpu.py -p no:cacheprovider ${EC_K:+-k $EC_K}" ;;
    prompt_mass)    echo "${PMS_LIMIT:-200} python3 -m pytest -q -m gpu tests/gpu/test_prompt_mass_gpu.py -p no:cacheprovider; r=\$?; python3 benchmarks/bench_prompt_mass.py ${PMS_ARGS:-}; exit \$(( r | \$? ))" ;;
    evict_bench)    echo "${EB_LIMIT:-260} python3 benchmarks/bench_generate.py --budget-s $(( ${EB_LIMIT:-260} - 20 )) --out $OUT --evict-interval ${INTERVAL:-64} --engine-scale ${SCALE:-token} --sections ${EB_SECTIONS:-engine_b,engine_evict_sink,engine_evict_h2o,engine_evict_snapkv} ${EB_ARGS:-}" ;;
    rot_bench)      echo "${RB_LIMIT:-120} python3 benchmarks/bench_rot_decode.py ${RB_ARGS:-}" ;;
    window_bench)   echo "${WB_LIMIT:-90} python3 benchmarks/bench_window_decode.py ${WB_ARGS:-}" ;;
    append_check)   echo "${AC_LIMIT:-150} env OMP_NUM_THREADS=1 python3 -m pytest -v $XD tests/kernels/test_append_tiles.py tests/kernels/test_append.py tests/kernels/test_append_codes.py -p no:cacheprovider" ;;   # -v: a cut log still names each failure
    append_bench)   echo "${AB_LIMIT:-200} python3 benchmarks/bench_append.py --json $OUT/bench_append.json ${AB_ARGS:-}" ;;
    latent_check)   echo "${LC_LIMIT:-200} python3 -m pytest -q -m gpu tests/gpu/test_latent_decode_gpu.py -p no:cacheprovider ${LC_K:+-k \"$LC_K\"}" ;;
    latent_quick)   echo "${LQ_LIMIT:-420} python3 benchmarks/bench_latent_decode.py --quick ${LQ_ARGS:-}" ;;
    latent_tp16)    echo "${LT_LIMIT:-290} python3 benchmarks/bench_latent_decode.py --quick --heads 16 --shapes ${LT_SHAPES:-B16_L8k,B64_L8k,B16_L32k,B64_L32k} ${LT_TILES:+--tiles $LT_TILES} ${LT_SPLITS:+--splits $LT_SPLITS}; r=\$?; python3 -m pytest -q -m gpu tests/gpu/test_latent_decode_gpu.py -p no:cacheprovider -k 'tensor_parallel'; exit \$(( r | \$? ))" ;;
    latent_cuda)    echo "${LX_LIMIT:-480} python3 benchmarks/bench_latent_decode.py --quick --heads ${LX_HEADS:-16} --rule-only --cuda ${LX_CUDA:-base,base:w8,aluk,alu,alu:s4} --shapes ${LX_SHAPES:-B16_L8k,B64_L8k,B16_L32k,B64_L32k} ${LX_SPLITS:+--splits $LX_SPLITS}; r=\$?; python3 -m pytest -q -m gpu tests/gpu/test_latent_sm90_gpu.py -p no:cacheprovider -x ${LX_K:+-k \"$LX_K\"}; exit \$(( r | \$? ))" ;;
    latent22j_check) echo "${LJ_CHECK_LIMIT:-220} $PAR -vv tests/gpu/test_latent_sm90_gpu.py tests/gpu/test_latent_decode_gpu.py -k \"test_cuda_latent_kernel or routes_decode_steps or kernel_matches_reference or tensor_parallel_shards\"" ;;
    latent22j_bench) echo "${LJ_LIMIT:-235} python3 benchmarks/bench_latent_decode.py --quick --graph --heads ${LX_HEADS:-16} --rule-only --cuda ${LJ_CUDA:-base,base:nm,base:ml,base:s4,aluv:s4,alu:s4,wide,wide:w8} --shapes ${LJ_SHAPES:-B16_L8k,B64_L8k,B16_L32k,B64_L32k}" ;;
    latent22k_check) echo "${LK_CHECK_LIMIT:-230} $PAR -vv tests/gpu/test_latent_sm90_gpu.py tests/gpu/test_latent_decode_gpu.py -k \"${LK_K:-test_cuda_latent or routes_decode_steps or kernel_matches_reference or tensor_parallel_shards}\"" ;;
    latent22k_bench) echo "${LK_LIMIT:-235} python3 benchmarks/bench_latent_decode.py --quick --graph --heads ${LX_HEADS:-16} --rule-only --cuda ${LK_CUDA:-base,base:rs,base:fm,ksplit:fm,ostage:fm,ostage+ksplit:fm,base:s4,base:s4:fm,ksplit:s4:fm,ostage+ksplit:s4:fm,base:s4:w8:fm,ksplit:s4:w8:fm,ostage+ksplit:s4:w8:fm,base:fm:prof,base:s4:fm:prof,ostage+ksplit:fm:prof,ostage+ksplit:s4:fm:prof,ostage+ksplit:s4:w8:fm:prof} --shapes ${LK_SHAPES:-B16_L8k,B64_L8k,B16_L32k,B64_L32k} ${LK_SPLITS:+--splits $LK_SPLITS}" ;;
    latent_bench)   echo "${LB_LIMIT:-300} python3 benchmarks/bench_latent_decode.py ${LB_ARGS:-}" ;;
    latent_gen)     echo "${LG_LIMIT:-420} for r in ${LG_ROWS:-hf_eager hf_static kvc_bf16 kvc_fp8_e4m3 kvc_fp8_e4m3+h2o kvc_fp8_e4m3+snapkv}; do python3 benchmarks/bench_latent_generate.py --ref $OUT/latent_ref.pt --rows \$r ${LG_ARGS:-}; done" ;;   # MLA generate, one process a row
    gen)            echo "${GEN_LIMIT:-360} python3 benchmarks/bench_generate.py --budget-s $(( ${GEN_LIMIT:-360} - 30 )) --out $OUT --sections ${GEN_SECTIONS:-hf_static,kvc_fp8,engine_b,engine_b_nograph} ${GEN_ARGS:-}" ;;
    profile)        echo "${PROF_LIMIT:-200} python3 benchmarks/profile_generate.py ${PROF_ARGS:-}" ;;
    engine_overlap) echo "${EO_LIMIT:-220} python3 -m pytest -s -q -m gpu tests/gpu/test_engine_overlap_gpu.py -p no:cacheprovider" ;;
    engine_profile) echo "${EP_LIMIT:-235} python3 benchmarks/profile_engine.py ${EP_ARGS:-}" ;;   # sync vs async steps, B16/P4096
    engine_sync_bench) echo "${ES_LIMIT:-235} python3 benchmarks/bench_generate.py --budget-s $(( ${ES_LIMIT:-235} - 20 )) --out $OUT --sections ${ES_SECTIONS:-engine_b,engine_b_sync} ${ES_ARGS:-}" ;;
    capacity32k_pe) echo "${CAP_LIMIT:-240} python3 benchmarks/engine_capacity_eviction.py --long --device cuda --layers ${CAP_LAYERS:-1} --kv-heads ${CAP_HEADS:-1} --requests ${CAP_REQ:-24} --new ${CAP_NEW:-512} --cases ${CAP_CASES:-2,3,4,5} --prefill-eviction-chunk ${CAP_CHUNK:-4096} --step-tokens 4224 ${CAP_ARGS:-}" ;;   # evict19f: prompts evicted every 4,096 tokens
    capacity32k)    echo "${CAP_LIMIT:-240} python3 benchmarks/engine_capacity_eviction.py --long --device cuda --layers ${CAP_LAYERS:-1} --kv-heads ${CAP_HEADS:-1} --requests ${CAP_REQ:-24} --new ${CAP_NEW:-512} --cases ${CAP_CASES:-0,2,4,3,5} ${CAP_ARGS:-}" ;;
    *)              echo "" ;;
  esac
}

: > "$OUT/summary.txt"
for name in "$@"; do
  spec=$(job "$name")
  if [ -z "$spec" ]; then echo "$name: unknown job" | tee -a "$OUT/summary.txt"; continue; fi
  limit=${spec%% *}
  cmd=${spec#* }
  left=$(( DEADLINE - ($(date +%s) - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "$name: SKIPPED (deadline)" | tee -a "$OUT/summary.txt"; continue; fi
  t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  case $rc in 0) verdict=PASS ;; 124|137) verdict=TIMEOUT ;; *) verdict="FAIL (exit $rc)" ;; esac
  echo "$name: $verdict in ${secs}s" | tee -a "$OUT/summary.txt"
  grep -v -i "warn" "$OUT/$name.log" | tail -n "${TAIL:-25}"
  echo "-----"
done
cat "$OUT/summary.txt"
