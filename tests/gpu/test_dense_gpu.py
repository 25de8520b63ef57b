"""The reference attention (kernels/dense.py) on CUDA: NaN / Inf in K/V as eager attention,
masked keys inert, empty rows 0 (the CUDA prefill fallback). On the H200:

    pytest -q -m gpu tests/gpu/test_dense_gpu.py        # or: bash benchmarks/gpu_jobs.sh dense

Each case compares sdpa_attention (torch SDPA, then the exact fp32 path where SDPA's output is
not finite) on CUDA with eager attention computed per query over the keys it sees (fp64, CPU).
(Was benchmarks/gpu_check_dense.py.)
"""

from __future__ import annotations

import pytest
import torch

from kvcompile.kernels.dense import sdpa_attention, sdpa_rows
from kvcompile.testing import REL_ERR, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = ("finite", "v_nan_seen", "v_inf_seen", "k_nan_seen", "masked_nan", "row_empty")


def eager_rows(q, k, v, seen, scale):
    # q [B, Hq, S, D], k/v [B, Hkv, L, D], seen [B, 1, S, L] -> [B, Hq, S, Dv] fp64
    B, Hq, S, _ = q.shape
    rep = Hq // k.shape[1]
    out = torch.zeros(B, Hq, S, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(S):
                keys = seen[b, 0, i].nonzero()[:, 0]
                if keys.numel():
                    s = (q[b, h, i].double() @ k[b, h // rep, keys].double().T) * scale
                    out[b, h, i] = torch.softmax(s, -1) @ v[b, h // rep, keys].double()
    return out


def assert_like_eager(got, ref, what: str, dt) -> None:
    """got (fp64, CPU) has ref's NaN / +Inf / -Inf where ref has them, and its finite values
    within 10x the dtype's tolerance."""
    for where in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(where(got), where(ref)), f"{what}: {where.__name__} differs"
    fin = torch.isfinite(ref)
    assert rel_err(got[fin], ref[fin]) <= 10 * REL_ERR[dt]


def make_case(name, g):
    B, Hq, Hkv, S, L, D = 2, 8, 2, 6, 40, 64
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, S), (Hkv, L), (Hkv, L)))
    seen = (torch.arange(L)[None] <= torch.arange(L - S, L)[:, None])[None, None]
    seen = seen.expand(B, 1, S, L).clone()
    seen[1, :, :, :5] = False
    if name == "v_nan_seen":
        v[0, 1, 36, 3] = float("nan")
    elif name == "v_inf_seen":
        v[1, 0, 20, 2] = float("inf")
    elif name == "k_nan_seen":
        k[1, 1, 37, 0] = float("nan")
    elif name == "masked_nan":
        k[1, 0, 1, 0] = v[1, 1, 2, 2] = float("nan")
    elif name == "row_empty":
        seen[0, :, 2] = False
    return q, k, v, seen


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", CASES)
def test_dense_non_finite_rules(name, dt):
    q, k, v, seen = make_case(name, torch.Generator().manual_seed(CASES.index(name)))
    ref = eager_rows(q, k, v, seen, 0.125)
    got = sdpa_attention(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt),
                         seen.cuda(), None, 0.125).double().cpu()
    assert_like_eager(got, ref, f"{name} {dt}", dt)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", ("finite", "v_nan_seen", "masked_nan"))
def test_sdpa_rows_left_padded(name, dt):
    """sdpa_rows (a left-padded fresh prompt, one causal SDPA call per row: flash / cuDNN on
    CUDA) against eager attention under the padded causal mask; a padding query gives 0."""
    g = torch.Generator().manual_seed(70 + len(name))
    B, Hq, Hkv, S, D = 3, 8, 2, 200, 64
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    starts = [0, 37, 150]
    if name == "v_nan_seen":
        v[1, 1, 120, 3] = float("nan")
    elif name == "masked_nan":
        k[2, 0, 20, 0] = v[1, 1, 30, 2] = float("nan")
    j = torch.arange(S)
    seen = torch.stack([(j[None] <= j[:, None]) & (j[None] >= s) for s in starts])[:, None]
    ref = eager_rows(q.to(dt), k.to(dt), v.to(dt), seen, 0.125)
    got = sdpa_rows(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt), starts, 0.125)
    got = got.double().cpu()
    assert_like_eager(got, ref, f"{name} {dt}", dt)
    assert not got[2, :, :150].any()


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", ("finite", "v_nan_seen"))
def test_sdpa_packed_prompts(name, dt):
    """sdpa_packed (the Engine's step of fresh prompts, packed along the sequence: one causal
    SDPA call a prompt on its own keys, one finiteness check for all) against eager attention
    under the block-diagonal causal mask; a NaN stays in its prompt."""
    from kvcompile.kernels.dense import sdpa_packed

    g = torch.Generator().manual_seed(80 + len(name))
    lens, Hq, Hkv, D = [130, 130, 1, 57, 200, 200], 8, 2, 64   # runs of equal lengths: batched
    T = sum(lens)
    # q in the layout a projection gives ([1, T, H, D] transposed), k / v contiguous
    q = torch.randn(1, T, Hq, D, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))
    if name == "v_nan_seen":
        v[0, 1, 270, 3] = float("nan")    # prompt 3 (alone in its run)
    pid = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    j = torch.arange(T)
    seen = ((j[None] <= j[:, None]) & (pid[None] == pid[:, None]))[None, None]
    ref = eager_rows(q.to(dt), k.to(dt), v.to(dt), seen, 0.125)
    got = sdpa_packed(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt), lens, 0.125)
    got = got.double().cpu()
    assert_like_eager(got, ref, f"{name} {dt}", dt)
    # the runs of equal lengths went to a fused kernel as one batch (not the math kernel,
    # nor a call a prompt)
    from kvcompile.kernels.dense import _batch, _fused_takes
    views = [_batch(x.cuda().to(dt), 0, 2, 130) for x in (q, k, v)]
    assert _fused_takes(*views)


def test_padded_rows_varlen_on_cuda(monkeypatch):
    """dispatch._padded_rows past FRESH_PADDED_ROWS_MAX on CUDA: the rows' tokens packed for
    one launch of the varlen prefill kernel (bf16, D 128), equal to sdpa_rows."""
    from types import SimpleNamespace

    from kvcompile.runtime import dispatch

    monkeypatch.setattr(dispatch, "FRESH_PADDED_ROWS_MAX", 2)
    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, S, D = 5, 8, 2, 300, 128
    q = torch.randn(B, Hq, S, D, generator=g).cuda().bfloat16()
    k, v = (torch.randn(B, Hkv, S, D, generator=g).cuda().bfloat16() for _ in range(2))
    starts = [0, 17, 299, S, 150]
    counted = []
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda device: True),
                            config=SimpleNamespace(prefill_attends="fresh"),
                            count=counted.append)
    got = dispatch._padded_rows(state, q, k, v, starts, 0.09).float()
    want = sdpa_rows(q, k, v, starts, 0.09).float()
    assert rel_err(got, want) <= 4 * REL_ERR[torch.bfloat16]
    assert not got[1, :, :17].any() and not got[3].any()
    assert counted == ["prefill_fresh_varlen"]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("dv", [64, 48])
@pytest.mark.parametrize("name", ("finite", "v_nan_seen", "k_nan_seen", "masked_nan"))
def test_chunk_causal_lower_right_on_cuda(name, dv, dt, monkeypatch):
    """Causal S < L without a mask (a chunk after its prefix, one K/V head a query head): SDPA
    under torch's lower-right causal bias on CUDA (flash / memory-efficient), no [S, L] mask
    built; eager's values over the causal keys of the last S positions, NaN / Inf included
    (a NaN under the causal mask inert)."""
    from kvcompile.kernels import dense

    monkeypatch.setattr(dense, "LOWER_RIGHT_DEVICES", ("cuda",))   # (whatever the default)
    g = torch.Generator().manual_seed(CASES.index(name) + dv)
    q, k, v, seen = make_case(name, g)
    k = k.repeat_interleave(4, 1)                     # MHA: 8 K/V heads
    v = torch.randn(*k.shape[:-1], dv, generator=g)
    if name == "v_nan_seen":
        v[0, 1, 36, 3] = float("nan")
    elif name == "masked_nan":
        v[1, 1, 39, 2] = float("nan")                 # after every query but the last: seen
        k[0, 2, 39, 1] = float("nan")                 # by the last query only
    seen = (torch.arange(k.shape[2])[None] <= torch.arange(k.shape[2] - q.shape[2],
                                                           k.shape[2])[:, None])[None, None]
    seen = seen.expand(q.shape[0], 1, *seen.shape[2:])
    built = []
    real = dense._causal
    monkeypatch.setattr(dense, "_causal", lambda *a: built.append(a) or real(*a))
    got = sdpa_attention(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt), None, None,
                         0.125, True)
    ref = eager_rows(q, k, v, seen, 0.125)
    assert_like_eager(got.double().cpu(), ref, f"{name} dv {dv} {dt}", dt)
    if name == "finite":
        assert not built, "an explicit causal mask was built"
