"""gpt-fast's own tensor parallelism (its tp.py), applied to the test zoo's gpt-fast model.

No DTensor: each rank slices its heads out of the fused wqkv and its columns of wo, keeps
caches of its own KV heads, and all-reduces the attention output with
`torch.distributed._functional_collectives.all_reduce` in a forward hook, as gpt-fast does.
The MLPs stay replicated. kvcompile learns the tp group from that all_reduce in the graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.passes.zoo import GptFast


def shard_gptfast(model: GptFast, rank: int, world: int) -> GptFast:
    import torch.distributed._functional_collectives as funcol

    for attn in model.layers:
        hq, hkv, hd = attn.n_head, attn.n_kv, attn.hd
        assert hq % world == 0 and hkv % world == 0, (hq, hkv, world)
        lq, lkv = hq // world, hkv // world
        w = attn.wqkv.weight.data                        # [(hq + 2 hkv) hd, dim]
        q, k, v = w.split([hq * hd, hkv * hd, hkv * hd])
        mine = [t.view(-1, hd, t.shape[-1])[rank * n:(rank + 1) * n].reshape(-1, t.shape[-1])
                for t, n in ((q, lq), (k, lkv), (v, lkv))]
        attn.wqkv = nn.Linear(w.shape[1], (lq + 2 * lkv) * hd, bias=False)
        attn.wqkv.weight.data.copy_(torch.cat(mine))
        wo = attn.wo.weight.data                         # [dim, hq hd]: columns by q head
        attn.wo = nn.Linear(lq * hd, wo.shape[0], bias=False)
        attn.wo.weight.data.copy_(wo[:, rank * lq * hd:(rank + 1) * lq * hd])
        attn.n_head, attn.n_kv = lq, lkv
        b, _, max_len, _ = attn.k_cache.shape
        attn.k_cache = torch.zeros(b, lkv, max_len, hd)
        attn.v_cache = torch.zeros(b, lkv, max_len, hd)
        attn.register_forward_hook(
            lambda _m, _i, y: funcol.all_reduce(y, "sum", dist.group.WORLD))
    return model
