"""The CUDA decode kernel (kernels/decode_sm90.py, Hopper) on the H200: correctness and accuracy.

    pytest -q -m gpu tests/gpu/test_decode_sm90_gpu.py       # or: gpu_jobs.sh decode_sm90

Cases: the kernel against the fp32 reference (kernels/reference.py) on fresh random inputs,
outputs poisoned with NaN, over formats x head_dim x GQA x page size x Sq, plus masks, splits,
mixed K / V formats and q dtypes, each asserting that the CUDA kernel (not the Triton one) takes
the case. Accuracy: L = 131,072 with peaky attention (a few keys hold most of the mass), both
backends against an fp32 reference over the same dequantized pages. All variants are built
first, in parallel threads. The timing half is benchmarks/gpu_decode_fast.py.
The opt-in qk_fp8 variant (q.k on e4m3 tensor cores, `-k qk8`): its cases against the reference
on q quantized the same way (decode_sm90.quantize_q_e4m3, the usual bounds) and on q itself
(REL_ERR_QK_FP8), and the long needle case.
(Was benchmarks/gpu_decode_fast.py --check --accuracy.)
"""

from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvcompile.kernels import decode as dec
from kvcompile.kernels.reference import paged_decode_attention_ref
from kvcompile.testing import REL_ERR, REL_ERR_QK_FP8, poison_, rel_err
from tests.kernels.kernel_cases import FAST_FORMATS, make_format, make_paged_kv
from tests.kernels.kernel_cases import launch_backend as launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

def _cases() -> list[dict]:
    cases = []
    for (kf, kg), D, G, P, Sq in itertools.product(FAST_FORMATS, (64, 128), (1, 4, 8),
                                                   (8, 16, 64, 128), (1, 2)):
        if G * Sq > 16 or (P == 8 and D == 64 and G == 1):
            continue
        cases.append(dict(k=(kf, kg), v=(kf, kg), D=D, G=G, P=P, Sq=Sq))
    fp8, bf = ("fp8_e4m3", "page"), ("bf16", "page")
    cases += [  # masks, splits, mixed formats, q dtypes
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, window=100, sinks=4),
        dict(k=("fp8_e4m3", "token"), v=("fp8_e4m3", "token"), D=128, G=4, P=16, Sq=2,
             window=37, sinks=3),
        dict(k=bf, v=bf, D=128, G=8, P=16, Sq=2, window=64, sinks=0),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, kmask=True),
        dict(k=bf, v=bf, D=64, G=4, P=32, Sq=4, kmask=True),
        # left padding and a hole among all-True mask steps (read as unmasked steps)
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, kmask="padded"),
        dict(k=bf, v=bf, D=128, G=4, P=16, Sq=1, kmask="padded"),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, softcap=30.0),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, splits=1),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, splits=7),
        dict(k=bf, v=bf, D=128, G=4, P=16, Sq=1, splits=1),
        dict(k=fp8, v=bf, D=128, G=4, P=16, Sq=1),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, q=torch.bfloat16),
        dict(k=bf, v=bf, D=128, G=4, P=16, Sq=1, q=torch.bfloat16),
    ]
    return cases


K4, V4 = ("int4", "channel"), ("int4", "token")


def _int4_cases() -> list[dict]:
    """int4 pages (the Pareto table's K int4/V int4: keys' scale + zero point per page and
    channel, values' per token), head_dim 64 / 128, pages of >= 16 tokens."""
    cases = []
    for D, G, P, Sq in itertools.product((64, 128), (1, 4, 8), (16, 64, 128), (1, 2)):
        cases.append(dict(k=K4, v=V4, D=D, G=G, P=P, Sq=Sq))
    cases += [
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, window=100, sinks=4),
        dict(k=K4, v=V4, D=128, G=8, P=16, Sq=2, window=37, sinks=3),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, kmask=True),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, kmask="padded"),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, softcap=30.0),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, splits=1),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, splits=7),
        dict(k=K4, v=V4, D=128, G=4, P=64, Sq=1, q=torch.bfloat16),
        dict(k=K4, v=("fp8_e4m3", "token"), D=128, G=4, P=16, Sq=1),
        dict(k=("fp8_e4m3", "token"), v=V4, D=128, G=4, P=16, Sq=2),
    ]
    return cases


INT4_CASES = _int4_cases()
CASES = _cases() + INT4_CASES


def _qk8_cases() -> list[dict]:
    cases = []
    for kg, D, G, P, Sq in itertools.product(("page", "token", "tensor"), (64, 128), (1, 4, 8),
                                             (16, 128), (1, 2)):
        if G * Sq <= 16:
            cases.append(dict(k=("fp8_e4m3", kg), v=("fp8_e4m3", kg), D=D, G=G, P=P, Sq=Sq,
                              qk8=True))
    fp8, bf = ("fp8_e4m3", "page"), ("bf16", "page")
    cases += [
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, window=100, sinks=4, qk8=True),
        dict(k=fp8, v=fp8, D=128, G=4, P=8, Sq=2, kmask=True, qk8=True),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, softcap=30.0, qk8=True),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, splits=7, qk8=True),
        dict(k=fp8, v=bf, D=128, G=4, P=16, Sq=1, qk8=True),
        dict(k=fp8, v=fp8, D=128, G=4, P=16, Sq=1, q=torch.bfloat16, qk8=True),
    ]
    return cases


QK8_CASES = _qk8_cases()


def _case_key(c: dict) -> tuple:
    """The kernel key (decode_sm90._kernel's arguments, no variant) a case launches."""
    from kvcompile.kernels import decode_sm90 as fast

    (kf, kg), (vf, vg) = c["k"], c["v"]
    kk, vk = fast._KIND[kf], fast._KIND[vf]

    def mode(kind, gran, int_mode):
        return fast._SCALE[gran] if kind < 2 else int_mode if kind == fast.INT4 else 0

    rows = 8 if c["G"] * c["Sq"] <= 8 else 16
    key = (kk, vk, mode(kk, kg, fast._SC_CHANZP), mode(vk, vg, fast._SC_TOKZP), c["D"],
           c["D"], rows, fast._QT[c.get("q", torch.float32)])
    return (*key, 1) if c.get("qk8") else key


@pytest.fixture(scope="module", autouse=True)
def built_variants(request):
    """Compile every variant the selected tests use, in parallel threads (as the old script
    did): the selected cases' own kernels where only case tests of this file were selected
    (`-k`), else every variant of the cases."""
    from kvcompile.kernels import decode_sm90 as fast

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA decode kernel is sm_90 (Hopper) only")
    ok, why = fast.device_ok(torch.device("cuda"))
    if not ok:
        pytest.fail(f"the CUDA decode kernel cannot be built on this H100/H200: {why}")
    mine = [it for it in request.session.items if it.module is request.module]
    cases = [it.callspec.params["case"] for it in mine
             if hasattr(it, "callspec") and "case" in it.callspec.params]
    if mine and len(cases) == len(mine):
        keys = fast.with_default_variants({_case_key(c) for c in cases})
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda k: fast._kernel(*k), sorted(keys)))
        return
    keys = set()
    for (kf, kg), d, rows, qt in itertools.product(FAST_FORMATS, (64, 128), (8, 16),
                                                    (torch.float32, torch.bfloat16)):
        kk = fast._KIND[kf]
        sm = fast._SCALE[kg] if kk < 2 else 0
        keys.add((kk, kk, sm, sm, d, d, rows, fast._QT[qt]))
    keys.add((0, 3, 1, 0, 128, 128, 8, 1))  # K fp8 / V bf16
    for d, rows, qt in itertools.product((64, 128), (8, 16), (torch.float32, torch.bfloat16)):
        keys.add((4, 4, 4, 5, d, d, rows, fast._QT[qt]))   # int4 pages
    keys.add((4, 0, 4, 2, 128, 128, 8, fast._QT[torch.float32]))
    keys.add((0, 4, 2, 5, 128, 128, 8, fast._QT[torch.float32]))
    for k in list(keys):  # the qk_fp8 variant of each e4m3-key variant
        if k[0] == 0:
            keys.add((*k, 1))
    keys = fast.with_default_variants(keys)   # what launches without variant= run
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: fast._kernel(*k), sorted(keys)))


def run_fast_case(c: dict, gen, corrupt: bool = False, unquantized_ref: bool = False,
                  wrong_zero: bool = False) -> tuple[float, float]:
    """(relative error, bound). qk8 cases: against the reference on q quantized as the kernel
    does, or (unquantized_ref) on q itself with REL_ERR_QK_FP8."""
    lens = [1, 17, 300, 1033, 16, 15][: 3 if c["D"] == 64 else 6]
    kc, vc, bt, sl = make_paged_kv(make_format(*c["k"]), make_format(*c["v"]), lens, 2,
                                   c["D"], c["P"], gen=gen)
    B, Hq = len(lens), 2 * c["G"]
    qdt = c.get("q", torch.float32)
    q = torch.randn(B, Hq, c["Sq"], c["D"], generator=gen).to("cuda", qdt)
    km = None
    if c.get("kmask") == "padded":   # generate's rows: left padding and a hole, else True
        km = torch.ones(B, max(lens) + 1, dtype=torch.bool, device="cuda")
        for b, n in enumerate(lens):
            km[b, :min((0, 5, 37, 16)[b % 4], n - 1)] = False
        km[2, 40:43] = False
    elif c.get("kmask"):
        km = torch.rand(B, max(lens), generator=gen).cuda() > 0.3
        km[:, -1] = True
    out = poison_(torch.empty(B, Hq, c["Sq"], c["D"], dtype=qdt, device="cuda"))
    why = dec.fast_path_reason(q, *c["k"], *c["v"], c["D"], c["D"], c["P"], c["G"] * c["Sq"])
    assert why == "", f"fast path refused: {why}"
    qk8 = c.get("qk8", False)
    if wrong_zero:  # negative case: the keys' zero points of other pages
        kc = _with_zero(kc, kc.zero.roll(1, 0).contiguous())
    launch(q, kc, vc, bt, sl, out, "cuda", key_mask=km, window=c.get("window", 0),
           sinks=c.get("sinks", 0), softcap=c.get("softcap", 0.0), splits=c.get("splits", 0),
           qk_fp8=qk8)
    torch.cuda.synchronize()
    if corrupt:
        out.mul_(1.05)
    if wrong_zero:
        kc = kc.original
    q_ref = q
    if qk8 and not unquantized_ref:
        from kvcompile.kernels.decode_sm90 import quantize_q_e4m3

        codes, qsc = quantize_q_e4m3(q)
        q_ref = codes.float() * qsc
    ref = paged_decode_attention_ref(q_ref, kc, vc, bt, sl, 1 / math.sqrt(c["D"]), key_mask=km,
                                     sliding_window=c.get("window", 0),
                                     sinks=c.get("sinks", 0), softcap=c.get("softcap", 0.0))
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output elements"
    cdt = torch.bfloat16 if "bf16" in (c["k"][0], c["v"][0]) else torch.float16
    if qdt == torch.bfloat16:
        cdt = torch.bfloat16
    if qk8 and unquantized_ref:
        return rel_err(out, ref), REL_ERR_QK_FP8
    return rel_err(out, ref), REL_ERR[cdt]


class _with_zero:
    """A PagedTensor's view with other zero points (the kernel reads them, not the reference)."""

    def __init__(self, paged, zero):
        self.original, self.zero = paged, zero

    def __getattr__(self, name):
        return getattr(self.original, name)


def _id(i, c):
    return f"{i}-" + json.dumps({k: (str(v) if isinstance(v, torch.dtype) else v)
                                 for k, v in c.items()}, separators=(",", ":"))


@pytest.mark.parametrize("case", CASES, ids=[_id(i, c) for i, c in enumerate(CASES)])
def test_cuda_decode_case(case):
    err, bound = run_fast_case(case, torch.Generator().manual_seed(CASES.index(case)))
    assert err <= bound, f"rel err {err:.2e} > {bound:.1e}"


@pytest.mark.parametrize("case", QK8_CASES, ids=[_id(i, c) for i, c in enumerate(QK8_CASES)])
def test_cuda_decode_qk8_case(case):
    seed = 1000 + QK8_CASES.index(case)
    err, bound = run_fast_case(case, torch.Generator().manual_seed(seed))
    assert err <= bound, f"vs reference on quantized q: rel err {err:.2e} > {bound:.1e}"
    err, bound = run_fast_case(case, torch.Generator().manual_seed(seed), unquantized_ref=True)
    assert err <= bound, f"vs reference on q: rel err {err:.2e} > {bound:.1e}"


def test_cuda_decode_qk8_is_quantized():
    """Negative case: the qk8 output against the reference on unquantized q misses the f16
    bound the default kernel meets (q really is quantized), and a 5% error fails its check."""
    c = QK8_CASES[0]
    err, _ = run_fast_case(c, torch.Generator().manual_seed(0), unquantized_ref=True)
    assert err > 3 * REL_ERR[torch.float16]
    err, bound = run_fast_case(c, torch.Generator().manual_seed(0), corrupt=True)
    assert err > bound


def test_cuda_decode_check_catches_a_wrong_output():
    """Negative case: the same check on an output off by 5% fails."""
    err, bound = run_fast_case(CASES[0], torch.Generator().manual_seed(0), corrupt=True)
    assert err > bound


def test_cuda_decode_int4_wrong_zero_point_fails():
    """Negative case: int4 keys read with the zero points of other pages fail the check the
    right ones pass (the kernel really adds sum_d q_d z_d per page)."""
    c = INT4_CASES[0]
    err, bound = run_fast_case(c, torch.Generator().manual_seed(0))
    assert err <= bound
    err, bound = run_fast_case(c, torch.Generator().manual_seed(0), wrong_zero=True)
    assert err > 10 * bound


@pytest.mark.parametrize("kf,kg", [("fp8_e4m3", "page"), ("fp8_e4m3", "tensor"),
                                   ("bf16", "page")])
def test_accuracy_long_peaky(kf, kg):
    _long_peaky(kf, kg, False)


def test_accuracy_long_peaky_int4():
    """The needle case in int4 pages (keys channel-scaled per page of 64, values per token)."""
    _long_peaky("int4", "channel", False, v=("int4", "token"), P=64)


@pytest.mark.parametrize("kg", ["page", "tensor"])
def test_accuracy_long_peaky_qk8(kg):
    """The needle case through the qk_fp8 variant: against the reference on quantized q with the
    f16 bound, on q itself with REL_ERR_QK_FP8 (CPU emulation at L 4096: 0.3-0.35%)."""
    _long_peaky("fp8_e4m3", kg, True)


def needle_pages(k_fmt, v_fmt, P, L=131072, Hkv=8, G=4, D=128):
    """The long-context needle case: B=1, q aligned with 8 'needle' keys of L, the rest noise,
    written into k_fmt / v_fmt pages of P tokens -> (q, kc, vc, bt, sl, ref over the pages)."""
    gen = torch.Generator().manual_seed(7)
    npg = L // P
    kc = make_format(*k_fmt).allocate(npg, Hkv, P, D, "cuda")
    vc = make_format(*v_fmt).allocate(npg, Hkv, P, D, "cuda")
    q = torch.randn(1, Hkv * G, 1, D, generator=gen).cuda()
    k = torch.randn(L, Hkv, D, generator=gen).cuda()
    needles = torch.randint(0, L, (8,), generator=gen)
    k[needles] = q[0, ::G, 0][None] * 1.5  # peaky: the group's first head finds its needles
    v = torch.randn(L, Hkv, D, generator=gen).cuda()
    slots = torch.arange(L, device="cuda")
    for a in range(0, L, 16384):
        kc.write(slots[a:a + 16384], k[a:a + 16384])
        vc.write(slots[a:a + 16384], v[a:a + 16384])
    bt = torch.arange(npg, dtype=torch.int32, device="cuda")[None]
    sl = torch.tensor([L], dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, sl, paged_decode_attention_ref(q, kc, vc, bt, sl, 1 / math.sqrt(D))


def _long_peaky(kf, kg, qk8, v=None, P=16):
    """B=1, L=131072, Hkv 8, G 4: q aligned with 8 'needle' keys; the rest noise."""
    L, Hkv, G, D = 131072, 8, 4, 128
    q, kc, vc, bt, sl, ref = needle_pages((kf, kg), v or (kf, kg), P, L, Hkv, G, D)
    bound = REL_ERR[torch.bfloat16 if kf == "bf16" else torch.float16]
    if qk8:
        from kvcompile.kernels.decode_sm90 import quantize_q_e4m3

        codes, qsc = quantize_q_e4m3(q)
        ref_q8 = paged_decode_attention_ref(codes.float() * qsc, kc, vc, bt, sl, 1 / math.sqrt(D))
        out = poison_(torch.empty(1, Hkv * G, 1, D, device="cuda"))
        launch(q, kc, vc, bt, sl, out, "cuda", qk_fp8=True)
        torch.cuda.synchronize()
        errs = {"vs quantized q": rel_err(out, ref_q8), "vs q": rel_err(out, ref)}
        print(f"qk8 {kf}/{kg} L{L}: {errs}")
        assert errs["vs quantized q"] <= bound and errs["vs q"] <= REL_ERR_QK_FP8, errs
        return
    errs = {}
    for backend in ("cuda", "triton"):
        out = poison_(torch.empty(1, Hkv * G, 1, D, device="cuda"))
        launch(q, kc, vc, bt, sl, out, backend)
        torch.cuda.synchronize()
        errs[backend] = rel_err(out, ref)
    assert max(errs.values()) <= bound, f"{kf}/{kg}: rel errs {errs} > {bound:.1e}"
