"""`torch.ops.kvcompile.skinny_linear`: F.linear on kernels/skinny.py's Triton kernel.

    torch.ops.kvcompile.skinny_linear(x, w, b)   # = F.linear(x, w, b)

passes/skinny_linears.py puts it in place of a decode graph's linears whose input has at most
16 rows (KVConfig.decode_gemms="triton"). It is F.linear by definition: the kernel takes x of at
most 16 rows and w with contiguous rows in one dtype with x, on CUDA (or under the Triton
interpreter); anything else (which the pass does not insert, but a graph's input could change
under it) runs F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvcompile.kernels import skinny


def takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands (else F.linear runs them)."""
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    return (k > 0 and w.dim() == 2 and w.shape[1] == k and rows <= skinny.MAX_M
            and w.stride(1) == 1 and x.dtype == w.dtype and (b is None or b.dtype == x.dtype)
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and x.device == w.device
            and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


@torch.library.custom_op("kvcompile::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if takes(x, w, b):
        return skinny.skinny_linear(x.contiguous(), w, b)
    return F.linear(x, w, b)


@skinny_linear.register_fake
def _(x, w, b):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
