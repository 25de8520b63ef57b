"""Hand-written models in styles common in research code (a few dozen lines each)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


class SliceCacheAttention(nn.Module):
    """K/V buffers written by slice assignment at `start_pos`, read back up to the current
    length, and SDPA with a boolean mask built from positions (no is_causal)."""

    def __init__(self, dim=64, n_head=4, max_len=64, batch=2):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (batch, n_head, max_len, self.hd)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos: int):
        # x: [B, T, dim] -> [B, T, dim]
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.h, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.h, self.hd).transpose(1, 2)
        self.cache_k[:, :, start_pos:start_pos + T] = k
        self.cache_v[:, :, start_pos:start_pos + T] = v
        keys = self.cache_k[:, :, :start_pos + T]
        values = self.cache_v[:, :, :start_pos + T]
        q_pos = torch.arange(start_pos, start_pos + T, device=x.device)
        k_pos = torch.arange(start_pos + T, device=x.device)
        mask = k_pos[None, :] <= q_pos[:, None]                      # [T, L]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class EinsumAttention(nn.Module):
    """Attention by torch.einsum over a [B, T, H, D] layout, causal mask by triu."""

    def __init__(self, dim=64, n_head=4):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, start_pos: int = 0):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).unbind(2)   # [B, T, H, D]
        s = torch.einsum("bthd,bshd->bhts", q, k) / self.hd ** 0.5
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        p = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)
        return self.wo(torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, C))


class TinyLM(nn.Module):
    """Embedding, `layers` pre-norm attention blocks of `attn_cls`, MLPs, LM head (x8)."""

    def __init__(self, attn_cls, dim=64, layers=2, **kw):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(attn_cls(dim, **kw) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx, start_pos: int = 0):
        # idx: [B, T] -> logits [B, T, VOCAB]
        x = self.emb(idx)
        for attn, norm, mlp in zip(self.layers, self.norms, self.mlps):
            x = x + attn(norm(x), start_pos)
            x = x + mlp(x)
        return self.head(x)


def make(attn_cls, seed=0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    m = TinyLM(attn_cls, **kw).eval()
    with torch.no_grad():
        m.head.weight.mul_(8.0)  # greedy decided by the model, not by rounding (zoo.py)
    return m


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill `prompt` [B, T], then `steps` greedy decode steps: (tokens [B, steps], logits)."""
    logits = [model(prompt, 0)]
    tok = logits[-1][:, -1:].argmax(-1)
    out = [tok]
    pos = prompt.shape[1]
    for _ in range(steps - 1):
        logits.append(model(tok, pos))
        tok = logits[-1][:, -1:].argmax(-1)
        out.append(tok)
        pos += 1
    return torch.cat(out, dim=1), logits
