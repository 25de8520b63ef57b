"""Hand-written attention whose scores get several masks and position biases before the softmax
(the idioms of MPT, GPT-Neo and CPM-Ant), and look-alikes that must stay as they are.

Each block takes (x [B, T, dim], start_pos) and keeps its own cache, like tests/passes/research.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.passes.research import FusedQKV


class _CatCache(FusedQKV):
    """q, k, v [B, H, T, D] from one projection; keys/values grown by cat(dim=2) on the module."""

    def __init__(self, dim=64, n_head=4, **kw):
        super().__init__(dim, n_head)
        self.kv = None

    def qkv_cached(self, x, start_pos):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        if start_pos > 0:
            k, v = torch.cat([self.kv[0], k], dim=2), torch.cat([self.kv[1], v], dim=2)
        self.kv = (k, v)
        return q, k, v

    def out(self, y):
        B, H, T, D = y.shape
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


def _future(T, L, device):
    # [T, L] bool: True where the key is after the query (queries are the last T positions)
    return torch.arange(L, device=device)[None, :] > torch.arange(L - T, L, device=device)[:, None]


class AlibiMaskedFill(_CatCache):
    """MPT: ALiBi [H, 1, L] added to the scaled scores, then masked_fill(future, finfo.min)."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        slopes = 2.0 ** -torch.arange(1, self.h + 1, device=x.device).float()
        alibi = slopes[:, None, None] * torch.arange(1 - L, 1, device=x.device)   # [H, 1, L]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = (s + alibi).masked_fill(_future(T, L, x.device), torch.finfo(s.dtype).min)
        p = torch.softmax(s.float(), dim=-1).to(v.dtype)
        return self.out(torch.matmul(p, v))


class CausalWhereLocalAdd(_CatCache):
    """GPT-Neo: attention in fp32 (cached keys upcast), where(causal, s, torch.tensor(min)),
    then an additive local-window mask (keys 4 or more positions back: -1e9)."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
        low = torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=x.device)
        s = torch.where(~_future(T, L, x.device), s, low)
        back = torch.arange(L - T, L, device=x.device)[:, None] - torch.arange(L, device=x.device)
        s = s + (back >= 4).float() * -1e9                                     # [T, L]
        p = torch.softmax(s, dim=-1).to(v.dtype)
        return self.out(torch.matmul(p, v))


class RelBiasZeroedProbs(_CatCache):
    """CPM-Ant: a learned bias per head and relative distance [1, H, T, L] under
    torch.masked_fill(.., mask == False, scalar_tensor(-inf)); after the softmax the same mask,
    computed again, zeroes the probabilities."""

    def __init__(self, dim=64, n_head=4, max_dist=8, **kw):
        super().__init__(dim, n_head)
        self.max_dist = max_dist
        self.rel = nn.Embedding(max_dist, n_head)

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        dist = torch.arange(L - T, L, device=x.device)[:, None] - torch.arange(L, device=x.device)
        bias = self.rel(dist.clamp(0, self.max_dist - 1)).permute(2, 0, 1)[None]   # [1, H, T, L]
        allowed = ~_future(T, L, x.device)
        s = torch.matmul(q, k.transpose(-1, -2)) / self.hd ** 0.5
        s = torch.masked_fill(s + bias, allowed == torch.tensor(False),
                              torch.scalar_tensor(float("-inf")))
        p = torch.softmax(s, dim=-1)
        p = torch.masked_fill(p, allowed == torch.tensor(False), torch.scalar_tensor(0))
        return self.out(torch.matmul(p, v))


class ProductMaskGPT1(FusedQKV):
    """OpenAI GPT: a [B, T, H, D] cache by cat(dim=1), keys permuted straight to [B, H, D, S],
    masking by product with a 0/1 float buffer: w * b + -1e4 * (1 - b)."""

    def __init__(self, dim=64, n_head=4, max_len=64, **kw):
        super().__init__(dim, n_head)
        self.register_buffer("bias", self._mask(max_len), persistent=False)
        self.kv = None

    @staticmethod
    def _mask(n):
        return torch.ones(n, n).tril().view(1, 1, n, n)

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).unbind(2)         # [B, T, H, D]
        if start_pos > 0:
            k, v = torch.cat([self.kv[0], k], dim=1), torch.cat([self.kv[1], v], dim=1)
        self.kv = (k, v)
        L = k.shape[1]
        w = torch.matmul(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1)) / self.hd ** 0.5
        b = self.bias[:, :, L - T:L, :L]
        w = w * b + -1e4 * (1 - b)
        y = torch.matmul(torch.softmax(w, dim=-1), v.permute(0, 2, 1, 3))
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class InPlaceMaskedFill(_CatCache):
    """XLM: q pre-scaled, scores masked in place (scores.masked_fill_(mask.expand_as(scores),
    min)), probabilities cast back by type_as(scores)."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        scores = torch.matmul(q / self.hd ** 0.5, k.transpose(2, 3))
        mask = _future(T, L, x.device)[None, None].expand_as(scores)
        scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).type_as(scores)
        return self.out(torch.matmul(weights, v))


# --- look-alikes ------------------------------------------------------------------------------

class ProductSoftMask(ProductMaskGPT1):
    """The same product, with a buffer of soft weights (a decay in (0, 1]): a reweighting of
    the scores, not a mask."""

    @staticmethod
    def _mask(n):
        i = torch.arange(n)
        return (0.9 ** (i[:, None] - i[None, :]).clamp(min=0).float()).view(1, 1, n, n)

class WhereZeroFill(_CatCache):
    """where(causal, s, 0.0): future scores set to 0, not removed; no attention mask."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = torch.where(~_future(T, L, x.device), s, 0.0)
        return self.out(torch.matmul(torch.softmax(s, dim=-1), v))


class KeyNormBias(_CatCache):
    """A bias computed from the cached keys themselves (their norms): the cache is read by more
    than attention, so paging it would change what the bias sees."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = (s + k.norm(dim=-1)[:, :, None, :]).masked_fill(_future(T, L, x.device),
                                                            float("-inf"))
        return self.out(torch.matmul(torch.softmax(s, dim=-1), v))


class ProbsZeroedByAnotherMask(_CatCache):
    """Causal attention whose probabilities are then zeroed on the first key: a mask after the
    softmax that was not applied before it (the rows no longer sum to 1)."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        p = torch.softmax(s.masked_fill(_future(T, L, x.device), float("-inf")), dim=-1)
        first = torch.arange(L, device=x.device)[None, :].expand(T, L) == 0
        return self.out(torch.matmul(p.masked_fill(first, 0.0), v))


class SinkLogits(_CatCache):
    """gpt-oss: a learned logit per head concatenated to the scores, the row max subtracted,
    softmax, the sink column dropped (kvcompile.attention's sink_logits)."""

    def __init__(self, dim=64, n_head=4, **kw):
        super().__init__(dim, n_head)
        self.sinks = nn.Parameter(torch.randn(n_head) * 0.5)

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        B, H, T, _ = q.shape
        L = k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        s = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        p = torch.softmax(s, dim=-1)[..., :-1]
        return self.out(torch.matmul(p, v))


class SinkByLogsumexp(SinkLogits):
    """Granite-SWA: the same sink as a scale of the output, sigmoid(logsumexp(s) - sink)."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        scale = (torch.logsumexp(s, dim=-1) - self.sinks.view(1, -1, 1)).sigmoid()
        y = torch.matmul(torch.softmax(s, dim=-1), v) * scale.unsqueeze(-1)
        return self.out(y)


class SinkPerQuery(SinkLogits):
    """A look-alike of sinks: the extra column is computed from the queries (one logit per
    query, not per head), so it is no input the op takes."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        s = torch.cat([s, q.sum(-1, keepdim=True)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        return self.out(torch.matmul(p, v))


class SinkColumnKept(SinkLogits):
    """A look-alike of sinks: after the softmax the *first* column is dropped, so the sink's
    probability weighs the last key's value and the first key is ignored."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        B, H, T, _ = q.shape
        L = k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        s = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., 1:]
        return self.out(torch.matmul(p, v))


class SinkGqaFloatKeys(nn.Module):
    """Flint: two kv heads repeated for four query heads (repeat_kv), the repeated keys then
    cast with .float() before q·kᵀ (exact), with attention sinks."""

    def __init__(self, dim=64, n_head=4, n_kv=2, **_):
        super().__init__()
        self.h, self.kv_h, self.hd = n_head, n_kv, dim // n_head
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(n_head) * 0.5)
        self.kv = None

    def forward(self, x, start_pos: int):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2, self.kv_h, self.hd).permute(2, 0, 3, 1, 4)
        if start_pos > 0:
            k, v = torch.cat([self.kv[0], k], dim=2), torch.cat([self.kv[1], v], dim=2)
        self.kv = (k, v)
        L, g = k.shape[2], self.h // self.kv_h
        k = k[:, :, None].expand(B, self.kv_h, g, L, self.hd).reshape(B, self.h, L, self.hd)
        v = v[:, :, None].expand(B, self.kv_h, g, L, self.hd).reshape(B, self.h, L, self.hd)
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        s = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        y = torch.matmul(p, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MaxSubtracted(_CatCache):
    """MiMo: the masked scores minus their row maximum (amax here) before the softmax, which
    changes nothing the softmax returns."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        p = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)
        return self.out(torch.matmul(p, v))


class MaxOverQueriesSubtracted(_CatCache):
    """A look-alike: the scores minus their maximum over the *queries* (dim -2), a different
    constant per key, which changes the softmax."""

    def forward(self, x, start_pos: int):
        q, k, v = self.qkv_cached(x, start_pos)
        T, L = q.shape[2], k.shape[2]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
        s = s - s.max(dim=-2, keepdim=True).values
        s = s.masked_fill(_future(T, L, x.device), float("-inf"))
        return self.out(torch.matmul(torch.softmax(s, dim=-1), v))
