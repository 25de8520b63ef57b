"""The prefill kernels' correctness matrix on the H200 (cases: tests/gpu/prefill_cases.py):

    pytest -q -m gpu tests/gpu/test_prefill_matrix_gpu.py -n 16   # or: gpu_jobs.sh prefill_matrix
    KVC_GPU_FULL=1 pytest ...  # the full matrix: every tile config of every varlen case and
                               # two geometries per paged format

Packed varlen prefill (bf16 / fp16, every candidate tile config of the quick matrix's shapes:
bf16/fp16 error at most 2x torch SDPA's at the same precision, both against the fp32 reference;
FP8 block-scale prefill within FP8_REL_ERR of the reference over the same E4M3 values), chunked
prefill over pages in every storage format and granularity, and bench_prefill.py's
specializations on small inputs (warm_cases). Triton compiles dominate: run it with
pytest-xdist (-n 16 on the H200 host's 16 cores). (Was benchmarks/gpu_check_prefill.py.)
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu import prefill_cases as pc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUICK = os.environ.get("KVC_GPU_FULL") != "1"
CASES = pc.warm_cases() + pc.varlen_cases(QUICK) + pc.paged_cases(QUICK)


def _id(c) -> str:
    what = c.get("fmt", c.get("dt", "fp8")) + (f"/{c['gran']}" if "gran" in c else "")
    warm = "-warm" if c.get("warm") else ""
    return f"{c['kind']}-{what}-D{c['D']}-H{c['hq']}x{c['hkv']}{warm}"


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{_id(c)}" for i, c in enumerate(CASES)])
def test_prefill_case(case):
    r = pc.run_case(case)
    assert r["ok"], (f"{r['status']}: err {r['err']:.3e} > bound {r['bound']:.3e} "
                     f"(sdpa / exact: {r['extra']}), cfg {r['cfg']}")


def test_prefill_runner_catches_a_wrong_output(monkeypatch):
    """Negative case: a kernel that writes a slightly wrong output fails its case."""
    real = pc.L.launch_prefill

    def off_by_a_bit(q, k, v, cu, out, *args, **kw):
        real(q, k, v, cu, out, *args, **kw)
        out.mul_(1.05)

    monkeypatch.setattr(pc.L, "launch_prefill", off_by_a_bit)
    c = dict(kind="varlen", dt="bf16", D=128, hq=8, hkv=2, lens=[300, 17], mask={}, cfg=None)
    assert not pc.run_case(c)["ok"]
