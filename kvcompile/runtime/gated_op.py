"""`torch.ops.kvcompile.act_mul_`: a gated MLP's product into its merged gate / up output.

    torch.ops.kvcompile.act_mul_(y, a, b, width, act)
    # y [..., W]: y[..., a:a+width] = act(y[..., a:a+width]) * y[..., b:b+width], in place

passes/merge_projections.py inserts it where a merged gate / up linear's halves meet only in
act(gate) * up, and the down projection reads y[..., a:a+width] as a view: the product takes
no buffer of its own (kernels/gated.py). It mutates y, which inductor re-inplaces (y is an
intermediate the graph does not read afterwards but through that view).
"""

from __future__ import annotations

import torch

from kvcompile.kernels import gated


@torch.library.custom_op("kvcompile::act_mul_", mutates_args=("y",))
def act_mul_(y: torch.Tensor, a: int, b: int, width: int, act: str) -> None:
    gated.act_mul_(y, a, b, width, act)


@act_mul_.register_fake
def _(y, a, b, width, act) -> None:
    return None
