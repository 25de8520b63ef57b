"""One launch of each build of the Gluon FP8 prefill kernel (kernels/prefill_sm90.py), for
Nsight Compute (session31_call.sh n): 8 warps, then 4, on B1 x 8,192 tokens, GQA 32/8,
head_dim 128, causal.

    ncu -k regex:prefill_fp8_sm90 --set full -o REPORT python benchmarks/ncu_prefill_fp8.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.kernels import prefill_sm90  # noqa: E402
from kvcompile.kernels.prefill import quantize_fp8_prefill  # noqa: E402


def main():
    L, hq, hkv, d = 8192, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(L, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (hq, hkv, hkv))
    cu = torch.tensor([0, L], device="cuda", dtype=torch.int32)
    q8, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
    out = torch.empty(L, hq, d, device="cuda", dtype=torch.bfloat16)
    for warps in (8, 4):
        prefill_sm90.launch_prefill_fp8_sm90(q8, k8, vt8, sc, cu, out, d ** -0.5, L,
                                             warps=warps)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
