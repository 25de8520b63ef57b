"""A fresh prompt's prefill attends to its K/V as computed (runtime/dispatch.py `_fresh_prefill`,
KVConfig.prefill_attends): with quantized pages its logits are the model's own, the pages are
written all the same (the decode steps read them); left padding attends a row at a time, and
every other case SDPA cannot take without a [B, S, L] mask goes to the paged path."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.errors import KVConfigError
from tests.engine.tiny import config, make_hf

B, S, NEW = 2, 24, 4


_REFERENCE: dict = {}


def _run(prefill_attends: str, kv_dtype: str = "fp8_e4m3", pad: bool = False, **kw):
    """(eager HF's generate output, kvcompile's, kvcompile.stats) for the same prompts."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (B, S), generator=g)
    am = torch.ones_like(ids)
    if pad == "hole":
        am[1, 9] = 0
    elif pad:
        am[1, :5] = 0
    gen = dict(attention_mask=am, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    if pad not in _REFERENCE:   # eager HF, computed once per padding for the module
        with torch.no_grad():
            _REFERENCE[pad] = make_hf("llama", "sdpa").generate(ids, **gen)
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype=kv_dtype, prefill_attends=prefill_attends, **kw))
    with torch.no_grad():
        got = model.generate(ids, **gen)
    return _REFERENCE[pad], got, kvcompile.stats(model)


def test_fresh_prefill_logits_are_the_models_own_with_fp8_pages():
    want, got, st = _run("fresh")
    assert st.get("prefill_fresh_sdpa", 0) == 2          # both layers, the one prefill forward
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=0, atol=1e-5)
    # the pages were written: decode steps read fp8 keys/values, so later logits move
    assert st["bytes_per_token"] < 2 * 2 * 2 * 8 * 4     # fp8, not fp32 storage
    later = max((g - w).abs().max().item() for g, w in zip(got.logits[1:], want.logits[1:]))
    assert later > 0


@pytest.mark.parametrize("kv_dtype,gran", [("fp8_e5m2", "token"), ("fp4_e2m1", "page"),
                                           ("int4", "channel")])
def test_every_format_prefills_fresh_and_decodes_from_its_pages(kv_dtype, gran):
    """Whatever the pages' format: the prefill's logits are the model's own, and the decode
    steps read the pages (their logits differ from the model's, for a lossy format)."""
    want, got, st = _run("fresh", kv_dtype=kv_dtype, scale_granularity=gran)
    assert st.get("prefill_fresh_sdpa", 0) == 2
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=0, atol=1e-5)
    assert max((g - w).abs().max().item() for g, w in zip(got.logits[1:], want.logits[1:])) > 0


def test_stored_prefill_attends_to_the_quantized_pages():
    want, got, st = _run("stored")
    assert st.get("prefill_fresh_sdpa", 0) == 0          # negative: the switch is honoured
    assert (got.logits[0] - want.logits[0]).abs().max().item() > 1e-4


def test_full_precision_pages_give_the_models_tokens():
    want, got, _ = _run("fresh", kv_dtype="auto")
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_padded_prompts_attend_fresh_a_row_at_a_time(kv_dtype):
    """Left padding (HF generate's batch of prompts of different lengths): each row attends to
    its own tokens' K/V as computed (dispatch._fresh_mode: causal SDPA per row, no
    [B, 1, S, L] mask), so the prefill's logits are the model's own with fp8 pages too."""
    want, got, st = _run("fresh", kv_dtype=kv_dtype, pad=True)
    assert st.get("prefill_fresh_sdpa", 0) == 2
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=0, atol=1e-5)
    if kv_dtype == "auto":
        assert torch.equal(got.sequences, want.sequences)


def test_padded_batch_over_the_row_limit_attends_fresh(monkeypatch):
    """A padded batch of more rows than FRESH_PADDED_ROWS_MAX still attends to its own K/V
    (the prefill's logits stay the model's with fp8 pages, whatever the batch size): one SDPA
    call a row off the Triton kernels (here), the varlen kernel on them (below)."""
    from kvcompile.runtime import dispatch

    monkeypatch.setattr(dispatch, "FRESH_PADDED_ROWS_MAX", B - 1)
    want, got, st = _run("fresh", pad=True)
    assert st.get("prefill_fresh_sdpa", 0) == 2
    torch.testing.assert_close(got.logits[0], want.logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # (bf16 tl.dot: garbage in
def test_padded_rows_pack_for_the_varlen_kernel(monkeypatch, dtype):   # the interpreter; GPU test)
    """Past FRESH_PADDED_ROWS_MAX rows where the Triton kernels run (the interpreter here),
    `_padded_rows` packs the rows' tokens for one launch of the varlen prefill kernel (the
    cu_seqlens of the rows' own tokens; a row of padding only is dropped) and scatters its
    output back: equal to dense.sdpa_rows (one SDPA call a row), padding queries 0."""
    from types import SimpleNamespace

    from kvcompile.kernels import prefill
    from kvcompile.kernels.dense import sdpa_rows
    from kvcompile.runtime import dispatch
    from kvcompile.testing import assert_rel_close

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "FRESH_PADDED_ROWS_MAX", 2)
    g = torch.Generator().manual_seed(11)
    Bq, Hq, Hkv, Sq, D = 4, 4, 2, 20, 64
    q = torch.randn(Bq, Hq, Sq, D, generator=g).to(dtype)
    k, v = (torch.randn(Bq, Hkv, Sq, D, generator=g).to(dtype) for _ in range(2))
    starts = [0, 7, Sq, 19]
    calls = []
    real = prefill.prefill_attention
    monkeypatch.setattr(prefill, "prefill_attention",
                        lambda *a, **kw: calls.append(a[3].tolist()) or real(*a, **kw))
    counted = []
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda device: True),
                            config=SimpleNamespace(prefill_attends="fresh"),
                            count=counted.append)
    got = dispatch._padded_rows(state, q, k, v, starts, 0.125)
    assert calls == [[0, 20, 33, 34]] and counted == ["prefill_fresh_varlen"]
    want = sdpa_rows(q, k, v, starts, 0.125)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_rel_close(got.float(), want.float(), dtype, factor=4, what="packed varlen")
    assert not got[1, :, :7].any() and not got[2].any()
    # negative: at or under the limit, no varlen launch
    monkeypatch.setattr(dispatch, "FRESH_PADDED_ROWS_MAX", Bq)
    dispatch._padded_rows(state, q, k, v, starts, 0.125)
    assert len(calls) == 1 and counted == ["prefill_fresh_varlen"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_fresh_prompts_take_the_varlen_kernel_past_the_limit(monkeypatch, dtype):
    """The Engine's step of fresh prompts (`_fresh_packed`): past FRESH_PACKED_SDPA_MAX prompts
    where the Triton kernels run, one varlen launch over the packed tokens (counted as
    prefill_fresh_varlen), equal to one causal SDPA call a prompt; at the limit, SDPA calls
    and no launch (negative)."""
    from types import SimpleNamespace

    from kvcompile.kernels import prefill
    from kvcompile.runtime import dispatch
    from kvcompile.testing import assert_rel_close

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(12)
    lens, Hq, Hkv, D = [5, 13, 1, 9], 4, 2, 64
    T = sum(lens)
    q = torch.randn(1, Hq, T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, T, D, generator=g).to(dtype) for _ in range(2))
    cu = torch.tensor([0, 5, 18, 19, 28], dtype=torch.int32)
    calls, counted = [], []
    real = prefill.prefill_attention
    monkeypatch.setattr(prefill, "prefill_attention",
                        lambda *a, **kw: calls.append(a[3].tolist()) or real(*a, **kw))
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda device: True),
                            config=SimpleNamespace(prefill_attends="fresh"), eviction=None,
                            count=counted.append)

    def run(limit):
        monkeypatch.setattr(dispatch, "FRESH_PACKED_SDPA_MAX", limit)
        plan = SimpleNamespace(is_decode=False, q_lens=lens, past_lens=[0] * 4,
                               cu_seqlens_q=cu, cache={})
        return dispatch._fresh_packed(state, 0, q, (k, v), plan, 0, 0.0, 0.125, {})

    got = run(len(lens) - 1)
    assert calls == [cu.tolist()] and counted == ["prefill_fresh_varlen", "prefill_fresh_sdpa"]
    want = run(len(lens))
    assert len(calls) == 1 and counted[2:] == ["prefill_fresh_sdpa"]
    a = 0
    for n in lens:   # each prompt attends causally to its own tokens only
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:a + n].float(), k[:, :, a:a + n].float(), v[:, :, a:a + n].float(),
            is_causal=True, scale=0.125, enable_gqa=True)
        assert_rel_close(want[:, :, a:a + n].float(), ref, dtype, factor=4, what="sdpa")
        a += n
    assert got.shape == want.shape
    assert_rel_close(got.float(), want.float(), dtype, factor=4, what="packed fresh varlen")


def test_a_mask_with_a_hole_takes_the_paged_path():
    """Negative: a hole inside a row's mask (not left padding) is no causal mask SDPA can take
    without [B, 1, S, L]: the prompt reads its pages, with eager's tokens."""
    want, got, st = _run("fresh", kv_dtype="auto", pad="hole")
    assert st.get("prefill_fresh_sdpa", 0) == 0
    assert torch.equal(got.sequences, want.sequences)


def test_eviction_fresh_prompt_takes_sdpa_h2o_included():
    """Nothing is evicted before a prompt's end: a SinkWindow prompt attends through SDPA as
    without eviction, and so does an H2O prompt, whose mass is added up apart (one pass over
    Q K^T: `EvictionRuntime.prompt_mass`)."""
    _, _, st = _run("fresh", kv_dtype="auto", eviction=kvcompile.SinkWindow(4, 64))
    assert st.get("prefill_fresh_sdpa", 0) > 0
    assert "eviction_prompt_mass_torch" not in st          # negative: no mass to add up
    _, _, st = _run("fresh", kv_dtype="auto", eviction=kvcompile.H2O(budget=64, recent=8,
                                                                      sinks=4))
    assert st.get("prefill_fresh_sdpa", 0) > 0
    assert st.get("eviction_prompt_mass_torch", 0) > 0


def test_bad_value_names_the_field():
    with pytest.raises(KVConfigError, match="prefill_attends"):
        kvcompile.KVConfig(prefill_attends="pages")


def _engine_first_tokens(kv_dtype: str, prefill_attends: str, budget: int):
    """The Engine's first greedy token of three prompts (one step when `budget` holds them),
    the same model's eager first tokens, and kvcompile.stats."""
    from kvcompile import Engine, SamplingParams
    from tests.engine.tiny import hf_greedy

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 23, 16)]
    ref = make_hf("llama", "sdpa")
    with torch.no_grad():
        want = [hf_greedy(ref, p, 1) for p in prompts]
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype=kv_dtype, prefill_attends=prefill_attends,
                                    page_size=8))
    eng = Engine(model, max_num_batched_tokens=budget, enable_prefix_caching=False)
    before = kvcompile.stats(model).get("prefill_fresh_sdpa", 0)   # (the engine's warm-up)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    got = [o.token_ids[:1] for o in outs]
    st = dict(kvcompile.stats(model))
    st["prefill_fresh_sdpa"] = st.get("prefill_fresh_sdpa", 0) - before
    eng.close()
    return want, got, st


def test_engine_step_of_fresh_prompts_attends_to_their_own_kv():
    """An Engine step that holds only fresh prompts (packed) attends each to its K/V as
    computed, one SDPA per prompt (`_fresh_packed`), with fp8 pages written for decode."""
    want, got, st = _engine_first_tokens("fp8_e4m3", "fresh", 512)
    assert st.get("prefill_fresh_sdpa", 0) == 2          # both layers, one prompt step
    assert got == want


def test_engine_prompt_chunks_over_a_cached_prefix_take_the_paged_path():
    """Negative: with a budget of 8 tokens the prompts are cut into chunks; a chunk after the
    first has a cached prefix, and the step that holds it reads the pages. Only the steps
    whose every row starts at 0 attend fresh: three here, one per prompt (a chunk that the
    budget left would cut inside an fp8 page waits, engine/scheduler.py `_chunk`, so each
    prompt's first chunk is a step of its own); the later chunks read the pages."""
    _, _, st = _engine_first_tokens("fp8_e4m3", "fresh", 8)
    assert st.get("prefill_fresh_sdpa", 0) == 2 * 3   # both layers
    _, _, st = _engine_first_tokens("fp8_e4m3", "stored", 512)
    assert st.get("prefill_fresh_sdpa", 0) == 0


def _fp8_run(prefill_attends: str, pad: bool = False, model_fn=None):
    """(logits of the prefill forward, kvcompile.stats, report's kernel notes) of a head_dim-64
    Llama prompt batch with fp8 pages."""
    from tests.engine.tiny import make_llama64

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (B, 40), generator=g)
    am = torch.ones_like(ids)
    if pad:
        am[1, :6] = 0
    model = (model_fn or make_llama64)()
    kvcompile.compile(model, config(kv_dtype="fp8_e4m3", prefill_attends=prefill_attends))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=am, max_new_tokens=2, min_new_tokens=2,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return got.logits[0], kvcompile.stats(model), kvcompile.report(model).kernel_notes


@pytest.mark.parametrize("pad", [False, True])
def test_fresh_fp8_prefill_attends_fresh_kv_in_e4m3(pad):
    """prefill_attends="fresh_fp8": the fresh prompt's K/V as computed, attended in E4M3 with
    P rounded as the kernels round it (the CPU reference of prefill_attention(fp8=True)):
    both layers take it, batch and left-padded rows alike, the report says which path, and
    the prefill's logits stay near the model's own (the bf16-free fresh path) yet differ."""
    base, st0, _ = _fp8_run("fresh", pad=pad)
    got, st, notes = _fp8_run("fresh_fp8", pad=pad)
    assert st0.get("prefill_fresh_fp8", 0) == 0                # negative: "fresh" stays SDPA
    assert st.get("prefill_fresh_fp8", 0) == 2 and st.get("prefill_fresh_sdpa", 0) == 2
    assert any("fresh_fp8" in n and "E4M3" in n for n in notes), notes
    diff = (got - base).abs().max().item()
    assert 0 < diff < 0.05 * base.abs().max().item(), diff


def test_fresh_fp8_prefill_says_when_the_head_dims_do_not_fit():
    """A layer the FP8 prefill kernels cannot take (head_dim 16 here) attends as "fresh" does,
    through SDPA, and the report says why, once."""
    got, st, notes = _fp8_run("fresh_fp8", model_fn=lambda: make_hf("llama", "sdpa"))
    assert st.get("prefill_fresh_fp8", 0) == 0 and st.get("prefill_fresh_sdpa", 0) == 2
    said = [n for n in notes if "fresh_fp8" in n and "head dims" in n]
    assert len(said) == 1, notes


def test_prefill_attends_refuses_an_unknown_choice():
    with pytest.raises(KVConfigError, match="fresh_fp8"):
        kvcompile.KVConfig(prefill_attends="fp8")
