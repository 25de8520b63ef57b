"""Shared helpers of the kernel tests, the GPU matrices (tests/gpu/decode_cases.py) and the
benchmarks that build paged inputs (no pytest import, so benchmarks can import them)."""

from __future__ import annotations

import math
import zlib

import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.kernels.decode import launch_decode
from kvcompile.kernels.reference import paged_decode_attention_ref
from kvcompile.testing import REL_ERR, poison_, rel_err


def case_seed(*case) -> int:
    """A generator seed fixed by a test case's parameters, the same in every process (Python's
    hash() of strings changes from one process to the next, PYTHONHASHSEED)."""
    return zlib.crc32(repr(case).encode())


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


# the formats the CUDA decode kernel (kernels/decode_sm90.py) takes
FAST_FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
                ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("fp8_e5m2", "token")]


def launch_backend(q, kc, vc, bt, sl, out, backend, *, key_mask=None, window=0, sinks=0,
                   softcap=0.0, splits=0, qk_fp8=False):
    """One decode launch over make_paged_kv's pages on a chosen backend ("cuda" / "triton"),
    scale 1 / sqrt(head_dim) (the GPU test of the CUDA kernel and gpu_decode_fast.py).
    qk_fp8: the CUDA kernel's opt-in q.k-on-e4m3-tensor-cores variant."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return launch_decode(
        q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl, key_mask, None,
        out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity, scale, window,
        sinks, softcap, splits, None, kz=kc.zero, vz=vc.zero, backend=backend, qk_fp8=qk_fp8)


def compute_dtype(k_fmt: KVFormat, device) -> torch.dtype:
    """Operand dtype of the kernel's dots: fp32 under the interpreter, else the page dtype
    (bf16 / fp16) or fp16 for quantized pages."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(k_fmt.name, torch.float16)


def run_case(k_fmt, v_fmt, lens, Hkv, G, D, P, *, Sq=1, Dv=None, q_dtype=torch.float32,
             splits=0, config=None, window=0, sinks=0, softcap=0.0, key_mask=None,
             with_mass=False, device=DEV, gen=None, sink_logits=None):
    """Kernel vs reference on fresh inputs; returns (relative error, bound, out, mass pair).
    sink_logits [Hq] fp32: attention sinks (one logit per query head)."""
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
                  v_res=vc.res_data, v_res_slot=vc.res_slot, sink_logits=sink_logits)
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, scale, key_mask=key_mask,
                                     sliding_window=window, sinks=sinks, softcap=softcap,
                                     attn_mass=mass_ref, sink_logits=sink_logits)
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
    for name in ("data", "scale", "zero", "micro"):
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


# --- NaN in K / V (tests/kernels/test_nan.py; tests/gpu/test_nan_gpu.py on the GPU) --------

NAN_LENS = [40, 33]          # two sequences; the NaN goes into sequence 0, kv head 1
NAN_HKV, NAN_G, NAN_D = 2, 2, 64


def nan_pages(fmt, P, which, token, dim, gen, device=DEV):
    """K/V caches of NAN_LENS (shuffled pages, unwritten slots NaN) with x[token, head 1, dim]
    NaN in sequence 0's K or V, written by PagedTensor.write -> (kc, vc, block_tables,
    seq_lens)."""
    Hkv, D = NAN_HKV, NAN_D
    need = [-(-n // P) for n in NAN_LENS]
    N = sum(need) + 2
    kc, vc = fmt.allocate(N, Hkv, P, D, device), fmt.allocate(N, Hkv, P, D, device)
    for c in (kc, vc):                       # what a slot never written may hold
        if c.data.element_size() == 1:
            c.data.view(torch.uint8).fill_(0x7F)
        else:
            c.data.fill_(float("nan"))
    perm = torch.randperm(N, generator=gen)
    bt = torch.zeros(len(NAN_LENS), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(NAN_LENS):
        bt[b, :need[b]] = perm[i:i + need[b]].int()
        i += need[b]
        pages = bt[b, :need[b]].long()
        slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)[:n]
        k = torch.randn(n, Hkv, D, generator=gen) * 1.5
        k[:, :, 0] += 3.0
        v = torch.randn(n, Hkv, D, generator=gen)
        if b == 0:
            (k if which == "k" else v)[token, 1, dim] = float("nan")
        kc.write(slots.to(device), k.to(device))
        vc.write(slots.to(device), v.to(device))
    return kc, vc, bt.to(device), torch.tensor(NAN_LENS, dtype=torch.int32, device=device)


def _stored(c, bt, b):
    # sequence b's dequantized cache [L, Hkv, D]
    L, P = NAN_LENS[b], c.page_size
    pages = bt[b, :-(-L // P)].long()
    return c.read(pages).permute(0, 2, 1, 3).reshape(-1, c.num_heads, c.head_dim)[:L]


def expected_nan(kc, vc, bt, allowed_of):
    """Per sequence, [S, Hq, D] bool (must, may): where eager attention over the stored values
    outputs NaN, for the visible keys allowed_of(b) [S, L]. `must`: a query that sees a NaN
    key (all dims) or value (its dims). `may` adds, for a NaN value that some query of the
    chunk sees, its dims in the chunk's other queries: eager multiplies their probability 0 by
    it (0 * NaN), and so does a kernel tile that holds such a query."""
    out = []
    for b in range(len(NAN_LENS)):
        k, v = _stored(kc, bt, b), _stored(vc, bt, b)
        allowed = allowed_of(b)                                           # [S, L]
        nan_k = torch.isnan(k).any(-1)                                    # [L, Hkv]
        nan_v = torch.isnan(v)                                            # [L, Hkv, D]
        row_k = (allowed[:, :, None] & nan_k[None]).any(1)                # [S, Hkv]
        row_v = (allowed[:, :, None, None] & nan_v[None]).any(1)          # [S, Hkv, D]
        seen_v = (allowed.any(0)[:, None, None] & nan_v).any(0)           # [Hkv, D]
        must = row_k[..., None] | row_v
        may = must | seen_v[None]
        out.append((must.repeat_interleave(NAN_G, 1), may.repeat_interleave(NAN_G, 1)))
    return out


def check_nan(out_rows, ref_rows, expect, what, tol):
    # out_rows / ref_rows: per sequence [S, Hq, D]; expect: expected_nan's
    for b, (o, r, (must, may)) in enumerate(zip(out_rows, ref_rows, expect)):
        got = torch.isnan(o.float())
        assert not (must & ~got).any(), f"{what}, sequence {b}: a NaN the query sees was lost"
        assert not (got & ~may).any(), f"{what}, sequence {b}: NaN where no query sees one"
        fine = ~may & torch.isfinite(r)
        err = rel_err(o[fine], r[fine])
        assert err <= tol, f"{what}, sequence {b}: relative error {err:.2e} > {tol:.1e}"


def _nan_tol(fmt, q_dtype, device) -> float:
    return max(REL_ERR[compute_dtype(fmt, device)], REL_ERR[q_dtype])


def nan_decode_case(name, gran, residual, which, seed=1, device=DEV, q_dtype=torch.float32,
                    splits=0):
    """NaN at sequence 0's token 5 (residual: 37, in the bf16 tail), kv head 1, dim 3 of K or
    V: the decode kernel's output is NaN where eager attention puts it, with the token seen,
    hidden by a window, hidden by key_mask. AssertionError otherwise. splits: the kernel's
    split count (0: its own choice; > 1: the combine kernel merges the splits)."""
    from kvcompile.kernels.reference import decode_mask_ref

    P = 32 if name.startswith("int") and gran == "channel" else 16
    fmt = make_format(name, gran, residual)
    gen = torch.Generator().manual_seed(seed)
    token = 37 if residual else 5
    kc, vc, bt, sl = nan_pages(fmt, P, which, token, 3, gen, device)
    B, D = len(NAN_LENS), NAN_D
    q = torch.randn(B, NAN_HKV * NAN_G, 1, D, generator=gen).to(device, q_dtype)
    tol = _nan_tol(fmt, q_dtype, device)
    hide = 2 if residual else 16                  # a window that leaves the token out
    for window, mask in ((0, None), (hide, None), (0, "hide")):
        key_mask = None
        if mask:
            key_mask = torch.ones(B, max(NAN_LENS), dtype=torch.bool, device=device)
            key_mask[0, token] = False
        out = poison_(torch.empty_like(q))
        launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl,
                      key_mask, None, out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name,
                      vc.fmt.granularity, 1 / math.sqrt(D), window, 0, 0.0, splits, None,
                      kz=kc.zero, vz=vc.zero, k_res=kc.res_data, k_res_slot=kc.res_slot,
                      v_res=vc.res_data, v_res_slot=vc.res_slot)
        ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 1 / math.sqrt(D),
                                         key_mask=key_mask, sliding_window=window)

        def allowed(b, window=window, key_mask=key_mask):
            L = NAN_LENS[b]
            return decode_mask_ref(torch.arange(L - 1, L, device=device), L,
                                   sliding_window=window,
                                   key_mask=None if key_mask is None else key_mask[b])

        expect = expected_nan(kc, vc, bt, allowed)
        if not (window or mask):
            assert expect[0][0].any() and not expect[1][1].any()
        elif not (fmt.is_int or name == "fp4_e2m1"):   # NaN in its own code: hidden, inert
            assert not any(e[1].any() for e in expect)
        check_nan([out[b].transpose(0, 1) for b in range(B)],
                  [ref[b].transpose(0, 1) for b in range(B)], expect,
                  f"decode {name}/{gran} {which}, window {window}, key_mask {mask}", tol)


def nan_prefill_case(name, gran, which, seed=2, device=DEV, q_dtype=torch.float32):
    """The chunked prefill kernel over pages: chunks of 12 and 33 queries, the NaN at sequence
    0's token 31, inside its chunk (seen by its queries from 31 on only), then behind a
    sliding window that hides it from all."""
    from kvcompile.kernels.prefill_launch import launch_paged_prefill
    from kvcompile.kernels.reference import paged_prefill_attention_ref, prefill_mask_ref

    fmt = make_format(name, gran)
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = nan_pages(fmt, 16, which, 31, 20, gen, device)
    q_lens = [12, 33]
    cu = torch.tensor([0, 12, 45], dtype=torch.int32, device=device)
    q = torch.randn(45, NAN_HKV * NAN_G, NAN_D, generator=gen).to(device, q_dtype)
    scale = 1 / math.sqrt(NAN_D)
    tol = _nan_tol(fmt, q_dtype, device)
    for window in (0, 4):
        out = poison_(torch.empty_like(q))
        launch_paged_prefill(q, out, (name, gran, kc.data, kc.scale, kc.micro),
                             (name, gran, vc.data, vc.scale, vc.micro), bt, cu, sl, None,
                             scale, window, 0, 0.0, max(q_lens))
        ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, scale, sliding_window=window)

        def allowed(b, window=window):
            L, S = NAN_LENS[b], q_lens[b]
            return prefill_mask_ref(torch.arange(L - S, L, device=device),
                                    torch.arange(L, device=device), sliding_window=window)

        expect = expected_nan(kc, vc, bt, allowed)
        if window == 0:
            must = expect[0][0]
            assert not must[:3].any() and must[3:].any()   # queries 28-30 do not see it
        check_nan([out[0:12], out[12:45]], [ref[0:12], ref[12:45]], expect,
                  f"prefill {name}/{gran} {which}, window {window}", tol)
