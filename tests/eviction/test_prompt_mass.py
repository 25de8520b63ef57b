"""H2O's prompt mass after a plain prefill (kernels/prompt_mass.py on the Triton interpreter,
eviction/attend.py `prompt_mass` on the CPU) against the mass of the fp32 path it replaces,
`attend_kept(want_mass=True)`: packed rows with GQA, prompt chunks over earlier keys, left
padding, a sliding window, soft-capping, a batch [B, Hq, S, D] passed as a view, and 16-bit
operands. Negative: causal and non-causal masses differ by far more than the tolerance."""

from __future__ import annotations

import pytest
import torch

from kvcompile.eviction.attend import attend_kept, prompt_mass
from kvcompile.testing import REL_ERR, kernel_rel_err, rel_err

# (q_len, k_len, start): a whole prompt, a chunk over earlier keys, a padded prompt, one query
ROWS = [(70, 70, 0), (40, 130, 0), (50, 50, 13), (1, 90, 0)]


def _inputs(hq=4, hkv=2, d=32, seed=0, dtype=torch.float32, device="cpu"):
    """Per row: q [Hq, n, D] in `dtype`, k [Hkv, L, D] fp32 holding `dtype` values (16-bit
    pages read back)."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(hq, n, d, generator=g).to(dtype).to(device) for n, _L, _s in ROWS]
    ks = [torch.randn(hkv, L, d, generator=g).to(dtype).float().to(device)
          for _n, L, _s in ROWS]
    return qs, ks


def _want(qs, ks, scale, **kw):
    """The mass of the fp32 path, row by row."""
    out = []
    for (n, L, st), q, k in zip(ROWS, qs, ks):
        dev = k.device
        pos = torch.arange(L, device=dev).expand(k.shape[0], L)
        v = torch.zeros(k.shape[0], L, 8, device=dev)
        _o, mass, _ = attend_kept(q.float(), k, v, pos, torch.arange(L - n, L, device=dev),
                                  scale, start=st, want_mass=True, **kw)
        out.append(mass)
    return out


def _kernel(qs, ks, scale, **kw):
    """kernels/prompt_mass.py over the rows packed: q [Hq, T, D], k [Hkv, N, D]."""
    from kvcompile.kernels.prompt_mass import prompt_mass as triton_mass

    q = torch.cat(qs, 1)
    k = torch.cat(ks, 1)
    qn = [n for n, _L, _s in ROWS]
    kl = [L for _n, L, _s in ROWS]
    i32 = dict(dtype=torch.int32, device=q.device)
    q_off = torch.tensor([0] + qn[:-1], device=q.device).cumsum(0) * q.stride(1)
    k_start = torch.tensor([0] + kl[:-1], **i32).cumsum(0).to(torch.int32)
    mass = triton_mass(q, k, q_off, torch.tensor(qn, **i32), k_start, torch.tensor(kl, **i32),
                       torch.tensor([L - n for n, L, _s in ROWS], **i32),
                       torch.tensor([s for _n, _L, s in ROWS], **i32), scale,
                       max_q=max(qn), max_k=max(kl), **kw)
    return list(mass.split(kl, 1))


CASES = [dict(), dict(window=24), dict(softcap=2.0), dict(causal=False)]


@pytest.mark.parametrize("kw", CASES, ids=["causal", "window", "softcap", "noncausal"])
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_kernel_mass_equals_fp32_path(kw, group):
    qs, ks = _inputs(hq=2 * group, hkv=2, seed=group)
    want = _want(qs, ks, 0.3, **kw)
    got = _kernel(qs, ks, 0.3, **kw)
    tol = kernel_rel_err(torch.float32, "cpu")
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w) <= tol, f"row {i}: {rel_err(g, w):.3e} > {tol:.1e}"
        # every query's probabilities sum to 1 over the keys it sees (0 for a padding query)
        n, _L, st = ROWS[i]
        seen = n - (max(0, st - (ROWS[i][1] - n)) if kw.get("causal", True) else 0)
        assert abs(g.sum().item() - 2 * group * seen) < 1e-3 * n * group


@pytest.mark.parametrize("d", [576, 300], ids=["latent576", "d300"])
@pytest.mark.parametrize("kw", [dict(), dict(window=24)], ids=["causal", "window"])
def test_kernel_mass_of_wide_heads(d, kw):
    """Heads wider than WIDE_D (an MLA layer's absorbed query over its latent pages: 576, one
    kv head for every query head) take Q K^T in BLOCK_D chunks; 300 leaves a partial chunk."""
    from kvcompile.kernels.prompt_mass import WIDE_D, d_tiles

    assert d > WIDE_D and d_tiles(d)["ND"] > 1
    qs, ks = _inputs(hq=4, hkv=1, d=d, seed=d)
    scale = d ** -0.5
    want = _want(qs, ks, scale, **kw)
    got = _kernel(qs, ks, scale, **kw)
    tol = kernel_rel_err(torch.float32, "cpu")
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= tol, (errs, tol)


def test_torch_mass_equals_fp32_path_in_small_blocks(monkeypatch):
    from kvcompile.eviction import attend

    monkeypatch.setattr(attend, "_MASS_ELEMS", 4 * 130 * 7)   # 7 queries a block
    qs, ks = _inputs(hq=4, hkv=2, seed=3)
    for kw in CASES:
        want = _want(qs, ks, 0.3, **kw)
        for (n, L, st), q, k, w in zip(ROWS, qs, ks, want):
            got = prompt_mass(q, k, torch.arange(L).expand(2, L), torch.arange(L - n, L), 0.3,
                              start=st, **kw)
            assert rel_err(got, w) <= REL_ERR[torch.float32]


def test_kernel_mass_of_a_batch_view_in_16_bits():
    """A batch [B, Hq, S, D] (HF's prefill) through q_off = b * stride(0), 16-bit operands
    (fp16: the interpreter's bf16 tl.dot is broken, triton#11584; bf16 is checked on CUDA,
    tests/gpu/test_prompt_mass_gpu.py)."""
    from kvcompile.kernels.prompt_mass import prompt_mass as triton_mass

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, S, D = 3, 4, 2, 45, 32
    q = torch.randn(B, Hq, S, D, generator=g).half()
    k = torch.randn(Hkv, B * S, D, generator=g).half().float()   # 16-bit pages read back
    i32 = dict(dtype=torch.int32)
    full = torch.full((B,), S, **i32)
    mass = triton_mass(q.transpose(0, 1)[:, 0], k, torch.arange(B) * q.stride(0), full,
                       torch.arange(B, **i32) * S, full, torch.zeros(B, **i32),
                       torch.zeros(B, **i32), 0.25, max_q=S, max_k=S)
    pos = torch.arange(S).expand(Hkv, S)
    for b in range(B):
        kb = k[:, b * S:(b + 1) * S]
        _o, want, _ = attend_kept(q[b].float(), kb, torch.zeros(Hkv, S, 4), pos,
                                  torch.arange(S), 0.25, want_mass=True)
        assert rel_err(mass[:, b * S:(b + 1) * S], want) <= REL_ERR[torch.float16]


def test_causal_and_noncausal_masses_differ():
    """Negative: the tolerance above would catch a kernel that ignored causality."""
    qs, ks = _inputs(seed=7)
    causal = _kernel(qs, ks, 0.3)
    want_nc = _want(qs, ks, 0.3, causal=False)
    errs = [rel_err(c, w) for c, w in zip(causal, want_nc)]
    assert min(errs[:3]) > 100 * kernel_rel_err(torch.float32, "cpu"), errs
