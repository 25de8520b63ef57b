"""The CUDA decode kernel's time against its split count (issue 14: is the split rule's one
wave of CTAs losing time to a tail?).

    python benchmarks/split_sweep.py [--shapes B16_L32k,B64_L8k] [--formats int4/channel]
                                     [--splits 1,2,3,4,6,8,12,16]

gpu_decode_fast.py's shapes and pages; each row is one split count given to the launcher (the
split merge included), the "auto" row the launcher's own choice (decode_sm90.choose_splits);
medians of CUDA-graph replays, time against SDPA over contiguous bf16 in the same process.
Nsight Compute measured the int4 kernel at B16 L32k (one wave, 512 CTAs on 528 slots) with its
SMs active 87% of the kernel's time on average (the least busy 73%, the most 96%).
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.gpu_decode_fast import (  # noqa: E402
    SHAPES,
    _bench,
    random_case,
    sdpa_baseline,
    warm_builds,
)
from tests.kernels.kernel_cases import launch_backend  # noqa: E402

DEV = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="B16_L32k,B64_L8k,B1_L128k")
    ap.add_argument("--formats", default="int4/channel,fp8_e4m3/page")
    ap.add_argument("--splits", default="1,2,3,4,5,6,8,12,16")
    a = ap.parse_args()
    formats = [f for f in a.formats.split(",") if f]
    warm_builds(formats=formats)
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | pages | splits | ms | x SDPA |\n|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        B, L, Hq, Hkv, D = SHAPES[shape]
        q, t_sdpa = sdpa_baseline(B, L, Hq, Hkv, D, gen)
        out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        for name in formats:
            kf, kg = name.split("/")
            P = 64 if kf == "int4" else 16
            f, vf, kc, vc, bt, sl = random_case(kf, kg, B, L, Hkv, D, P, gen)
            for s in ["auto"] + [int(x) for x in a.splits.split(",")]:
                t = _bench(functools.partial(launch_backend, q, kc, vc, bt, sl, out, "cuda",
                                             splits=0 if s == "auto" else s))
                print(f"| {shape} | {name} | {s} | {t:.4f} | {t / t_sdpa:.3f} |", flush=True)
            del kc, vc
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
