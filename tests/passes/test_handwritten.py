"""Hand-written attention in research-code styles (tests/passes/research.py), against eager.

Each style: every site rewritten, the greedy tokens of kvcompile (fp32 pages) equal to plain
PyTorch's, logits within fp32 rounding, the pool holding the cache. Each look-alike (a softmax
between two products that is not q·kᵀ over a cache) is not rewritten, runs exactly as eager,
and is named as a near miss with the pattern step that failed.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompile
from tests.passes import research
from tests.passes.caught import has, kv_warnings

# style -> (cache kind, GQA form) the report must show
STYLES = {
    "EinsumSliceBTHD": ("index_put", "mha"),        # einsum, [B, T, H, D] slice-assigned buffers
    "BaddbmmMQA": ("cat", "expand"),                 # baddbmm bias mask, [B*H, T, D], MQA
    "WhereIndexCopyGQA": ("index_copy", "repeat_interleave"),   # where + tril, index_copy_
    "EinsumCatBTHDGQA": ("cat", "repeat_interleave"),  # [B, T, H, D] cat(dim=1), masked_fill
    "BmmFlatGQA": ("cat", "repeat_kv"),              # bmm, GQA expand+reshape to [B*H, L, D]
    "SliceCacheAttention": ("index_put", "mha"),     # SDPA, bool mask from positions
}


_prompt = research.prompt
_compile = research.compile_eager


@pytest.mark.parametrize("style", list(STYLES))
def test_handwritten_style_rewritten_and_token_identical(style):
    torch._dynamo.reset()
    rep = research.assert_rewritten_and_identical(research.make(getattr(research, style)), style)
    cache, gqa = STYLES[style]
    assert {(s.cache, s.gqa) for s in rep.rewritten} == {(cache, gqa)}, str(rep)


@pytest.mark.parametrize("style,step", [("LinearAttentionLike", "output"),
                                        ("MemorySlots", "keys")])
def test_lookalike_is_not_rewritten(style, step):
    torch._dynamo.reset()
    model = research.make(getattr(research, style))
    eager = copy.deepcopy(model)
    want, want_logits = research.greedy(eager, _prompt(), 4)
    before = torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"]
    with kv_warnings() as warned:
        got, logits = research.greedy(_compile(model), _prompt(), 4)
    assert torch.equal(got, want)
    for a, b in zip(logits, want_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)     # untouched: exactly eager
    rep = kvcompile.report(model)
    assert rep.sites == [] and not rep.rewritten
    assert torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"] == before
    assert {m.step for m in rep.near_misses} == {step}, rep.near_misses
    assert has(warned, "rewrote no attention site of TinyLM")


def test_einsum_subscripts_are_read_not_assumed():
    """The same einsum letters with k and q swapped in the equation (scores transposed to
    [B, H, S, T]) is not q·kᵀ over the last dim: not rewritten, exactly eager."""

    class Swapped(torch.nn.Module):
        def __init__(self, dim=64, **_):
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)

        def forward(self, x, start_pos: int = 0):
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, 4, C // 4).unbind(2)
            s = torch.einsum("bthd,bshd->bhst", q, k)       # softmax over the queries
            return torch.einsum("bhst,bshd->bthd", s.softmax(-1), v).reshape(B, T, C)

    torch._dynamo.reset()
    model = research.make(Swapped)
    want, _ = research.greedy(copy.deepcopy(model), _prompt(), 3)
    with kv_warnings():
        got, _ = research.greedy(_compile(model), _prompt(), 3)
    assert torch.equal(got, want)
    rep = kvcompile.report(model)
    assert not rep.rewritten and rep.near_misses


def test_keys_projected_from_a_latent_cache_are_left_alone_and_said():
    """The prefill's attention reads this forward's own keys (rewritten, no cache); the decode's
    keys are projected from the cached latent: left alone with that reason, and a warning
    that the site runs uncompiled there (it was silent before)."""
    torch._dynamo.reset()
    model = research.make(research.LatentCacheAttention)
    want, _ = research.greedy(copy.deepcopy(model), _prompt(), 5)
    with kv_warnings() as warned:
        got, _ = research.greedy(_compile(model), _prompt(), 5)
    assert torch.equal(got, want)
    rep = kvcompile.report(model)
    alone = [s for s in rep.sites if not s.rewritten]
    assert alone and all("computed from the cached tensors" in s.reason for s in alone), str(rep)
    assert has(warned, "in an earlier graph but leaves them alone in graph"), warned
