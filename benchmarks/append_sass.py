"""The append kernels' sm_90 builds, read on a machine without a GPU: registers, stack (spills),
shared memory, SASS instruction count (static, both sides of every branch) and the global
load / store widths, per kernel variant at the bench shape (D 128, page 16, bf16 input).

    python benchmarks/append_sass.py

A proxy for the GPU timing (benchmarks/bench_append.py), not a substitute: it tells a kernel
that spills or loads 2 bytes at a time from one that does not. Needs Triton's NVIDIA backend
(ptxas, cuobjdump and nvdisasm ship with it); TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvcompile.kernels import append as A  # noqa: E402

TYPES = dict(X="*bf16", SLOTS="*i64", SORTED="*i64", ORDER="*i64", DATA="*u8", SCALE="*fp32",
             MICRO="*u8", AMAX="*fp32", T="i32", H="i32", N="i32")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def build(fn, consts: dict, warps: int) -> dict:
    sig = {n: "constexpr" if n in consts else TYPES[n] for n in fn.arg_names}
    # pointers 16-byte aligned, as the JIT specializes torch's allocations
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", res)
    ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(
        re.sub(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split(" ")[0].rstrip(";")
        for ln in ins)
    mem = " ".join(f"{k2}:{v}" for k2, v in sorted(ops.items())
                   if k2.startswith(("LDG", "STG")))
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), smem=k.metadata.shared,
                sass=len(ins), shfl=sum(v for k2, v in ops.items() if k2.startswith("SHFL")),
                mem=mem)


def cases():
    for code, name, dt, fmax, div in ((A.FMT_E4M3, "fp8_e4m3", tl.float8e4nv, 448.0, 448.0),
                                      (A.FMT_E2M1, "fp4_e2m1", tl.float8e4nv, 6.0, 6.0 * 448.0)):
        base = dict(D=128, P=16, FMT=code, EXPLICIT=False, FMAX=fmax, DIV=div, RECIP=True)
        rows = A.ROW_TILE_ELEMS // 128
        pairs = (True, False) if code == A.FMT_E2M1 else (True,)
        for p in pairs:
            tag = "" if p else ", split loads (old)"
            yield (f"{name} token, rows kernel{tag}", A._append_rows_kernel,
                   dict(base, R=rows, SM=3, PAIRS=p), 4)
            yield (f"{name} page, runs kernel{tag}", A._append_pages_kernel,
                   dict(base, R=16, DATA_DT=dt, WIN=16, PAIRS=p), 4)
        yield (f"{name} page, windows kernel", A._append_pages_bulk_kernel,
               dict(base, R=16, W=A.BULK_TILE_ELEMS // 128, DATA_DT=dt, GROUPED=True), 8)
        W = A.PAGE_TILE_ELEMS // 128
        for part, tag in ((0, ""), (1, ", split: full pages"), (2, ", split: other runs")):
            yield (f"{name} page, tiles kernel ({W} x 128){tag}", A._append_pages_tiles_kernel,
                   dict(base, R=16, W=W, DATA_DT=dt, GROUPED=True, PART=part,
                        SPEC=A.PAGE_TILE_SPEC),
                   A.PAGE_TILE_WARPS[code == A.FMT_E2M1])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":   # kernels imported as interpreted ones
        print("append_sass.py compiles for sm_90: run it without TRITON_INTERPRET=1")
        return 2
    print(f"triton {triton.__version__}, sm_90 builds (D 128, page 16, bf16 input)\n")
    print("| kernel | warps | registers | stack B | shared B | SASS instrs | SHFL | "
          "global loads / stores |")
    print("|---|---|---|---|---|---|---|---|")
    for label, fn, consts, warps in cases():
        r = build(fn, consts, warps)
        print(f"| {label} | {warps} | {r['regs']} | {r['stack']} | {r['smem']} | {r['sass']} | "
              f"{r['shfl']} | {r['mem']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
