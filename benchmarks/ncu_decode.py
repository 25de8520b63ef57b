"""The CUDA decode kernel's launches, one each, for Nsight Compute (issue 14's limiter).

    ncu --clock-control none -k regex:kvc_paged_decode --section ... \\
        python benchmarks/ncu_decode.py --shape B16_L32k --formats int4/channel,fp8_e4m3/page

Builds each format's random pages at the shape (gpu_decode_fast.py's SHAPES and pages: block
tables a random permutation, every sequence full), warms the kernel's build, then launches the
CUDA kernel `--launches` times per format with its own split choice (the default launch of
`kernels="auto"` on sm_90), synchronizing after each, so a profiler sees one kernel per launch
(plus the split merge, which `-k regex:kvc_paged_decode` leaves out). Prints each format's
launch time from CUDA events (no profiler: the time to compare with gpu_decode_fast.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.gpu_decode_fast import (  # noqa: E402
    SHAPES,
    _launch_variant,
    random_case,
    warm_builds,
)
from tests.kernels.kernel_cases import launch_backend  # noqa: E402

DEV = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B16_L32k", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="int4/channel,fp8_e4m3/page,bf16/page")
    ap.add_argument("--launches", type=int, default=1)
    ap.add_argument("--int4-page", type=int, default=64)
    ap.add_argument("--key-mask", action="store_true")
    ap.add_argument("--variants", default="",
                    help="comma-separated decode_sm90.VARIANTS launched after the default")
    a = ap.parse_args()
    B, L, Hq, Hkv, D = SHAPES[a.shape]
    gen = torch.Generator(device=DEV).manual_seed(0)
    formats = [f for f in a.formats.split(",") if f]
    variants = [v for v in a.variants.split(",") if v]
    warm_builds(formats=formats, variants=variants)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
    km = torch.ones(B, L + 1, dtype=torch.bool, device=DEV) if a.key_mask else None
    for name in formats:
        kf, kg = name.split("/")
        P = a.int4_page if kf == "int4" else 16
        f, vf, kc, vc, bt, sl = random_case(kf, kg, B, L, Hkv, D, P, gen)
        stored = B * L * (f.bytes_per_token(Hkv, D, P) + vf.bytes_per_token(Hkv, D, P))
        for var in [None] + variants:
            times = []
            for _ in range(a.launches):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                if var is None:
                    launch_backend(q, kc, vc, bt, sl, out, "cuda", key_mask=km)
                else:
                    _launch_variant(q, kc, vc, bt, sl, out, var, key_mask=km)
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            ms = min(times)
            print(f"{a.shape} {name} P{P} {var or 'default'}: {ms:.4f} ms a launch (events, "
                  f"min of {len(times)}), {stored / 1e9:.3f} GB stored, "
                  f"{stored / ms / 1e9:.0f} GB/s", flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    if os.environ.get("NCU_DECODE_SDPA"):
        import torch.nn.functional as F

        k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
