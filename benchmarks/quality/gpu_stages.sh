#!/bin/bash
# The quality harness's device stages (benchmarks/quality/quality.py on CUDA, fp32 weights as the
# CPU rows): issue 7's eviction-quality runs (benchmarks/RESULTS.md, "Against the targets
# (issue 7)"). Run through the device runner: gpu_jobs.sh jobs quality_canary and quality.
#   passkey   7.5k-token prompts x 5 depths, the rows of the 1k-4k runs (+ H2O@50), and the 1k
#             prompts again (same keys as the CPU run: a check that CUDA gives the CPU's answers)
#   stream    the whole Lee corpus (~75k tokens): SinkWindow(4, 1020) (sinks re-rotated, and at
#             their original positions), window-only SinkWindow(0, 1024), one process per row;
#             full-attention baselines (2048-token windows; sliding 1024-token window, strides
#             256 and 64)
#   ruler     RULER-like multi-key needle and variable tracking at 2k and 4k, 5 prompts each
# All stages run at once (the work is host-bound: one process per stage, 6 of the 16 cores),
# each under its own `timeout` (whole script: at most ~235 s); results:
# $OUT/quality_results_h200.json (suites <suite>_h200), logs $OUT/<stage>.log. A stage stopped
# by its deadline keeps what it saved: the streaming rows save every 1,024 tokens, and the
# report compares rows on a common prefix.
#
# SmolLM2's GGUF (94 MiB) is larger than one device call carries (64 MiB): it travels in two
# halves, in two calls to the same machine, which stays warm for 30 s after a call:
#   here, once:     bash benchmarks/quality/gpu_stages.sh pack   # -> .kvc_gpu_a/ .kvc_gpu_b/
#                   (git-ignored)
#   device call 1:  carry [".kvc_gpu_a"]  command: bash benchmarks/gpu_jobs.sh quality_canary
#                   (about 2 min: random model of SmolLM2's layout, CUDA vs CPU, time per step;
#                   its per-row "s for the Lee corpus" line says whether STREAM_PARTS is needed)
#   device call 2:  at once after call 1 (same kind), carry [".kvc_gpu_b"]
#                   command: bash benchmarks/gpu_jobs.sh quality          (about 4 min)
#   here:           python benchmarks/quality/quality_report.py \
#                       --merge-from <files_at>/quality_results_h200.json --only _h200
# If call 2 lands on a fresh machine it stops at once ("part A is missing"): repeat both calls.
# `gpu_stages.sh cap` (job quality_cap) in call 2 instead runs issue 19's capacity settings only:
# SnapKV-w8-shared at 50% over fp8 pages and the 4-bit format (CAP_KV), passkey at 7.5k (5 depths,
# the full cache beside it) and the multi-key needle at 2k / 4k; suites <suite>_h200_<format>.
#
# Env: OUT (default /tmp/kvc_out), TAG (_h200), STREAM_S (220) and STAGE_S (200) deadlines in
# seconds, PYTHON (python3), STREAM_PARTS=K (fallback if the canary's time per step says one
# row cannot stream the corpus by STREAM_S: K processes stream K parts of it, each after a
# 2,048-token warm-up; see quality.py suite_stream). SMOKE=1: tiny sizes on the CPU, one stage
# at a time (checks this script's commands; not a measurement).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/kvc_out}
TAG=${TAG:-_h200}
PY=${PYTHON:-python3}
MODE=${1:-run}
A=.kvc_gpu_a
B=.kvc_gpu_b
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
say() { echo "[$(date +%H:%M:%S) +$((SECONDS - t0))s] $*"; }

if [ "$MODE" = pack ]; then
  for d in $A $B; do
    git check-ignore -q "$d/x" || { echo "$d is not git-ignored: add /$d/ to .git/info/exclude" \
      "first (else it travels with every device call and breaks the 64 MiB limit)"; exit 2; }
  done
  gguf=$($PY -c "from kvcompile.models import smollm2_path; print(smollm2_path())") || exit 2
  lee=$($PY -c "import sys; sys.path.insert(0, 'benchmarks/quality')
from quality_data import lee_corpus_path; print(lee_corpus_path())") || exit 2
  ver=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))") || exit 2
  rm -rf $A $B && mkdir -p $A $B
  size=$(stat -c %s "$gguf")
  half=$((size / 2))
  head -c $half "$gguf" > $A/gguf.part1
  tail -c +$((half + 1)) "$gguf" > $B/gguf.part2
  sha256sum < "$gguf" | cut -d' ' -f1 | tee $A/gguf.sha256 > $B/gguf.sha256
  cp "$lee" $A/lee_background.cor
  $PY -m pip download -q --no-deps --only-binary=:all: -d $A "gguf==$ver" || exit 2
  du -sh $A $B
  exit 0
fi

if [ "$MODE" = canary ]; then
  # no model needed: checks the CUDA paths of the harness and fills Triton's cache for call 2
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda',
torch.cuda.is_available(), '| transformers', transformers.__version__, '| triton',
triton.__version__)"
  ls -la $A 2>/dev/null | tail -n +2
  timeout -k 5 "${CANARY_S:-300}" $PY benchmarks/quality/quality.py --canary --device \
    "${DEVICE:-cuda}" --threads 8 2>&1 | grep -v -i "warn" | tee "$OUT/canary.log"
  exit "${PIPESTATUS[0]}"
fi

[ "$MODE" = run ] || [ "$MODE" = cap ] || { echo "usage: $0 [pack|canary|run|cap]"; exit 2; }

# --- model and corpus: part A (call 1) + part B (this call) ---------------------------------
if [ ! -f $A/gguf.part1 ] || [ ! -f $B/gguf.part2 ]; then
  say "part A is missing ($A from device call 1; ls: $(ls -d $A $B 2>&1 | tr '\n' ' ')):" \
    "this machine is a fresh one; repeat call 1 (carry $A) and this call right after it"
  exit 3
fi
MODEL_DIR=${MODEL_DIR:-/tmp/kvc_model}
mkdir -p "$MODEL_DIR"
cat $A/gguf.part1 $B/gguf.part2 > "$MODEL_DIR/$GGUF_NAME"
[ "$(sha256sum < "$MODEL_DIR/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat $B/gguf.sha256)" ] || {
  say "the reassembled GGUF does not match its sha256 (parts from different packs?)"; exit 3; }
if ! $PY -c "import gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvc_site $A/gguf-*.whl \
    || exit 3
  export PYTHONPATH="$PYTHONPATH:/tmp/kvc_site"
fi
export KVCOMPILE_SMOLLM2_GGUF="$MODEL_DIR/$GGUF_NAME" KVCOMPILE_LEE_CORPUS="$ROOT/$A/lee_background.cor"

RES="$OUT/quality_results${TAG}.json"
DEV=cuda
STREAM_TOKENS=1000000000
PK_LENGTHS=1024,2048,4096,7680       # the CPU run's keys for 1k-4k; 7680 draws the next five
PK_DEPTHS=0.1,0.3,0.5,0.7,0.9
RU_LENGTHS=2048,4096
RU_SAMPLES=5
SERIAL=0
if [ "${SMOKE:-0}" = 1 ]; then       # CPU, tiny: only that every command runs
  DEV=cpu STREAM_TOKENS=1152 PK_LENGTHS=256,384,512,640 PK_DEPTHS=0.5 RU_LENGTHS=256,384
  RU_SAMPLES=1 SERIAL=1
fi
# the passkey rows of the 1k-4k runs (full, SinkWindow/SnapKV/SnapKV-shared at 50%, the new
# default SnapKV-w8-shared and TOVA-like at 25/50/75%), plus H2O at 50%
PK_ROWS=SinkWindow@50,H2O@50,SnapKV@50,SnapKV-shared@50,SnapKV-w8-shared,TOVA-like
RU_ROWS=SinkWindow,H2O,SnapKV,SnapKV-shared,SnapKV-w8-shared,TOVA-like    # all at 50%
skip_but() {  # the lengths of $1 other than $2, comma-separated
  echo "$1" | tr ',' '\n' | grep -vx "$2" | paste -sd, -
}
PK_FIRST=${PK_LENGTHS%%,*}
PK_LAST=${PK_LENGTHS##*,}
rm -f "$RES" "$RES.tmp"
say "$($PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| cuda', torch.cuda.is_available())")"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null

declare -A PIDS LIMITS RCS
LOGS=/tmp/kvc_logs
rm -rf $LOGS && mkdir -p $LOGS
logof() { case $1 in stream_part*) echo "$LOGS/$1.log" ;; *) echo "$OUT/$1.log" ;; esac; }
stage() {  # stage NAME DEADLINE ARGS...: one harness process, its log in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" $PY benchmarks/quality/quality.py --device $DEV --threads 1 --tag "$TAG" \
    --results "$RES" "$@" > "$(logof "$name")" 2>&1 &
  PIDS[$name]=$!
  LIMITS[$name]=$limit
  say "started $name (deadline ${limit}s): $*"
  if [ $SERIAL = 1 ]; then wait "${PIDS[$name]}"; RCS[$name]=$?; say "$name exit ${RCS[$name]}"; fi
}
STREAM_S=${STREAM_S:-220}
STAGE_S=${STAGE_S:-200}
STREAM_PARTS=${STREAM_PARTS:-0}
if [ "$MODE" = cap ]; then
  rows=""
  # issue 19's capacity settings (SnapKV-w8-shared at 50% over fp8 pages and the 4-bit format),
  # the prompts the CPU could not afford: passkey at the last length (5 depths, the full cache
  # beside it), and the multi-key needle at the ruler lengths. One process per format and suite.
  for kv in ${CAP_KV:-fp8_e4m3 int4-kc-vt-p64-rot}; do
    stage "cap_passkey_$kv" "$STAGE_S" --suite passkey --kv "$kv" --lengths $PK_LENGTHS \
      --depths $PK_DEPTHS --skip-lengths "$(skip_but $PK_LENGTHS "$PK_LAST")" \
      --rows SnapKV-w8-shared --ratios 0.5 --tag "${TAG}_$kv" --kv-gib 4
    stage "cap_ruler_$kv" "$STAGE_S" --suite ruler --kv "$kv" --ruler-lengths $RU_LENGTHS \
      --ruler-samples $RU_SAMPLES --ruler-tasks multikey --rows SnapKV-w8-shared --ratios 0.5 \
      --tag "${TAG}_$kv" --kv-gib 4
  done
elif [ "$STREAM_PARTS" -gt 1 ]; then
  # fallback when one row's stream cannot finish in time: K processes stream K parts of the
  # corpus (sinks and window-only together), each after a 2,048-token unscored warm-up, plus
  # the continuous sink row as far as it gets (the check of the parts on a common prefix)
  for ((k = 0; k < STREAM_PARTS; k++)); do
    stage "stream_part$k" "$STREAM_S" --suite stream --stream-rows sink,window \
      --stream-segment "$k/$STREAM_PARTS" --no-stream-baselines --stream-tokens $STREAM_TOKENS \
      --kv-gib 1
  done
  rows="sink"
else
  rows="sink window sink-orig"
fi
for row in $rows; do
  stage "stream_$row" "$STREAM_S" --suite stream --stream-rows $row --no-stream-baselines \
    --stream-tokens $STREAM_TOKENS --kv-gib 1
done
if [ "$MODE" = run ]; then
stage passkey "$STAGE_S" --suite passkey --lengths $PK_LENGTHS --depths $PK_DEPTHS \
  --skip-lengths "$(skip_but $PK_LENGTHS "$PK_LAST")" --rows $PK_ROWS --ratios 0.25,0.5,0.75
stage ruler "$STAGE_S" --suite ruler --ruler-lengths $RU_LENGTHS --ruler-samples $RU_SAMPLES \
  --rows $RU_ROWS --kv-gib 4
stage baselines_pk1k "$STAGE_S" --suite stream,passkey --stream-rows none \
  --stream-tokens $STREAM_TOKENS --slide-stride 256,64 --lengths $PK_LENGTHS \
  --depths $PK_DEPTHS --skip-lengths "$(skip_but $PK_LENGTHS "$PK_FIRST")" --rows $PK_ROWS \
  --ratios 0.25,0.5,0.75 --kv-gib 4
fi

# progress: every 20 s, each running stage's last harness line
shown=$SECONDS
while :; do
  running=()
  for name in "${!PIDS[@]}"; do kill -0 "${PIDS[$name]}" 2>/dev/null && running+=("$name"); done
  [ ${#running[@]} = 0 ] && break
  sleep 2
  if [ $((SECONDS - shown)) -ge 20 ]; then
    shown=$SECONDS
    say "${#running[@]} stage(s) running"
    for name in "${running[@]}"; do
      printf '    %-16s %s\n' "$name" "$(grep -a '^\[' "$(logof "$name")" | tail -1 | cut -c1-150)"
    done
  fi
done
status=0
for name in "${!PIDS[@]}"; do
  if [ -n "${RCS[$name]:-}" ]; then rc=${RCS[$name]}; else wait "${PIDS[$name]}"; rc=$?; fi
  note=""
  [ $rc = 124 ] || [ $rc = 137 ] && note=" (stopped at its ${LIMITS[$name]}s deadline; what it saved is kept)"
  [ $rc != 0 ] && [ -z "$note" ] && status=1
  say "$name exit $rc$note"
  [ $rc != 0 ] && [ -z "$note" ] && grep -a -v -i "warn" "$(logof "$name")" | tail -15
done
for f in "$LOGS"/stream_part*.log; do
  [ -f "$f" ] && { echo "=== $(basename "$f")"; cat "$f"; } >> "$OUT/stream_parts.log"
done
rm -f "$RES.tmp"
say "results: $RES"
[ -f "$RES" ] && $PY benchmarks/quality/quality_report.py --results "$RES" --no-plot
exit $status
