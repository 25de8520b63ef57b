"""Which decode kernel runs on Hopper, and how the CUDA kernel cuts a sequence into splits.
Both are decided from shapes and format names only (no device sync: CUDA graphs capture them),
so they are tested here on the CPU; the kernel itself is tested by test_decode_sm90_emu.py and
on the GPU by tests/gpu/test_decode_sm90_gpu.py."""

import pytest

from kvcompile.kernels.decode import CUDA_DECODE_FORMATS, cuda_decode_by_default
from kvcompile.kernels.decode_sm90 import choose_splits, kernel_constants

H200_SMS = 132


@pytest.mark.parametrize("k,v,want", [
    ("fp8_e4m3", "fp8_e4m3", True), ("fp8_e5m2", "fp8_e5m2", True),
    ("bf16", "bf16", False), ("fp16", "fp16", False),   # Triton measured faster
    ("fp8_e4m3", "bf16", False), ("int4", "int4", False), ("fp4_e2m1", "fp4_e2m1", False)])
def test_auto_asks_for_the_cuda_kernel_only_for_fp8_pages(k, v, want):
    assert cuda_decode_by_default(k, v) is want
    assert CUDA_DECODE_FORMATS == {"fp8_e4m3", "fp8_e5m2"}


@pytest.mark.parametrize("k,kg,v,vg,want", [
    ("int4", "channel", "int4", "token", True),    # the Pareto table's K int4/V int4
    ("int4", "page", "int4", "page", False), ("int4", "token", "int4", "token", False),
    ("int4", "channel", "int4", "page", False), ("int3", "channel", "int3", "token", False),
    ("fp8_e4m3", "token", "fp8_e4m3", "page", True)])
def test_auto_asks_for_the_cuda_kernel_for_int4_with_its_scales(k, kg, v, vg, want):
    assert cuda_decode_by_default(k, v, kg, vg) is want


def _rounds_cost(B, H, L, s, slots, overhead=256):
    return -(-B * H * s // slots) * (L / s + overhead)


@pytest.mark.parametrize("B,H,L", [(64, 8, 8192), (16, 8, 32768), (1, 8, 131072), (1, 8, 300),
                                   (3, 2, 1033), (128, 8, 4096), (1, 1, 256), (7, 3, 50000)])
def test_splits_are_within_two_percent_of_the_best_round_count(B, H, L):
    ctas = kernel_constants(0, 0, 1, 1, 128, 128, 8, 1)[1]
    s = choose_splits(B, H, L, H200_SMS, ctas_per_sm=ctas)
    assert isinstance(s, int) and 1 <= s <= max(1, L // 256)
    costs = [_rounds_cost(B, H, L, t, H200_SMS * ctas) for t in range(1, max(1, L // 256) + 1)]
    assert _rounds_cost(B, H, L, s, H200_SMS * ctas) <= min(costs) * 1.02
    # and no smaller split count is as good (fewer partial outputs to merge)
    assert all(c > min(costs) * 1.02 for c in costs[:s - 1])


def test_splits_on_the_measured_h200_shapes():
    # fp8 pages, head_dim 128: 3 CTAs an SM; splits 3 measured fastest at these two shapes
    ctas = kernel_constants(0, 0, 1, 1, 128, 128, 8, 1)[1]
    assert ctas == 3
    assert choose_splits(64, 8, 8192, H200_SMS, ctas_per_sm=ctas) == 3
    assert choose_splits(16, 8, 32768, H200_SMS, ctas_per_sm=ctas) == 3
    # one long sequence: enough splits to fill one round of every SM's slots, not two
    s = choose_splits(1, 8, 131072, H200_SMS, ctas_per_sm=ctas)
    assert 8 * s <= H200_SMS * ctas < 8 * (s + 2)


def test_short_sequences_are_not_split_and_waves_keeps_the_old_rule():
    assert choose_splits(4, 8, 255, H200_SMS) == 1          # under 256 tokens: one split
    assert choose_splits(1, 8, 131072, H200_SMS, waves=2.0) == 33
    assert choose_splits(64, 8, 8192, H200_SMS, waves=8.0) == 3


@pytest.mark.parametrize("variant", ["base", "nocap", "aluv", "alu"])
def test_plan_with_automatic_splits(variant):
    """The launcher's plan with num_splits=0 (the split rule, the default in every model):
    shapes only, so it runs on CPU tensors. A parameter once shadowed the module's constants
    function here and every automatic launch on the GPU raised TypeError."""
    import torch

    from kvcompile.kernels import decode_sm90 as fast

    B, Hq, Hkv, D, P, pages = 2, 8, 2, 128, 16, 64
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    kd = torch.zeros(pages, Hkv, P, D, dtype=torch.uint8)
    sc = torch.ones(pages, Hkv)
    bt = torch.arange(B * (pages // B), dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), (pages // B) * P, dtype=torch.int32)
    lp = fast.plan_decode_sm90(q, kd, sc, kd, sc, bt, sl, None, None, "fp8_e4m3", "page",
                               "fp8_e4m3", "page", D ** -0.5, 0, 0, 0.0, 0, H200_SMS,
                               variant=variant)
    ctas = fast.kernel_constants(*lp.key)[1]
    assert lp.num_splits == choose_splits(B, Hkv, bt.shape[1] * P, H200_SMS, ctas_per_sm=ctas)


@pytest.mark.parametrize("fmt,gran,want", [
    ("fp8_e4m3", "page", "pvt4h"), ("fp8_e4m3", "tensor", "pvt4h"), ("fp8_e5m2", "page", "pvt4h"),
    ("fp8_e4m3", "token", "base"), ("bf16", "page", "base")])
def test_launch_without_a_variant_runs_the_default_variant(fmt, gran, want):
    """variant=None (what the run time passes): pvt4h for fp8 pages with page / tensor scales
    (measured faster on the H200), base elsewhere; qk_fp8 keeps base. The plan's kernel key
    carries exactly the named variant's bits."""
    import torch

    from kvcompile.kernels import decode_sm90 as fast

    B, Hq, Hkv, D, P, pages = 2, 8, 2, 128, 16, 8
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    dt = torch.uint8 if fmt.startswith("fp8") else torch.bfloat16
    kd = torch.zeros(pages, Hkv, P, D, dtype=dt)
    sc = (torch.ones(pages, Hkv) if gran == "page" else torch.ones(1) if gran == "tensor"
          else torch.ones(pages, Hkv, P)) if fmt.startswith("fp8") else None
    bt = torch.arange(pages, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), (pages // B) * P, dtype=torch.int32)
    args = (q, kd, sc, kd, sc, bt, sl, None, None, fmt, gran, fmt, gran, D ** -0.5, 0, 0, 0.0,
            1, H200_SMS)
    got = fast.plan_decode_sm90(*args).key
    named = fast.plan_decode_sm90(*args, variant=want).key
    assert got == named
    assert (got != fast.plan_decode_sm90(*args, variant="base").key) == (want != "base")
    if fmt == "fp8_e4m3" and gran == "page":
        assert fast.plan_decode_sm90(*args, qk_fp8=True).key[-1] == 1   # q8, no variant bits


def test_int4_pages_default_to_pvt4sp():
    """int4 K channel / V token pages without variant= run pvt4sp (cuda14h; measured faster than
    base on the H200 at every bench shape); at 16 query rows its bits reduce to pvt4nz's."""
    import torch

    from kvcompile.kernels import decode_sm90 as fast

    assert fast.default_variant(fast.INT4, fast.INT4, fast._SC_CHANZP, fast._SC_TOKZP) == "pvt4sp"
    B, Hkv, D, P, pages = 2, 2, 128, 64, 4
    for G, Sq in ((4, 1), (8, 2)):
        q = torch.randn(B, Hkv * G, Sq, D, dtype=torch.bfloat16)
        codes = torch.zeros(pages, Hkv, P, D // 2, dtype=torch.uint8)
        ks, kz = (torch.ones(pages, Hkv, D, dtype=torch.float16) for _ in range(2))
        vs, vz = (torch.ones(pages, Hkv, P, dtype=torch.float16) for _ in range(2))
        bt = torch.arange(pages, dtype=torch.int32).view(B, -1)
        sl = torch.full((B,), (pages // B) * P, dtype=torch.int32)
        args = (q, codes, ks, codes, vs, bt, sl, None, None, "int4", "channel", "int4", "token",
                D ** -0.5, 0, 0, 0.0, 1, H200_SMS)
        got = fast.plan_decode_sm90(*args, kz=kz, vz=vz).key
        assert got == fast.plan_decode_sm90(*args, kz=kz, vz=vz, variant="pvt4sp").key
        want = "pvt4sp" if G * Sq <= 8 else "pvt4nz"
        assert got == fast.plan_decode_sm90(*args, kz=kz, vz=vz, variant=want).key
