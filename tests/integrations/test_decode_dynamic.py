"""A first `generate` compiles two graphs, prefill and decode: the decode step's growing
dimensions (cache stubs' length, the attention mask's width) are marked dynamic before its first
compile (integrations/hf_graphs.py `mark_decode_dynamic`). Unmarked, Dynamo compiled the first
decode step for its length only and recompiled at the second (three graphs, about a quarter of
the first call's time on the CPU)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import kvcompile
from kvcompile.integrations import hf_graphs
from tests.engine.tiny import config, make_hf


def _first_generate_graphs(prompts, new=6, backend=False) -> tuple[int, torch.Tensor,
                                                                     torch.Tensor]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = make_hf("llama")
    eager = m.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    if backend:   # the README's first form: Dynamo calls the forward, no kvcompile wrapper
        m.forward = torch.compile(m.forward, backend="kvcompile",
                                  options={"kv_dtype": "auto", "max_kv_bytes": 1 << 24})
    else:
        kvcompile.compile(m, config(kv_dtype="auto"))
    out = m.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                     pad_token_id=0, eos_token_id=None)
    return counters["stats"]["unique_graphs"], out, eager


@pytest.mark.parametrize("backend", [False, True], ids=["kvcompile.compile", "torch.compile"])
def test_first_generate_compiles_prefill_and_one_decode_graph(backend, monkeypatch):
    prompts = torch.randint(1, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    graphs, out, eager = _first_generate_graphs(prompts, backend=backend)
    assert graphs == 2
    assert torch.equal(out, eager)   # fp32 pages: the eager model's tokens
    # negative: without the marks the second decode step recompiles
    monkeypatch.setattr(hf_graphs, "mark_decode_dynamic", lambda kwargs: None)
    graphs, out, _ = _first_generate_graphs(prompts, backend=backend)
    assert graphs == 3
    assert torch.equal(out, eager)


def test_only_a_pooled_caches_first_decode_step_is_marked():
    from transformers import DynamicCache

    torch._dynamo.reset()
    m = make_hf("llama")
    kvcompile.compile(m, config(kv_dtype="auto"))
    ids = torch.randint(1, 200, (2, 7), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache()
    with torch.no_grad():
        m(input_ids=ids, past_key_values=cache, use_cache=True)   # the prompt, into the pool
    step = torch.ones(2, 1, dtype=torch.long)

    def marked(t):
        return getattr(t, "_dynamo_weak_dynamic_indices", None)

    prompt_mask = torch.ones(2, 7, dtype=torch.long)   # a prompt: nothing marked
    hf_graphs.mark_decode_dynamic({"input_ids": ids, "attention_mask": prompt_mask,
                                   "past_key_values": cache})
    assert not marked(prompt_mask)
    mask = torch.ones(2, 8, dtype=torch.long)
    hf_graphs.mark_decode_dynamic({"input_ids": step, "attention_mask": mask,
                                   "past_key_values": cache})
    assert marked(mask) == {1} and marked(cache.layers[0].keys) == {2}
    again = torch.ones(2, 9, dtype=torch.long)   # the same cache's next step: already done
    hf_graphs.mark_decode_dynamic({"input_ids": step, "attention_mask": again,
                                   "past_key_values": cache})
    assert not marked(again)
    plain = DynamicCache()   # not kvcompile's: left alone
    plain.update(torch.zeros(2, 2, 7, 16), torch.zeros(2, 2, 7, 16), 0)
    other = torch.ones(2, 8, dtype=torch.long)
    hf_graphs.mark_decode_dynamic({"input_ids": step, "attention_mask": other,
                                   "past_key_values": plain})
    assert not marked(other) and not marked(plain.layers[0].keys)
