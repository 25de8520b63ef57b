"""check_tensor_parallel on an unsharded model whose config refuses a global head_dim
(transformers >= 5.25 raises for a per-layer attribute): nothing to refuse, no crash."""

from __future__ import annotations

import pytest
import torch

from kvcompile.integrations.tp import check_tensor_parallel


class _Config:
    @property
    def head_dim(self):
        raise RuntimeError("'head_dim' is a per-layer attribute")   # as transformers 5.25


class _Attn(torch.nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = torch.nn.Linear(16, 4 * head_dim)
        self.k_proj = torch.nn.Linear(16, 2 * head_dim)
        self.v_proj = torch.nn.Linear(16, 2 * head_dim)


def test_per_layer_head_dim_config_does_not_crash():
    m = torch.nn.Sequential(_Attn(8), _Attn(4))
    m.config = _Config()
    check_tensor_parallel(m)          # unsharded: passes, reading each module's head_dim
    with pytest.raises(RuntimeError):
        _ = m.config.head_dim         # (the config does refuse it)
