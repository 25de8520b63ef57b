"""The CUDA latent decode kernel's main loop in SASS (kernels/cuda/latent_decode.cuh): registers,
spills and instructions per 64-token tile and warp, by kind (sass_counts.py's groups).

    python benchmarks/latent_sass.py [--keys bf16,e4m3,e4m3:s4,e4m3:s4:w8,bf16:prof,bf16:fm]

A key is pages[:s<stages>][:w<warps>][:<variant>][:prof][:fm][:rs][:mask] (pages bf16 or e4m3,
latent and rotary key alike; variant of latent_sm90.VARIANTS; mask: the build that reads a key
mask and writes H2O's scores, LAT_VAR_MASKED). Needs nvcc and nvdisasm; no GPU. "hot"
leaves out forward-branched blocks of more than 12 instructions without a cp.async (in this
kernel: the O rescale a tile skips when no row's max grew, mla22k).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.sass_counts import GROUPS, cold_ranges, count, main_loop, nvdisasm, parse  # noqa: E402
from kvcompile.kernels import latent_sm90 as ls  # noqa: E402
from kvcompile.kernels.cuda import build  # noqa: E402


def parse_key(spec: str) -> tuple:
    pages, *opts = spec.split(":")
    ck = {"bf16": 3, "e4m3": 0, "e5m2": 1, "fp16": 2}[pages]
    st, w, var = None, 4, 0
    for o in opts:
        if o[:1] == "s" and o[1:].isdigit():
            st = int(o[1:])
        elif o[:1] == "w" and o[1:].isdigit():
            w = int(o[1:])
        elif o == "prof":
            var |= ls.PROF
        elif o == "fm":
            var |= ls.FMERGE
        elif o == "rs":
            var |= ls.RESCALE
        elif o == "mask":
            var |= ls.MASKED
        else:
            var |= ls.variant_bits(o, 0)
    return (ck, ck, 512, 64, 16, 1, st, var, w)


def compile_key(key: tuple) -> tuple[str, str]:
    defines, ctas, _ = ls.kernel_constants(*key)
    wrapper = build._WRAPPER.format(header="latent_decode.cuh", threads=defines["KVC_LW"] * 32,
                                    min_blocks=ctas, name="kvc_latent_decode",
                                    params="LatentParams", call=ls.KERNEL_CALL)
    flags = ["-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-std=c++17",
             f"-I{build._HERE}", "-Xptxas", "-v"] + [f"-D{k}={v}" for k, v in
                                                     sorted(defines.items())]
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = Path(tmp, "k.cu"), Path(tmp, "k.cubin")
        cu.write_text(wrapper)
        res = subprocess.run([build.nvcc_path(), *flags, "-o", str(out), str(cu)],
                             capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise SystemExit(f"nvcc failed for {key}:\n{res.stderr[-3000:]}")
        sass = subprocess.run([nvdisasm(), "-c", str(out)], capture_output=True, text=True,
                              timeout=300, check=True).stdout
    return sass, res.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="bf16,e4m3,e4m3:s4")
    a = ap.parse_args()
    cols = [g for g, _ in GROUPS] + ["other", "total"]
    for spec in a.keys.split(","):
        key = parse_key(spec)
        sass, info = compile_key(key)
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        insns, labels = parse(sass)
        lo, hi = main_loop(insns, labels)
        cold = cold_ranges(insns, labels, lo, hi)
        c = count(insns, lo, hi, cold)
        _, ctas, smem = ls.kernel_constants(*key)
        h = c["hot"]
        print(f"{spec}: regs {regs.group(1) if regs else '?'}, spill "
              f"{spill.group(0) if spill else '?'}, {ctas} CTA/SM, {smem // 1024} KB, kernel "
              f"{len(insns)} insns | loop hot {h['total']} (all {c['all']['total']}, cold "
              f"{[b - a for a, b in cold]}): " + " ".join(f"{g}={h[g]}" for g in cols if h.get(g)))


if __name__ == "__main__":
    main()
