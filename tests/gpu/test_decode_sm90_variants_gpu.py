"""The CUDA decode kernel's issue-14 variants (decode_sm90.VARIANTS: nocap, aluk, aluv, alu;
cuda14g's chain, pvt, pvt4, pvt4h, pvt5h, cta4) on the H200: each against the fp32 reference with the base kernel's bounds.
`-k "int4 or sixteen"` (gpu_jobs.sh i4v_check): cuda14h's int4 variants (pvt4n, pvt4nz, pvt4s, pvt4sz, pvt4sp) beside base and pvt4h
on int4 K channel / V token pages (INT4_CASES), the L = 131,072 needle case in int4 P64 for
each, and the wrong-zero-point negative; pvt4s on bf16 / fp16 pages (SIXTEEN_CASES).

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
VARIANTS = ["base", "nocap", "alu", "chain", "pvt", "pvt4", "pvt4h", "pvt5h", "cta4",
            "pvt4s",  # cuda14h: q.k with the tokens as M at <= 8 rows (fp8 pages too)
            "pvt4h_pf", "base_pf"]  # twenty-sixth session: page ids loaded ahead (BTPF)
# cuda14h: int4 K channel / V token pages (and int4 beside e4m3 token pages)
K4, V4 = ("int4", "channel"), ("int4", "token")
INT4_CASES = [
    (K4, V4, 128, 4, 64, 1, {}),
    (K4, V4, 128, 8, 16, 2, {}),                     # 16 query rows: 3 CTAs a SM
    (K4, V4, 128, 1, 128, 1, {"splits": 5}),
    (K4, V4, 64, 4, 64, 1, {}),
    (K4, V4, 64, 8, 16, 2, {}),
    (K4, V4, 128, 4, 64, 1, {"softcap": 30.0, "kmask": True}),
    (K4, V4, 128, 8, 32, 2, {"window": 37, "sinks": 3, "splits": 3}),
    (K4, V4, 128, 4, 64, 1, {"peaky": True}),
    (K4, V4, 128, 4, 32, 1, {"peaky": True, "splits": 2}),
    (K4, E4T, 128, 4, 16, 1, {}),
    (E4T, V4, 128, 4, 16, 2, {}),
]
INT4_VARIANTS = ["base", "pvt4h", "pvt4n", "pvt4nz", "pvt4s", "pvt4sz", "pvt4sp", "pvt4sp_pf",
                 "pvt5sp"]
# cuda14h: pvt4s on 16-bit pages (q.k with the tokens as M, P.V transposed; 8 rows)
F16P = ("fp16", "page")
SIXTEEN_CASES = [
    (BF, BF, 128, 4, 16, 1, {}),
    (BF, BF, 64, 8, 16, 1, {}),
    (BF, BF, 128, 4, 64, 2, {"window": 37, "sinks": 3, "splits": 3}),
    (BF, BF, 128, 4, 16, 1, {"softcap": 30.0, "kmask": True}),
    (BF, BF, 128, 1, 32, 1, {"splits": 5}),
    (F16P, F16P, 128, 4, 8, 1, {}),
    (BF, BF, 128, 8, 16, 2, {}),   # 16 rows: pvt4h's code
]
SIXTEEN_VARIANTS = ["base", "pvt4h", "pvt4s", "base_pf"]


def _kinds(fast, k, v):
    kk, vk = fast._KIND[k[0]], fast._KIND[v[0]]
    ksm = fast._SCALE[k[1]] if kk < 2 else fast._SC_CHANZP if kk == fast.INT4 else 0
    vsm = fast._SCALE[v[1]] if vk < 2 else fast._SC_TOKZP if vk == fast.INT4 else 0
    return kk, vk, ksm, vsm


def _variant_keys(fast, fp8=True, int4=True, sixteen=True, only=None):
    keys = set()
    for cases, names in ((CASES, VARIANTS) if fp8 else ((), ()),
                         (INT4_CASES, INT4_VARIANTS) if int4 else ((), ()),
                         (SIXTEEN_CASES, SIXTEEN_VARIANTS) if sixteen else ((), ())):
        for k, v, D, G, _P, Sq, kw in cases:
            rows = 8 if G * Sq <= 8 else 16
            kk, vk, ksm, vsm = _kinds(fast, k, v)
            for name in names:
                if only is not None and name not in only:
                    continue
                var = fast.variant_bits(name, kk, vk, kw.get("softcap", 0.0), rows=rows)
                keys.add((kk, vk, ksm, vsm, D, D, rows, fast._QT[torch.float32], 0)
                         + ((var,) if var else ()))
    return keys


@pytest.fixture(scope="module", autouse=True)
def built(request):
    from kvcompile.kernels import decode_sm90 as fast

    # prebuild what the selected tests launch (-k int4: the int4 variants only)
    names = [it.name for it in request.session.items]
    int4 = any("int4" in n for n in names)
    sixteen = any("sixteen" in n for n in names)
    only = {it.callspec.params["variant"] for it in request.session.items
            if hasattr(it, "callspec") and "variant" in it.callspec.params}
    only = only if all(hasattr(it, "callspec") and "variant" in it.callspec.params
                       for it in request.session.items) else None
    fp8 = any("int4" not in n and "sixteen" not in n for n in names)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA decode kernel is sm_90 (Hopper) only")
    ok, why = fast.device_ok(torch.device("cuda"))
    if not ok:
        pytest.fail(f"the CUDA decode kernel cannot be built here: {why}")
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: fast._kernel(*k), sorted(_variant_keys(fast, fp8, int4, sixteen, only))))


def run_case(variant, case, seed=0, corrupt=False, wrong_zero=False) -> tuple[float, float]:
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
    kz = kc.zero
    if wrong_zero:  # negative case: the keys' zero points of other pages
        kz = kz.roll(1, 0).contiguous()
    window, sinks, softcap = kw.get("window", 0), kw.get("sinks", 0), kw.get("softcap", 0.0)
    fast.launch_decode_sm90(q, kc.data, kc.scale, vc.data, vc.scale, bt, sl, km, out, k[0],
                            k[1], v[0], v[1], scale, window, sinks, softcap,
                            kw.get("splits", 0), dec._sm_count(q.device), dec._combine,
                            kz=kz, vz=vc.zero, variant=variant)
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


@pytest.mark.parametrize("variant", INT4_VARIANTS)
@pytest.mark.parametrize("case", INT4_CASES, ids=[f"{i}-{c[0][0]}-{c[1][0]}-D{c[2]}"
                                                  for i, c in enumerate(INT4_CASES)])
def test_int4_variant_case(variant, case):
    err, bound = run_case(variant, case)
    assert err <= bound, f"{variant}: relative error {err:.2e} > {bound}"


@pytest.mark.parametrize("variant", SIXTEEN_VARIANTS)
@pytest.mark.parametrize("case", SIXTEEN_CASES, ids=[f"{i}-{c[0][0]}-D{c[2]}"
                                                     for i, c in enumerate(SIXTEEN_CASES)])
def test_sixteen_bit_variant_case(variant, case):
    err, bound = run_case(variant, case)
    assert err <= bound, f"{variant}: relative error {err:.2e} > {bound}"


@pytest.mark.parametrize("variant", ["pvt4n", "pvt4sz", "pvt4sp"])
def test_int4_variant_wrong_zero_point_fails(variant):
    """Negative case: the int4 variants given the key zero points of other pages fail."""
    err, bound = run_case(variant, INT4_CASES[0])
    assert err <= bound
    err, bound = run_case(variant, INT4_CASES[0], wrong_zero=True)
    assert err > 10 * bound, f"{variant}: wrong zero points pass ({err:.2e})"


@pytest.mark.parametrize("variant", ["base", "pvt4n", "pvt4s", "pvt4sz", "pvt4sp"])
def test_int4_variant_long_peaky(variant):
    """The needle case (B 1, L 131,072, Hkv 8, G 4, int4 K channel / V token pages of 64): q
    aligned with 8 keys, the rest noise; against the fp32 reference over the same pages. The
    I4N variants accumulate codes as f16 subnormals (c * 2^-24) in the MMAs' f32 sums."""
    from kvcompile.kernels import decode_sm90 as fast
    from tests.gpu.test_decode_sm90_gpu import needle_pages

    L, Hkv, G, D = 131072, 8, 4, 128
    q, kc, vc, bt, sl, ref = needle_pages(K4, V4, 64, L, Hkv, G, D)
    scale = 1 / math.sqrt(D)
    out = poison_(torch.empty(1, Hkv * G, 1, D, device="cuda"))
    fast.launch_decode_sm90(q, kc.data, kc.scale, vc.data, vc.scale, bt, sl, None, out, *K4,
                            *V4, scale, 0, 0, 0.0, 0, dec._sm_count(q.device), dec._combine,
                            kz=kc.zero, vz=vc.zero, variant=variant)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    print(f"int4 needle L{L} {variant}: rel err {err:.2e}")
    assert err <= REL_ERR[torch.float16], f"{variant}: rel err {err:.2e}"
