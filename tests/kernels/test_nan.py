"""NaN in K or V reaches the Triton kernels' output as eager attention would: a query that sees
a NaN key outputs NaN (every dim), one that sees a NaN value outputs NaN in that value's dims;
keys no query sees (masked, outside the window, past the sequence) stay inert, and no other
sequence or kv head changes. Every page format, decode and chunked prefill, encoded by the
reference writer (PagedTensor.write), so the NaN is where each format puts it: its own fp8 code,
the fp4 micro-block (16 values) it is in, or, int codes holding no NaN, its int scale group.

Under the interpreter these failed on fp8 and fp4 pages before (kernels/decode_tiles.py,
FP8_SPECIALS: its fp8 upcast reads NaN codes as finite numbers)."""

from __future__ import annotations

import pytest

from tests.kernels.kernel_cases import nan_decode_case, nan_prefill_case

# the interpreter's numpy warns on the NaN it computes with
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")
FP = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
DECODE_FORMATS = ([(n, "page", False) for n in ("bf16", "fp16", "fp32")]
                  + [(n, g, False) for n in FP for g in ("page", "token", "tensor", "channel")]
                  # int codes kept NaN before too (a NaN scale); int3 / int2 take ~10 s a case
                  # under the interpreter: in the slow run
                  + [("int4", "page", False), ("int4", "channel", True), ("fp8_e4m3", "page", True)]
                  + [pytest.param(n, g, False, marks=pytest.mark.slow)
                     for n, g in (("int3", "token"), ("int2", "page"))])
PREFILL_FORMATS = [("fp32", "page"), ("fp16", "page")] + [(n, g) for n in FP
                                                          for g in ("page", "token", "tensor")]


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name,gran,residual", DECODE_FORMATS,
                         ids=lambda v: str(v) if not isinstance(v, bool) else f"res{int(v)}")
def test_decode_nan_reaches_the_queries_that_see_it(name, gran, residual, which):
    """Then hidden from the query by a window, and by the key mask."""
    nan_decode_case(name, gran, residual, which)


@pytest.mark.parametrize("which", ["k", "v"])
def test_decode_nan_survives_the_split_combine(which):
    """Three splits: the split holding the NaN key gives a NaN lse, and the combine kernel keeps
    it NaN (it used to take the NaN total for "no key seen" and write 0)."""
    nan_decode_case("fp8_e4m3", "page", False, which, splits=3)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name,gran", PREFILL_FORMATS)
def test_paged_prefill_nan_reaches_the_queries_that_see_it(name, gran, which):
    """Chunks of 12 and 33 queries; the NaN at sequence 0's token 31, inside its chunk (seen by
    the queries from 31 on only), then behind a sliding window that hides it from all."""
    nan_prefill_case(name, gran, which)
