"""Sites the passes must leave alone, exactly as they were, and say why."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import kvcompile
from tests.passes.caught import has, kv_warnings


class ScoresReturned(nn.Module):
    """Attention whose probabilities are also an output (like output_attentions=True)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(x).split(C, -1))
        s = (q @ k.transpose(-2, -1)) * 0.25
        p = torch.softmax(s, dim=-1)
        return p @ v, p


class RouterSoftmax(nn.Module):
    """A softmax that is not attention: mixture weights over experts."""

    def __init__(self, dim=32, experts=4):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * 0.1)

    def forward(self, x):
        w = F.softmax(self.router(x), dim=-1)               # [B, T, E]
        y = torch.einsum("bte,edk,btd->btk", w, self.experts, x)
        return torch.matmul(torch.softmax(y, dim=1), x.transpose(1, 2))  # softmax over dim 1


class CrossAttentionDecoder(nn.Module):
    """Causal self-attention plus cross-attention over encoder states."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.h = heads
        self.self_qkv = nn.Linear(dim, 3 * dim)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)

    def _heads(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.h, C // self.h).transpose(1, 2)

    def forward(self, x, enc):
        q, k, v = (self._heads(t) for t in self.self_qkv(x).split(x.shape[-1], -1))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        q = self._heads(self.cross_q(x))
        k, v = (self._heads(t) for t in self.cross_kv(enc).split(x.shape[-1], -1))
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def test_grad_mode_graph_left_alone():
    torch.manual_seed(0)
    m = CrossAttentionDecoder()
    x, enc = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    ref = m(x, enc)
    with kv_warnings() as warned:
        got = _compile(m)(x, enc)  # autograd is recording: an inference-only rewrite must not
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    rep = kvcompile.report(m)
    assert not rep.rewritten and all("torch.no_grad" in s.reason for s in rep.sites)
    assert has(warned, "rewrote no attention site of CrossAttentionDecoder.*: 2 attention site")


def _compile(module):
    return kvcompile.compile(module, kvcompile.KVConfig(kv_dtype="fp8_e4m3", inner="aot_eager",
                                                        max_kv_bytes=1 << 22))


@torch.no_grad()
def test_scores_used_elsewhere_left_alone():
    torch.manual_seed(0)
    m = ScoresReturned().eval()
    x = torch.randn(2, 7, 32)
    ref_out, ref_p = m(x)
    with kv_warnings() as warned:
        out, p = _compile(m)(x)
    rep = kvcompile.report(m)
    assert len(rep.sites) == 1 and not rep.rewritten
    assert "used elsewhere" in rep.sites[0].reason
    assert has(warned, "rewrote no attention site of ScoresReturned.*used elsewhere")
    torch.testing.assert_close(out, ref_out)   # untouched: exact
    torch.testing.assert_close(p, ref_p)


@torch.no_grad()
def test_softmax_that_is_not_attention_is_not_a_site():
    torch.manual_seed(0)
    m = RouterSoftmax().eval()
    x = torch.randn(2, 5, 32)
    before = torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"]
    ref = m(x)
    with kv_warnings() as warned:
        got = _compile(m)(x)
    torch.testing.assert_close(got, ref)
    rep = kvcompile.report(m)
    assert rep.sites == []
    assert torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"] == before
    # both softmaxes are near misses, with the step that failed
    steps = {(n.node, n.step) for n in rep.near_misses}
    assert steps == {("w", "scores"), ("softmax_1", "softmax")}, steps
    assert has(warned, "rewrote no attention site of RouterSoftmax")


@torch.no_grad()
def test_cross_attention_left_alone_self_attention_rewritten():
    torch.manual_seed(0)
    m = CrossAttentionDecoder().eval()
    x, enc = torch.randn(2, 6, 32), torch.randn(2, 11, 32)
    ref = m(x, enc)
    got = _compile(m)(x, enc)
    rep = kvcompile.report(m)
    assert len(rep.sites) == 2
    rewritten, skipped = rep.rewritten, rep.skipped
    assert len(rewritten) == 1 and len(skipped) == 1
    assert "cross-attention" in skipped[0].reason
    assert (got - ref).abs().max() < 0.05  # self-attention over fp8 pages, cross exact


@torch.no_grad()
def test_cross_attention_same_length_still_left_alone():
    # the encoder states have the query's length: shapes alone would not tell them apart
    torch.manual_seed(0)
    m = CrossAttentionDecoder().eval()
    x, enc = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    _compile(m)(x, enc)
    rep = kvcompile.report(m)
    assert len(rep.rewritten) == 1 and "cross-attention" in rep.skipped[0].reason
