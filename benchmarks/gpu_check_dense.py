"""The reference attention (kernels/dense.py) on CUDA: NaN / Inf in K/V as eager attention, masked
keys inert, empty rows 0 (the CUDA prefill fallback; no pytest on the GPU machine).

    python benchmarks/gpu_check_dense.py        # prints a PASS/FAIL table, exit status 1 on FAIL

Each case compares sdpa_attention (torch SDPA, then the exact fp32 path where SDPA's output is
not finite) on CUDA with eager attention computed per query over the keys it sees (fp64, CPU).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcompile.kernels.dense import sdpa_attention  # noqa: E402
from kvcompile.testing import REL_ERR, rel_err  # noqa: E402


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


def case(name, g):
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    g = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for name in ("finite", "v_nan_seen", "v_inf_seen", "k_nan_seen", "masked_nan", "row_empty"):
        q, k, v, seen = case(name, g)
        ref = eager_rows(q, k, v, seen, 0.125)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            got = sdpa_attention(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt),
                                 seen.cuda(), None, 0.125).double().cpu()
            same = all(torch.equal(f(got), f(ref)) for f in (torch.isnan, torch.isposinf,
                                                             torch.isneginf))
            fin = torch.isfinite(ref)
            err = rel_err(got[fin], ref[fin])
            passed = same and err <= 10 * REL_ERR[dt]
            ok &= passed
            rows.append((name, str(dt).split(".")[-1], int(torch.isnan(got).sum()),
                         int(torch.isnan(ref).sum()), f"{err:.1e}", "PASS" if passed else "FAIL"))
    print(f"{'case':12s} {'dtype':9s} {'NaN':>5s} {'eager':>6s} {'rel err':>8s} verdict")
    for r in rows:
        print(f"{r[0]:12s} {r[1]:9s} {r[2]:5d} {r[3]:6d} {r[4]:>8s} {r[5]}")
    print("ALL PASS" if ok else "SOME FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
