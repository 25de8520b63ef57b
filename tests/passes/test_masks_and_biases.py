"""Several masks and position biases before the softmax (tests/passes/research_masks.py, and a
tiny transformers MPT): every site rewritten, greedy tokens equal to eager with fp32 pages. The
look-alikes run exactly as eager, not rewritten, and say why.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompile
from tests.passes import research, research_masks
from tests.passes.caught import has, kv_warnings

_prompt = research.prompt
_compile = research.compile_eager


@pytest.mark.parametrize("style", ["AlibiMaskedFill", "CausalWhereLocalAdd",
                                   "RelBiasZeroedProbs", "ProductMaskGPT1",
                                   "InPlaceMaskedFill", "SinkLogits", "SinkByLogsumexp",
                                   "SinkGqaFloatKeys", "MaxSubtracted"])
def test_masks_and_biases_rewritten_and_token_identical(style):
    torch._dynamo.reset()
    rep = research.assert_rewritten_and_identical(
        research.make(getattr(research_masks, style)), style)
    assert {s.cache for s in rep.rewritten} == {"cat"}, str(rep)


@pytest.mark.parametrize("style,why", [
    ("WhereZeroFill", "scores step failed"),                   # a fill of 0 is no mask
    ("ProbsZeroedByAnotherMask", "masked after the softmax"),
    ("KeyNormBias", "also read by"),                            # the bias reads the cache
    ("ProductSoftMask", "scores step failed"),                  # not a 0/1 buffer
    ("SinkPerQuery", "not one learned logit per query head"),
    ("SinkColumnKept", "not the one dropped"),
    ("MaxOverQueriesSubtracted", "scores step failed"),       # not the row's maximum
])
def test_mask_lookalike_is_left_alone(style, why):
    torch._dynamo.reset()
    model = research.make(getattr(research_masks, style))
    want, want_logits = research.greedy(copy.deepcopy(model), _prompt(), 4)
    with kv_warnings() as warned:
        got, logits = research.greedy(_compile(model), _prompt(), 4)
    assert torch.equal(got, want)
    for a, b in zip(logits, want_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)     # untouched: exactly eager
    rep = kvcompile.report(model)
    assert not rep.rewritten, str(rep)
    reasons = [s.reason for s in rep.sites] + [str(m) for m in rep.near_misses]
    assert reasons and all(why in r for r in reasons), reasons
    assert has(warned, "rewrote no attention site of TinyLM")


def test_mpt_alibi_with_a_cache_is_rewritten_and_token_identical():
    """transformers' MPT (eager attention: ALiBi added to the scaled scores under
    masked_fill(mask, finfo.min)) with use_cache=True, so decode reads a DynamicCache (cat)."""
    import transformers

    torch._dynamo.reset()
    cfg = transformers.MptConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2,
                                 expansion_ratio=2, max_seq_len=128, use_cache=True)
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    ids = _prompt()
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
              use_cache=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with kv_warnings() as warned:
            _compile(model)
            got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    rep = kvcompile.report(model)
    assert rep.rewritten and len(rep.rewritten) == len(rep.sites), str(rep)
    assert "cat" in {s.cache for s in rep.rewritten}, str(rep)
    assert not warned, warned
