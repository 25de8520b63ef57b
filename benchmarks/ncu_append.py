"""The append kernels' launches, one each, for Nsight Compute (issue 16's append rows).

    ncu --clock-control none -k regex:_append --set full ... \\
        python benchmarks/ncu_append.py --rows int4/channel,int4/token,fp4_e2m1/page

Builds bench_append.py's bulk write (T tokens x H heads x D of bf16 input into whole pages in
random order, slots grouped by page as the runtime's prefill gives them; token scales take
them as they come) for each row, warms the kernel's build with two writes, then writes
`--launches` times, synchronizing after each, so a profiler sees one append kernel per launch.
Prints each row's time from CUDA events (no profiler) and its GB/s (bench_append's bytes).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.kernels.append import quantize_append  # noqa: E402

DEV = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="int4/channel,int4/token,fp4_e2m1/page")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--launches", type=int, default=1)
    a = ap.parse_args()
    T, H, D, P = a.tokens, a.heads, a.dim, a.page
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
    N = T // P
    perm = torch.randperm(N, device=DEV, generator=gen)
    slots = (perm[:, None] * P + torch.arange(P, device=DEV)).reshape(-1).contiguous()
    for row in a.rows.split(","):
        name, gran = row.split("/")
        fmt = KVFormat(name, gran)
        grouped = gran != "token"
        c = fmt.allocate(N, H, P, D, DEV)
        for _ in range(2):
            quantize_append(c, slots, x, grouped, direct=True)
        torch.cuda.synchronize()
        total = x.numel() * x.element_size() + T * fmt.bytes_per_token(H, D, P)
        times = []
        for _ in range(a.launches):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            quantize_append(c, slots, x, grouped, direct=True)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        ms = min(times)
        print(f"{row} T{T} H{H} D{D} P{P}: {ms:.4f} ms (events, min of {len(times)}), "
              f"{total / 1e6:.1f} MB, {total / ms / 1e6:.0f} GB/s", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
