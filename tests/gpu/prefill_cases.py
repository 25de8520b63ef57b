"""The prefill correctness matrix of the GPU tests (tests/gpu/test_prefill_matrix_gpu.py) and
the cases benchmarks/kernel_report.py compiles: case builders and runners (no pytest import).

Packed varlen prefill: bf16 / fp16 x head_dim {64, 128, 256} x GQA {1, 4, 8} x masks (causal,
window + sinks, softcap, non-causal, queries at the tail of longer keys) x odd / empty / mixed
lengths, each on every candidate tile config (TMA, warp-specialized, pointer path). bf16/fp16
error must be at most 2x the error of torch SDPA at the same precision against the fp32
reference (kernels/reference.py). FP8 (E4M3 block scales) error is bounded by FP8_REL_ERR.
Chunked prefill over pages: every format and granularity x head_dim x GQA x page size
{16, 32, 64, 128} x chunk boundaries x left padding. Outputs are poisoned with NaN first.
warm_cases(): each benchmark specialization (bench_prefill.py) on a small input with every
candidate config. (Was benchmarks/gpu_check_prefill.py.)
"""

from __future__ import annotations

import itertools
import json
import time
import traceback
import zlib

import torch

from kvcompile.config import KVConfig
from kvcompile.kernels import prefill_launch as L
from kvcompile.kernels.prefill import dequantize_fp8_prefill, quantize_fp8_prefill
from kvcompile.kernels.reference import (
    paged_prefill_attention_ref,
    prefill_attention_ref,
    prefill_mask_ref,
)
from kvcompile.testing import REL_ERR, poison_, rel_err
from tests.kernels.test_prefill import (
    FP8_REL_ERR,
    cu_of,
    make_format,
    make_paged_kv,
    make_qkv,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
           ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("fp8_e5m2", "token"),
           ("fp4_e2m1", "page"), ("fp4_e2m1", "token"), ("fp4_e2m1", "tensor")]
BF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def sdpa_masked(q, k, v, allowed, scale):
    # q [S, Hq, D], k/v [L, Hkv, D] in the test dtype; allowed [S, L] -> [S, Hq, Dv]
    g = q.shape[1] // k.shape[1]
    qb = q.transpose(0, 1)[None]
    kb = k.transpose(0, 1).repeat_interleave(g, 0)[None]
    vb = v.transpose(0, 1).repeat_interleave(g, 0)[None]
    o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed,
                                                         scale=scale)
    return torch.where(allowed.any(-1)[:, None, None], o[0].transpose(0, 1), 0.0)


def sdpa_varlen(q, k, v, cu, scale, cu_k=None, **mask):
    """SDPA at the inputs' precision with the same mask: the 2x yardstick."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    c = cu.tolist()
    ck = c if cu_k is None else cu_k.tolist()
    for b in range(len(c) - 1):
        s0, s1, k0, k1 = c[b], c[b + 1], ck[b], ck[b + 1]
        if s1 == s0:
            continue
        qp = torch.arange(k1 - k0 - (s1 - s0), k1 - k0, device=q.device)
        allowed = prefill_mask_ref(qp, torch.arange(k1 - k0, device=q.device), **mask)
        out[s0:s1] = sdpa_masked(q[s0:s1], k[k0:k1], v[k0:k1], allowed, scale)
    return out


# --- cases ------------------------------------------------------------------------------------

def varlen_cases(quick: bool):
    cases = []
    heads = [(8, 8), (8, 2), (16, 2)]
    lens_sets = [[1, 17, 300, 1000, 2049], [777, 0, 64, 1500], [4000, 3]]
    masks = [{}, {}, dict(sliding_window=256, sinks=4), dict(softcap=30.0), dict(causal=False)]
    for i, (dt, D, (hq, hkv)) in enumerate(itertools.product(("bf16", "fp16"), (64, 128, 256),
                                                               heads)):
        mask = masks[i % len(masks)]
        lens = lens_sets[i % len(lens_sets)]
        group = hq // hkv
        ws = L.ws_ok(True, False, mask.get("sliding_window", 0), mask.get("sinks", 0),
                     KVConfig().prefill_warp_spec)
        for cfg in L.candidates(L._VARLEN, D, group, warp_spec=ws):
            if quick and cfg != L._VARLEN[D][0]:
                continue
            cases.append(dict(kind="varlen", dt=dt, D=D, hq=hq, hkv=hkv, lens=lens, mask=mask,
                              cfg=cfg))
    cases.append(dict(kind="varlen", dt="bf16", D=128, hq=8, hkv=2, lens=[100, 900, 1],
                      k_lens=[3000, 900, 40], mask=dict(sliding_window=500, sinks=2), cfg=None))
    cases.append(dict(kind="varlen", dt="bf16", D=128, hq=8, hkv=2, lens=[1000, 33], mask={},
                      cfg=L._VARLEN[128][0], tma=False))
    for D, (hq, hkv) in itertools.product((64, 128, 256), ((8, 8), (8, 2))):
        for cfg in L.candidates(L._VARLEN, D, hq // hkv, warp_spec=False):
            cases.append(dict(kind="fp8", D=D, hq=hq, hkv=hkv, lens=[1, 300, 2049, 129],
                              cfg=cfg))
    return cases


def paged_cases(quick: bool):
    geo = [(1, 16), (4, 32), (8, 64), (4, 128), (4, 16), (2, 64)]
    chunks = [([3000, 700, 129], [512, 700, 1]), ([2048, 33], [2048, 17]),
              ([5000], [1000]), ([64, 1500, 4100], [64, 9, 300])]
    cases = []
    for i, ((name, gran), D) in enumerate(itertools.product(FORMATS, (64, 128, 256))):
        for j in range(1 if quick else 2):
            G, P = geo[(i + 3 * j) % len(geo)]
            lens, q_lens = chunks[(i + j) % len(chunks)]
            cfgs = L.candidates(L._PAGED, D, G, warp_spec=False)
            cases.append(dict(kind="paged", fmt=name, gran=gran, D=D, hq=2 * G, hkv=2, P=P,
                              lens=lens, q_lens=q_lens, cfg=cfgs[(i + j) % len(cfgs)],
                              qdt="bf16" if (i + j) % 3 else "fp16", mask={}))
    cases += [
        dict(kind="paged", fmt="fp8_e4m3", gran="page", D=128, hq=32, hkv=8, P=16,
             lens=[3000, 2100], q_lens=[700, 2100], cfg=None, qdt="bf16",
             mask=dict(sliding_window=1024, sinks=4, softcap=30.0)),
        dict(kind="paged", fmt="fp4_e2m1", gran="page", D=128, hq=8, hkv=2, P=16,
             lens=[1200, 800], q_lens=[300, 800], cfg=None, qdt="bf16",
             mask=dict(kv_start=[100, 0], sliding_window=400, sinks=1)),
        dict(kind="paged", fmt="bf16", gran="page", D=128, hq=8, hkv=2, P=64,
             lens=[1500, 600], q_lens=[1500, 50], cfg=None, qdt="bf16",
             mask=dict(kv_start=[0, 37])),
    ]
    return cases


def warm_cases():
    """Small inputs with the benchmark kernels' specializations, on every candidate config."""
    cases = []
    # warp-specialized tiles only when they are offered
    ws = L.ws_ok(True, False, 0, 0, KVConfig().prefill_warp_spec)
    for hkv in (32, 8):
        for cfg in L.candidates(L._VARLEN, 128, 32 // hkv, warp_spec=ws):
            cases.append(dict(kind="varlen", dt="bf16", D=128, hq=32, hkv=hkv,
                              lens=[1024, 1024], mask={}, cfg=cfg, warm=True))
        for cfg in L.candidates(L._VARLEN, 128, 32 // hkv, warp_spec=False):
            cases.append(dict(kind="fp8", D=128, hq=32, hkv=hkv, lens=[1024, 1024], cfg=cfg,
                              warm=True))
    for cfg in L.candidates(L._VARLEN, 128, 4, warp_spec=ws):
        cases.append(dict(kind="varlen", dt="bf16", D=128, hq=32, hkv=8, lens=[256],
                          k_lens=[2048], mask={}, cfg=cfg, warm=True))
    for name in ("fp8_e4m3", "bf16"):
        for cfg in L.candidates(L._PAGED, 128, 4, warp_spec=False):
            cases.append(dict(kind="paged", fmt=name, gran="page", D=128, hq=32, hkv=8, P=16,
                              lens=[2048], q_lens=[256], cfg=cfg, qdt="bf16", mask={},
                              warm=True))
    return cases


# --- runners ----------------------------------------------------------------------------------

def run_varlen(c, gen):
    dt = BF[c["dt"]]
    q, k, v = make_qkv(c["lens"], c["hq"], c["hkv"], c["D"], dt, gen=gen, k_lens=c.get("k_lens"))
    cu = cu_of(c["lens"])
    cu_k = cu_of(c["k_lens"]) if c.get("k_lens") else None
    out = poison_(torch.empty_like(q))
    scale = c["D"] ** -0.5
    m = c["mask"]
    saved = L.device_has_tma
    if c.get("tma") is False:
        L.device_has_tma = lambda device: False
    try:
        L.launch_prefill(q, k, v, cu, out, scale, m.get("causal", True),
                         m.get("sliding_window", 0), m.get("sinks", 0), m.get("softcap", 0.0),
                         max(c["lens"]), None, config=c["cfg"], cu_seqlens_k=cu_k)
    finally:
        L.device_has_tma = saved
    sync()
    ref = prefill_attention_ref(q, k, v, cu, scale, cu_seqlens_k=cu_k, **m)
    err = rel_err(out, ref)
    if m.get("softcap"):
        return err, REL_ERR[dt], None
    sd = rel_err(sdpa_varlen(q, k, v, cu, scale, cu_k=cu_k,
                             **{x: m[x] for x in ("causal", "sliding_window", "sinks")
                                if x in m}), ref)
    return err, max(2 * sd, REL_ERR[torch.float32]), sd


def run_fp8(c, gen):
    q, k, v = make_qkv(c["lens"], c["hq"], c["hkv"], c["D"], torch.bfloat16, gen=gen)
    cu = cu_of(c["lens"])
    q8, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
    out = poison_(torch.empty(q.shape, dtype=torch.bfloat16, device=DEV))
    scale = c["D"] ** -0.5
    L.launch_prefill(q8, k8, vt8, cu, out, scale, True, 0, 0, 0.0, max(c["lens"]), sc,
                     config=c["cfg"])
    sync()
    qd, kd, vd = dequantize_fp8_prefill(q8, k8, vt8, sc, cu)
    err_q = rel_err(out, prefill_attention_ref(qd, kd, vd, cu, scale))
    err = rel_err(out, prefill_attention_ref(q, k, v, cu, scale))
    return err_q, FP8_REL_ERR, err  # third column: error against the unquantized inputs


def run_paged(c, gen):
    fmt = make_format(c["fmt"], c["gran"])
    kc, vc, bt, sl = make_paged_kv(fmt, c["lens"], c["hkv"], c["D"], c["P"], gen=gen)
    cu = cu_of(c["q_lens"])
    dt = BF[c["qdt"]]
    q = torch.randn(int(cu[-1]), c["hq"], c["D"], generator=gen).to(device=DEV, dtype=dt)
    m = dict(c["mask"])
    ks = m.pop("kv_start", None)
    ks = None if ks is None else torch.tensor(ks, dtype=torch.int32, device=DEV)
    out = poison_(torch.empty_like(q))
    scale = c["D"] ** -0.5
    L.launch_paged_prefill(q, out, (fmt.name, fmt.granularity, kc.data, kc.scale, kc.micro),
                           (fmt.name, fmt.granularity, vc.data, vc.scale, vc.micro), bt, cu, sl,
                           ks, scale, m.get("sliding_window", 0), m.get("sinks", 0),
                           m.get("softcap", 0.0), max(c["q_lens"]), config=c["cfg"])
    sync()
    ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, scale, kv_start=ks, **m)
    err = rel_err(out, ref)
    if c["fmt"] in ("bf16", "fp16") and c["fmt"] == c["qdt"] and not m.get("softcap"):
        # yardstick: SDPA at q's precision over the same stored values and mask
        sd_out = torch.zeros_like(q)
        P, c_ = c["P"], cu.tolist()
        for b, n in enumerate(c["lens"]):
            pages = bt[b, :(n + P - 1) // P].long()
            kk = kc.read(pages).permute(0, 2, 1, 3).reshape(-1, c["hkv"], c["D"])[:n].to(dt)
            vv = vc.read(pages).permute(0, 2, 1, 3).reshape(-1, c["hkv"], c["D"])[:n].to(dt)
            ql = c_[b + 1] - c_[b]
            allowed = prefill_mask_ref(torch.arange(n - ql, n, device=DEV),
                                       torch.arange(n, device=DEV),
                                       0 if ks is None else int(ks[b]), **m)
            sd_out[c_[b]:c_[b + 1]] = sdpa_masked(q[c_[b]:c_[b + 1]], kk, vv, allowed, scale)
        sd = rel_err(sd_out, ref)
        return err, max(2 * sd, REL_ERR[torch.float32]), sd
    if c["fmt"] in ("bf16", "fp16"):  # plain pages in another dtype than q: q's dtype
        return err, REL_ERR[dt], None
    return err, REL_ERR[torch.float16], None  # quantized pages: fp16 tensor-core operands


def run_case(c):
    # a seed from the case itself, the same in every process (str hash() is salted per process)
    seed = zlib.crc32(json.dumps(c, default=str, sort_keys=True).encode()) % (1 << 31)
    gen = torch.Generator().manual_seed(seed)
    t = time.time()
    try:
        fn = {"varlen": run_varlen, "fp8": run_fp8, "paged": run_paged}[c["kind"]]
        err, bound, extra = fn(c, gen)
        ok = err <= bound
        status = "ok" if ok else "FAIL"
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        err, bound, extra, ok = float("nan"), float("nan"), None, False
        status = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    name = {k: v for k, v in c.items() if k not in ("cfg",)}
    return dict(case=name, cfg=str(c["cfg"]), err=err, bound=bound, extra=extra, ok=ok,
                status=status, seconds=time.time() - t)
