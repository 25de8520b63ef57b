"""A gated MLP's product written in place into its merged gate / up output.

After passes/merge_projections.py runs gate and up as one linear, y = x @ [W_gate; W_up]^T
holds both halves side by side ([..., 2I]). The model's next step, act(gate) * up, would be a
new [..., I] tensor beside y, which lives until that product is done: at a prefill of T tokens
that is T x I elements more than the unmerged graph keeps, which writes the product into
gate's buffer (1.75 GiB at B16 x 4096 tokens of Llama-3-8B's MLP; the peak rose from 12.6 to
13.6 GiB, H100). `act_mul_` writes act(y[..., a:a+I]) * y[..., b:b+I] into y[..., a:a+I] and
the down projection reads that half as a view: one buffer, as unmerged.

    act_mul_(y, a, b, width, act)     y [..., W] with a unit last stride, act in ACTS

CUDA: one Triton kernel, one pass (reads both halves, writes one), the activation and product
in fp32 and one rounding, as inductor's fused kernel of the unmerged graph computes them.
Elsewhere (the CPU, or a layout the kernel does not take): the model's own ops, `act(g) * u`
in y's dtype, blocks of rows at a time (bit for bit the eager model's product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# the activations the rewrite recognizes, by the name the op takes
ACTS = ("silu", "gelu_tanh")
BLOCK = 1024            # columns per program
_TORCH_ROWS = 1 << 22   # elements of gate per block of the torch path (its temporaries)


@triton.jit
def _act_mul_kernel(y_ptr, row_stride, a, b, width, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    base = y_ptr + row * row_stride
    g = tl.load(base + a + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(base + b + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:    # silu
        h = g * tl.sigmoid(g)
    else:           # gelu, tanh approximation: tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        h = g * tl.sigmoid(2.0 * z)
    tl.store(base + a + cols, (h * u).to(y_ptr.dtype.element_ty), mask=ok)


def _act(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"act_mul_: activation {name!r} is not one of {ACTS}")


def act_mul_(y: torch.Tensor, a: int, b: int, width: int, act: str,
             kernel: str = "auto") -> None:
    """y[..., a:a+width] = act(y[..., a:a+width]) * y[..., b:b+width], in place. kernel:
    "auto" (Triton on CUDA), "triton", "torch"."""
    fn = _act(act)
    if not (0 <= a and 0 <= b and width > 0 and max(a, b) + width <= y.shape[-1]
            and (a + width <= b or b + width <= a)):
        raise ValueError(f"act_mul_: columns [{a}, {a + width}) and [{b}, {b + width}) must be "
                         f"disjoint and within y's last dimension ({y.shape[-1]})")
    rows = y.numel() // max(y.shape[-1], 1)
    flat = _rows(y)
    if kernel == "auto":
        kernel = "triton" if y.is_cuda and flat is not None else "torch"
    if kernel == "triton":
        if flat is None:
            raise ValueError("act_mul_: the Triton kernel takes rows a fixed stride apart "
                             "with a unit last stride")
        if rows:
            grid = (rows, triton.cdiv(width, BLOCK))
            _act_mul_kernel[grid](flat, flat.stride(0), a, b, width,
                                  ACT=ACTS.index(act), BLOCK=BLOCK)
        return
    y2 = flat if flat is not None else y.reshape(-1, y.shape[-1])
    step = max(1, _TORCH_ROWS // width)
    for r0 in range(0, rows, step):
        blk = y2[r0:r0 + step]
        g = blk[:, a:a + width]
        g.copy_(fn(g) * blk[:, b:b + width])
    if flat is None:   # y2 is a copy (reshape could not view y): write it back
        y.copy_(y2.view(y.shape))


def _rows(y: torch.Tensor) -> torch.Tensor | None:
    """y as [rows, W] without a copy, where its rows (every index but the last) sit a fixed
    stride apart with a unit last stride; else None."""
    if y.dim() == 0 or y.stride(-1) != 1:
        return None
    try:
        return y.view(-1, y.shape[-1])
    except RuntimeError:
        return None
