"""Chunked prefill through a gathered workspace (kernels/prefill_gather.py) vs the plain-PyTorch
reference over the dequantized pages (kernels/reference.py `paged_prefill_attention_ref`):
every format the paged prefill reads x scale granularity, GQA, several sequences of different
lengths in one batch, windows / sinks / softcap / left padding, a workspace bound that splits
the batch, and the route rule (including where it must keep the paged route)."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.kernels import prefill_gather as G  # noqa: E402
from kvcompile.kernels import prefill_launch as L  # noqa: E402
from kvcompile.kernels.prefill import paged_prefill_attention  # noqa: E402
from kvcompile.kernels.reference import paged_prefill_attention_ref  # noqa: E402
from kvcompile.testing import ASSERT_CLOSE, kernel_rel_err, rel_err  # noqa: E402
from tests.kernels.test_prefill import (  # noqa: E402
    DEV,
    _bound,
    _cpu_dtypes,
    cu_of,
    make_format,
    make_paged_kv,
)

CASES = [
    # format, gran, seq_lens, q_lens, Hq, Hkv, D, P, kwargs
    ("fp32", "page", [70, 19, 33], [21, 19, 1], 4, 2, 64, 16, {}),
    ("fp16", "page", [45, 64], [45, 3], 4, 4, 64, 8, {}),
    ("fp8_e4m3", "page", [90, 17, 51], [30, 17, 6], 4, 2, 64, 16, {}),
    ("fp8_e4m3", "token", [57, 40], [9, 40], 8, 2, 128, 32, dict(softcap=4.0)),
    ("fp8_e4m3", "tensor", [66, 30], [20, 5], 4, 2, 64, 16, dict(sliding_window=15, sinks=2)),
    ("fp8_e5m2", "page", [81, 5], [16, 5], 6, 2, 64, 16, {}),                       # G=3
    ("fp8_e5m2", "token", [100], [33], 4, 1, 64, 64, dict(sliding_window=20)),
    ("fp4_e2m1", "page", [77, 30], [25, 4], 4, 2, 64, 16, {}),
    ("fp4_e2m1", "token", [52, 70], [52, 11], 4, 2, 128, 16, dict(sliding_window=10)),
    ("fp4_e2m1", "tensor", [60, 60], [7, 60], 4, 4, 64, 32, {}),
    ("fp8_e4m3", "page", [80, 40], [24, 40], 4, 2, 64, 16,
     dict(kv_start=[5, 0], sliding_window=20, sinks=3)),
    ("fp16", "page", [64, 33, 48], [16, 0, 8], 4, 2, 64, 16, dict(kv_start=[0, 30, 7])),
]


def _run(case, dtype, *, budget=G.DEFAULT_WORKSPACE_BYTES, gen=None):
    name, gran, lens, q_lens, Hq, Hkv, D, P, kw = case
    kw = dict(kw)
    fmt = make_format(name, gran)
    kc, vc, bt, sl = make_paged_kv(fmt, lens, Hkv, D, P, gen=gen)
    cu = cu_of(q_lens)
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen).to(device=DEV, dtype=dtype)
    starts = kw.pop("kv_start", None)
    ks = None if starts is None else torch.tensor(starts, dtype=torch.int32, device=DEV)
    out = G.gathered_prefill_attention(q, kc, vc, bt, cu, sl, D ** -0.5, kv_start=ks,
                                       workspace_bytes=budget, **kw)
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, D ** -0.5, kv_start=ks, **kw)
    return out, ref


@pytest.mark.parametrize("dtype", _cpu_dtypes())
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gathered_prefill_matches_reference(case, dtype):
    gen = torch.Generator().manual_seed(300 + case)
    out, ref = _run(CASES[case], dtype, gen=gen)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # the workspace holds the dequantized pages in q's dtype, so every format gets q's
    # dtype's bound (the dense kernel over K/V in that dtype)
    assert rel_err(out, ref) <= _bound(dtype), f"rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("name,gran", [("bf16", "page"), ("fp8_e4m3", "page"),
                                       ("fp8_e5m2", "token"), ("fp8_e4m3", "tensor"),
                                       ("fp4_e2m1", "page"), ("fp4_e2m1", "token"),
                                       ("int4", "channel"), ("int4", "token"),
                                       ("int3", "token"), ("int2", "page")])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_gather_pages_equals_the_format_decoder(name, gran, kernel, monkeypatch):
    """The gather kernel (and the op's plain-PyTorch path, off the kernels' devices) writes
    exactly PagedTensor.read's values (fp32 workspace), from a key in the middle of a page,
    for sequences of different lengths."""
    if not kernel:
        monkeypatch.setattr(G, "_on_kernel_device", lambda t: False)
    gen = torch.Generator().manual_seed(17)
    kc, _, bt, _ = make_paged_kv(make_format(name, gran), [45, 70, 9], 2, 64, 16, gen=gen)
    starts, counts = [3, 20, 0], [42, 50, 9]
    cu = cu_of(counts)
    out = G.gather_pages(kc, bt, torch.tensor(starts, dtype=torch.int32, device=DEV), cu,
                         sum(counts), max(counts), torch.float32)
    for b, (s, n) in enumerate(zip(starts, counts)):
        pages = bt[b, :(s + n + 15) // 16].long()
        want = kc.read(pages).float().permute(0, 2, 1, 3).reshape(-1, 2, 64)[s:s + n]
        atol, rtol = ASSERT_CLOSE[torch.float32]
        torch.testing.assert_close(out[int(cu[b]):int(cu[b + 1])], want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("budget", [G.DEFAULT_WORKSPACE_BYTES, 60 * 2 * 128 * 2 * 4],
                         ids=["one workspace", "in pieces"])
def test_int_pages_prefill_by_gathering(budget, monkeypatch):
    """Int pages (the Pareto table's K int4 channel / V int4 token, pages of 64) have no paged
    prefill kernel: a chunk over them attends by gathering (with a zero point), matching the
    reference over the same dequantized pages, also when a sequence is attended in pieces."""
    from tests.kernels.kernel_cases import make_paged_kv as make_kv

    monkeypatch.setattr(G, "_on_kernel_device", lambda t: True)   # pieces on the CPU too
    gen = torch.Generator().manual_seed(23)
    lens, q_lens, Hq, Hkv, D = [150, 70], [40, 6], 4, 2, 128
    kc, vc, bt, sl = make_kv(make_format("int4", "channel"), make_format("int4", "token"),
                             lens, Hkv, D, 64, gen=gen, device=DEV)
    cu = cu_of(q_lens)
    dt = _cpu_dtypes()[0]   # fp32 on the CPU, bf16 on CUDA
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen).to(DEV, dt)
    out = G.gathered_prefill_attention(q, kc, vc, bt, cu, sl, D ** -0.5, workspace_bytes=budget)
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, D ** -0.5)
    assert rel_err(out, ref) <= _bound(dt), f"rel err {rel_err(out, ref):.2e}"
    # without the zero points the values are off (the kernel reads them)
    kc.zero = torch.zeros_like(kc.zero)
    bad = G.gathered_prefill_attention(q, kc, vc, bt, cu, sl, D ** -0.5)
    assert rel_err(bad, ref) > 10 * _bound(dt)


def test_workspace_bound_splits_the_batch(monkeypatch):
    """A workspace bound below the batch's keys: sequences go in groups, each workspace within
    the bound, the output unchanged."""
    case = ("fp8_e4m3", "page", [90, 17, 51, 64], [30, 17, 6, 10], 4, 2, 64, 16, {})
    per_key = 2 * (64 + 64) * 4   # Hkv * (D + Dv) * fp32
    seen = []
    real = G.gather_pages

    def spy(cache, bt, starts, cu_k, total, max_len, dtype):
        seen.append(total)
        return real(cache, bt, starts, cu_k, total, max_len, dtype)

    monkeypatch.setattr(G, "gather_pages", spy)
    out, ref = _run(case, torch.float32, budget=100 * per_key,
                    gen=torch.Generator().manual_seed(5))
    assert rel_err(out, ref) <= kernel_rel_err(torch.float32, DEV)
    assert len(seen) >= 6 and max(seen) <= 100, seen   # [90], [17, 51], [64]: K and V each


@pytest.mark.parametrize("kw", [{}, dict(softcap=3.0)])
def test_a_sequence_over_the_bound_is_attended_in_pieces(monkeypatch, kw):
    """A sequence whose keys exceed the workspace: pieces of keys (the last one causal, the
    earlier ones unmasked) merged by log-sum-exp, each workspace within the bound; the other
    sequences as usual."""
    case = ("fp8_e4m3", "page", [90, 17, 51], [30, 17, 6], 4, 2, 64, 16, kw)
    per_key = 2 * (64 + 64) * 4
    seen = []
    real = G.gather_pages

    def spy(cache, bt, starts, cu_k, total, max_len, dtype):
        seen.append(total)
        return real(cache, bt, starts, cu_k, total, max_len, dtype)

    monkeypatch.setattr(G, "gather_pages", spy)
    out, ref = _run(case, torch.float32, budget=40 * per_key,
                    gen=torch.Generator().manual_seed(6))
    assert rel_err(out, ref) <= kernel_rel_err(torch.float32, DEV)
    # sequence 0: [50, 90) causal, [0, 40), [40, 50); then [17], [51] (over: alone, in pieces)
    assert max(seen) <= 40 and seen[:6] == [40, 40, 40, 40, 10, 10], seen


def test_varlen_lse_and_merge():
    """The varlen kernel's log-sum-exp output (log2 units) equals torch's over the visible
    scores, and merge_attention of two key halves equals attention over all keys."""
    gen = torch.Generator().manual_seed(9)
    q_lens, k_lens = [9, 24], [50, 33]
    q = torch.randn(sum(q_lens), 4, 64, generator=gen).to(DEV)
    k = torch.randn(sum(k_lens), 2, 64, generator=gen).to(DEV)
    v = torch.randn(sum(k_lens), 2, 64, generator=gen).to(DEV)
    cu_q, cu_k = cu_of(q_lens), cu_of(k_lens)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], 4, dtype=torch.float32, device=DEV)
    L.launch_prefill(q, k, v, cu_q, out, 0.125, True, 0, 0, 0.0, max(q_lens), None,
                     config=L.INTERPRET_CONFIG, cu_seqlens_k=cu_k,
                     lse=lse)
    want = []
    for b in range(2):
        qb = q[int(cu_q[b]):int(cu_q[b + 1])].float()
        kb = k[int(cu_k[b]):int(cu_k[b + 1])].float().repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * 0.125
        pos = torch.arange(k_lens[b] - q_lens[b], k_lens[b], device=DEV)
        s = s.masked_fill(torch.arange(k_lens[b], device=DEV)[None] > pos[:, None], -math.inf)
        want.append((torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1))
    atol, rtol = ASSERT_CLOSE[torch.float16]   # tf32 dots on CUDA
    torch.testing.assert_close(lse, torch.cat(want), atol=atol * 10, rtol=rtol)
    # merge: sequence 0's keys split into its first 20 (unmasked) and last 30 (causal tail)
    q0, kk, vv = q[:9], k[:50], v[:50]
    parts = []
    for a, z, causal in ((0, 20, False), (20, 50, True)):
        o = torch.empty(9, 4, 64, dtype=torch.float32, device=DEV)
        ls = torch.empty(9, 4, dtype=torch.float32, device=DEV)
        L.launch_prefill(q0, kk[a:z], vv[a:z], cu_of([9]), o, 0.125, causal, 0, 0, 0.0, 9,
                         None, config=L.INTERPRET_CONFIG,
                         cu_seqlens_k=cu_of([z - a]), lse=ls)
        parts.append((o, ls))
    merged, _ = G.merge_attention(*parts[0], *parts[1])
    assert rel_err(merged, out[:9]) <= kernel_rel_err(torch.float32, DEV) * 4


def _host(q_lens, seq_lens, kv_start=None):
    return G.HostLens(q_lens, seq_lens, kv_start or [0] * len(q_lens))


def test_route_rule():
    big = 1 << 30
    long_chunk = _host([2048], [32768])
    assert G.choose_route("auto", long_chunk, 4, 4096, big).route == "gather"
    # negative cases: the rule keeps the paged route
    assert G.choose_route("auto", _host([64], [32768]), 4, 4096, big).route == "gather"
    short = G.choose_route("auto", _host([32], [32768]), 4, 4096, big)
    assert short.route == "paged" and "short chunk" in short.reason
    mixed = _host([512, 4], [600, 60000])   # the long prefix has the short chunk: 4 rows/key
    assert G.choose_route("auto", mixed, 1, 4096, big).route == "paged"
    assert G.choose_route("paged", long_chunk, 4, 4096, big).route == "paged"
    sinks = G.choose_route("gather", long_chunk, 4, 4096, big, sink_logits=True)
    assert sinks.route == "paged" and "sink" in sinks.reason
    # a sequence over the bound is attended in pieces, unless windowed or its chunk alone is over
    assert G.choose_route("auto", long_chunk, 4, 4096, 8192 * 4096).route == "gather"
    over = G.choose_route("auto", long_chunk, 4, 4096, 2047 * 4096)
    assert over.route == "paged" and "exceeds" in over.reason
    over_win = G.choose_route("auto", long_chunk, 4, 4096, 3000 * 4096, window=4000)
    assert over_win.route == "paged" and "exceeds" in over_win.reason
    padded = G.choose_route("gather", _host([2048], [3000], [1000]), 4, 4096, big)
    assert padded.route == "paged" and "padding" in padded.reason
    # a window bounds the keys gathered, and so the workspace
    win = G.choose_route("auto", long_chunk, 4, 4096, 4096 * 4096, window=2048)
    assert win.route == "gather"


def test_chunk_prefill_attention_routes():
    """chunk_prefill_attention(route=...): "gather" and "auto" give the paged result and say
    which route ran; "gather" that cannot run (sink logits) raises naming the way out; a bad
    route is refused."""
    gen = torch.Generator().manual_seed(23)
    fmt = make_format("fp8_e4m3", "page")
    kc, vc, bt, sl = make_paged_kv(fmt, [70, 40], 2, 64, 16, gen=gen)
    cu = cu_of([30, 12])
    q = torch.randn(42, 4, 64, generator=gen).to(DEV)
    paged = paged_prefill_attention(q, kc, vc, bt, cu, sl, 0.125)
    for route, taken in (("gather", "gather"), ("auto", "paged"), ("paged", "paged")):
        out, pick = G.chunk_prefill_attention(q, kc, vc, bt, cu, sl, 0.125, route=route)
        assert pick.route == taken, pick
        assert rel_err(out, paged) <= kernel_rel_err(torch.float32, DEV) * 4
    with pytest.raises(UnsupportedShapeError, match="route='paged'"):
        G.chunk_prefill_attention(q, kc, vc, bt, cu, sl, 0.125, route="gather",
                                  sink_logits=torch.zeros(4, device=DEV))
    with pytest.raises(ValueError, match="route"):
        G.chunk_prefill_attention(q, kc, vc, bt, cu, sl, 0.125, route="fast")
