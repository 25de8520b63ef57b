#!/bin/bash
# Device calls of the thirty-seventh session (and the next's): several parts a call
# (PARTS="g t"), each part's output under $OUT; ends with the GPU's name and versions.
#   g: bench_skinny_gemm.py --m 1 16 --sweep: a decode step's weight GEMMs, cuBLAS against
#      kernels/skinny.py (the H200 is the open question: cuBLAS streamed ~65% of copy there)
#   t: rows at B x P (default 16 x 4096), fp8 pages, a process a row: the step's GEMMs by
#      cuBLAS (KVConfig.decode_gemms="torch", the default) and by kernels/skinny.py ("triton")
#   k: issue 14 / 16's B16 x P32768 rows (HF static + inductor needs more than 78 GiB: an
#      H200), a process a row, up to 170 s each: two a call, HF static and fp8 pages by
#      default, then K_ROWS="kvc_bf16:auto kvc_int4:auto" (the same machine: ratios hold)
#   e2: the MLA Engine row (fp8 latent pages, B16 x P8192, 2,048-token chunks) with the
#      step split (default) and with every chunk folded (--expand-min 1000000): its A/B
#   s: every kernel of a B16 x P4096 fp8 decode step (profile_generate.py --steps): names,
#      launches and ms a step, the list to fuse from (~177 kernels a step, 33rd session)
#   other parts: session36_call.sh's (b, p, m, e, ...)
# The next session's order, on an H200: g, then t; then b (the 60% roofline: B16 x P4096,
# B64 x P2048, B1 x P32768) and k.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
for part in ${PARTS:-g}; do
  echo "== part $part =="
  case $part in
    g)
      timeout -k 5 ${G_LIMIT:-240} python3 benchmarks/bench_skinny_gemm.py --m 1 16 \
        ${G_ARGS:---sweep} --json "$OUT/g_gemms.json" 2>&1 | grep -vE "^\{" \
        | tee "$OUT/g_gemms.txt" | tail -24 ;;
    t)
      for g in torch triton; do
        KVCOMPILE_DECODE_GEMMS=$g B=${B:-16} P=${P:-4096} N=${N:-64} \
          ROW_LIMIT=${ROW_LIMIT:-110} OUT=$OUT/t_$g bash benchmarks/e2e_kv_rows.sh \
          "${T_ROWS:-kvc_fp8:auto}" 2>&1 | tail -2
      done ;;
    k)
      B=16 P=32768 N=64 ROW_LIMIT=${ROW_LIMIT:-170} OUT=$OUT/k bash benchmarks/e2e_kv_rows.sh \
        "${K_ROWS:-hf_static:auto kvc_fp8:auto}" 2>&1 ;;
    s)
      timeout -k 5 ${S_LIMIT:-200} python3 benchmarks/profile_generate.py --paths fp8 --steps \
        --new 16 2>&1 | tee "$OUT/s_profile.txt" | grep -A200 "every kernel" | head -80 ;;
    e2)
      for x in 0 1000000; do
        timeout -k 5 ${E_LIMIT:-200} python3 benchmarks/bench_latent_generate.py \
          --batch ${B:-16} --prompt ${P:-8192} --new 16 --repeats 2 --rows engine_fp8_e4m3 \
          --expand-min $x 2>&1 | grep -E "^\| engine|^# engine" | tee -a "$OUT/e2_rows.txt"
      done ;;
    *)
      PART=$part OUT=$OUT bash benchmarks/session36_call.sh ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
