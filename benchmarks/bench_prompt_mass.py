"""H2O's prompt mass: the extra pass (kernels/prompt_mass.py) against the attention it rides
on and against the fp32 path it replaced (eviction/attend.py attend_kept, per sequence).

    python benchmarks/bench_prompt_mass.py                     # H200: B16 x 4k, B4 x 32k
    python benchmarks/bench_prompt_mass.py --shapes B2_P512 --smoke   # CPU interpreter, tiny

One layer of a Llama-3-8B shape (32 q / 8 kv heads, head_dim 128), bf16 q and keys (as bf16
pages read back), causal prompts of P tokens in B rows packed as the Engine packs them.
Columns (ms, triton.testing.do_bench median; the fp32 path once per shape, it is slow):
  sdpa      torch SDPA causal over the same q / k / v, [B, Hq, P, D] (the plain prefill's
            attention: what the mass pass is added to)
  read      the keys of every row read back from a bf16 pool layout and laid out per kv head
            (what EvictionRuntime._kernel_mass does before the launches)
  mass      the two mass kernels (lse per query, then mass per key)
  fp32      attend_kept(want_mass=True) row by row (the path H2O prompts took before)
  mass/sdpa, fp32/(sdpa+mass): the cost of the mass over the attention, and the speedup
A `check` column gives the mass's relative error against the fp32 path's (rows of 1 shape).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvcompile.eviction.attend import attend_kept  # noqa: E402
from kvcompile.kernels.prompt_mass import prompt_mass  # noqa: E402
from kvcompile.testing import rel_err  # noqa: E402


def _bench(fn, smoke: bool) -> float:
    if smoke:
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=40)


def run(shape: str, hq: int, hkv: int, d: int, smoke: bool, fp32: bool) -> dict:
    B, P = (int(x[1:]) for x in shape.split("_"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, B * P, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(hkv, B * P, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(hkv, B * P, d, device=dev, dtype=dt, generator=g)
    scale = d ** -0.5
    i32 = dict(dtype=torch.int32, device=dev)
    rows = torch.arange(B, **i32)
    args = (torch.arange(B, device=dev) * P * q.stride(2), torch.full((B,), P, **i32),
            rows * P, torch.full((B,), P, **i32), torch.zeros(B, **i32),
            torch.zeros(B, **i32), scale)
    qb = q[0].view(hq, B, P, d).transpose(0, 1)                          # [B, Hq, P, D]
    kb = k.view(hkv, B, P, d).transpose(0, 1).repeat_interleave(hq // hkv, 1)
    vb = v.view(hkv, B, P, d).transpose(0, 1).repeat_interleave(hq // hkv, 1)
    out = dict(shape=shape)
    if dev == "cuda":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["sdpa"] = _bench(lambda: sdpa(qb, kb, vb, is_causal=True, scale=scale), smoke)
    pages = k.view(hkv, B * P // 16, 16, d).permute(1, 0, 2, 3).contiguous()   # [N, H, 16, D]
    out["read"] = _bench(lambda: pages.float().to(dt).permute(1, 0, 2, 3)
                         .reshape(hkv, -1, d), smoke)
    mass = prompt_mass(q[0], k, *args, max_q=P, max_k=P)
    out["mass"] = _bench(lambda: prompt_mass(q[0], k, *args, max_q=P, max_k=P), smoke)
    if fp32:
        pos = torch.arange(P, device=dev).expand(hkv, P)

        def old():
            res = []
            for b in range(B):
                kk = k[:, b * P:(b + 1) * P].float()
                res.append(attend_kept(q[0, :, b * P:(b + 1) * P], kk, v[:, b * P:(b + 1) * P]
                                       .float(), pos, pos[0], scale, want_mass=True)[1])
            return res

        ref = old()
        out["check"] = max(rel_err(mass[:, b * P:(b + 1) * P], ref[b]) for b in range(B))
        out["fp32"] = _bench(old, True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="B16_P4096,B4_P32768")
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 path's column")
    ap.add_argument("--smoke", action="store_true", help="one call each, no do_bench (CPU)")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    cols = ["shape", "sdpa", "read", "mass", "fp32", "mass/sdpa", "fp32/(sdpa+mass)", "check"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for shape in a.shapes.split(","):
        r = run(shape, hq, hkv, d, a.smoke, not a.no_fp32)
        if "sdpa" in r:
            r["mass/sdpa"] = r["mass"] / r["sdpa"]
            if "fp32" in r:
                r["fp32/(sdpa+mass)"] = r["fp32"] / (r["sdpa"] + r["mass"])
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else
                                str(r.get(c, "-")) for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
