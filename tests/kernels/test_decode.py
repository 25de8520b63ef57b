"""Paged decode kernel vs the plain-PyTorch reference, over formats x head_dim x GQA x page size.

On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py) in fp32 on small shapes; on
CUDA the same tests run the compiled kernels (tests/gpu/test_decode_matrix_gpu.py runs the full
matrix there).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.kernels.decode import paged_decode_attention  # noqa: E402
from kvcompile.kernels.reference import paged_decode_attention_ref  # noqa: E402
from kvcompile.testing import REL_ERR, poison_, rel_err  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    DEV,
    case_seed,
    compute_dtype,
    make_format,
    make_paged_kv,
    run_case,
)

CASES = [  # k format, v format, granularity, head_dim, G, page size, lens
    ("fp32", "fp32", "page", 64, 1, 16, [37, 70]),
    ("bf16", "bf16", "page", 128, 4, 32, [65]),
    ("fp16", "fp16", "page", 64, 8, 8, [19, 40, 3]),
    ("fp8_e4m3", "fp8_e4m3", "page", 64, 4, 16, [37, 70]),
    ("fp8_e4m3", "fp8_e4m3", "token", 128, 1, 32, [91, 5]),
    ("fp8_e5m2", "fp8_e5m2", "tensor", 64, 8, 16, [53]),
    ("fp8_e5m2", "fp8_e5m2", "page", 64, 1, 64, [130, 1]),
    ("fp4_e2m1", "fp4_e2m1", "page", 64, 4, 16, [45, 77]),
    ("fp4_e2m1", "fp4_e2m1", "token", 128, 8, 32, [33]),
    ("fp4_e2m1", "fp4_e2m1", "tensor", 64, 1, 16, [71, 16]),
    ("fp8_e4m3", "fp4_e2m1", "page", 64, 4, 16, [50]),  # keys fp8, values fp4
    ("bf16", "fp8_e4m3", "token", 64, 4, 16, [29, 61]),
]


@pytest.mark.parametrize("kf,vf,gran,D,G,P,lens", CASES)
def test_decode_matches_reference(kf, vf, gran, D, G, P, lens):
    gen = torch.Generator().manual_seed(case_seed(kf, vf, gran, D, G, P))
    err, bound, _, _ = run_case(make_format(kf, gran), make_format(vf, gran), lens, 2, G, D, P,
                                splits=2, config={"BLOCK_T": 32}, gen=gen)
    assert err <= bound, f"relative error {err:.2e} > {bound:.1e}"


@pytest.mark.parametrize("splits,block_t", [(1, 32), (3, 16), (16, 16)])
def test_decode_splits_and_tiles(splits, block_t):
    # direct write (1 split), uneven splits, and more splits than tiles (empty splits)
    gen = torch.Generator().manual_seed(splits)
    fmt = make_format("fp8_e4m3", "page")
    err, bound, _, _ = run_case(fmt, fmt, [41, 100, 7], 2, 4, 64, 16, splits=splits,
                                config={"BLOCK_T": block_t}, gen=gen)
    assert err <= bound


@pytest.mark.parametrize("fmt,cfg", [
    ("fp8_e4m3", {"SPLIT": 0}),
    ("bf16", {"SPLIT": 1, "num_stages": 1}),
    ("fp8_e5m2", {"SPLIT": 1, "num_stages": 2}),
    ("fp4_e2m1", {"SPLIT": 1, "num_stages": 1}),
])
def test_decode_tile_variants(fmt, cfg):
    # with and without column-split dots, for every format family
    gen = torch.Generator().manual_seed(len(cfg))
    f = make_format(fmt, "token")
    err, bound, _, _ = run_case(f, f, [70, 9, 33], 2, 4, 64, 16, Sq=2, splits=2,
                                config={"BLOCK_T": 16, **cfg}, gen=gen)
    assert err <= bound


@pytest.mark.parametrize("Sq,G", [(3, 4), (8, 1)])
def test_decode_speculative_queries_are_causal(Sq, G):
    gen = torch.Generator().manual_seed(Sq)
    fmt = make_format("fp4_e2m1", "token")
    err, bound, _, _ = run_case(fmt, fmt, [29, 64], 2, G, 64, 16, Sq=Sq, splits=2,
                                config={"BLOCK_T": 16}, gen=gen)
    assert err <= bound


def test_decode_window_sinks_softcap_and_key_mask():
    gen = torch.Generator().manual_seed(7)
    fmt = make_format("fp8_e5m2", "page")
    lens = [90, 37]
    km = torch.rand(2, 60, generator=gen) > 0.3
    km[:, 0] = True
    err, bound, _, _ = run_case(fmt, fmt, lens, 2, 4, 64, 16, Sq=2, window=24, sinks=3,
                                softcap=5.0, key_mask=km.to(DEV), splits=3,
                                config={"BLOCK_T": 16}, gen=gen)
    assert err <= bound


def test_decode_attention_mass_matches_reference():
    gen = torch.Generator().manual_seed(11)
    fmt = make_format("fp8_e4m3", "token")
    err, bound, _, (mass, mass_ref) = run_case(fmt, fmt, [40, 75], 2, 4, 64, 16, Sq=2,
                                                window=32, sinks=2, with_mass=True, splits=3,
                                                config={"BLOCK_T": 16}, gen=gen)
    assert err <= bound
    assert rel_err(mass, mass_ref) <= 1e-4


def test_decode_fully_masked_row_and_empty_sequence_give_zero():
    gen = torch.Generator().manual_seed(3)
    fmt = make_format("bf16")
    km = torch.zeros(2, 40, dtype=torch.bool)  # sequence 0 sees nothing
    err, bound, out, _ = run_case(fmt, fmt, [33, 0], 1, 4, 64, 16, key_mask=km.to(DEV),
                                  splits=2, config={"BLOCK_T": 16}, gen=gen)
    assert err <= bound
    assert torch.equal(out, torch.zeros_like(out))


def test_decode_public_api_with_out_and_bf16_queries():
    gen = torch.Generator().manual_seed(5)
    fmt = make_format("fp4_e2m1", "page")
    kc, vc, bt, sl = make_paged_kv(fmt, fmt, [50, 17], 2, 64, 16, gen=gen)
    q = torch.randn(2, 8, 1, 64, generator=gen).to(DEV, torch.bfloat16)
    out = poison_(torch.empty(2, 8, 1, 64, dtype=torch.bfloat16, device=DEV))
    got = paged_decode_attention(q, kc, vc, bt, sl, 0.125, out=out)
    assert got is out and not torch.isnan(out).any()
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125)
    assert rel_err(out, ref) <= REL_ERR[torch.bfloat16]
    again = paged_decode_attention(q, kc, vc, bt, sl, 0.125)
    assert again.dtype == torch.bfloat16 and again.shape == (2, 8, 1, 64)
    assert rel_err(again, ref) <= REL_ERR[torch.bfloat16]


def test_decode_op_has_fake_and_compiles():
    from torch._subclasses.fake_tensor import FakeTensorMode

    fmt = make_format("fp8_e4m3", "page")
    kc, vc, bt, sl = make_paged_kv(fmt, fmt, [20], 2, 64, 16)
    q = torch.randn(1, 4, 2, 64, device=DEV)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = paged_decode_attention(torch.empty(1, 4, 2, 64, device=DEV), kc, vc, bt, sl, 0.1)
    assert fake.shape == (1, 4, 2, 64)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q):
        return paged_decode_attention(q * 1.0, kc, vc, bt, sl, 0.1) + 1.0

    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.1) + 1.0
    assert rel_err(f(q), ref) <= REL_ERR[compute_dtype(fmt, DEV)]


def _bad(**over):
    fmt = make_format(over.pop("fmt", "fp8_e4m3"), over.pop("gran", "page"))
    kc, vc, bt, sl = make_paged_kv(fmt, fmt, [20], 2, over.pop("D", 64), 16, nan_fill=False)
    q = over.pop("q", torch.randn(1, 4, 1, 64, device=DEV))
    bt = over.pop("bt", bt)
    paged_decode_attention(q, kc, vc, bt, sl, 0.1)


@pytest.mark.parametrize("what,over,msg", [
    ("head_dim", {"D": 32, "q": torch.randn(1, 4, 1, 32, device=DEV)}, "head_dim 32"),
    ("Sq", {"q": torch.randn(1, 4, 9, 64, device=DEV)}, "Sq=9"),
    ("q dtype", {"q": torch.randn(1, 4, 1, 64, device=DEV).to(torch.float64)}, "dtype"),
    ("q head_dim mismatch", {"q": torch.randn(1, 4, 1, 128, device=DEV)}, "head_dim 128"),
    ("heads", {"q": torch.randn(1, 3, 1, 64, device=DEV)}, "multiple"),
    ("block table dtype", {"bt": torch.zeros(1, 2, dtype=torch.int64, device=DEV)}, "int32"),
])
def test_decode_rejects_unsupported_inputs(what, over, msg):
    with pytest.raises(UnsupportedShapeError, match=msg):
        _bad(**over)


# --- int4 / int3 / int2, channel scales, residual pages ---------------------------------------

NEW_CASES = [  # k format/granularity, v format/granularity, head_dim, G, page size, lens
    ("int4/channel", "int4/token", 64, 4, 64, [130, 37]),  # the 4-bit config of issue 9
    ("int4/channel", "int4/token", 64, 1, 32, [37, 70, 5]),
    ("int4/channel", "fp4_e2m1/page", 64, 4, 64, [77, 130]),
    ("int4/page", "int4/page", 128, 1, 16, [45, 19]),
    ("int4/token", "int4/channel", 64, 4, 32, [33, 70]),
    ("int2/channel", "int2/token", 64, 4, 64, [130, 61]),
    ("int2/page", "int2/page", 64, 1, 16, [37, 70]),
    ("int2/token", "int2/channel", 128, 4, 32, [29]),
    ("int3/channel", "int3/token", 64, 4, 32, [37, 70]),
    ("int3/page", "int3/page", 64, 1, 64, [71]),
    ("int3/token", "int3/channel", 128, 4, 32, [45]),
    ("fp8_e4m3/channel", "fp8_e4m3/page", 64, 4, 16, [37, 70]),
    ("fp8_e5m2/channel", "fp8_e5m2/token", 128, 1, 64, [130]),
    ("fp8_e4m3/channel", "int4/token", 64, 4, 64, [99, 3]),
    ("fp4_e2m1/channel", "fp4_e2m1/page", 64, 4, 16, [45, 77]),
    ("fp4_e2m1/channel", "fp4_e2m1/channel", 64, 1, 64, [90]),
]


def _fmt(spec: str, residual: bool = False):
    name, _, gran = spec.partition("/")
    return make_format(name, gran or "page", residual)


@pytest.mark.parametrize("kf,vf,D,G,P,lens", NEW_CASES)
def test_decode_int_and_channel_formats(kf, vf, D, G, P, lens):
    gen = torch.Generator().manual_seed(case_seed(kf, vf, D, G, P))
    err, bound, _, _ = run_case(_fmt(kf), _fmt(vf), lens, 2, G, D, P, splits=2,
                                config={"BLOCK_T": 32}, gen=gen)
    assert err <= bound, f"relative error {err:.2e} > {bound:.1e}"


RESIDUAL_CASES = [  # the sequences' last, partly filled pages are read from bf16 rows
    ("int4/channel", "int4/token", 64, 4, 64, [130, 37]),
    ("int2/page", "int2/page", 64, 1, 16, [37, 70]),
    ("int3/token", "int3/channel", 64, 4, 32, [45, 20]),
    ("fp4_e2m1/page", "fp4_e2m1/page", 64, 4, 16, [45]),
    ("fp8_e4m3/token", "fp8_e4m3/channel", 128, 1, 16, [61, 33]),
    ("int4/channel", "fp4_e2m1/page", 64, 4, 64, [77]),
]


@pytest.mark.parametrize("kf,vf,D,G,P,lens", RESIDUAL_CASES)
def test_decode_residual_pages(kf, vf, D, G, P, lens):
    gen = torch.Generator().manual_seed(case_seed(kf, vf, D, P))
    kc, vc, bt, sl = make_paged_kv(_fmt(kf, True), _fmt(vf, True), lens, 2, D, P, gen=gen)
    assert kc.residual_pages() and vc.residual_pages()  # the case reads residual rows
    q = torch.randn(len(lens), 2 * G, 1, D, generator=gen).to(DEV)
    out = poison_(torch.empty(len(lens), 2 * G, 1, D, device=DEV))
    paged_decode_attention(q, kc, vc, bt, sl, D**-0.5, out=out, num_splits=2)
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, D**-0.5)
    assert rel_err(out, ref) <= REL_ERR[compute_dtype(kc.fmt, DEV)]


@pytest.mark.parametrize("kf,vf,P,cfg", [
    ("int4/token", "int2/page", 16, {"SPLIT": 1}),      # column halves for per-token int scales
    ("int4/channel", "int4/token", 32, {"BLOCK_T": 128}),  # tiles clamped to the page
])
def test_decode_int_tile_variants(kf, vf, P, cfg):
    gen = torch.Generator().manual_seed(len(kf) + len(cfg))
    err, bound, _, _ = run_case(_fmt(kf), _fmt(vf), [70, 9, 33], 2, 4, 64, P, Sq=2, splits=2,
                                config={"BLOCK_T": 32, **cfg}, gen=gen)
    assert err <= bound


PAIR_CASES = [  # channel scales in tiles of two pages: each query row held twice (PAIR)
    ("int4/channel", "int4/token", 64, 4, 32, [130, 37, 5], 1, 2),
    ("int4/channel", "int4/token", 128, 8, 32, [64, 95], 1, 1),     # G = 8: M = 16 exactly
    ("int4/token", "int4/channel", 64, 2, 32, [77, 33], 3, 2),      # value channel scales
    ("int4/channel", "int4/channel", 64, 1, 64, [200, 64], 2, 3),
    ("int4/channel", "fp4_e2m1/page", 64, 4, 32, [99], 1, 2),
    ("int2/channel", "int2/token", 64, 4, 32, [70, 129], 1, 2),    # full-width (int2) rows
    ("int3/token", "int3/channel", 64, 4, 32, [45, 96], 1, 1),
    ("fp8_e4m3/channel", "int4/token", 64, 4, 32, [99, 3], 1, 2),  # fp32 channel scales
    ("int4/channel", "int4/token", 64, 4, 32, [70, 33], 3, 2),     # G * Sq = 12: no pair
]


@pytest.mark.parametrize("kf,vf,D,G,P,lens,Sq,splits", PAIR_CASES)
def test_decode_channel_tiles_of_two_pages(kf, vf, D, G, P, lens, Sq, splits):
    gen = torch.Generator().manual_seed(case_seed(kf, vf, D, G, P, Sq))
    err, bound, _, _ = run_case(_fmt(kf), _fmt(vf), lens, 2, G, D, P, Sq=Sq, splits=splits,
                                config={"BLOCK_T": 2 * P}, gen=gen)
    assert err <= bound, f"relative error {err:.2e} > {bound:.1e}"


def test_decode_channel_tiles_of_two_pages_with_masks_window_mass_and_residual():
    gen = torch.Generator().manual_seed(29)
    km = torch.rand(2, 100, generator=gen) > 0.3
    km[:, 0] = True
    err, bound, _, (mass, mass_ref) = run_case(
        _fmt("int4/channel", True), _fmt("int4/channel", True), [150, 61], 2, 2, 64, 32, Sq=2,
        window=70, sinks=3, softcap=5.0, key_mask=km.to(DEV), with_mass=True, splits=2,
        config={"BLOCK_T": 64}, gen=gen)
    assert err <= bound
    assert rel_err(mass, mass_ref) <= 1e-4


def test_decode_int_masks_window_mass_and_speculative():
    gen = torch.Generator().manual_seed(19)
    km = torch.rand(2, 60, generator=gen) > 0.3
    km[:, 0] = True
    err, bound, _, (mass, mass_ref) = run_case(
        _fmt("int4/channel", True), _fmt("int4/token", True), [90, 37], 2, 4, 64, 32, Sq=3,
        window=40, sinks=3, softcap=5.0, key_mask=km.to(DEV), with_mass=True, splits=3,
        config={"BLOCK_T": 32}, gen=gen)
    assert err <= bound
    assert rel_err(mass, mass_ref) <= 1e-4


def test_decode_int_public_op_compiles_with_bf16_queries():
    gen = torch.Generator().manual_seed(23)
    kc, vc, bt, sl = make_paged_kv(_fmt("int4/channel", True), _fmt("int4/token", True),
                                   [50, 17], 2, 64, 32, gen=gen)
    q = torch.randn(2, 8, 1, 64, generator=gen).to(DEV, torch.bfloat16)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q):
        return paged_decode_attention(q, kc, vc, bt, sl, 0.125)

    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125)
    got = f(q)
    assert got.dtype == torch.bfloat16 and rel_err(got, ref) <= REL_ERR[torch.bfloat16]


@pytest.mark.parametrize("spec,P,least", [("fp8_e4m3/channel", 8, 16), ("int4/channel", 16, 32)])
def test_decode_channel_scales_need_large_enough_pages(spec, P, least):
    # a channel-scaled tile is one page of >= 16 keys (int codes: >= 32, see channel_min_page):
    # smaller pages are refused, and the runtime sends such layers to the reference
    from kvcompile.runtime.kernel_formats import kernel_readable

    fmt = _fmt(spec)
    kc, vc, bt, sl = make_paged_kv(fmt, fmt, [20], 2, 64, P, nan_fill=False)
    assert not kernel_readable(kc)
    assert kernel_readable(fmt.allocate(2, 2, least, 64))
    with pytest.raises(UnsupportedShapeError, match=f"page_size >= {least}"):
        paged_decode_attention(torch.randn(1, 4, 1, 64, device=DEV), kc, vc, bt, sl, 0.1)


def test_kernel_readable_by_op():
    from kvcompile.runtime.kernel_formats import kernel_readable

    for spec, res in (("int2/token", True), ("fp8_e4m3/channel", False),
                      ("fp4_e2m1/channel", False), ("fp4_e2m1/page", True)):
        c = _fmt(spec, res).allocate(2, 1, 32, 64)
        assert kernel_readable(c) and kernel_readable(c, "decode")
        assert not kernel_readable(c, "append") and not kernel_readable(c, "prefill")
    for spec in ("int4/channel", "int3/page", "int2/token"):   # kernels/append_int.py
        c = _fmt(spec).allocate(2, 1, 32, 64)
        assert kernel_readable(c, "append") and not kernel_readable(c, "prefill")
    plain = _fmt("fp8_e4m3/page").allocate(2, 1, 16, 64)
    assert all(kernel_readable(plain, op) for op in ("decode", "append", "prefill"))


@pytest.mark.parametrize("residual", [True, pytest.param(False, marks=pytest.mark.skipif(
    not os.environ.get("KVCOMPILE_TEST_FULL"),
    reason="KVCOMPILE_TEST_FULL=1: the int append kernel in the Engine (tests/gpu/"
           "test_int_graphs_gpu.py runs it on CUDA)"))])
def test_engine_decode_steps_read_int4_channel_residual_pages_with_the_kernel(residual):
    """KVConfig int4 + channel scales (keys int4 channel, values int4 token), with residual
    pages (written by the reference) or without (written by kernels/append_int.py): decode
    steps take the kernel (prefill stays on the reference), same tokens as the reference
    attention and writer."""
    import random

    from kvcompile import Engine, SamplingParams
    from kvcompile.api import state_of
    from tests.engine.tiny import config, make_llama64, random_prompts

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(random.Random(7), 2, 20, 40)
    outs = {}
    for kernels in ("reference", "triton"):
        torch._dynamo.reset()
        m = make_llama64()
        eng = Engine(m, config=config(kernels=kernels, kv_dtype="int4", residual=residual,
                                      scale_granularity="channel", page_size=32))
        outs[kernels] = [o.token_ids for o in eng.generate(prompts, greedy)]
        calls = state_of(m).counters.get("engine_decode_kernel_calls", 0)
        assert calls == (2 * (greedy.max_tokens - 1) if kernels == "triton" else 0)
    assert outs["triton"] == outs["reference"]
