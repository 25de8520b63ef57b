"""Models for `kvcompile inspect tests.cli.factories:NAME` (the module:factory spec)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.passes.research import FusedQKV


class StaticCacheAttention(nn.Module):
    """gpt-fast style: k_cache / v_cache buffers written with index_put, then SDPA."""

    def __init__(self, dim=32, heads=2, max_len=64):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, self.hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, self.hd), persistent=False)

    def forward(self, x, mask, input_pos):
        # x: [1, S, dim]  mask: [1, 1, S, max_len] bool  input_pos: [S]
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, self.heads, self.hd).transpose(1, 2)
                   for t in self.wqkv(x).chunk(3, dim=-1))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class StaticCacheModel(nn.Module):
    def __init__(self, vocab=64, dim=32, max_len=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = StaticCacheAttention(dim, max_len=max_len)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)),
                             persistent=False)

    def forward(self, idx, input_pos):
        mask = self.causal[None, None, input_pos]
        return self.head(self.emb(idx) + self.attn(self.emb(idx), mask, input_pos))


def static_cache():
    torch.manual_seed(0)
    model = StaticCacheModel().eval()
    return model, (torch.randint(0, 64, (1, 8)), torch.arange(8))


def no_inputs():
    return StaticCacheModel()


def not_a_module():
    return 42


class DistanceAttention(FusedQKV):
    """Softmax over negative query-key distances (torch.cdist), not over q . k: attention-like,
    but no pattern matches it (a near miss at the scores)."""

    def forward(self, x, start_pos: int = 0):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        s = -torch.cdist(q, k)                                              # [B, H, T, T]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        p = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)
        return self.wo((p @ v).transpose(1, 2).reshape(B, T, C))


def distance_attention():
    """A near miss for `inspect` (see DistanceAttention)."""
    from tests.passes.research import make

    return make(DistanceAttention), (torch.randint(0, 256, (1, 8)), 0)


def needs_arguments(n_layers):
    """A factory that cannot be called as `module:factory` (it needs an argument)."""
    raise AssertionError("never called")
