"""The decode and append correctness matrix of the GPU tests (tests/gpu/test_decode_matrix_gpu.py,
tests/gpu/test_append_gpu.py): case lists and checks (no pytest import).

Decode: every storage format and scale granularity (int4 / int3 / int2 and channel scales
included) x head_dim {64, 128, 256} x GQA ratio {1, 4, 8} x page size {16, 32, 64, 128} x Sq
{1, 3, 8}, odd and mixed lengths in each batch, against the fp32 reference
(kernels/reference.py) on fresh random inputs, outputs poisoned with NaN before each launch;
plus masks (window + sinks, key_mask, softcap), the attention mass, one split (direct write)
and many splits, K / V in different formats, bf16 residual pages, and every tile variant
bench_decode.py may pick (config_cases). Append: bit-exact with PagedTensor.write for every
format it writes, granularity and head_dim, bulk and decode-style appends.
(Was benchmarks/gpu_check_decode.py.)
"""

from __future__ import annotations

import itertools

import torch

from tests.kernels.kernel_cases import (
    append_slot_steps,
    assert_same_storage,
    make_format,
    run_case,
    storage_pair,
)

FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
           ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("fp8_e5m2", "token"),
           ("fp4_e2m1", "page"), ("fp4_e2m1", "token"), ("fp4_e2m1", "tensor")]
# Read by the decode kernel only (the append kernel leaves them to PagedTensor.write).
DECODE_ONLY = [("int4", "page"), ("int4", "token"), ("int4", "channel"), ("int3", "page"),
               ("int3", "token"), ("int3", "channel"), ("int2", "page"), ("int2", "token"),
               ("int2", "channel"), ("fp8_e4m3", "channel"), ("fp8_e5m2", "channel"),
               ("fp4_e2m1", "channel")]


def decode_cases(quick: bool):
    geo = [(1, 16, 1), (4, 32, 3), (8, 128, 1), (4, 16, 8), (8, 64, 1), (1, 128, 3)]
    cases = []
    for i, ((name, gran), D) in enumerate(itertools.product(FORMATS + DECODE_ONLY,
                                                            (64, 128, 256))):
        for j in range(1 if quick else 2):
            G, P, Sq = geo[(i + 3 * j) % len(geo)]
            if name.startswith("int") and gran == "channel":
                P = max(P, 32)  # the kernel refuses smaller pages (decode.channel_min_page)
            lens = [1 + (37 * i + 11 * j) % 300, 777 + 13 * i, 2 * P + 5, 4000 + 97 * j]
            cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq, lens=lens))
    extra = [
        dict(kf="fp8_e4m3", vf="fp4_e2m1", gran="page", D=128, G=4, P=16, Sq=1, lens=[900, 33]),
        dict(kf="bf16", vf="fp8_e5m2", gran="token", D=64, G=8, P=32, Sq=2, lens=[513, 7000]),
        dict(kf="fp4_e2m1", vf="fp4_e2m1", gran="page", D=128, G=4, P=16, Sq=4, lens=[3000, 61],
             window=500, sinks=4, softcap=30.0, with_mass=True),
        dict(kf="fp8_e4m3", vf="fp8_e4m3", gran="page", D=128, G=4, P=16, Sq=1,
             lens=[2048, 999], key_mask=True, with_mass=True),
        dict(kf="bf16", vf="bf16", gran="page", D=128, G=4, P=16, Sq=1, lens=[4096, 100],
             splits=1),
        dict(kf="fp8_e5m2", vf="fp8_e5m2", gran="tensor", D=256, G=8, P=16, Sq=1,
             lens=[20000], splits=300),
        dict(kf="bf16", vf="bf16", gran="page", D=128, G=4, P=16, Sq=1, lens=[5000, 70],
             q_dtype=torch.bfloat16, window=1000, sinks=1),
        # issue 9: K / V in different formats and granularities, residual pages
        dict(kf="int4", vf="int4", gran="channel", vgran="token", D=128, G=4, P=64, Sq=1,
             lens=[4001, 77, 64]),
        dict(kf="int4", vf="int4", gran="channel", vgran="token", D=64, G=1, P=64, Sq=3,
             lens=[1000, 5], residual=True),
        dict(kf="int4", vf="fp4_e2m1", gran="channel", vgran="page", D=128, G=4, P=64, Sq=1,
             lens=[3000, 130], residual=True),
        dict(kf="int2", vf="int2", gran="channel", vgran="token", D=128, G=8, P=64, Sq=1,
             lens=[2500, 63], window=700, sinks=4, with_mass=True),
        dict(kf="int3", vf="int3", gran="channel", vgran="token", D=128, G=4, P=32, Sq=2,
             lens=[1800, 17], key_mask=True, residual=True),
        dict(kf="int4", vf="int4", gran="token", vgran="page", D=64, G=1, P=16, Sq=1,
             lens=[1000, 21], config=dict(BLOCK_T=16)),  # bumped to 32-token tiles
        dict(kf="fp8_e4m3", vf="fp8_e4m3", gran="channel", vgran="token", D=128, G=4, P=64,
             Sq=1, lens=[6000, 300], residual=True, q_dtype=torch.bfloat16),
        dict(kf="fp4_e2m1", vf="fp4_e2m1", gran="channel", vgran="page", D=128, G=4, P=32,
             Sq=1, lens=[2222, 31], softcap=30.0),
        dict(kf="int4", vf="int2", gran="token", vgran="page", D=128, G=4, P=16, Sq=1,
             lens=[3000, 41], config=dict(BLOCK_T=128, num_stages=1, SPLIT=1, num_warps=4)),
    ]
    return cases + extra



def config_cases():
    """Every tile variant bench_decode.py may pick, checked before its timing is trusted."""
    from benchmarks.bench_decode import VARIANTS

    fmts = {"bf16": [("bf16", "page")], "fp8": [("fp8_e4m3", "page"), ("fp8_e5m2", "token")],
            "fp4": [("fp4_e2m1", "page")]}
    cases = []
    for fam, variants in VARIANTS.items():
        if fam == "int":  # the bench's int rows: K channel, V token or fp4 page, pages of 64
            for cfg in variants:
                cases += [dict(kf="int4", vf="int4", gran="channel", vgran="token", D=128, G=4,
                               P=64, Sq=1, lens=[1500, 37, 640], config=dict(cfg)),
                          dict(kf="int2", vf="fp4_e2m1", gran="channel", vgran="page", D=64,
                               G=8, P=64, Sq=3, lens=[900, 5], config=dict(cfg))]
            continue
        for cfg in variants:
            for k, (name, gran) in enumerate(fmts[fam]):
                D, G, P, Sq = ((128, 4, 16, 1), (64, 8, 32, 3))[k % 2]
                cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq,
                                  lens=[1500, 37, 640], config=dict(cfg)))
                if fam != "fp8":
                    D, G, P, Sq = 64, 8, 32, 3
                    cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq,
                                      lens=[900, 5], config=dict(cfg)))
    return cases


def check_decode(c, gen) -> str:
    c = dict(c)
    km = None
    if c.pop("key_mask", False):
        km = torch.rand(len(c["lens"]), max(c["lens"]) - 3, generator=gen) > 0.2
        km = km.to("cuda")
    kf, vf, gran = c.pop("kf"), c.pop("vf"), c.pop("gran")
    vgran, res = c.pop("vgran", gran), c.pop("residual", False)
    lens, D, G, P = c.pop("lens"), c.pop("D"), c.pop("G"), c.pop("P")
    err, bound, _, (mass, mass_ref) = run_case(make_format(kf, gran, res),
                                                make_format(vf, vgran, res), lens, 2, G, D, P,
                                                key_mask=km, device="cuda", gen=gen, **c)
    ok = err <= bound
    msg = f"err {err:.2e} <= {bound:.1e}"
    if mass is not None:
        merr = float((mass - mass_ref).norm() / mass_ref.norm())
        ok = ok and merr <= 1e-3
        msg += f", mass err {merr:.1e}"
    if not ok:
        raise AssertionError(msg)
    return msg


def append_cases(quick: bool):
    cases = [dict(name=n, gran=g, D=D, P=P) for (n, g), D, P in itertools.product(
        FORMATS, (64, 128, 256), (16,) if quick else (16, 64))]
    bulk = [dict(name=n, gran=g, D=128, P=16, bulk=True) for n, g in FORMATS if g != "token"]
    return cases + bulk


def check_append(c, gen) -> str:
    from kvcompile.kernels.append import quantize_append

    H, P = 4, c["P"]
    steps = [1700, 1, 5, 300] if c.get("bulk") else [2 * P + 3, 1, 1, 5, 1, P + 1]
    per_seq = -(-sum(steps) // P)
    N = 3 * per_seq + 4
    ref, got = storage_pair(make_format(c["name"], c["gran"]), N, H, P, c["D"], "cuda")
    perm = torch.randperm(N, generator=gen).tolist()
    pages = [perm[k * per_seq:(k + 1) * per_seq] for k in range(3)]
    for i, slots in enumerate(append_slot_steps(steps, P, pages, gen)):
        x = torch.randn(slots.numel(), H, c["D"], generator=gen) * (1.0 + 2.0 * i)
        x = x.to(torch.bfloat16 if i % 2 else torch.float32).cuda()
        ref.write(slots.cuda(), x)
        quantize_append(got, slots.cuda(), x)
        assert_same_storage(ref, got, f"write {i}")
    return "bit-exact"
