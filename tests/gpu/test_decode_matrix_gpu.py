"""The decode kernel's correctness matrix on the H200 (cases: tests/gpu/decode_cases.py):

    pytest -q -m gpu tests/gpu/test_decode_matrix_gpu.py -n 16   # or: gpu_jobs.sh decode_matrix
    pytest ... -k donly          # only the decode-only formats (int codes, channel scales,
                                 # residual pages, K and V in different formats)
    KVC_GPU_FULL=1 pytest ...    # the full matrix: two geometries per format and head_dim

Every storage format and granularity x head_dim x GQA x page size x Sq against the fp32
reference, masks, the attention mass, split counts, mixed K / V formats, residual pages, and
every tile variant bench_decode.py may pick. Almost every case is its own Triton
specialization, so compiles dominate: 114 cases (quick) or 180, about 3-11 s of compile each
on one core; run it with pytest-xdist (-n 16 on the H200 host's 16 cores).
(Was benchmarks/gpu_check_decode.py.)
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu import decode_cases as dc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUICK = os.environ.get("KVC_GPU_FULL") != "1"
CASES = dc.decode_cases(QUICK) + dc.config_cases()


def _id(i: int, c: dict) -> str:
    k = (c["kf"], c["gran"])
    v = (c["vf"], c.get("vgran", c["gran"]))
    donly = k in dc.DECODE_ONLY or v in dc.DECODE_ONLY or c.get("residual")
    kv = f"{k[0]}.{k[1]}" + ("" if v == k else f"+{v[0]}.{v[1]}")
    return (f"{i}-{kv}-D{c['D']}-G{c['G']}-P{c['P']}-Sq{c['Sq']}"
            + ("-cfg" if "config" in c else "") + ("-donly" if donly else ""))


@pytest.mark.parametrize("case", CASES, ids=[_id(i, c) for i, c in enumerate(CASES)])
def test_decode_case(case):
    dc.check_decode(case, torch.Generator().manual_seed(1000 + CASES.index(case)))


def test_decode_check_catches_a_wrong_output(monkeypatch):
    """Negative case: a kernel whose output is off by 5% fails the case's bound."""
    import tests.kernels.kernel_cases as kc

    real = kc.launch_decode

    def off_by_a_bit(*args, **kw):
        real(*args, **kw)
        args[11].mul_(1.05)  # out

    monkeypatch.setattr(kc, "launch_decode", off_by_a_bit)
    c = dict(kf="bf16", vf="bf16", gran="page", D=128, G=4, P=16, Sq=1, lens=[300, 17])
    with pytest.raises(AssertionError, match="err"):
        dc.check_decode(c, torch.Generator().manual_seed(0))
