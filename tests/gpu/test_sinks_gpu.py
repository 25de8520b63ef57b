"""Attention sinks (sink_logits [Hq]) in the compiled Triton kernels, on the H200:

    pytest -q -m gpu tests/gpu/test_sinks_gpu.py        # or: bash benchmarks/gpu_jobs.sh sinks

The paged decode kernel (one split: the direct epilogue; several: the combine) and the chunked
prefill kernel, bf16 / fp16 / fp8 pages, against the fp32 references of kernels/reference.py
on fresh random inputs, outputs poisoned with NaN; the CPU tests (tests/kernels/
test_sink_logits.py) run the same kernels under the interpreter in fp32 only. Also: the CUDA
decode kernel declines sinks (fast_path_reason). (Was benchmarks/gpu_check_sinks.py.)
"""

from __future__ import annotations

import pytest
import torch

from kvcompile.kernels import prefill_launch as L
from kvcompile.kernels.decode import fast_path_reason
from kvcompile.kernels.reference import paged_prefill_attention_ref
from kvcompile.testing import REL_ERR, poison_, rel_err
from tests.kernels.kernel_cases import make_format, make_paged_kv, run_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DECODE = [  # format, granularity, head_dim, G, page, Sq, splits, lens
    ("bf16", "page", 128, 4, 16, 1, 1, [300, 17]),
    ("bf16", "page", 128, 8, 32, 3, 0, [4000, 129, 1]),
    ("fp16", "page", 64, 4, 16, 1, 7, [1000, 33]),
    ("fp8_e4m3", "page", 128, 4, 16, 1, 0, [2048, 70]),
    ("fp8_e4m3", "token", 128, 8, 64, 2, 1, [511]),
]
PREFILL = [  # format, head_dim, G, page, lens, q_lens, q dtype
    ("bf16", 128, 4, 16, [300, 77], [300, 20], torch.bfloat16),
    ("fp16", 64, 8, 32, [129, 64], [64, 64], torch.float16),
    ("fp8_e4m3", 128, 4, 16, [256, 40], [100, 40], torch.bfloat16),
]


def _decode(fmt, gran, D, G, P, Sq, splits, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    Hkv = 2
    sinks = (torch.randn(Hkv * G, generator=gen) * 2).cuda()
    f = make_format(fmt, gran)
    err, bound, _, (mass, mass_ref) = run_case(
        f, f, lens, Hkv, G, D, P, Sq=Sq, splits=splits, with_mass=True, device="cuda",
        gen=gen, q_dtype=torch.bfloat16, sink_logits=sinks)
    return err, max(bound, REL_ERR[torch.bfloat16]), rel_err(mass, mass_ref)


@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"{c[0]}-{c[1]}-D{c[2]}-G{c[3]}-P{c[4]}-"
                         f"Sq{c[5]}-splits{c[6]}")
def test_decode_sinks(case):
    err, bound, mass_err = _decode(*case, seed=DECODE.index(case))
    assert err <= bound, f"rel err {err:.2e} > {bound:.1e}"
    assert mass_err <= 1e-3, f"attention mass rel err {mass_err:.1e} > 1e-3"


def _prefill(fmt, D, G, P, lens, q_lens, dtype, seed, ref_sinks=True):
    gen = torch.Generator().manual_seed(seed)
    Hkv = 2
    f = make_format(fmt, "page")
    kc, vc, bt, sl = make_paged_kv(f, f, lens, Hkv, D, P, device="cuda", gen=gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), Hkv * G, D, generator=gen).to("cuda", dtype)
    sinks = (torch.randn(Hkv * G, generator=gen) * 2).cuda()
    out = poison_(torch.empty_like(q))
    L.launch_paged_prefill(q, out, (f.name, f.granularity, kc.data, kc.scale, kc.micro),
                           (f.name, f.granularity, vc.data, vc.scale, vc.micro), bt, cu, sl,
                           None, D ** -0.5, 0, 0, 0.0, max(q_lens), sink_logits=sinks)
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, D ** -0.5,
                                      sink_logits=sinks if ref_sinks else None)
    return rel_err(out, ref)


@pytest.mark.parametrize("case", PREFILL, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-P{c[3]}")
def test_prefill_sinks(case):
    err = _prefill(*case, seed=10 + PREFILL.index(case))
    assert err <= REL_ERR[torch.bfloat16], f"rel err {err:.2e} > {REL_ERR[torch.bfloat16]:.1e}"


def test_prefill_sinks_matter():
    """Negative case: against a reference without the sinks the same output fails the bound
    (the sinks take a visible share of the softmax mass)."""
    err = _prefill(*PREFILL[0], seed=10, ref_sinks=False)
    assert err > REL_ERR[torch.bfloat16], f"rel err {err:.2e}: the sinks changed nothing"


def test_cuda_decode_kernel_declines_sinks():
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    why = fast_path_reason(q, "bf16", "page", "bf16", "page", 128, 128, 16, 4, sinks=True)
    assert "sink" in why
