"""Chunked prefill through HF generate (integrations/hf_prefill.py): HF's prefill_chunk_size on a
kvcompile model gives eager's tokens and logits, left padding may span chunks (pad K/V stored as
zeros in every chunk), and kvcompile picks a chunk size itself when a batch would not fit."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.integrations import hf_prefill
from kvcompile.runtime.hooks import RuntimeHook
from tests.engine.tiny import config, make_hf

NEW = 6
PADS = (0, 11, 37)      # row 2's padding covers two chunks of 16 and part of a third


@pytest.fixture(scope="module")
def pair():
    """(eager reference, compiled twin): same weights, fp32, sdpa; fp32 pages."""
    ref = make_hf("llama", "sdpa")
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config())
    return ref, model


def _batch(S=53, pads=PADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (len(pads), S), generator=g)
    am = torch.ones_like(ids)
    for b, p in enumerate(pads):
        am[b, :p] = 0
    ids[am == 0] = 0
    return ids, am


class _Forwards(RuntimeHook):
    """Per forward: new tokens, kv_start, and whether every stored pad position is zero."""

    def __init__(self, state):
        self.state, self.seen = state, []

    def after_forward(self, ctx):
        plan, pool = ctx.plan, self.state.pool
        zero = True
        for row, sid in enumerate(plan.seq_ids):
            pad = min(plan.kv_start[row], plan.seq_lens_list[row])
            pages = torch.as_tensor(pool.pages_of(sid), dtype=torch.long)
            for layer in range(len(pool.k)):
                for t in (pool.k[layer], pool.v[layer]):
                    x = t.read(pages).permute(1, 0, 2, 3).reshape(t.num_heads, -1, t.head_dim)
                    zero &= bool((x[:, :pad] == 0).all())
        self.seen.append((plan.new_tokens, list(plan.kv_start), zero))


def _generate(model, ids, am, **kw):
    st = state_of(model)
    hook = _Forwards(st)
    st.hooks.append(hook)
    try:
        out = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True, **kw)
    finally:
        st.hooks.remove(hook)
    return out, hook.seen


def _same(a, b):
    torch.testing.assert_close(a.sequences, b.sequences, rtol=0, atol=0)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("chunk", [16, 13])
def test_chunked_prefill_matches_unchunked(pair, chunk):
    ref, model = pair
    ids, am = _batch()
    expect = ref.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    whole, seen_whole = _generate(model, ids, am)
    chunked, seen = _generate(model, ids, am, prefill_chunk_size=chunk)
    _same(whole, expect)
    _same(chunked, whole)
    n_chunks = -(-ids.shape[1] // chunk)
    assert [s[0] for s in seen[:n_chunks]] == [chunk] * (n_chunks - 1) + [
        ids.shape[1] - (n_chunks - 1) * chunk]
    assert seen_whole[0][1] == list(PADS)
    # the padding is found chunk by chunk: kv_start never passes the real start
    assert seen[n_chunks - 1][1] == list(PADS)
    assert all(s[2] for s in seen), "a pad token's K/V was stored non-zero"


def test_chunk_size_rule():
    page = 16
    assert hf_prefill.chunk_size(4, 1000, 100, None, page) is None         # CPU: not known
    assert hf_prefill.chunk_size(4, 1000, 100, 2 * 10**6, page) is None     # fits
    size = hf_prefill.chunk_size(16, 32768, 160_000, 40 << 30, page)
    assert size % page == 0 and 16 * size * 160_000 <= 40 << 30 and size >= 8192
    for prompt in (4105, 8200, 9000, 20_003):  # no tail chunk of <= 8 tokens (decode path)
        size = hf_prefill.chunk_size(8, prompt, 50_000, 200 << 20, page)
        assert size is not None and size % page == 0 and not 0 < prompt % size <= 8, prompt
    assert hf_prefill.chunk_size(8, 400, 10**6, 1, page) is None            # <= MIN_CHUNK
    # within the budget, and balanced: no chunk much shorter than the others (cut at the
    # budget alone, 32,768 tokens in 3 became 10,912 x 3 and a tail of 32)
    for prompt in (32768, 20_003, 9000, 4105):
        need = 16 * prompt * 50_000 + prompt * prompt
        for n in range(2, 9):
            budget = -(-need // n)
            size = hf_prefill.chunk_size(16, prompt, 50_000, budget, page)
            chunks = -(-prompt // size)
            tail = prompt - (chunks - 1) * size
            assert size * (16 * 50_000 + prompt) <= budget, (prompt, n, size)
            assert chunks <= n + 1 and tail >= size - chunks * page, (prompt, n, size, tail)
    # the H200 case (8-layer Llama-3-8B shape, 128 KB per token): B16 x 32k runs whole in
    # PREFILL_MEMORY_FRACTION of 140 GiB, and in two chunks in half that
    budget = int(hf_prefill.PREFILL_MEMORY_FRACTION * (140 << 30))
    assert hf_prefill.chunk_size(16, 32768, 128_000, budget, page) is None
    assert hf_prefill.chunk_size(16, 32768, 128_000, budget // 2, page) == 16384
    # the mask part counts: activations that fit alone, but not with the [1, 1, C, L] mask
    assert hf_prefill.chunk_size(1, 4096, 1, 4096 + 4096 * 4096 - 1, page) is not None


def test_auto_chunk_when_the_batch_does_not_fit(pair, monkeypatch):
    """No prefill_chunk_size given: a budget below the batch's activations splits it, and the
    result is the unchunked one; a caller's own chunk size is left alone."""
    ref, model = pair
    ids, am = _batch()
    whole, _ = _generate(model, ids, am)
    per_token = hf_prefill.activation_bytes_per_token(model)
    monkeypatch.setattr(hf_prefill, "MIN_CHUNK", 8)
    monkeypatch.setattr(hf_prefill, "prefill_activation_budget",
                        lambda device, state: 3 * 20 * per_token)   # 20 tokens per row fit
    before = state_of(model).counters.get("prefill_chunked", 0)
    auto, seen = _generate(model, ids, am)
    assert state_of(model).counters.get("prefill_chunked", 0) == before + 1
    assert [s[0] for s in seen[:4]] == [16, 16, 16, 5], [s[0] for s in seen]
    _same(auto, whole)
    _, seen = _generate(model, ids, am, prefill_chunk_size=27)
    assert [s[0] for s in seen[:2]] == [27, 26]
    # shared prompts (num_return_sequences) are prefilled once, in chunks
    r = ref.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                     pad_token_id=0, eos_token_id=None, num_beams=2, num_return_sequences=2)
    o = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0, eos_token_id=None, num_beams=2, num_return_sequences=2)
    torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_activation_bytes_with_one_intermediate_size_per_layer():
    """Gemma 3n's config lists one intermediate size per layer: the largest counts (the sweep
    found compile crashing on int(list))."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=[128, 256])
    model = SimpleNamespace(config=cfg, dtype=torch.float32)
    want = hf_prefill.activation_bytes_per_token(
        SimpleNamespace(config=SimpleNamespace(hidden_size=64, intermediate_size=256),
                        dtype=torch.float32))
    assert hf_prefill.activation_bytes_per_token(model) == want


def test_budget_keeps_the_gather_workspace_free(monkeypatch):
    """The chunker's budget leaves KVConfig.prefill_gather_bytes free for the gathered chunk
    route (kernels/prefill_gather.py), and not when the chunks stay paged."""
    from types import SimpleNamespace

    total = 100 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=total))
    dev = torch.device("cuda")
    plain = int(hf_prefill.PREFILL_MEMORY_FRACTION * total)

    def state(**kw):
        return SimpleNamespace(pool=None, config=kvcompile.KVConfig(**kw))

    assert hf_prefill.prefill_activation_budget(dev, None) == plain
    assert hf_prefill.prefill_activation_budget(dev, state()) == plain - (1 << 30)
    assert hf_prefill.prefill_activation_budget(
        dev, state(prefill_gather_bytes=5 << 30)) == plain - (5 << 30)
    assert hf_prefill.prefill_activation_budget(
        dev, state(prefill_chunk_route="paged")) == plain
