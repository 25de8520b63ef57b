"""SmolLM2-135M through kvcompile: perplexity on real text through the real cache."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import kvcompile

pytestmark = pytest.mark.realmodel


def _lee_text() -> str:
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        pytest.skip("gensim (the Lee corpus) is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "test", "test_data", "lee_background.cor")
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def smollm2():
    from kvcompile.models import ModelNotFoundError, load_smollm2

    try:
        model, tok, _ = load_smollm2(torch.float32)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return model, tok


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    return math.exp(nll.item())


def _simulated_perplexity(model, ids: torch.Tensor, kv_dtype: str) -> float:
    """Perplexity of the uncompiled model whose attention reads K/V rounded as kvcompile's pages
    store them, in plain PyTorch: bf16, or fp8 e4m3 with one scale per page of 16 tokens and kv
    head (amax / 448)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):                                     # [B, H, L, D]
        if kv_dtype == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        B, H, L, D = x.shape
        pad = (-L) % 16
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H, -1, 16, D)
        s = xp.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / 448.0
        q = (xp / s).to(torch.float8_e4m3fn).to(x.dtype) * s
        return q.view(B, H, -1, D)[:, :, :L]

    def attention(module, q, k, v, mask, **kw):
        return sdpa_attention_forward(module, q, rounded(k), rounded(v), mask, **kw)

    AttentionInterface.register("kvcompile_test_rounded", attention)
    cfgs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {k: c._attn_implementation for k, c in cfgs.items()}
    try:
        for c in cfgs.values():
            c._attn_implementation = "kvcompile_test_rounded"
        return _perplexity(model, ids)
    finally:
        for k, c in cfgs.items():
            c._attn_implementation = before[k]


# 512 tokens: 32 pages of 16 per sequence, each page scale set from its own tokens; the same
# checks held on 1024 and 2048. Five 1024-token forwards (three compiled, two simulated) were
# about 40% of this test's time, three compiles of the 30 layers the rest (timed on 1 thread).
PPL_TOKENS = 512


def test_smollm2_perplexity_of_pages_equals_plain_pytorch_rounding(smollm2, record_property):
    """Prefill of 512 tokens of real text through the pages: the perplexity is the one of the
    model whose attention reads K/V rounded to the pages' format (simulated in plain PyTorch),
    and fp8's cost over bf16 stays small (measured on these 512 tokens: +0.98%, 25.38 ->
    25.63; on 1024: +1.06%, 27.97 -> 28.27, fp4 +8.7%; on 2048: +1.1%, 26.42 -> 26.71)."""
    model, tok = smollm2
    ids = torch.tensor(tok(_lee_text())["input_ids"][:PPL_TOKENS])
    assert ids.numel() == PPL_TOKENS
    ppl = {}
    # fp4 (a third compile, about 15 s) only with KVCOMPILE_TEST_FULL=1: its bound is loose;
    # SmolLM2 through fp4 pages stays in tests/cli/test_verify_verdict.py (logit bounds)
    fp4 = ("fp4_e2m1",) if os.environ.get("KVCOMPILE_TEST_FULL") else ()
    for kv_dtype in ("bf16", "fp8_e4m3") + fp4:
        model.__dict__.pop("forward", None)  # back to the class's forward, then compile anew
        model.__dict__.pop("generate", None)
        torch._dynamo.reset()
        # "stored": the forward attends to the rounded pages (the fresh default would attend
        # to the K/V as computed, and the perplexity of one forward would not see the pages)
        kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, inner="eager",
                                                    max_kv_bytes=1 << 28,
                                                    prefill_attends="stored"))
        ppl[kv_dtype] = _perplexity(model, ids)
        rep = kvcompile.report(model)
        assert len(rep.rewritten) == 30, str(rep)
        record_property(f"ppl_{kv_dtype}", ppl[kv_dtype])
    model.__dict__.pop("forward", None)
    model.__dict__.pop("generate", None)
    sim = {k: _simulated_perplexity(model, ids, k) for k in ("bf16", "fp8_e4m3")}
    print(f"SmolLM2-135M ppl on {PPL_TOKENS} Lee tokens:", {k: round(v, 4) for k, v in ppl.items()},
          "plain PyTorch rounding:", {k: round(v, 4) for k, v in sim.items()})
    for k, v in sim.items():
        assert abs(ppl[k] / v - 1) < 1e-4, (k, ppl[k], v)
    rel_fp8 = ppl["fp8_e4m3"] / ppl["bf16"] - 1
    assert 0 < rel_fp8 <= 0.015, f"fp8_e4m3 raised perplexity by {100 * rel_fp8:.2f}%"
    # fp4 is recorded, and bounded loosely (REFERENCE.md measured +10% by simulation)
    if fp4:
        assert ppl["fp4_e2m1"] / ppl["bf16"] - 1 <= 0.25


PROMPTS = ["The capital of France is", "def fibonacci(n):\n   "]
# 32 new tokens: every row (prompt + new tokens, more than 32) crosses two page boundaries
# (page 16) while decoding
GREEDY = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)


def _eager_then_compiled(model, tok, kv_dtype, processors=()):
    """(eager greedy output with its per-step logits, kvcompile's generate output) of the two
    left-padded prompts; the model is restored to the uncompiled class forward after."""
    from transformers import LogitsProcessorList

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(GREEDY, pad_token_id=tok.pad_token_id)
    try:
        model.__dict__.pop("forward", None)
        model.__dict__.pop("generate", None)
        torch._dynamo.reset()
        with torch.no_grad():
            ref = model.generate(**enc, **kw, output_logits=True, return_dict_in_generate=True)
        kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, inner="eager",
                                                    max_kv_bytes=1 << 26))
        procs = [p(ref.sequences[:, enc["input_ids"].shape[1]:]) for p in processors]
        with torch.no_grad():
            out = model.generate(**enc, **kw, logits_processor=LogitsProcessorList(procs))
        assert len(kvcompile.report(model).rewritten) == 30
    finally:
        model.__dict__.pop("forward", None)
        model.__dict__.pop("generate", None)
    return ref, out, procs


def test_smollm2_fp32_pages_token_identical_to_eager(smollm2):
    """fp32 model, fp32 pages: kvcompile runs eager's own computation (the same SDPA call on the
    same values), so its 32 greedy tokens equal eager Hugging Face's."""
    model, tok = smollm2
    ref, out, _ = _eager_then_compiled(model, tok, "auto")
    assert torch.equal(out, ref.sequences), tok.batch_decode(out[:, -GREEDY["max_new_tokens"]:])


class _Forced:
    """A logits processor that records the scores it is given and forces `tokens` [B, N]."""

    def __init__(self, tokens):
        self.tokens, self.scores = tokens, []

    def __call__(self, input_ids, scores):
        step = len(self.scores)
        self.scores.append(scores.clone())
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(scores.shape[0]), self.tokens[:, step]] = 0
        return out


# bf16 logits of SmolLM2 are 16-32 in size: a bf16 ulp there is 0.125-0.25. Eager's top two
# tokens are often closer than that (19 of the 96 row-steps of a 48-token run, some exact
# ties), so greedy tokens of two bf16 computations can part ways by rounding alone; such steps
# are excused.
BF16_NEAR_TIE = 0.25
BF16_LOGIT_ERR = 0.25  # mean over steps of the largest |logit - eager's| of the step


def test_smollm2_bf16_pages_agree_with_eager_teacher_forced(smollm2):
    """bf16 model, bf16 pages, eager's 32 greedy tokens forced into kvcompile's generate: at
    every step the next-token logits match eager's to a bf16 ulp (the largest difference of a
    step, averaged over steps: 0 on the 2-core Xeon with avx512_bf16 here; 0.55 before the
    reference path ran eager's SDPA in the model's dtype instead of fp32 math), and kvcompile's
    argmax is eager's token wherever eager's top-2 gap is at least a bf16 ulp."""
    model, tok = smollm2
    model = model.to(torch.bfloat16)
    try:
        ref, _, (forced,) = _eager_then_compiled(model, tok, "bf16", processors=[_Forced])
    finally:
        model.to(torch.float32)
    tokens = forced.tokens
    assert len(forced.scores) == len(ref.logits) == tokens.shape[1]
    errs, bad = [], []
    for step, (got, want) in enumerate(zip(forced.scores, ref.logits)):
        errs.append((got.float() - want.float()).abs().max().item())
        top2 = want.float().topk(2, dim=-1).values
        for row in range(tokens.shape[0]):
            if (int(got[row].argmax()) != int(tokens[row, step])
                    and float(top2[row, 0] - top2[row, 1]) >= BF16_NEAR_TIE):
                bad.append((row, step, float(top2[row, 0] - top2[row, 1])))
    mean_err = sum(errs) / len(errs)
    assert mean_err <= BF16_LOGIT_ERR, f"largest |logit - eager| per step, mean {mean_err:.3f}"
    assert not bad, f"(row, step, eager's top-2 gap) where kvcompile's argmax differs: {bad}"
