"""A first `generate` compiles two graphs, prefill and decode: the decode step's growing
dimensions (cache stubs' length, the attention mask's width) are marked dynamic before its first
compile (integrations/hf_graphs.py `mark_decode_dynamic`). Unmarked, Dynamo compiled the first
decode step for its length only and recompiled at the second (three graphs, about a quarter of
the first call's time on the CPU)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import kvcompile
from kvcompile.integrations import hf_graphs
from tests.engine.tiny import config, make_hf


def _first_generate_graphs(prompts, new=6) -> tuple[int, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = make_hf("llama")
    eager = m.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    kvcompile.compile(m, config(kv_dtype="auto"))
    out = m.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                     pad_token_id=0, eos_token_id=None)
    return counters["stats"]["unique_graphs"], out, eager


def test_first_generate_compiles_prefill_and_one_decode_graph(monkeypatch):
    prompts = torch.randint(1, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    graphs, out, eager = _first_generate_graphs(prompts)
    assert graphs == 2
    assert torch.equal(out, eager)   # fp32 pages: the eager model's tokens
    # negative: without the marks the second decode step recompiles
    monkeypatch.setattr(hf_graphs, "mark_decode_dynamic", lambda kwargs: None)
    graphs, out, _ = _first_generate_graphs(prompts)
    assert graphs == 3
    assert torch.equal(out, eager)


def test_prefill_and_other_masks_are_not_marked():
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)
    hf_graphs.mark_decode_dynamic({"input_ids": ids, "attention_mask": mask})
    assert not getattr(mask, "_dynamo_weak_dynamic_indices", None)
    step = torch.ones(2, 1, dtype=torch.long)
    mask4d = torch.ones(2, 1, 1, 6)
    hf_graphs.mark_decode_dynamic({"input_ids": step, "attention_mask": mask4d})
    assert not getattr(mask4d, "_dynamo_weak_dynamic_indices", None)
    mask2d = torch.ones(2, 6, dtype=torch.long)
    hf_graphs.mark_decode_dynamic({"input_ids": step, "attention_mask": mask2d})
    assert getattr(mask2d, "_dynamo_weak_dynamic_indices", None) == {1}
