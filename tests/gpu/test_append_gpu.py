"""The append kernel (kernels/append.py quantize_append) on the H200: bit-exact with
PagedTensor.write for every format it writes, granularity and head_dim, decode-style and bulk
appends, with the hardware casts (cases: tests/gpu/decode_cases.py):

    pytest -q -m gpu tests/gpu/test_append_gpu.py -n 16     # or: gpu_jobs.sh append_matrix
    KVC_GPU_FULL=1 pytest ...    # pages of 16 and 64 (quick: 16)

(Was the append half of benchmarks/gpu_check_decode.py.)
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu import decode_cases as dc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = dc.append_cases(os.environ.get("KVC_GPU_FULL") != "1")


@pytest.mark.parametrize("case", CASES, ids=[
    f"{i}-{c['name']}.{c['gran']}-D{c['D']}-P{c['P']}" + ("-bulk" if c.get("bulk") else "")
    for i, c in enumerate(CASES)])
def test_append_case(case):
    dc.check_append(case, torch.Generator().manual_seed(2000 + CASES.index(case)))


def test_append_check_catches_a_changed_byte(monkeypatch):
    """Negative case: an append that leaves one stored byte different fails the comparison."""
    import kvcompile.kernels.append as ap

    real = ap.quantize_append

    def one_byte_off(cache, slots, x):
        real(cache, slots, x)
        cache.data.view(torch.uint8).view(-1)[0] ^= 1

    monkeypatch.setattr(ap, "quantize_append", one_byte_off)
    c = dict(name="fp8_e4m3", gran="page", D=128, P=16)
    with pytest.raises(AssertionError):
        dc.check_append(c, torch.Generator().manual_seed(0))
