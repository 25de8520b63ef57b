"""Tensor-parallel models (Hugging Face `tp_plan="auto"`, `parallelize_module`): checks at compile.

Under tensor parallelism each rank's attention sees plain local tensors holding Hq/tp query heads
and Hkv/tp KV heads (the projections are DTensors sharded on their output dim), and kvcompile
rewrites that local attention into a pool holding only the rank's own KV heads. That is only
correct when every rank gets whole heads: a head count that does not divide by the tp size would
split a head's channels across ranks. Hugging Face and torch load such a model without a word and
fail later inside the first forward with a reshape error; kvcompile refuses it at compile time.
"""

from __future__ import annotations

import torch

from kvcompile.errors import TensorParallelError


def _shard_count(weight) -> int:
    """How many ranks split `weight`'s output dim (1 when it is not a DTensor sharded on dim 0)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return 1
    if not isinstance(weight, DTensor):
        return 1
    n = 1
    for size, p in zip(weight.device_mesh.shape, weight.placements):
        if isinstance(p, Shard) and p.dim in (0, -weight.dim()):
            n *= size
    return n


def check_tensor_parallel(model: torch.nn.Module) -> None:
    """Refuse attention whose query or KV heads do not split evenly over the tp ranks."""
    cfg = getattr(model, "config", None)
    for name, mod in model.named_modules():
        head_dim = getattr(mod, "head_dim", None) or getattr(cfg, "head_dim", None)
        for proj, kind in (("q_proj", "query"), ("k_proj", "KV"), ("v_proj", "KV")):
            lin = getattr(mod, proj, None)
            w = getattr(lin, "weight", None)
            if w is None or not head_dim:
                continue
            tp = _shard_count(w)
            heads, rest = divmod(w.shape[0], head_dim)  # a DTensor's shape is the global one
            if tp > 1 and (rest or heads % tp):
                key = "num_attention_heads" if kind == "query" else "num_key_value_heads"
                raise TensorParallelError(
                    f"{name}.{proj} splits {heads} {kind} heads (head_dim {head_dim}) over "
                    f"{tp} tensor-parallel ranks: {heads} does not divide by {tp}, so a rank "
                    f"would hold part of a head. Run with a tp size that divides "
                    f"{key}={heads} (--nproc-per-node), or leave {proj} unsharded.")
