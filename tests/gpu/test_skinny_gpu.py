"""The decode GEMMs' Triton kernel (kernels/skinny.py) and the op's measured choice
(runtime/skinny_op.py, KVConfig.decode_gemms="auto") on CUDA:

    pytest -q -m gpu tests/gpu/test_skinny_gpu.py

The kernel against F.linear in float64 at a decode step's shapes (bf16, M 1 / 16, split-K
included); "auto" measures both candidates once a shape (real CUDA timings), answers within
bf16's error either way, and a CUDA graph captured after the measurement replays the chosen
kernel; a shape first met inside a capture is not timed (cuBLAS, said in the notes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcompile.testing import REL_ERR, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (1024, 4096), (32000, 4096)])
def test_kernel_matches_linear(M, N, K):
    from kvcompile.kernels.skinny import skinny_linear

    g = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    for bias in (None, b):
        y = skinny_linear(x, w, bias)
        assert rel_err(y, _ref(x, w, bias)) < REL_ERR[torch.bfloat16]


def test_auto_measures_once_and_a_graph_replays_the_choice(monkeypatch):
    from kvcompile.runtime import skinny_op

    monkeypatch.setattr(skinny_op, "CHOICES", {})
    monkeypatch.setattr(skinny_op, "_UNMEASURED", set())
    op = torch.ops.kvcompile.skinny_linear
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    y = op(x, w, None, True)
    key = skinny_op.shape_key(x, w, None)
    choice, t_torch, t_triton = skinny_op.CHOICES[key]
    assert choice in ("torch", "triton") and t_torch > 0 and t_triton > 0
    assert (choice == "triton") == (t_triton <= skinny_op.MARGIN * t_torch)
    assert rel_err(y, _ref(x, w, None)) < REL_ERR[torch.bfloat16]
    timed = []
    monkeypatch.setattr(skinny_op, "time_candidates", lambda *a: timed.append(1) or [1, 1])
    static_x = x.clone()
    out = op(static_x, w, None, True)   # warm (cached choice: no timing)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static_x, w, None, True)
    static_x.copy_(torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert not timed
    expect = (skinny_op.skinny.skinny_linear(static_x, w) if choice == "triton"
              else F.linear(static_x, w))
    assert torch.equal(out, expect)   # the chosen implementation, bit for bit
    # a new shape first met inside a capture: cuBLAS, not timed
    w2 = w[:1024].contiguous()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        out2 = op(static_x, w2, None, True)
    graph2.replay()
    torch.cuda.synchronize()
    assert not timed
    assert skinny_op.shape_key(static_x, w2, None) not in skinny_op.CHOICES
    assert torch.equal(out2, F.linear(static_x, w2))
