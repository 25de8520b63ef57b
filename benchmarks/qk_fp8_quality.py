"""The error the qk_fp8 decode variant adds (q quantized to e4m3 per row), in CPU emulation.

    python benchmarks/qk_fp8_quality.py [--needle-len 4096]

The CUDA kernel (kernels/cuda/paged_decode.cuh) runs on the CPU through its host emulation
(kernels/cuda/emu), default variant and qk_fp8 variant side by side, against the fp32 reference
(kernels/reference.py) on the same e4m3 pages: relative output error (||out - ref|| / ||ref||)
and, straight from PyTorch, the change in the scaled logits (log2 units as the kernel uses them,
q.k * scale / ln 2) that quantizing q makes. Inputs: make_paged_kv's random keys (unit-variance
plus an outlier channel) and values, and needle-style rows as tests/gpu/test_decode_sm90_gpu.py
test_accuracy_long_peaky builds them (each kv head holds 8 keys equal to 1.5 x its group's first
query head, the rest noise). Nothing is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvcompile.kernels import decode_sm90 as fast  # noqa: E402
from kvcompile.kernels.cuda.emu import build_emu as emu  # noqa: E402
from kvcompile.kernels.reference import gather_pages, paged_decode_attention_ref  # noqa: E402
from kvcompile.testing import rel_err  # noqa: E402
from tests.kernels.kernel_cases import make_format, make_paged_kv  # noqa: E402


def run(kc, vc, bt, sl, q, qk_fp8: bool) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full((*q.shape[:3], vc.head_dim), float("nan"))
    lp = fast.plan_decode_sm90(q, kc.data, kc.scale, vc.data, vc.scale, bt, sl, None, out,
                               kc.fmt.name, kc.fmt.granularity, vc.fmt.name,
                               vc.fmt.granularity, scale, 0, 0, 0.0, 0, 132, qk_fp8=qk_fp8)
    emu.run(lp)
    return emu.finish(lp)


def logit_change(kc, bt, sl, q) -> tuple[float, float]:
    """(RMS, max) over all (row, key) of |s(q8) - s(q)|, s = q.k * scale / ln 2 (log2 units)."""
    codes, s = fast.quantize_q_e4m3(q)
    qq = codes.float() * s
    scale = 1.0 / math.sqrt(q.shape[-1]) / math.log(2)
    G = q.shape[1] // kc.num_heads
    d = []
    for b in range(q.shape[0]):
        k = gather_pages(kc, bt[b], int(sl[b])).repeat_interleave(G, 0)  # [Hq, L, D]
        d.append((torch.einsum("hsd,hld->hsl", qq[b] - q[b], k) * scale).flatten())
    d = torch.cat(d).abs()
    return float(d.pow(2).mean().sqrt()), float(d.max())


def row(name, kc, vc, bt, sl, q) -> dict:
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 1.0 / math.sqrt(q.shape[-1]))
    codes, s = fast.quantize_q_e4m3(q)
    ref_q8 = paged_decode_attention_ref(codes.float() * s, kc, vc, bt, sl,
                                        1.0 / math.sqrt(q.shape[-1]))
    base, q8 = run(kc, vc, bt, sl, q, False), run(kc, vc, bt, sl, q, True)
    rms, mx = logit_change(kc, bt, sl, q)
    r = {"case": name, "default vs ref": rel_err(base, ref), "qk_fp8 vs ref": rel_err(q8, ref),
         "qk_fp8 vs ref(q8)": rel_err(q8, ref_q8), "ref(q8) vs ref": rel_err(ref_q8, ref),
         "logit RMS": rms, "logit max": mx}
    print(f"{name:34s} " + " ".join(f"{v:9.2e}" for k, v in r.items() if k != "case"),
          flush=True)
    return r


def needle_inputs(L, fmt, gen, Hkv=2, G=4, D=128, P=16):
    f = make_format(*fmt)
    npg = L // P
    kc, vc = f.allocate(npg, Hkv, P, D, "cpu"), f.allocate(npg, Hkv, P, D, "cpu")
    q = torch.randn(1, Hkv * G, 1, D, generator=gen)
    k = torch.randn(L, Hkv, D, generator=gen)
    needles = torch.randint(0, L, (8,), generator=gen)
    k[needles] = q[0, ::G, 0][None] * 1.5
    v = torch.randn(L, Hkv, D, generator=gen)
    kc.write(torch.arange(L), k)
    vc.write(torch.arange(L), v)
    bt = torch.arange(npg, dtype=torch.int32)[None]
    return kc, vc, bt, torch.tensor([L], dtype=torch.int32), q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--needle-len", type=int, default=4096)
    a = ap.parse_args()
    print(f"{'case':34s} " + " ".join(f"{h:>9s}" for h in (
        "base/ref", "q8/ref", "q8/ref8", "ref8/ref", "lgt RMS", "lgt max")))
    for fmt in (("fp8_e4m3", "page"), ("fp8_e4m3", "token")):
        for D, G in ((128, 4), (64, 8)):
            for seed in (0, 1):
                gen = torch.Generator().manual_seed(seed)
                kc, vc, bt, sl = make_paged_kv(make_format(*fmt), make_format(*fmt),
                                               [1, 17, 300, 1033], 2, D, 16, gen=gen,
                                               device="cpu")
                q = torch.randn(4, 2 * G, 1, D, generator=gen)
                row(f"random {fmt[1]} D{D} G{G} s{seed}", kc, vc, bt, sl, q)
        for seed in (0, 1):
            gen = torch.Generator().manual_seed(7 + seed)
            row(f"needle {fmt[1]} L{a.needle_len} s{seed}",
                *needle_inputs(a.needle_len, fmt, gen))


if __name__ == "__main__":
    main()
