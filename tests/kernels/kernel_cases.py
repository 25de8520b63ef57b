"""Shared helpers of the kernel tests and benchmarks/gpu_check_decode.py (no pytest import, so
the GPU machine, which has no pytest, can run the full matrix with them)."""

from __future__ import annotations

import math

import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.kernels.decode import launch_decode
from kvcompile.kernels.reference import paged_decode_attention_ref
from kvcompile.testing import REL_ERR, poison_, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PLAIN = ("bf16", "fp16", "fp32")


def make_format(name: str, gran: str = "page", residual: bool = False) -> KVFormat:
    return KVFormat(name) if name in PLAIN else KVFormat(name, gran, residual=residual)


def make_paged_kv(k_fmt: KVFormat, v_fmt: KVFormat, lens, Hkv: int, D: int, P: int, *,
                  Dv: int | None = None, device=DEV, chunks: int = 2, spare_pages: int = 3,
                  gen=None, nan_fill: bool = True):
    """Random K/V for sequences of `lens` tokens, written with PagedTensor.write (the reference
    append) in `chunks` appends per sequence, into shuffled pages. Unwritten slots hold NaN.
    -> (k_cache, v_cache, block_tables [B, maxP] int32, seq_lens [B] int32)."""
    Dv = Dv or D
    need = [(n + P - 1) // P for n in lens]
    N = sum(need) + spare_pages
    kc = k_fmt.allocate(N, Hkv, P, D, device)
    vc = v_fmt.allocate(N, Hkv, P, Dv, device)
    if nan_fill:
        for c in (kc, vc):
            if c.fmt.is_int and c.fmt.granularity == "token":  # unwritten slots' scales
                c.scale.fill_(float("nan"))
            if c.data.dtype == torch.uint8:
                c.data.fill_(0x77)
                if c.micro is not None:  # e4m3 NaN micro: the block reads NaN
                    c.micro.view(torch.uint8).fill_(0x7F)
            else:
                c.data.fill_(float("nan"))
    perm = torch.randperm(N, generator=gen)
    bt = torch.zeros(len(lens), max(1, max(need)), dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens):
        bt[b, :need[b]] = perm[i:i + need[b]].int()
        i += need[b]
        if n == 0:
            continue
        pages = bt[b, :need[b]].long()
        slots = (pages[:, None] * P + torch.arange(P)[None]).reshape(-1)[:n].to(device)
        k = torch.randn(n, Hkv, D, generator=gen) * 1.5
        k[:, :, 0] += 3.0  # an outlier channel, as real keys have
        v = torch.randn(n, Hkv, Dv, generator=gen)
        cuts = sorted({0, n, *[(n * j) // chunks for j in range(1, chunks)]})
        for a, z in zip(cuts[:-1], cuts[1:]):
            kc.write(slots[a:z], k[a:z].to(device))
            vc.write(slots[a:z], v[a:z].to(device))
    return kc, vc, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def compute_dtype(k_fmt: KVFormat, device) -> torch.dtype:
    """Operand dtype of the kernel's dots: fp32 under the interpreter, else the page dtype
    (bf16 / fp16) or fp16 for quantized pages."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(k_fmt.name, torch.float16)


def run_case(k_fmt, v_fmt, lens, Hkv, G, D, P, *, Sq=1, Dv=None, q_dtype=torch.float32,
             splits=0, config=None, window=0, sinks=0, softcap=0.0, key_mask=None,
             with_mass=False, device=DEV, gen=None):
    """Kernel vs reference on fresh inputs; returns (relative error, bound, out, mass pair)."""
    kc, vc, bt, sl = make_paged_kv(k_fmt, v_fmt, lens, Hkv, D, P, Dv=Dv, device=device, gen=gen)
    B, Hq = len(lens), Hkv * G
    q = torch.randn(B, Hq, Sq, D, generator=gen).to(device=device, dtype=q_dtype)
    scale = 1.0 / math.sqrt(D)
    out = poison_(torch.empty(B, Hq, Sq, vc.head_dim, dtype=q_dtype, device=device))
    mass = mass_ref = None
    if with_mass:
        mass = torch.rand(B, Hkv, max(lens) + 5, generator=gen).to(device)
        mass_ref = mass.clone()
    launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl,
                  key_mask, mass, out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name,
                  vc.fmt.granularity, scale, window, sinks, softcap, splits, config,
                  kz=kc.zero, vz=vc.zero, k_res=kc.res_data, k_res_slot=kc.res_slot,
                  v_res=vc.res_data, v_res_slot=vc.res_slot)
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, scale, key_mask=key_mask,
                                     sliding_window=window, sinks=sinks, softcap=softcap,
                                     attn_mass=mass_ref)
    assert not torch.isnan(out).any(), "unwritten (poisoned) or NaN output elements"
    cdt = compute_dtype(k_fmt, device)
    if q_dtype != torch.float32 and cdt == torch.float32:
        cdt = q_dtype  # the output is rounded to q's dtype
    return rel_err(out, ref), REL_ERR[cdt], out, (mass, mass_ref)



def storage_pair(fmt, N, H, P, D, device=DEV):
    """Two PagedTensors with identical (garbage-free) starting storage."""
    a, b = fmt.allocate(N, H, P, D, device), fmt.allocate(N, H, P, D, device)
    for t in (a, b):
        t.data.view(torch.uint8).fill_(0x5A)
        if t.micro is not None:
            t.micro.view(torch.uint8).fill_(0x30)
    return a, b


def assert_same_storage(ref, got, what=""):
    for name in ("data", "scale", "micro"):
        r, g = getattr(ref, name), getattr(got, name)
        if r is None:
            continue
        if r.dtype in (torch.float32, torch.float16, torch.bfloat16):
            same = torch.equal(r.isnan(), g.isnan()) and torch.equal(
                r.nan_to_num(0).view(torch.uint8), g.nan_to_num(0).view(torch.uint8))
        else:
            same = torch.equal(r.view(torch.uint8), g.view(torch.uint8))
        if not same:
            bad = (r.view(torch.uint8) != g.view(torch.uint8)).sum().item()
            raise AssertionError(f"{what}: {name} differs from PagedTensor.write in {bad} bytes")


def append_slot_steps(lens_steps, P, pages_per_seq, gen):
    """Slots of successive writes: each write appends `n` tokens to every sequence."""
    B = len(pages_per_seq)
    filled = [0] * B
    for n in lens_steps:
        slots = []
        for b in range(B):
            for t in range(filled[b], filled[b] + n):
                slots.append(pages_per_seq[b][t // P] * P + t % P)
            filled[b] += n
        yield torch.tensor(slots, dtype=torch.int64)
