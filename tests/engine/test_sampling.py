"""Engine sampling (no model): filters against plain definitions, per-request determinism,
distribution, non-finite rows, banned tokens, repetition penalty as Hugging Face applies it;
SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompile.engine.params import RequestError, SamplingParams
from kvcompile.engine.sampling import _filter, make_generator, sample

V = 50


def _logits(seed=0, B=1):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(row, p, n=3000, seed=0):
    g = make_generator(seed, torch.device("cpu"))
    return [sample(row[None], [p], [g], [[]])[0][0] for _ in range(n)]


def test_greedy_is_argmax_and_reports_logprob():
    x = _logits(B=4)
    ps = [SamplingParams(temperature=0, logprobs=True)] * 4
    toks, lps, ok = sample(x, ps, [None] * 4, [[]] * 4)
    assert toks == x.argmax(-1).tolist() and all(ok)
    ref = torch.log_softmax(x, -1).gather(1, x.argmax(-1, keepdim=True))[:, 0]
    torch.testing.assert_close(torch.tensor(lps), ref)


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2),
                                dict(top_k=8, top_p=0.9, min_p=0.05)])
def test_filters_keep_exactly_the_defined_set(kw):
    x = _logits(1)[0]
    p = SamplingParams(temperature=0.8, **kw)
    kept = torch.isfinite(_filter(x / p.temperature, p))
    probs = torch.softmax(x / p.temperature, -1)
    order = probs.argsort(descending=True)
    expect = torch.ones(V, dtype=torch.bool)
    if p.top_k:
        expect[order[p.top_k:]] = False
    if p.min_p:  # min_p applies to the distribution left by top-k
        q = torch.where(expect, probs, torch.zeros_like(probs))
        q = q / q.sum()
        expect &= q >= p.min_p * q.max()
    if p.top_p < 1:
        q = torch.where(expect, probs, torch.zeros_like(probs))
        q = q / q.sum()
        s, o = q.sort(descending=True)
        before = s.cumsum(0) - s
        nucleus = torch.zeros(V, dtype=torch.bool)
        nucleus[o[before < p.top_p]] = True
        expect &= nucleus
    assert torch.equal(kept, expect)
    drawn = set(_draws(x, p, n=400))
    assert drawn <= set(expect.nonzero()[:, 0].tolist())


def test_distribution_matches_softmax_at_temperature():
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = SamplingParams(temperature=1.5)
    row = torch.cat([x, torch.full((V - 5,), -30.0)])
    n = 6000
    counts = torch.bincount(torch.tensor(_draws(row, p, n=n)), minlength=V)[:5].float()
    expect = torch.softmax(x / 1.5, -1) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p = 0.0004


def test_each_request_draws_the_same_tokens_whatever_runs_with_it():
    x = _logits(3, B=3)
    p = SamplingParams(temperature=1.0, top_k=20)
    alone = [sample(x[1:2], [p], [make_generator(7, torch.device("cpu"))], [[]])[0][0]
             for _ in range(1)]
    gens = [make_generator(s, torch.device("cpu")) for s in (1, 7, 9)]
    together = sample(x, [p, p, SamplingParams(temperature=0)], gens, [[]] * 3)[0]
    assert together[1] == alone[0]
    seq_a = _draws(x[0], p, n=20, seed=5)
    seq_b = _draws(x[0], p, n=20, seed=5)
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_non_finite_rows_are_reported_not_sampled():
    x = _logits(B=4)
    x[1, 3] = float("nan")
    x[2] = float("-inf")
    x[3, 0] = float("inf")
    ps = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(), SamplingParams()]
    gens = [make_generator(i, torch.device("cpu")) for i in range(4)]
    toks, _, ok = sample(x, ps, gens, [[]] * 4)
    assert ok == [True, False, False, False]
    assert toks[0] == int(x[0].argmax()) and toks[1:] == [-1, -1, -1]


def test_banned_tokens_are_never_drawn():
    x = _logits(4)
    best = int(x[0].argmax())
    toks, _, _ = sample(x, [SamplingParams(temperature=0)], [None], [[]], [[best]])
    assert toks[0] != best and toks[0] == int(x[0].topk(2).indices[1])


def test_repetition_penalty_matches_hugging_face():
    from transformers import RepetitionPenaltyLogitsProcessor

    x = _logits(5)
    hist = [3, 3, 7, 11, 40]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([hist]), x.clone())
    p = SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=True)
    toks, lps, _ = sample(x.clone(), [p], [None], [hist])
    assert toks[0] == int(ref.argmax())
    assert math.isclose(lps[0], float(torch.log_softmax(ref[0], -1)[toks[0]]), rel_tol=1e-5)


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]),
                                                           "stop_token_ids"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(temperature=float("nan")),
                                                       "temperature"),
    (dict(ignore_eos=1), "ignore_eos")])
def test_sampling_params_name_the_bad_field(kw, field):
    with pytest.raises(RequestError, match=f"SamplingParams.{field}="):
        SamplingParams(**kw)


def test_sampling_params_normalize():
    p = SamplingParams(stop="\n", stop_token_ids=[5], temperature=1)
    assert p.stop == ("\n",) and p.stop_token_ids == (5,) and isinstance(p.temperature, float)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().filters
