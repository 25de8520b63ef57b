#!/bin/bash
# Device calls of the thirty-eighth session: several parts a call (PARTS="u t"), each part's
# output under $OUT; ends with the GPU's name and versions.
#   u: tests/gpu/test_skinny_gpu.py (the Triton GEMM kernel at a step's shapes; "auto"'s real
#      timings, its choice replayed by a CUDA graph, a shape first met in a capture)
#   t: rows at B x P (default 16 x 4096), fp8 pages, a process a row, the step's GEMMs by
#      KVConfig.decode_gemms = each of T_GEMMS (default "torch auto"); the auto row's kernel
#      notes (each shape's choice and times) follow its line
#   e3: the MLA Engine row (fp8 latent, B16 x P8192 by default) with the packed split on
#      (--packed-split) and off (the default now)
#   h: one call on an H200 (~500 s): u, t (torch / auto), fp8 rows at B1 x P32768 and
#      B64 x P2048, e3 at B16 x P4096
#   other parts: session37_call.sh's (g, k, s, e2; and through it session36_call.sh's b, p, ...)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvc_out}; mkdir -p "$OUT"
for part in ${PARTS:-u}; do
  echo "== part $part =="
  case $part in
    u)
      timeout -k 5 ${U_LIMIT:-200} python3 -m pytest -q -m gpu tests/gpu/test_skinny_gpu.py \
        2>&1 | tail -4 | tee "$OUT/u_tests.txt" ;;
    t)
      for g in ${T_GEMMS:-torch auto}; do
        KVCOMPILE_DECODE_GEMMS=$g B=${B:-16} P=${P:-4096} N=${N:-64} \
          ROW_LIMIT=${ROW_LIMIT:-110} OUT=$OUT/t_$g bash benchmarks/e2e_kv_rows.sh \
          "${T_ROWS:-kvc_fp8:auto}" 2>&1 | tail -2
        python3 - "$OUT/t_$g" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*/bench_generate.json"):
    for k, r in json.load(open(f))["results"].items():
        if isinstance(r, dict):
            for n in r.get("kernel_notes", []):
                if "decode GEMMs" in n:
                    print("   ", n)
PY
      done ;;
    h)    # one call's worth on an H200 (~500 s): u, t (torch / auto), then the fp8 rows at
          # B1 x P32768 and B64 x P2048 (the 60% roofline there), then the MLA A/B at P4096
      PARTS="u t" T_GEMMS="torch auto" OUT=$OUT bash "$0" | grep -vE "^NVIDIA|^[0-9]+\.[0-9]+"
      for bp in "1 32768" "64 2048"; do
        set -- $bp
        KVCOMPILE_DEVICE_LOOP=1 B=$1 P=$2 N=64 ROW_LIMIT=90 OUT=$OUT/h_${1}x$2 \
          bash benchmarks/e2e_kv_rows.sh "kvc_fp8:auto" 2>&1 | tail -1
      done
      PARTS=e3 B=16 P=4096 E_LIMIT=90 OUT=$OUT bash "$0" | grep -vE "^NVIDIA|^[0-9]+\.[0-9]+" ;;
    e3)   # the MLA Engine row with the packed split (opt-in since this session) and without
      for x in "--packed-split" ""; do
        timeout -k 5 ${E_LIMIT:-200} python3 benchmarks/bench_latent_generate.py \
          --batch ${B:-16} --prompt ${P:-8192} --new 16 --repeats 2 --rows engine_fp8_e4m3 \
          $x 2>&1 | grep -E "^\| engine|^# engine" | tee -a "$OUT/e3_rows.txt"
      done ;;
    *)
      PARTS=$part OUT=$OUT bash benchmarks/session37_call.sh | grep -v "^== part" \
        | grep -vE "^NVIDIA|^[0-9]+\.[0-9]+\.[0-9]+" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
