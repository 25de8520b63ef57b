"""NaN in K / V on the GPU: the decode and chunked-prefill kernels put NaN in the output exactly
where eager attention over the stored values does, for every page format (the CPU runs the same
cases under the Triton interpreter: tests/kernels/test_nan.py).

    python benchmarks/gpu_check_nan.py          # prints a PASS / FAIL table; exit 1 on a FAIL

Under the interpreter the kernels correct its fp8 upcast, which reads NaN codes as finite
numbers (kernels/decode_tiles.py, FP8_SPECIALS); on the GPU nothing is corrected: this checks
that the hardware conversions (cvt e4m3x2 -> f16x2, the e5m2 byte shift, the fp4 asm widening)
keep NaN.
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from tests.kernels.kernel_cases import nan_decode_case, nan_prefill_case  # noqa: E402

FP = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
DECODE = ([(n, "page", False) for n in ("bf16", "fp16", "fp32")]
          + [(n, g, False) for n in FP for g in ("page", "token", "tensor", "channel")]
          + [(n, g, False) for n in ("int4", "int3", "int2") for g in ("page", "token", "channel")]
          + [("int4", "channel", True), ("fp8_e4m3", "page", True), ("fp4_e2m1", "page", True)])
PREFILL = [("bf16", "page"), ("fp16", "page"), ("fp32", "page")] + [
    (n, g) for n in FP for g in ("page", "token", "tensor")]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    kinds = sys.argv[1:] or ["decode", "prefill"]   # e.g. `gpu_check_nan.py prefill`
    rows, failed = [], 0
    cases = [("decode", c, w) for c in DECODE for w in "kv" if "decode" in kinds] + [
        ("prefill", c, w) for c in PREFILL for w in "kv" if "prefill" in kinds]
    for kind, case, which in cases:
        for q_dtype in (torch.float16, torch.bfloat16):
            t0 = time.perf_counter()
            try:
                if kind == "decode":
                    nan_decode_case(*case, which, device="cuda", q_dtype=q_dtype)
                else:
                    nan_prefill_case(*case, which, device="cuda", q_dtype=q_dtype)
                status = "PASS"
            except Exception as e:  # noqa: BLE001  (reported per case)
                status, failed = f"FAIL {type(e).__name__}: {str(e)[:120]}", failed + 1
            name = "/".join(str(x) for x in case)
            rows.append(f"| {kind} | {name} | {which} | {str(q_dtype)[6:]} | "
                        f"{time.perf_counter() - t0:.1f} s | {status} |")
            print(rows[-1], flush=True)   # progress (a run cut by its time limit says where)
    print("| kernel | format | NaN in | q | time | result |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(rows) - failed} PASS, {failed} FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
