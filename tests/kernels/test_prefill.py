"""Prefill kernels vs the plain-PyTorch references (kernels/reference.py).

Packed varlen prefill: dtype x head_dim x GQA x masks x odd / empty lengths x tile configs
(TMA, pointer and warp-specialized variants) x FP8. Chunked prefill over pages: every stored
format and scale granularity x page size x GQA x chunk boundaries x left padding. On the CPU the
kernels run under TRITON_INTERPRET=1 in fp32 / fp16 on small shapes (the interpreter's bf16 dot
is broken); tests/gpu/test_prefill_matrix_gpu.py runs the full matrix on the H200.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.errors import UnsupportedShapeError  # noqa: E402
from kvcompile.kernels import prefill_launch as L  # noqa: E402
from kvcompile.kernels.prefill import (  # noqa: E402
    dequantize_fp8_prefill,
    paged_prefill_attention,
    prefill_attention,
    quantize_fp8_prefill,
)
from kvcompile.kernels.reference import (  # noqa: E402
    paged_prefill_attention_ref,
    prefill_attention_ref,
)
from kvcompile.testing import REL_ERR, kernel_rel_err, poison_, rel_err, sqnr_db  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PLAIN = ("bf16", "fp16", "fp32")
FP8_REL_ERR = 0.07  # FP8 kernel vs the fp32 reference on the same E4M3 values: P is E4M3 too
CFG = L.TileConfig  # (block_m, block_n, num_warps, num_stages, warp_spec)


# --- case builders (also used by tests/gpu/prefill_cases.py) ----------------------------------

def cu_of(lens, device=DEV) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_qkv(lens, Hq, Hkv, D, dtype, *, Dv=None, gen=None, device=DEV, k_lens=None):
    """Random packed q [T, Hq, D], k/v [Tk, Hkv, D(v)] with an outlier key channel."""
    T, Tk = sum(lens), sum(k_lens or lens)
    q = torch.randn(T, Hq, D, generator=gen)
    k = torch.randn(Tk, Hkv, D, generator=gen) * 1.5
    k[:, :, 0] += 3.0
    v = torch.randn(Tk, Hkv, Dv or D, generator=gen)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def make_paged_kv(fmt: KVFormat, lens, Hkv, D, P, *, Dv=None, gen=None, device=DEV, chunks=2):
    """K/V of sequences of `lens` tokens written with PagedTensor.write (the reference append)
    in `chunks` appends into shuffled pages; unwritten slots hold NaN (fp4: NaN micro scales;
    int formats: NaN scales).
    -> (k_cache, v_cache, block_tables [B, maxP] int32, seq_lens [B] int32)."""
    Dv = Dv or D
    need = [(n + P - 1) // P for n in lens]
    N = sum(need) + 3
    kc, vc = fmt.allocate(N, Hkv, P, D, device), fmt.allocate(N, Hkv, P, Dv, device)
    for c in (kc, vc):
        if c.data.dtype == torch.uint8 and c.micro is None:   # int codes: NaN scales
            c.scale.fill_(float("nan"))
        elif c.data.dtype == torch.uint8:
            c.data.fill_(0x77)
            c.micro.view(torch.uint8).fill_(0x7F)
        elif c.data.element_size() == 1:
            c.data.view(torch.uint8).fill_(0x7F)  # NaN in E4M3 and E5M2
        else:
            c.data.fill_(float("nan"))
    perm = torch.randperm(N, generator=gen)
    bt = torch.zeros(len(lens), max(1, max(need)), dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens):
        bt[b, :need[b]] = perm[i:i + need[b]].int()
        i += need[b]
        pages = bt[b, :need[b]].long()
        slots = (pages[:, None] * P + torch.arange(P)[None]).reshape(-1)[:n].to(device)
        k = torch.randn(n, Hkv, D, generator=gen) * 1.5
        k[:, :, 0] += 3.0
        v = torch.randn(n, Hkv, Dv, generator=gen)
        cuts = sorted({0, n, *[(n * j) // chunks for j in range(1, chunks)]})
        for a, z in zip(cuts[:-1], cuts[1:]):
            kc.write(slots[a:z], k[a:z].to(device))
            vc.write(slots[a:z], v[a:z].to(device))
    return kc, vc, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def make_format(name: str, gran: str = "page") -> KVFormat:
    return KVFormat(name) if name in PLAIN else KVFormat(name, gran)


def run_prefill(lens, Hq, Hkv, D, dtype, *, config=None, tma=True, gen=None, Dv=None,
                k_lens=None, **mask):
    """Kernel vs reference on fresh inputs; returns (rel_err, out, ref)."""
    q, k, v = make_qkv(lens, Hq, Hkv, D, dtype, Dv=Dv, gen=gen, k_lens=k_lens)
    cu = cu_of(lens)
    cu_k = cu_of(k_lens) if k_lens else None
    out = poison_(torch.empty(q.shape[0], Hq, Dv or D, dtype=dtype, device=DEV))
    scale = D ** -0.5
    saved = L.device_has_tma
    if not tma:
        L.device_has_tma = lambda device: False
    try:
        L.launch_prefill(q, k, v, cu, out, scale, mask.get("causal", True),
                         mask.get("sliding_window", 0), mask.get("sinks", 0),
                         mask.get("softcap", 0.0), max(lens), None, config=config,
                         cu_seqlens_k=cu_k)
    finally:
        L.device_has_tma = saved
    ref = prefill_attention_ref(q, k, v, cu, scale, cu_seqlens_k=cu_k, **mask)
    return rel_err(out, ref), out, ref


def run_paged(fmt, lens, q_lens, Hq, Hkv, D, P, dtype, *, config=None, gen=None, kv_start=None,
              scale_mult=1.0, **mask):
    kc, vc, bt, sl = make_paged_kv(fmt, lens, Hkv, D, P, gen=gen)
    if scale_mult != 1.0:  # every stored value times scale_mult (page / token scales)
        kc.scale.mul_(scale_mult)
        vc.scale.mul_(scale_mult)
    cu = cu_of(q_lens)
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen).to(device=DEV, dtype=dtype)
    ks = None if kv_start is None else torch.tensor(kv_start, dtype=torch.int32, device=DEV)
    out = poison_(torch.empty_like(q))
    scale = D ** -0.5
    L.launch_paged_prefill(q, out, (fmt.name, fmt.granularity, kc.data, kc.scale, kc.micro),
                           (fmt.name, fmt.granularity, vc.data, vc.scale, vc.micro), bt, cu, sl,
                           ks, scale, mask.get("sliding_window", 0), mask.get("sinks", 0),
                           mask.get("softcap", 0.0), max(q_lens), config=config)
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, scale, kv_start=ks, **mask)
    return rel_err(out, ref), out, ref


def _cpu_dtypes():
    return (torch.float32, torch.float16) if DEV == "cpu" else (torch.bfloat16, torch.float16)


def _bound(dtype) -> float:
    return REL_ERR[dtype] * (2.0 if dtype == torch.bfloat16 else 1.0)


# --- packed varlen prefill ------------------------------------------------------------------

VARLEN_CASES = [
    # lens, Hq, Hkv, D, mask, config
    ([37, 5, 64], 4, 4, 64, {}, CFG(32, 16, 4, 1)),
    ([1, 70, 16], 4, 2, 64, {}, CFG(32, 16, 4, 1)),
    ([45, 0, 9], 6, 2, 64, {}, CFG(32, 16, 4, 1)),                     # G=3, empty sequence
    ([50, 21], 8, 1, 64, {}, CFG(64, 32, 4, 1)),                      # MQA, G=8
    ([33, 40], 4, 2, 128, dict(sliding_window=9), CFG(32, 16, 4, 1)),
    ([61, 3], 4, 2, 64, dict(sliding_window=13, sinks=5), CFG(32, 16, 4, 1)),
    ([29, 47], 2, 2, 256, dict(softcap=5.0), CFG(16, 16, 4, 1)),
    ([40, 17], 4, 2, 64, dict(causal=False), CFG(32, 16, 4, 1)),
    ([70, 19], 4, 2, 64, {}, CFG(32, 16, 4, 1, True)),               # warp-specialized form
    ([70, 19], 4, 4, 64, dict(sliding_window=20), CFG(32, 16, 4, 1, True)),
]


@pytest.mark.parametrize("dtype", _cpu_dtypes())
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_prefill_matches_reference(case, dtype):
    lens, Hq, Hkv, D, mask, cfg = VARLEN_CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    err, out, _ = run_prefill(lens, Hq, Hkv, D, dtype, config=cfg, gen=gen, **mask)
    assert torch.isfinite(out).all(), "unwritten or non-finite output rows"
    assert err <= _bound(dtype), f"rel err {err:.2e}"


@pytest.mark.parametrize("mask", [{}, dict(sliding_window=11, sinks=2)])
def test_prefill_pointer_path(mask):
    """The non-TMA path (pre-Hopper GPUs) computes the same."""
    gen = torch.Generator().manual_seed(7)
    err, out, _ = run_prefill([45, 20], 4, 2, 64, torch.float32, config=CFG(32, 16, 4, 1),
                              tma=False, gen=gen, **mask)
    assert err <= kernel_rel_err(torch.float32, DEV), err


def test_prefill_queries_at_the_tail_of_longer_keys():
    """cu_seqlens_k: each sequence's queries are the last q_len positions of its keys."""
    gen = torch.Generator().manual_seed(8)
    err, _, _ = run_prefill([9, 24, 1], 4, 2, 64, torch.float32, k_lens=[50, 24, 33],
                            config=CFG(32, 16, 4, 1), gen=gen, sliding_window=17, sinks=3)
    assert err <= kernel_rel_err(torch.float32, DEV), err


def test_prefill_fp8_block_scales():
    gen = torch.Generator().manual_seed(9)
    lens = [150, 37, 1]  # crosses a 128-token scale block
    q, k, v = make_qkv(lens, 4, 2, 64, torch.float32, gen=gen)
    q = q * 3.0
    cu = cu_of(lens)
    q8, k8, vt8, scales = quantize_fp8_prefill(q, k, v, cu)
    assert q8.dtype == k8.dtype == vt8.dtype == torch.float8_e4m3fn
    qd, kd, vd = dequantize_fp8_prefill(q8, k8, vt8, scales, cu)
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert sqnr_db(a, b) > 30.0
    out = poison_(torch.empty(q.shape[0], 4, 64, dtype=torch.float32))
    L.launch_prefill(q8, k8, vt8, cu, out, 0.125, True, 0, 0, 0.0, max(lens), scales,
                     config=CFG(32, 32, 4, 1))   # an FP8 dot needs K >= 32 on the GPU
    ref_q = prefill_attention_ref(qd, kd, vd, cu, 0.125)   # same E4M3 values, fp32 math
    ref = prefill_attention_ref(q, k, v, cu, 0.125)        # unquantized
    assert rel_err(out, ref_q) <= FP8_REL_ERR
    assert rel_err(out, ref) <= FP8_REL_ERR * 1.5


def test_prefill_fp8_reference_rounds_p_as_the_kernels_do():
    """The FP8 op's reference path (no GPU, no interpreter) rounds each key tile's weights to
    E4M3 after its running max, as the kernels do: unrounded, the same tiling is plain causal
    attention; rounded, it differs from it by P's rounding alone (a relative error of about
    1e-2, not 0), and a one-tile sequence rounds against its own max."""
    from kvcompile.kernels.reference import prefill_attention_fp8_ref

    gen = torch.Generator().manual_seed(21)
    lens = [300, 1, 129]
    q, k, v = make_qkv(lens, 4, 2, 64, torch.float32, gen=gen)
    q = q * 2.0
    cu = cu_of(lens)
    plain = prefill_attention_ref(q, k, v, cu, 0.125)
    assert rel_err(prefill_attention_fp8_ref(q, k, v, cu, 0.125, round_p=False), plain) < 1e-5
    rounded = prefill_attention_fp8_ref(q, k, v, cu, 0.125)
    assert 2e-3 < rel_err(rounded, plain) < 3e-2
    assert torch.equal(rounded[300], v[300].repeat_interleave(2, 0))   # one key: P = 256, exact
    short = prefill_attention_fp8_ref(q[:5], k[:5], v[:5], cu_of([5]), 0.125)
    s = (q[:5].transpose(0, 1) @ k[:5].repeat_interleave(2, 1).permute(1, 2, 0)) * 0.125
    s = s.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf")) * 1.4426950408889634
    p = torch.exp2(s - s.amax(-1, keepdim=True) + 8.0)
    want = (p.to(torch.float8_e4m3fn).float() @ v[:5].repeat_interleave(2, 1).transpose(0, 1))
    want = (want / p.sum(-1, keepdim=True)).transpose(0, 1)
    assert rel_err(short, want) < 1e-6


def test_prefill_fp8_with_queries_quantized_by_the_kernel(monkeypatch):
    """fp8 scales with q_descale None: bf16 queries that the Hopper kernel quantizes a scale
    per row. The op's reference path computes with those same row-quantized values; where the
    Hopper kernel cannot run, launch_prefill refuses bf16 queries and says why; and
    prefill_attention(fp8=True) keeps q's block quantization off Hopper."""
    from kvcompile.kernels import prefill_sm90
    from kvcompile.kernels.reference import quantize_rows_fp8_ref

    gen = torch.Generator().manual_seed(19)
    lens = [150, 37]
    q, k, v = make_qkv(lens, 4, 2, 64, torch.float32, gen=gen)
    q = (q * 3.0).to(torch.bfloat16)
    q[5, 1] = 0.0                                   # an all-zero row: scale 1
    cu = cu_of(lens)
    codes, qs = quantize_rows_fp8_ref(q)
    assert qs[5, 1].item() == 1.0 and not codes[5, 1].float().any()
    assert codes.float().abs().amax(-1)[qs[..., 0] != 1.0].eq(448.0).all()   # each row's amax
    _, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu, with_q=False)
    sc = sc._replace(q_descale=None)
    qd, kd, vd = dequantize_fp8_prefill(q, k8, vt8, sc, cu)
    assert torch.equal(qd, codes.float() * qs) and sqnr_db(q.float(), qd) > 30.0
    want = prefill_attention_ref(qd, kd, vd, cu, 0.125)
    if DEV == "cpu":   # the op's reference path (the kernel's bits are checked on the GPU)
        import kvcompile.kernels.prefill as P

        monkeypatch.setattr(P, "interpreting", lambda: False)
        got = torch.ops.kvcompile.prefill(q, k8, vt8, cu, 0.125, True, 0, 0, 0.0, 0, None,
                                          sc.k_descale, sc.v_descale, sc.cu_blocks,
                                          torch.bfloat16, None)
        monkeypatch.undo()
        assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) <= 0.01
    why = prefill_sm90.takes_bf16_q(q, k, v, torch.bfloat16, True, 0, 0, 0.0, None)
    if why is not None:   # no Hopper GPU here: launch_prefill refuses bf16 queries, saying why
        out = torch.empty(q.shape[0], 4, 64, dtype=torch.bfloat16, device=q.device)
        with pytest.raises(UnsupportedShapeError, match="bf16 q on the FP8 path"):
            L.launch_prefill(q, k8, vt8, cu, out, 0.125, True, 0, 0, 0.0, max(lens), sc)
        assert "Hopper" in why or "gluon" in why.lower()
    assert "q torch.float16" in prefill_sm90.takes_bf16_q(q.half(), k, v, torch.bfloat16,
                                                          True, 0, 0, 0.0, None)
    assert "causal" in prefill_sm90.takes_bf16_q(q, k, v, torch.bfloat16, True, 16, 0, 0.0,
                                                 None)
    assert "head_dim" in prefill_sm90.takes_bf16_q(q, k, v[..., :32], torch.bfloat16, True,
                                                   0, 0, 0.0, None)


def test_prefill_public_api_and_custom_op():
    """prefill_attention goes through torch.ops.kvcompile.prefill, traces under torch.compile
    (fake impl), and the fp8=True path quantizes on the fly."""
    gen = torch.Generator().manual_seed(10)
    lens = [20, 13]
    q, k, v = make_qkv(lens, 4, 2, 64, torch.float32, gen=gen)
    cu = cu_of(lens)
    ref = prefill_attention_ref(q, k, v, cu, 0.125, sliding_window=8)
    out = prefill_attention(q, k, v, cu, 0.125, sliding_window=8, max_seqlen=20)
    assert rel_err(out, ref) <= kernel_rel_err(torch.float32, DEV)

    def f(q, k, v):
        return prefill_attention(q, k, v, cu, 0.125, sliding_window=8, max_seqlen=20) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(q, k, v), 2 * ref) <= kernel_rel_err(torch.float32, DEV)
    out8 = prefill_attention(q, k, v, cu, 0.125, fp8=True)
    assert out8.dtype == torch.bfloat16
    assert rel_err(out8.float(), prefill_attention_ref(q, k, v, cu, 0.125)) <= 0.1
    buf = torch.empty_like(q)
    assert prefill_attention(q, k, v, cu, 0.125, out=buf, sliding_window=8) is buf


def test_prefill_cpu_reference_fallback(monkeypatch):
    """Without a GPU or the interpreter the op runs the reference."""
    import kvcompile.kernels.prefill as P

    monkeypatch.setattr(P, "interpreting", lambda: False)
    if DEV == "cuda":
        pytest.skip("the fallback is for CPU tensors")
    q, k, v = make_qkv([10, 6], 4, 2, 64, torch.float32)
    cu = cu_of([10, 6])
    out = prefill_attention(q, k, v, cu, 0.125)
    torch.testing.assert_close(out, prefill_attention_ref(q, k, v, cu, 0.125))


@pytest.mark.parametrize("bad", ["head_dim", "gqa", "dtype", "cu", "window", "fp8_v", "cu_k"])
def test_prefill_rejects_bad_input(bad):
    q, k, v = make_qkv([8, 8], 4, 2, 64, torch.float32)
    cu = cu_of([8, 8])
    out = torch.empty_like(q)
    args = dict(causal=True, window=0, sinks=0, fp8=None)
    if bad == "head_dim":
        q, k, v = make_qkv([8, 8], 4, 2, 96, torch.float32)
        out = torch.empty_like(q)
    elif bad == "gqa":
        q, _, _ = make_qkv([8, 8], 3, 2, 64, torch.float32)
        out = torch.empty_like(q)
    elif bad == "dtype":
        k = k.half()
    elif bad == "cu":
        cu = cu.long()
    elif bad == "window":
        args.update(causal=False, window=4)
    elif bad == "fp8_v":
        q8, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
        q, k, v, args["fp8"] = q8, k8, v.to(torch.float8_e4m3fn), sc
    elif bad == "cu_k":
        with pytest.raises(UnsupportedShapeError, match="cu_seqlens_k"):
            L.launch_prefill(q, k, v, cu, out, 0.1, True, 0, 0, 0.0, 8, None,
                             cu_seqlens_k=cu_of([8]))
        return
    with pytest.raises(UnsupportedShapeError):
        L.launch_prefill(q, k, v, cu, out, 0.1, args["causal"], args["window"], args["sinks"],
                         0.0, 8, args["fp8"])


# --- chunked prefill over pages ---------------------------------------------------------------

PAGED_CASES = [
    # format, gran, seq_lens, q_lens, Hq, Hkv, D, P, mask/kwargs, config
    ("fp32", "page", [70, 19, 33], [21, 19, 1], 4, 2, 64, 16, {}, CFG(32, 16, 4, 1)),
    ("fp16", "page", [45, 64], [45, 3], 4, 4, 64, 8, {}, CFG(32, 16, 4, 1)),
    ("fp8_e4m3", "page", [90, 17], [30, 17], 4, 2, 64, 16, {}, CFG(32, 16, 4, 1)),
    ("fp8_e4m3", "token", [57, 40], [9, 40], 8, 2, 128, 32, dict(softcap=4.0),
     CFG(32, 16, 4, 1)),
    ("fp8_e4m3", "tensor", [66], [20], 4, 2, 64, 16, dict(sliding_window=15, sinks=2),
     CFG(32, 16, 4, 1)),
    ("fp8_e5m2", "page", [81, 5], [16, 5], 6, 2, 64, 16, {}, CFG(32, 16, 4, 1)),     # G=3
    ("fp8_e5m2", "token", [100], [33], 4, 1, 256, 64, {}, CFG(16, 16, 4, 1)),
    ("fp4_e2m1", "page", [77, 30], [25, 4], 4, 2, 64, 16, {}, CFG(32, 16, 4, 1)),
    ("fp4_e2m1", "token", [52], [52], 4, 2, 128, 16, dict(sliding_window=10),
     CFG(32, 16, 4, 1)),
    ("fp4_e2m1", "tensor", [60, 60], [7, 60], 4, 4, 64, 32, {}, CFG(32, 32, 4, 1)),
    ("fp8_e4m3", "page", [80, 40], [24, 40], 4, 2, 64, 16,
     dict(kv_start=[5, 17], sliding_window=20, sinks=3), CFG(32, 16, 4, 1)),
    ("fp16", "page", [64, 33], [16, 8], 4, 2, 64, 16, dict(kv_start=[0, 30]),
     CFG(32, 16, 4, 1)),
]


@pytest.mark.parametrize("dtype", _cpu_dtypes())
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_prefill_matches_reference(case, dtype):
    name, gran, lens, q_lens, Hq, Hkv, D, P, kw, cfg = PAGED_CASES[case]
    gen = torch.Generator().manual_seed(200 + case)
    err, out, _ = run_paged(make_format(name, gran), lens, q_lens, Hq, Hkv, D, P, dtype,
                            config=cfg, gen=gen, **kw)
    assert torch.isfinite(out).all(), "unwritten or non-finite output rows"
    # quantized pages are computed in fp16 (fp32 under the interpreter with fp32 q)
    bound = _bound(dtype) if name in PLAIN or dtype == torch.float32 else REL_ERR[torch.float16]
    assert err <= bound, f"rel err {err:.2e}"


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1"])
def test_paged_prefill_small_valued_pages_fp16(name):
    # K / V of magnitude ~1e-3 (page scales ~2e-6 for fp8): K's scale folds into the score
    # columns in fp32; V's must not be folded into fp16 P (P * scale would be subnormal)
    gen = torch.Generator().manual_seed(31)
    err, out, _ = run_paged(make_format(name, "page"), [70, 33], [30, 33], 4, 2, 64, 16,
                            torch.float16, config=CFG(32, 16, 4, 1), gen=gen,
                            scale_mult=2.0 ** -11)
    assert torch.isfinite(out).all()
    assert err <= REL_ERR[torch.float16], f"rel err {err:.2e}"


def test_paged_equals_contiguous_chunk():
    """Chunked prefill over bf16-like pages == the varlen kernel with cu_seqlens_k."""
    gen = torch.Generator().manual_seed(11)
    fmt = make_format("fp32")
    kc, vc, bt, sl = make_paged_kv(fmt, [60, 35], 2, 64, 16, gen=gen)
    q_lens = [12, 35]
    cu = cu_of(q_lens)
    q = torch.randn(int(cu[-1]), 4, 64, generator=gen).to(DEV)
    paged = paged_prefill_attention(q, kc, vc, bt, cu, sl, 0.125, max_q_len=35)
    ks, vs = [], []
    for b, n in enumerate([60, 35]):
        pages = bt[b, :(n + 15) // 16].long()
        ks.append(kc.read(pages).permute(0, 2, 1, 3).reshape(-1, 2, 64)[:n])
        vs.append(vc.read(pages).permute(0, 2, 1, 3).reshape(-1, 2, 64)[:n])
    contiguous = prefill_attention(q, torch.cat(ks), torch.cat(vs), cu, 0.125,
                                   cu_seqlens_k=cu_of([60, 35]))
    assert rel_err(paged, contiguous) <= REL_ERR[torch.float32]


def test_paged_prefill_custom_op_traces():
    gen = torch.Generator().manual_seed(12)
    fmt = make_format("fp8_e4m3", "page")
    kc, vc, bt, sl = make_paged_kv(fmt, [40], 2, 64, 16, gen=gen)
    cu = cu_of([8])
    q = torch.randn(8, 4, 64, generator=gen).to(DEV)

    def f(q):
        return paged_prefill_attention(q, kc, vc, bt, cu, sl, 0.125, max_q_len=8) + 1

    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, 0.125)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q)
    assert rel_err(out - 1, ref) <= kernel_rel_err(torch.float32, DEV)


@pytest.mark.parametrize("bad", ["block_table", "fp4_micro", "head_dim", "kv_heads", "seq_lens",
                                 "q_dtype"])
def test_paged_prefill_rejects_bad_input(bad):
    fmt = make_format("fp4_e2m1" if bad == "fp4_micro" else "fp8_e4m3", "page")
    kc, vc, bt, sl = make_paged_kv(fmt, [20], 2, 64, 16)
    cu = cu_of([4])
    q = torch.randn(4, 4, 64, device=DEV)
    k = (fmt.name, fmt.granularity, kc.data, kc.scale, kc.micro)
    v = (fmt.name, fmt.granularity, vc.data, vc.scale, vc.micro)
    if bad == "block_table":
        bt = bt.long()
    elif bad == "fp4_micro":
        k = k[:4] + (None,)
    elif bad == "head_dim":
        q = torch.randn(4, 4, 32, device=DEV)
    elif bad == "kv_heads":
        q = torch.randn(4, 3, 64, device=DEV)
    elif bad == "seq_lens":
        sl = sl.long()
    elif bad == "q_dtype":
        q = q.to(torch.float8_e4m3fn)
    with pytest.raises(UnsupportedShapeError):
        L.launch_paged_prefill(q, torch.empty(4, q.shape[1], 64, device=DEV), k, v, bt, cu, sl,
                               None, 0.125, 0, 0, 0.0, 4)


# --- GPU only: precision against torch SDPA (the H200 run does the full matrix) --------------

@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_prefill_bf16_error_within_2x_sdpa(D):
    gen = torch.Generator().manual_seed(13)
    lens = [1000, 333, 2049]
    q, k, v = make_qkv(lens, 8, 2, D, torch.bfloat16, gen=gen)
    cu = cu_of(lens)
    out = prefill_attention(q, k, v, cu, D ** -0.5)
    ref = prefill_attention_ref(q, k, v, cu, D ** -0.5)
    sdpa = sdpa_varlen(q, k, v, cu, D ** -0.5)
    assert rel_err(out, ref) <= 2 * rel_err(sdpa, ref)


def sdpa_varlen(q, k, v, cu, scale, causal=True):
    """torch SDPA per sequence, in the inputs' dtype: the precision yardstick."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    g = q.shape[1] // k.shape[1]
    c = cu.tolist()
    for b in range(len(c) - 1):
        s0, s1 = c[b], c[b + 1]
        if s1 == s0:
            continue
        qb = q[s0:s1].transpose(0, 1)[None]
        kb = k[s0:s1].transpose(0, 1).repeat_interleave(g, 0)[None]
        vb = v[s0:s1].transpose(0, 1).repeat_interleave(g, 0)[None]
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal,
                                                             scale=scale)
        out[s0:s1] = o[0].transpose(0, 1)
    return out


def test_sdpa_yardstick_agrees():
    """The SDPA helper used for the 2x bound computes the same attention as the reference."""
    q, k, v = make_qkv([9, 4], 4, 2, 64, torch.float32)
    cu = cu_of([9, 4])
    assert rel_err(sdpa_varlen(q, k, v, cu, 0.125), prefill_attention_ref(q, k, v, cu, 0.125)) \
        < 1e-5
    assert math.isfinite(rel_err(q, q))


# --- the FP8 inputs' quantization (kernels/prefill_quant.py) ----------------------------------

def test_vt_token_order_is_a_permutation_within_32_token_chunks():
    """vt's token order (P's lane order in the Hopper kernel): vt_column permutes each 32-token
    chunk, keeps a thread's pair of adjacent keys together, and vt_token undoes it."""
    from kvcompile.kernels.prefill_quant import vt_column, vt_token

    t = torch.arange(256)
    c = vt_column(t)
    assert torch.equal(vt_token(c), t) and torch.equal(vt_column(vt_token(t)), t)
    assert torch.equal((c // 32).sort().values, t // 32)            # within each chunk
    assert torch.equal(c[0::2] + 1, c[1::2])                       # pairs stay adjacent
    assert not torch.equal(c, t)                                   # not the identity
    # a thread (q = 1) holds keys 2, 3, 10, 11 of each 16: they sit at columns 4..7
    assert c[[2, 3, 10, 11]].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("lens, Hq, Hkv, D, Dv", [
    ([150, 37, 1], 2, 1, 32, 32),     # crosses a 128-token block; a one-token sequence
    ([100, 100], 3, 1, 32, 48),       # a group of 3, Dv != D; a spare block (T // 128 + B = 3)
])
def test_quantize_fp8_prefill_kernel_bit_exact(lens, Hq, Hkv, D, Dv):
    """The one-kernel quantization gives the torch form's bits: codes (RN(x / scale), clamped),
    transposed V with zero columns past each sequence and in the spare blocks, and the scales,
    with an all-zero block (scale 1), a NaN in V and an inf in Q."""
    from kvcompile.kernels import prefill_quant as PQ
    from kvcompile.kernels.reference import quantize_fp8_prefill_ref

    gen = torch.Generator().manual_seed(3)
    T = sum(lens)
    q = (torch.randn(T, Hq, D, generator=gen) * 3).to(DEV)
    k = torch.randn(T, Hkv, D, generator=gen).to(DEV)
    v = (torch.randn(T, Hkv, Dv, generator=gen) * 1e-3).to(DEV)
    k[lens[0]:, 0] = 0.0                  # the second sequence's first block of head 0: zeros
    v[5, 0, 3] = float("nan")
    q[lens[0] + 1, Hq - 1, 7] = float("inf")
    cu = cu_of(lens)
    nb = PQ.block_bound(T, len(lens))
    got = PQ.quantize_fp8_prefill_triton(q, k, v, cu, nb)
    want = quantize_fp8_prefill_ref(q, k, v, cu, nb)
    for name, a, b in zip(("q8", "k8", "vt8"), got[:3], want[:3]):
        assert a.shape == b.shape, name
        bad = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
        assert bad == 0, f"{name}: {bad} codes differ"
    for name, a, b in zip(("q scale", "k scale", "v scale", "cu_blocks"), got[3], want[3]):
        assert torch.equal(a, b), name
    first = int(got[3][3][1])             # the second sequence's first block
    assert got[3][1][first, 0].item() == 1.0   # its all-zero k block has scale 1
    spare = int(got[3][3][-1])            # blocks past the last sequence's
    assert spare == nb or lens == [100, 100] and spare == 2
    assert (got[3][0][spare:] == 1.0).all() and not got[2][:, spare * 128:].view(
        torch.uint8).any()
    # the public entry point (the kernel on CUDA, the torch form on the CPU): the same bits
    q8, _, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
    assert torch.equal(q8.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(sc.v_descale, want[3][2])
    assert vt8.shape == (Hkv * Dv, nb * 128)
    # K and V alone (the Hopper kernel quantizes Q itself): their bits unchanged, q as it came
    for kv in (PQ.quantize_fp8_prefill_triton(q, k, v, cu, nb, with_q=False),
               quantize_fp8_prefill(q, k, v, cu, with_q=False)):
        assert kv[0] is q and bool((kv[3][0] == 1.0).all())
        for name, a, b in zip(("k8", "vt8"), kv[1:3], want[1:3]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        assert torch.equal(kv[3][1], want[3][1]) and torch.equal(kv[3][2], want[3][2])
