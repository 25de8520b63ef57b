"""The CUDA latent decode kernel (kernels/cuda/latent_decode.cuh, launcher kernels/latent_sm90.py,
opt-in) on the CPU: its own source run by the emulation (kernels/cuda/emu, g++ only) against the
paged reference over the same latent pages (kernels/dense.py, latent=True), DeepSeek's widths
(R 512, DR 64) with short contexts; and nvcc builds for sm_90 (no GPU needed) without spills.
Each emulated variant is one g++ build (~10 s cold, cached after): the default run builds two
(bf16 pages; fp8 e4m3 latent + bf16 rotary key with the "aluk" variant, pages of 8, so tiles span
8 pages); KVCOMPILE_TEST_FULL=1 adds the other formats, page sizes and variants.
tests/gpu/test_latent_sm90_gpu.py-style timing is benchmarks/bench_latent_decode.py --cuda."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels import latent_sm90 as ls
from kvcompile.kernels.cuda import build
from kvcompile.kernels.cuda.emu import build_emu
from kvcompile.kernels.dense import paged_reference_attention
from kvcompile.testing import REL_ERR, rel_err
from tests.kernels.test_decode_sm90_nvcc import _cuobjdump
from tests.kernels.test_latent_decode import _masked_reference, _mass_reference
from tests.kernels.test_latent_decode import _pool as _latent_pool

R, DR = 512, 64
FULL = bool(os.environ.get("KVCOMPILE_TEST_FULL"))


def _pool(c_fmt: str, r_fmt: str, lens: list[int], g, page: int = 16):
    return _latent_pool(c_fmt, r_fmt, lens, g, page, R, DR)


def _case(c_fmt, r_fmt, heads, lens, page, q_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool, plan = _pool(c_fmt, r_fmt, lens, g, page)
    q = (torch.randn(len(lens), heads, R + DR, generator=g) * 0.05).to(q_dtype)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q.float()[:, :, None], plan, None,
                                    True, 0, 0.0, 0.2, latent=True)[:, :, 0]
    return pool, plan, q, ref


def _emulate(pool, plan, q, lens, **kw):
    sl = torch.tensor(lens, dtype=torch.int32)
    lp = ls.plan_latent_sm90(q, pool.k[0], pool.v[0], plan.block_tables, sl, 0.2, poison=True,
                             **kw)
    return build_emu.run_latent(lp)


def _bound(c_fmt):   # the MMA dtype: bf16 for bf16 pages, fp16 for fp16 / fp8 pages
    return REL_ERR[torch.bfloat16 if c_fmt == "bf16" else torch.float16]


# (latent, rotary key, heads, lengths, page, splits, variant, q dtype, ring stages, warps)
CASES = [
    # 20 heads: two head blocks, the second 4 rows; 3 splits over [300, 17]: an empty split;
    # the 5-stage ring wraps (10 half tiles in the first split)
    ("bf16", "bf16", 20, [300, 17], 16, 3, "base", torch.bfloat16, None, 4),
    # pages of 8: a 64-token tile gathers 8 pages (8 scales); fp8 keys and values widened by
    # integer ops ("alu"); the 4-stage ring (two CTAs an SM) wraps; 8 warps (8 tokens a warp in
    # the scores, 64 output columns a warp: 8-byte value units)
    ("fp8_e4m3", "bf16", 16, [329, 64], 8, 2, "alu", torch.bfloat16, 4, 8),
    # "wide": the latent widened once a tile into a 16-bit shared copy that P V reads (mla22j);
    # 20 heads (a partial second head block), the 6-stage ring wraps, an empty split
    ("fp8_e4m3", "bf16", 20, [520, 30], 16, 3, "wide", torch.bfloat16, None, 4),
]
FULL_CASES = [
    # "ksplit" (mla22k): scores split over the warps by k, q in registers, partial sums through
    # shared memory; fp8 latent and rotary pages of 8 (per-page scales on both partials), the
    # 4-stage ring (two CTAs an SM) wraps, an empty split; "ostage": O out as whole rows (the
    # default run has this launch with the fused merge: test_fused_merge_and_profile)
    ("fp8_e4m3", "fp8_e4m3", 20, [329, 17], 8, 3, "ostage+ksplit", torch.bfloat16, 4, 4),
    ("bf16", "bf16", 20, [300, 17], 16, 3, "ksplit", torch.bfloat16, None, 4),
    ("fp8_e5m2", "bf16", 16, [300, 64], 32, 2, "aluv+ksplit", torch.float32, None, 4),
    # ksplit at 8 warps: 4 k parts x 2 token groups (32 tokens each), two CTAs an SM
    ("fp8_e4m3", "fp8_e4m3", 20, [329, 17], 8, 3, "ksplit", torch.bfloat16, 4, 8),
    ("bf16", "bf16", 20, [300, 17], 16, 1, "ostage", torch.bfloat16, None, 4),  # direct
    ("fp8_e5m2", "fp8_e4m3", 16, [300, 64], 32, 2, "wide", torch.bfloat16, None, 8),
    ("fp8_e4m3", "bf16", 16, [700, 1], 16, 1, "base", torch.bfloat16, None, 4),  # 10 stages wrap
    ("fp8_e5m2", "fp8_e4m3", 16, [100], 32, 1, "aluk", torch.float32, None, 4),
    ("fp8_e4m3", "fp8_e4m3", 32, [150, 70], 16, 2, "aluk", torch.float16, 4, 4),
    ("fp8_e5m2", "fp8_e5m2", 16, [150, 40], 16, 2, "alu", torch.bfloat16, None, 4),
    ("fp8_e4m3", "bf16", 16, [200], 16, 1, "aluv", torch.bfloat16, None, 4),
    ("fp16", "fp16", 8, [150], 128, 1, "base", torch.float16, None, 4),
    ("fp8_e4m3", "bf16", 16, [329, 64], 8, 2, "alu", torch.bfloat16, 4, 4),
    ("bf16", "bf16", 20, [300, 17], 16, 3, "base", torch.bfloat16, None, 8),
    # 8 warps over fp8 rotary keys: 64 rotary rows a pass, half the threads idle
    ("fp8_e4m3", "fp8_e4m3", 16, [400], 16, 1, "base", torch.bfloat16, None, 8),
]


@pytest.mark.skipif(not build_emu.available()[0], reason="g++ not found")
@pytest.mark.parametrize("case", CASES + (FULL_CASES if FULL else []),
                         ids=lambda c: f"{c[0]}-{c[1]}-h{c[2]}-p{c[4]}-s{c[5]}-{c[6]}-ns{c[8]}-w{c[9]}")
def test_emulated_matches_reference(case):
    c_fmt, r_fmt, heads, lens, page, splits, variant, qd, stages, warps = case
    pool, plan, q, ref = _case(c_fmt, r_fmt, heads, lens, page, qd)
    out = _emulate(pool, plan, q, lens, num_splits=splits, variant=variant, stages=stages,
                   warps=warps)
    err = rel_err(out, ref)
    assert err <= _bound(c_fmt), f"relative error {err:.3e} > {_bound(c_fmt):.1e}"
    if case is CASES[0]:
        # negative control: the kernel told one token less of the short sequence than the
        # reference sees (its last page then ends one row earlier)
        short = lens[:-1] + [lens[-1] - 1]
        bad = _emulate(pool, plan, q, short, num_splits=splits, variant=variant, stages=stages,
                       warps=warps)
        assert rel_err(bad[-1], ref[-1]) > _bound(c_fmt)


@pytest.mark.skipif(not build_emu.available()[0], reason="g++ not found")
@pytest.mark.parametrize("which", [1, 2], ids=["alu", "wide"])
def test_page_scales_are_read(which):
    """Negative control for the fp8 path: the latent page scales doubled after the reference
    was taken change the output beyond the bound (scores and probabilities use them; "wide"
    values come from its 16-bit copy, their scale through P)."""
    c_fmt, r_fmt, heads, lens, page, splits, variant, qd, stages, warps = CASES[which]
    pool, plan, q, ref = _case(c_fmt, r_fmt, heads, lens, page, qd)
    pool.k[0].scale.mul_(2.0)
    out = _emulate(pool, plan, q, lens, num_splits=splits, variant=variant, stages=stages,
                   warps=warps)
    assert rel_err(out, ref) > 0.1


@pytest.mark.skipif(not build_emu.available()[0], reason="g++ not found")
@pytest.mark.parametrize("which", [0, 1], ids=["bf16-base", "fp8-alu-w8"])
def test_key_mask_and_attn_mass(which):
    """key_mask (an HF decode step's mask: left padding over a whole tile, holes, a row hidden
    whole, a mask narrower than the longest row) and H2O's attn_mass (each key's probability
    summed over the heads, added to what the mass held, keys below its width) through CASES'
    launches (no build of their own), against plain torch: sequence 0's first tile is hidden
    whole (its split's running max stays -inf for a tile), sequence 1 gets zeros and no mass.
    Negatives: the same launch without the mask misses the reference; an all-True mask equals
    no mask; the mass leaves the output as it is."""
    c_fmt, r_fmt, heads, _, page, splits, variant, qd, stages, warps = CASES[which]
    lens = [300, 17, 90]
    g = torch.Generator().manual_seed(21 + which)
    pool, plan = _pool(c_fmt, r_fmt, lens, g, page)
    q = (torch.randn(len(lens), heads, R + DR, generator=g) * 0.05).to(qd)
    km = torch.rand(len(lens), 200, generator=g) > 0.3   # holes; keys 200..299 of row 0 seen
    km[0, :70] = False                                    # left padding: tile 0 and 6 more
    km[1] = False                                         # every key of row 1 hidden
    kw = dict(num_splits=splits, variant=variant, stages=stages, warps=warps)
    sl = torch.tensor(lens, dtype=torch.int32)
    lp = ls.plan_latent_sm90(q, pool.k[0], pool.v[0], plan.block_tables, sl, 0.2, poison=True,
                             key_mask=km, mass_len=250, **kw)
    out = build_emu.run_latent(lp)
    before = torch.rand(len(lens), 1, 250, generator=g)
    mass = before.clone()
    ls.add_mass(lp, mass, sl)
    ref = _masked_reference(pool, plan, q, lens, km)
    ref_mass = _mass_reference(pool, plan, q, lens, km, 250)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert rel_err(out, ref) <= _bound(c_fmt)
    assert rel_err(mass - before, ref_mass) <= _bound(c_fmt)
    assert torch.equal(mass[1], before[1]) and torch.equal(mass[2, :, 90:], before[2, :, 90:])
    one = ls.plan_latent_sm90(q, pool.k[0], pool.v[0], plan.block_tables, sl, 0.2, poison=True,
                              key_mask=km, mass_len=250, **dict(kw, num_splits=1))
    assert rel_err(build_emu.run_latent(one), ref) <= _bound(c_fmt)   # one split: the kernel
    mass = before.clone()                                              # writes (max, sum) too
    ls.add_mass(one, mass, sl)
    assert rel_err(mass - before, ref_mass) <= _bound(c_fmt)
    assert torch.equal(_emulate(pool, plan, q, lens, key_mask=km, **kw), out)
    plain = _emulate(pool, plan, q, lens, **kw)
    assert rel_err(plain[[0, 2]], ref[[0, 2]]) > _bound(c_fmt)
    same = _emulate(pool, plan, q, lens, key_mask=torch.ones(len(lens), 300, dtype=torch.bool),
                    **kw)
    assert torch.equal(same, plain)
    with pytest.raises(UnsupportedShapeError, match="key_mask must be a bool tensor"):
        _emulate(pool, plan, q, lens, key_mask=km.to(torch.uint8), **kw)


def test_merge_once_matches_torch(monkeypatch):
    """The one-launch merge (latent_decode.merge_launch, "once": every split loaded at once, R
    over programs) and the loop merge it replaces against merge_splits (PyTorch), 3 splits (a
    masked 4th slot), one split empty for one sequence, 20 heads (a partial head block).
    Negative: the merge told one split less differs."""
    from kvcompile.kernels import latent_decode as ld

    g = torch.Generator().manual_seed(3)
    B, S, H = 2, 3, 20
    acc = torch.randn(B, S, H, R, generator=g)
    ml = torch.stack([torch.randn(B, S, H, generator=g) * 4,
                      torch.rand(B, S, H, generator=g) * 10 + 1], -1)
    ml[1, 2, :, 0], ml[1, 2, :, 1] = float("-inf"), 0.0   # sequence 1's last split: empty
    acc[1, 2] = 0.0
    ref = ls.merge_splits(acc, ml)
    for mode in ("once", "loop"):
        monkeypatch.setattr(ld, "MERGE", mode)
        out = torch.empty(B, H, R)
        ld.merge_launch(acc, ml, out, S)
        assert rel_err(out, ref) <= 1e-6, mode
    short = torch.empty(B, H, R)
    ld.merge_launch(acc[:, :2].contiguous(), ml[:, :2].contiguous(), short, 2)
    assert rel_err(short[0], ref[0]) > 1e-2


def test_refusals_name_the_fix():
    g = torch.Generator().manual_seed(0)
    spec = LayerSpec(num_kv_heads=1, head_dim=256, v_head_dim=DR,
                     k_format=KVFormat("bf16", "page"), v_format=KVFormat("bf16", "page"))
    pool = PagePool([spec], 4, 16)
    q = torch.randn(1, 16, 256 + DR, generator=g).to(torch.bfloat16)
    why = ls.unsupported(q, pool.k[0], pool.v[0])
    assert "512 + 64" in why
    pool2, plan, q2, _ = _case("bf16", "bf16", 16, [20], 16)
    assert ls.unsupported(q2, pool2.k[0], pool2.v[0]) == ""
    with pytest.raises(UnsupportedShapeError, match="unknown variant"):
        ls.plan_latent_sm90(q2, pool2.k[0], pool2.v[0], plan.block_tables,
                            torch.tensor([20], dtype=torch.int32), 0.2, variant="nope")
    with pytest.raises(UnsupportedShapeError, match="stages"):
        ls.geometry(3, 3, R, DR, 16, stages=6)   # 6 x 37 KB bf16 half tiles do not fit


def test_geometry_and_splits():
    # bf16: five 37 KB half-tile stages, one CTA an SM; fp8 latent + bf16 rotary: ten 21 KB
    # stages, and four fit two CTAs an SM
    ns, smem, ctas = ls.geometry(3, 3, R, DR, 16)
    assert (ns, ctas) == (5, 1) and smem <= ls.SMEM_LIMIT
    ns, smem, ctas = ls.geometry(0, 3, R, DR, 16)
    assert (ns, ctas) == (10, 1) and smem <= ls.SMEM_LIMIT
    assert ls.geometry(0, 3, R, DR, 16, stages=4)[2] == 2
    # the H200's 132 SMs filled once: B16 -> 8 splits, B64 -> 2, B1 x 8k -> 32 (256 tokens each)
    assert ls.choose_splits(16, 1, 8192, 132, 1) == 8
    assert ls.choose_splits(64, 1, 32768, 132, 1) == 2
    assert ls.choose_splits(1, 1, 8192, 132, 1) == 32
    assert ls.choose_splits(16, 2, 8192, 132, 2) == 8


# (ck, rk, r, dr, page, qt, stages, var): fp8 + bf16 rotary at two CTAs an SM with the alu
# variant (one nvcc build, ~8 s, in the default run); (full) the bf16 default, fp8 at the default
# stages, aluk over e5m2 with fp32 queries, aluv, fp16
NVCC = [(0, 3, R, DR, 16, 1, 4, 3)]
NVCC_FULL = [(3, 3, R, DR, 16, 1, None, 0), (0, 3, R, DR, 16, 1, None, 0),
             (1, 1, R, DR, 8, 2, None, 1), (3, 3, R, DR, 16, 1, None, 0, 8),
             (0, 0, R, DR, 16, 1, 4, 3, 8),
             (0, 0, R, DR, 16, 1, None, 2), (2, 2, R, DR, 128, 0, None, 0),
             (0, 3, R, DR, 16, 1, None, 4), (1, 0, R, DR, 16, 1, None, 4, 8),
             (0, 0, R, DR, 16, 1, 4, 64), (3, 3, R, DR, 16, 1, None, 64),
             (0, 0, R, DR, 16, 1, 4, 64, 8),
             (3, 3, R, DR, 16, 1, None, 256), (0, 3, R, DR, 16, 1, 4, 256)]   # the routes, masked


@pytest.mark.skipif(build.nvcc_path() is None or _cuobjdump() is None,
                    reason="nvcc / cuobjdump not found")
@pytest.mark.parametrize("key", NVCC + (NVCC_FULL if FULL else []),
                         ids=lambda k: "-".join(map(str, k)))
def test_builds_for_sm90_without_spills(key, tmp_path, monkeypatch):
    """Builds for sm_90 into a fresh cache; no local memory (spills) in the SASS; the MMA count
    a 64-token tile takes (QK^T 72 + PV 64 HMMA.16816); the F2FP conversions of the latent: 256
    a tile (base), 128 with aluk or aluv (scores or values by integer ops), none with alu; 16
    for an fp8 rotary key; none for 16-bit pages."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    defines, ctas, _ = ls.kernel_constants(*key)
    cubin = build.build_cubin("latent_decode.cuh", "kvc_latent_decode", ls.KERNEL_CALL, defines,
                              arch="sm_90", threads=defines["KVC_LW"] * 32, min_blocks=ctas,
                              params="LatentParams")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          timeout=120).stdout
    assert not re.search(r"\b(LDL|STL)(\.|\s)", sass), "local memory: registers spilled"
    warps = key[8] if len(key) > 8 else 4
    assert len(re.findall(r"\bHMMA\.16816", sass)) == 136 * 4 // warps   # a warp's share
    unpack = len(re.findall(r"F2FP\.F16\.E(4M3|5M2)\.UNPACK_B", sass))
    fp8 = key[0] < 2
    latent = {0: 256, 1: 128, 2: 128, 3: 0, 4: 128}[key[7] & 7] if fp8 else 0
    assert unpack == (latent + (16 if key[1] < 2 else 0)) * 4 // warps, unpack


@pytest.mark.skipif(not build_emu.available()[0], reason="g++ not found")
def test_fused_merge_and_profile():
    """The mla22k options in one launch (one g++ build): variant "ostage+ksplit" (scores split
    over the warps by k, q in registers, partial scores through shared memory; O out as whole
    rows), fused_merge (the last CTA of each head block merges the splits), the per-CTA timers;
    fp8 e4m3 latent and rotary pages of 8 (per-page scales on every warp's partial), the 4-stage
    ring (two CTAs an SM) wrapping, 20 heads (a partial second head block), 3 splits over
    [300, 17] (an empty split), outputs poisoned: matches the reference; the arrival counters
    are back at 0; every CTA's timers in order and its tile count. Negatives: the latent page
    scales doubled (> 0.1); a head block's counter left at 1 (its merge then runs one CTA
    early, before the last split's partials) fails the bound."""
    c_fmt, r_fmt, heads, lens, page, splits = "fp8_e4m3", "fp8_e4m3", 20, [300, 17], 8, 3
    kw = dict(num_splits=splits, variant="ostage+ksplit", stages=4, fused_merge=True)
    pool, plan, q, ref = _case(c_fmt, r_fmt, heads, lens, page)
    ctas = len(lens) * 2 * splits
    prof = torch.zeros(ctas * ls.PROF_SLOTS, dtype=torch.int64)
    out = _emulate(pool, plan, q, lens, profile=prof, **kw)
    assert rel_err(out, ref) <= _bound(c_fmt)
    cnt = ls.arrivals(torch.device("cpu"), 4)
    assert cnt[:4].tolist() == [0, 0, 0, 0]
    p = prof.view(ctas, ls.PROF_SLOTS)
    times = p[:, [0, 1, 3, 4, 5]]   # entry, q, loop end, stored, merged (tile 0: CTAs with tiles)
    assert bool((times[:, 1:] >= times[:, :-1]).all()) and bool((times[:, 0] > 0).all())
    # tiles a CTA: 5 tiles of sequence 0 over 3 splits of 2 -> 2, 2, 1; sequence 1: 1, 0, 0
    assert p[:, 7].view(2, 2, splits)[:, 0].tolist() == [[2, 2, 1], [1, 0, 0]]
    cnt[1] = 1   # sequence 0, head block 1
    bad = _emulate(pool, plan, q, lens, profile=prof, **kw)
    cnt.zero_()
    assert not rel_err(bad[0, 16:], ref[0, 16:]) <= _bound(c_fmt)
    pool.k[0].scale.mul_(2.0)
    assert rel_err(_emulate(pool, plan, q, lens, profile=prof, **kw), ref) > 0.1


def test_cuda_launch_rule(monkeypatch):
    """The run time's route table (latent_sm90.CUDA_LAUNCH): below a page kind's first size the
    Triton rule (None), else the last entry the step's batch x context reaches; a copy each
    time (a caller's edit does not change the table)."""
    assert ls.cuda_launch(False, (1 << 17) - 1) is None
    assert ls.cuda_launch(False, 16 * 8192) == dict(ls.CUDA_LAUNCH[False][0][1])
    for kind, entries in ls.CUDA_LAUNCH.items():   # sizes ascending, options a launch takes
        sizes = [n for n, _ in entries]
        assert sizes == sorted(sizes), kind
        for _, opts in entries:
            assert set(opts) <= {"stages", "variant", "warps", "fused_merge", "num_splits"}, opts
    table = [(100, {"stages": 4}), (1000, {"stages": 4, "fused_merge": True})]
    monkeypatch.setitem(ls.CUDA_LAUNCH, True, table)
    assert ls.cuda_launch(True, 99) is None
    assert ls.cuda_launch(True, 999) == {"stages": 4}
    got = ls.cuda_launch(True, 1 << 30)
    assert got == {"stages": 4, "fused_merge": True}
    got["stages"] = 9
    assert table[1][1]["stages"] == 4
