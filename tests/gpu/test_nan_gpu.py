"""NaN in K / V on the GPU: the decode and chunked-prefill kernels put NaN in the output exactly
where eager attention over the stored values does, for every page format. The CPU runs the same
cases under the Triton interpreter (tests/kernels/test_nan.py); on the H200:

    pytest -q -m gpu tests/gpu/test_nan_gpu.py          # or: bash benchmarks/gpu_jobs.sh nan

Under the interpreter the kernels correct its fp8 upcast, which reads NaN codes as finite
numbers (kernels/decode_tiles.py, FP8_SPECIALS); on the GPU nothing is corrected: this checks
that the hardware conversions (cvt e4m3x2 -> f16x2, the e5m2 byte shift, the fp4 asm widening)
keep NaN. (Was benchmarks/gpu_check_nan.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import nan_decode_case, nan_prefill_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
DECODE = ([(n, "page", False) for n in ("bf16", "fp16", "fp32")]
          + [(n, g, False) for n in FP for g in ("page", "token", "tensor", "channel")]
          + [(n, g, False) for n in ("int4", "int3", "int2") for g in ("page", "token", "channel")]
          + [("int4", "channel", True), ("fp8_e4m3", "page", True), ("fp4_e2m1", "page", True)])
PREFILL = [("bf16", "page"), ("fp16", "page"), ("fp32", "page")] + [
    (n, g) for n in FP for g in ("page", "token", "tensor")]
Q_DTYPES = [torch.float16, torch.bfloat16]


def _id(case) -> str:
    return "/".join(str(x) for x in case)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("case", DECODE, ids=_id)
def test_decode_keeps_nan(case, which, q_dtype):
    nan_decode_case(*case, which, device="cuda", q_dtype=q_dtype)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("case", PREFILL, ids=_id)
def test_prefill_keeps_nan(case, which, q_dtype):
    nan_prefill_case(*case, which, device="cuda", q_dtype=q_dtype)
