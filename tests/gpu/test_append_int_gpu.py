"""The int append kernels (kernels/append_int.py) on the H200: bit-exact with PagedTensor.write
(codes, scales, zero points) for int4 / int3 / int2 x token / page / channel scales x head_dim x
page size, decode-style and bulk appends, sorted and grouped slots, fp32 and bf16 inputs; one
decode-step write captured in a CUDA graph and replayed; negative cases.

    pytest -q -m gpu tests/gpu/test_append_int_gpu.py -n 16     # or: gpu_jobs.sh append_int
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernels.kernel_cases import assert_same_storage, make_format, storage_pair
from tests.kernels.test_append_int import int_step_inputs, run_int_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF = [torch.float32, torch.bfloat16]
CASES = list(itertools.product(("int4", "int3", "int2"), ("token", "page", "channel"),
                               (64, 128, 256), (16, 64)))


@pytest.mark.parametrize("name,gran,D,P", CASES)
def test_int_append_matrix(name, gran, D, P):
    gen = torch.Generator().manual_seed(CASES.index((name, gran, D, P)))
    got = run_int_steps(name, gran, D, P, [2 * P + 3, 1, 1, 5, 1, P + 1], gen, device="cuda",
                        dtypes=BF)
    if gran != "token":
        assert got.reencoded >= 2


@pytest.mark.parametrize("name,gran,grouped,bulk", list(itertools.product(
    ("int4", "int3", "int2"), ("page", "channel"), (False, True), ("tiles", "runs"))))
def test_int_append_bulk(name, gran, grouped, bulk, monkeypatch):
    # more than append_int.BULK_TOKENS tokens in one write (the threshold lowered to 64 so
    # that the later writes take the bulk kernels too): "tiles" (fresh full pages from one tile,
    # the other runs one by one) and "runs" (windows of P slots per program)
    from kvcompile.kernels import append_int

    monkeypatch.setattr(append_int, "BULK_TOKENS", 64)
    monkeypatch.setattr(append_int, "PAGE_BULK", bulk)
    gen = torch.Generator().manual_seed(7)
    run_int_steps(name, gran, 128, 64, [2100, 1, 5, 300, 700], gen, device="cuda",
                  grouped=grouped, dtypes=BF)


@pytest.mark.parametrize("gran", ["channel", "token"])
def test_int_append_in_a_cuda_graph(gran):
    """One decode step's write (the 4-bit format: keys channel, values token scales; pages of
    64) captured once, replayed for 70 steps with new tokens copied into its inputs: the same
    bytes as PagedTensor.write after every step (no host sync inside the kernel's launch)."""
    from kvcompile.kernels.append import quantize_append

    gen = torch.Generator().manual_seed(3)
    B, H, D, P = 4, 8, 128, 64
    N = B * 3
    ref, got = storage_pair(make_format("int4", gran), N, H, P, D, "cuda")
    pages = torch.randperm(N, generator=gen).view(B, 3)
    x0 = int_step_inputs(B * 5, H, D, 0, gen).cuda()
    s0 = (pages[:, :1] * P + torch.arange(5)).reshape(-1).cuda()
    ref.write(s0, x0)
    quantize_append(got, s0, x0, grouped=True, direct=True)
    xs = torch.zeros(B, H, D, device="cuda")
    slots = torch.zeros(B, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # warm up (compile) outside the capture, on scratch
        scratch = storage_pair(make_format("int4", gran), N, H, P, D, "cuda")[0]
        quantize_append(scratch, slots, xs, grouped=True, direct=True)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        quantize_append(got, slots, xs, grouped=True, direct=True)
    for t in range(5, 75):
        x = int_step_inputs(B, H, D, 1 + t % 7, gen).cuda() * (1 + t / 10)
        s = (pages[:, t // P] * P + t % P).cuda()
        xs.copy_(x)
        slots.copy_(s)
        g.replay()
        ref.write(s, x)
        torch.cuda.synchronize()
        assert_same_storage(ref, got, f"replay at token {t}")


def test_int_append_check_catches_a_changed_zero_point():
    """Negative case: one zero point moved by an fp16 ulp after the kernel fails."""
    gen = torch.Generator().manual_seed(0)
    got = run_int_steps("int4", "channel", 128, 64, [70], gen, device="cuda")
    ref = storage_pair(make_format("int4", "channel"), got.num_pages, 2, 64, 128, "cuda")[0]
    for t in ("data", "scale", "zero"):
        getattr(ref, t).copy_(getattr(got, t))
    got.zero.view(torch.int16).view(-1)[5] += 1
    with pytest.raises(AssertionError, match="zero"):
        assert_same_storage(ref, got)
