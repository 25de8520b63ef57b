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


class FusedQKV(nn.Module):
    """A block with one fused q/k/v projection (`qkv`) and an output projection (`wo`)."""

    def __init__(self, dim=64, n_head=4, **_):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)


class EinsumAttention(FusedQKV):
    """Attention by torch.einsum over a [B, T, H, D] layout, causal mask by triu."""

    def forward(self, x, start_pos: int = 0):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).unbind(2)   # [B, T, H, D]
        s = torch.einsum("bthd,bshd->bhts", q, k) / self.hd ** 0.5
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        p = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)
        return self.wo(torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, C))


class EinsumSliceBTHD(nn.Module):
    """[B, T, H, D] buffers written by slice assignment; scores and output by einsum; an
    additive causal mask from triu; softmax in fp32 (issue 17's first model)."""

    def __init__(self, dim=64, n_head=4, max_len=64, batch=2):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("ck", torch.zeros(batch, max_len, n_head, self.hd), persistent=False)
        self.register_buffer("cv", torch.zeros(batch, max_len, n_head, self.hd), persistent=False)

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.h, self.hd).unbind(2)     # [B, T, H, D]
        self.ck[:, start_pos:start_pos + T] = k
        self.cv[:, start_pos:start_pos + T] = v
        keys, values = self.ck[:, :start_pos + T], self.cv[:, :start_pos + T]
        s = torch.einsum("bthd,bshd->bhts", q, keys) * self.hd ** -0.5
        L = start_pos + T
        s = s + torch.full((T, L), float("-inf"), device=x.device).triu(start_pos + 1)
        p = torch.softmax(s.float(), dim=-1).type_as(q)
        return self.wo(torch.einsum("bhts,bshd->bthd", p, values).reshape(B, T, C))


class BaddbmmMQA(nn.Module):
    """Heads flattened into the batch ([B*H, T, D]), one kv head shared by all (MQA through
    expand + reshape), cache by cat kept on the module, scores by baddbmm with the additive
    mask as its bias, output by bmm (issue 17's second model; BLOOM / fairseq style)."""

    def __init__(self, dim=64, n_head=4, **_):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.hd)
        self.o = nn.Linear(dim, dim)
        self.past = None

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        H, D = self.h, self.hd
        q = self.q(x).view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D)
        k, v = self.kv(x).view(B, T, 1, 2 * D).transpose(1, 2).split(D, dim=-1)  # [B, 1, T, D]
        if start_pos == 0:
            self.past = (k.new_zeros(B, 1, 0, D), v.new_zeros(B, 1, 0, D))
        k = torch.cat([self.past[0], k], dim=2)
        v = torch.cat([self.past[1], v], dim=2)
        self.past = (k, v)
        L = k.shape[2]
        k = k.expand(B, H, L, D).reshape(B * H, L, D)
        v = v.expand(B, H, L, D).reshape(B * H, L, D)
        q_pos = torch.arange(L - T, L, device=x.device)[:, None]
        bias = (torch.arange(L, device=x.device)[None, :] > q_pos).float() * -1e9   # [T, L]
        bias = bias.expand(B * H, T, L)
        s = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=D ** -0.5)
        y = torch.bmm(torch.softmax(s, dim=-1), v)                          # [B*H, T, D]
        return self.o(y.view(B, H, T, D).transpose(1, 2).reshape(B, T, C))


class WhereIndexCopyGQA(nn.Module):
    """[B, H, T, D] buffers written by index_copy_, GQA by repeat_interleave, matmul scores,
    where(mask, s, -inf) from a tril buffer, softmax(dtype=float32)."""

    def __init__(self, dim=64, n_head=4, n_kv=2, max_len=64, batch=2):
        super().__init__()
        self.h, self.kvh, self.hd = n_head, n_kv, dim // n_head
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (batch, n_kv, max_len, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("tril", torch.ones(max_len, max_len, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        pos = torch.arange(start_pos, start_pos + T, device=x.device)
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2 * self.kvh, self.hd).transpose(1, 2).chunk(2, dim=1)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        rep = self.h // self.kvh
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        s = torch.matmul(q, keys.transpose(2, 3)) / self.hd ** 0.5
        s = torch.where(self.tril[pos], s, float("-inf"))                 # [T, max_len]
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.wo(torch.matmul(p, values).transpose(1, 2).reshape(B, T, C))


class EinsumCatBTHDGQA(nn.Module):
    """A [B, T, H, D] cache grown by cat along dim 1 (flash-attn layout), GQA by
    repeat_interleave over the heads dim, einsum with other letters, masked_fill with a
    boolean mask from position comparisons."""

    def __init__(self, dim=64, n_head=4, n_kv=2, **_):
        super().__init__()
        self.h, self.kvh, self.hd = n_head, n_kv, dim // n_head
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.to_v = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.cache = None

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        q = self.to_q(x).unflatten(-1, (self.h, self.hd))                      # [B, T, H, D]
        k = self.to_k(x).unflatten(-1, (self.kvh, self.hd))
        v = self.to_v(x).unflatten(-1, (self.kvh, self.hd))
        if start_pos > 0:
            k = torch.cat([self.cache[0], k], dim=1)
            v = torch.cat([self.cache[1], v], dim=1)
        self.cache = (k, v)
        L = k.shape[1]
        k = k.repeat_interleave(self.h // self.kvh, dim=2)
        v = v.repeat_interleave(self.h // self.kvh, dim=2)
        att = torch.einsum("nqhc,nkhc->nhqk", q * self.hd ** -0.5, k)
        future = torch.arange(L, device=x.device)[None, :] > torch.arange(L - T, L,
                                                                          device=x.device)[:, None]
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.out(torch.einsum("nhqk,nkhc->nqhc", att, v).flatten(2))


class BmmFlatGQA(nn.Module):
    """[B*H, T, D] bmm attention with GQA through x[:, :, None].expand(..).reshape(B*H, ..),
    a [B, H, T, D] cache by cat(dim=-2), q pre-scaled, where(future, -inf, s)."""

    def __init__(self, dim=64, n_head=4, n_kv=2, **_):
        super().__init__()
        self.h, self.kvh, self.hd = n_head, n_kv, dim // n_head
        self.qkv = nn.Linear(dim, (n_head + 2 * n_kv) * self.hd)
        self.proj = nn.Linear(dim, dim)
        self.kv = None

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        H, G, D = self.h, self.kvh, self.hd
        q, k, v = self.qkv(x).split([H * D, G * D, G * D], dim=-1)
        q = q.view(B, T, H, D).permute(0, 2, 1, 3).reshape(B * H, T, D) * D ** -0.5
        k = k.view(B, T, G, D).permute(0, 2, 1, 3)
        v = v.view(B, T, G, D).permute(0, 2, 1, 3)
        if start_pos > 0:
            k, v = torch.cat([self.kv[0], k], dim=-2), torch.cat([self.kv[1], v], dim=-2)
        self.kv = (k, v)
        L = k.shape[2]
        k = k[:, :, None].expand(B, G, H // G, L, D).reshape(B * H, L, D)
        v = v[:, :, None].expand(B, G, H // G, L, D).reshape(B * H, L, D)
        s = torch.bmm(q, k.transpose(1, 2))
        future = torch.ones(T, L, dtype=torch.bool, device=x.device).triu(L - T + 1)
        s = torch.where(future, float("-inf"), s)
        y = torch.bmm(s.softmax(-1), v).view(B, H, T, D)
        return self.proj(y.permute(0, 2, 1, 3).reshape(B, T, C))


class LatentCacheAttention(nn.Module):
    """MLA-like: the cache holds a low-rank latent [B, T, r] (cat along dim 1); keys and values
    are projected from the whole cached latent at every step, so the K/V attention reads are
    not what is cached."""

    def __init__(self, dim=64, n_head=4, rank=16, **_):
        super().__init__()
        self.h, self.hd = n_head, dim // n_head
        self.wq = nn.Linear(dim, dim, bias=False)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up_k = nn.Linear(rank, dim, bias=False)
        self.up_v = nn.Linear(rank, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.latent = None

    def forward(self, x, start_pos: int):
        B, T, C = x.shape
        c = self.down(x)                                                     # [B, T, r]
        if start_pos > 0:
            c = torch.cat([self.latent, c], dim=1)
        self.latent = c
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.up_k(c).view(B, -1, self.h, self.hd).transpose(1, 2)       # [B, H, L, D]
        v = self.up_v(c).view(B, -1, self.h, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)   # prefill or one token
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


# --- look-alikes: a softmax between two products that is not attention over a cache ---------

class LinearAttentionLike(FusedQKV):
    """softmax over a k·vᵀ summary (contracted over time), then q·summary: not q·kᵀ."""

    def forward(self, x, start_pos: int = 0):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        summary = torch.einsum("bhtd,bhte->bhde", k, v).softmax(dim=-1)    # [B, H, D, D]
        y = torch.einsum("bhtd,bhde->bhte", q, summary)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class MemorySlots(nn.Module):
    """bmm attention of each token over learned memory slots (keys and values are parameters,
    not this forward's tokens nor a cache)."""

    def __init__(self, dim=64, slots=6, **_):
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.mem_k = nn.Parameter(torch.randn(slots, dim) * 0.3)
        self.mem_v = nn.Parameter(torch.randn(slots, dim) * 0.3)

    def forward(self, x, start_pos: int = 0):
        B = x.shape[0]
        mk = self.mem_k.expand(B, -1, -1)
        s = torch.bmm(self.q(x), mk.transpose(1, 2)) / 8.0                 # [B, T, slots]
        return torch.bmm(torch.softmax(s, dim=-1), self.mem_v.expand(B, -1, -1))


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


def prompt() -> torch.Tensor:
    """The [2, 7] prompt the hand-written models' tests decode from."""
    return torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))


def compile_eager(model):
    import kvcompile

    return kvcompile.compile(model, kvcompile.KVConfig(inner="eager", max_kv_bytes=1 << 22))


def assert_rewritten_and_identical(model, name: str):
    """Compile `model` (a two-layer `make(...)` model): 10 greedy tokens equal eager's, logits
    within fp32 tolerance, both sites rewritten, the pool holding the cache, no warning.
    Returns the report (for the caller's checks of how each site was read)."""
    import copy

    import kvcompile
    from kvcompile.testing import assert_rel_close
    from tests.passes.caught import kv_warnings

    want, want_logits = greedy(copy.deepcopy(model), prompt(), 10)
    with kv_warnings() as warned:
        got, logits = greedy(compile_eager(model), prompt(), 10)
    assert torch.equal(got, want), f"{name}: tokens differ from eager"
    for a, b in zip(logits, want_logits):
        assert_rel_close(a, b, torch.float32, factor=4, what="logits")
    rep = kvcompile.report(model)
    assert len(rep.sites) == 2 and len(rep.rewritten) == 2, str(rep)
    assert kvcompile.stats(model)["tokens"] == 2 * (7 + 9)   # the pool holds the cache
    assert not warned, warned
    return rep
