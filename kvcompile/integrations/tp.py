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
    try:
        cfg_head_dim = getattr(cfg, "head_dim", None)
    except Exception:  # noqa: BLE001  (transformers >= 5.25 raises for a per-layer head_dim:
        cfg_head_dim = None   # each attention module's own head_dim is used then)
    for name, mod in model.named_modules():
        head_dim = getattr(mod, "head_dim", None) or cfg_head_dim
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


# --- the tensor-parallel group of a compiled model --------------------------------------------

class TensorParallel:
    """The ranks a model's attention heads are split over, and the few collectives kvcompile
    itself needs on them (`ModelState.tp`). Every call is collective: each rank makes it at
    the same point of the same step, which holds because every rank runs the same steps.

    - `sum_heads`: eviction scores shared by a layer's kv heads (layer-shared SnapKV, page
      eviction) summed over all ranks' heads, so every rank keeps the same tokens;
    - `min_int`: the pool's page count (each rank sizes from its own free memory);
    - `broadcast_tokens`: the Engine's sampled tokens, rank 0's;
    - `check_same`: the Engine's schedule of a step, the same on every rank or an error.
    """

    def __init__(self, group, source: str):
        import torch.distributed as dist

        self.group, self.source = group, source
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, from {self.source})"

    def sum_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks (a new tensor; fp32, as the scores are)."""
        import torch.distributed as dist

        y = x.float().contiguous().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def min_int(self, n: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([int(n)], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's tokens on every rank (-1 rows stay -1)."""
        import torch.distributed as dist

        t = torch.tensor(tokens, dtype=torch.int64, device=self._device())
        dist.broadcast(t, group_src=0, group=self.group)
        return t.tolist()

    def check_same(self, what: str, fingerprint: int, fix: str) -> None:
        """Raise TensorParallelError on every rank when the ranks' fingerprints differ."""
        import torch.distributed as dist

        mine = torch.tensor([fingerprint & ((1 << 62) - 1)], dtype=torch.int64,
                            device=self._device())
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        got = [int(t.item()) for t in every]
        if len(set(got)) > 1:
            odd = [r for r, g in enumerate(got) if g != got[0]]
            raise TensorParallelError(
                f"tensor-parallel rank(s) {odd} have a different {what} than rank 0 "
                f"(this is rank {self.rank} of {self.size}); {fix}")

    def _device(self) -> torch.device:
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _mesh_group(weight):
    """The process group of the mesh dim that shards `weight` (a DTensor), or None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    for i, p in enumerate(weight.placements):
        if isinstance(p, Shard) and mesh.shape[i] > 1:
            return mesh.get_group(i)
    return None


def tensor_parallel_of(model: torch.nn.Module) -> TensorParallel | None:
    """The group of a DTensor-sharded model (`tp_plan="auto"`, `parallelize_module`): the mesh
    that shards its first sharded k_proj / v_proj; None when nothing is sharded."""
    try:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    for mod in model.modules():
        for proj in ("k_proj", "v_proj", "wk", "wv", "wqkv", "qkv_proj"):
            group = _mesh_group(getattr(getattr(mod, proj, None), "weight", None))
            if group is not None:
                return TensorParallel(group, "DTensor placements")
    return None


def tensor_parallel_of_graph(gm: torch.fx.GraphModule) -> TensorParallel | None:
    """The group a hand-sharded model (gpt-fast's tp.py: local heads, then
    `funcol.all_reduce(y, "sum", group)` after the output projection) all-reduces over in this
    graph; None when the graph has no functional all-reduce of more than one rank."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    ops = {getattr(torch.ops._c10d_functional, "all_reduce", None),
           getattr(torch.ops._c10d_functional, "all_reduce_", None)}
    for n in gm.graph.nodes:
        packet = getattr(n.target, "overloadpacket", n.target)   # Dynamo keeps the packet
        if n.op == "call_function" and packet in ops:
            name = n.args[2] if len(n.args) > 2 else n.kwargs.get("group_name")
            group = _resolve_process_group(name)
            if dist.get_world_size(group) > 1:
                return TensorParallel(group, "the graph's functional all_reduce")
    return None
