"""The CUDA decode kernel's issue-14 variants (decode_sm90.VARIANTS: nocap, aluk, aluv, alu;
cuda14g's chain, pvt, pvt4, pvt4h, pvt5h, cta4) on the H200: each against the fp32 reference with the base kernel's bounds.

    pytest -q -m gpu tests/gpu/test_decode_sm90_variants_gpu.py    # or: gpu_jobs.sh var14_check

Launched through decode_sm90.launch_decode_sm90(variant=...) (the variants are not reachable
from paged_decode's API); outputs poisoned with NaN first. Their host-emulation twins are in
tests/kernels/test_decode_sm90_emu.py (-k variant); the timing is
benchmarks/gpu_decode_fast.py --variants (gpu_jobs.sh var14_bench).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvcompile.kernels import decode as dec
from kvcompile.kernels.reference import paged_decode_attention_ref
from kvcompile.testing import REL_ERR, poison_, rel_err
from tests.kernels.kernel_cases import make_format, make_paged_kv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4, E4T, E4X = ("fp8_e4m3", "page"), ("fp8_e4m3", "token"), ("fp8_e4m3", "tensor")
E5, BF = ("fp8_e5m2", "page"), ("bf16", "page")
# (keys, values, D, G, P, Sq, extra launch arguments)
CASES = [
    (E4, E4, 128, 4, 16, 1, {}),
    (E4, E4, 64, 8, 16, 2, {}),
    (E4T, E4T, 128, 8, 64, 2, {}),
    (E4X, E4X, 128, 4, 8, 1, {}),
    (E5, E5, 128, 4, 16, 1, {}),
    (E5, E5, 64, 4, 128, 4, {}),
    (E4, BF, 128, 4, 16, 1, {}),
    (E4, E4, 128, 4, 16, 1, {"softcap": 30.0, "kmask": True}),
    (E4T, E4T, 128, 4, 16, 2, {"window": 37, "sinks": 3, "splits": 3}),
    (E4, E4, 128, 1, 32, 1, {"splits": 5}),
    # keys of later pages 32x larger: row maxima move apart, O rescaled row by row (pvt: the
    # factors come from other lanes); ROWS 8 and 16
    (E4, E4, 128, 4, 16, 1, {"peaky": True}),
    (E4, E4, 64, 4, 16, 1, {"peaky": True}),  # 8 rows at D 64: pvt5h's 5 CTAs a SM
    (E4, E4, 64, 8, 16, 2, {"peaky": True}),
]
# (aluk / aluv: alu's code for one operand, checked on the H200 before)
VARIANTS = ["base", "nocap", "alu", "chain", "pvt", "pvt4", "pvt4h", "pvt5h", "cta4"]


def _variant_keys(fast):
    keys = set()
    for k, v, D, G, _P, Sq, kw in CASES:
        rows = 8 if G * Sq <= 8 else 16
        kk, vk = fast._KIND[k[0]], fast._KIND[v[0]]
        ksm = fast._SCALE[k[1]] if kk < 2 else 0
        vsm = fast._SCALE[v[1]] if vk < 2 else 0
        for name in VARIANTS:
            var = fast.variant_bits(name, kk, vk, kw.get("softcap", 0.0), rows=rows)
            keys.add((kk, vk, ksm, vsm, D, D, rows, fast._QT[torch.float32], 0)
                     + ((var,) if var else ()))
    return keys


@pytest.fixture(scope="module", autouse=True)
def built():
    from kvcompile.kernels import decode_sm90 as fast

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA decode kernel is sm_90 (Hopper) only")
    ok, why = fast.device_ok(torch.device("cuda"))
    if not ok:
        pytest.fail(f"the CUDA decode kernel cannot be built here: {why}")
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: fast._kernel(*k), sorted(_variant_keys(fast))))


def run_case(variant, case, seed=0, corrupt=False) -> tuple[float, float]:
    from kvcompile.kernels import decode_sm90 as fast

    k, v, D, G, P, Sq, kw = case
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 17, 300, 1033, 16, 15]
    kc, vc, bt, sl = make_paged_kv(make_format(*k), make_format(*v), lens, 2, D, P, gen=gen)
    q = torch.randn(len(lens), 2 * G, Sq, D, generator=gen).cuda()
    if kw.get("peaky"):
        kc.scale[bt[:, 2:].flatten().unique()] *= 32
    km = None
    if kw.get("kmask"):
        km = torch.rand(len(lens), max(lens), generator=gen).cuda() > 0.3
        km[:, -1] = True
    out = poison_(torch.empty(*q.shape[:3], D, device="cuda"))
    scale = 1.0 / math.sqrt(D)
    window, sinks, softcap = kw.get("window", 0), kw.get("sinks", 0), kw.get("softcap", 0.0)
    fast.launch_decode_sm90(q, kc.data, kc.scale, vc.data, vc.scale, bt, sl, km, out, k[0],
                            k[1], v[0], v[1], scale, window, sinks, softcap,
                            kw.get("splits", 0), dec._sm_count(q.device), dec._combine,
                            variant=variant)
    torch.cuda.synchronize()
    if corrupt:
        out.mul_(1.05)
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, scale, key_mask=km,
                                     sliding_window=window, sinks=sinks, softcap=softcap)
    assert not torch.isnan(out).any(), "NaN (unwritten or poisoned) output elements"
    bound = REL_ERR[torch.bfloat16 if "bf16" in (k[0], v[0]) else torch.float16]
    return rel_err(out, ref), bound


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c[0][0]}-{c[0][1]}-D{c[2]}"
                                             for i, c in enumerate(CASES)])
def test_variant_case(variant, case):
    err, bound = run_case(variant, case)
    assert err <= bound, f"{variant}: relative error {err:.2e} > {bound}"


def test_variant_check_catches_a_wrong_output():
    err, bound = run_case("alu", CASES[0], corrupt=True)
    assert err > bound
