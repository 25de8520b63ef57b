"""Nothing falls back silently: configs no format can honour are refused by name, a site a
format cannot hold warns once, a model with no rewritten site warns once (with its near misses),
and bad calls fail with one line naming the input and the fix."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import kvcompile
from kvcompile.errors import InvalidInputError, KVConfigError
from kvcompile.inputs import position_limit
from kvcompile.testing import assert_rel_close, rel_err
from tests.cli.factories import DistanceAttention
from tests.passes.caught import has, kv_warnings
from tests.passes.research import SliceCacheAttention, greedy, make
from tests.passes.zoo import make_hf

KV = dict(inner="eager", max_kv_bytes=1 << 22)


def _prompt(length=7):
    return torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(2))


# --- refused by KVConfig ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(kv_dtype="fp8_e4m3", scale_granularity="tensor", static_scale=math.inf),
     "static_scale"),
    (dict(kv_dtype="fp8_e4m3", scale_granularity="tensor", static_scale=math.nan),
     "static_scale"),
    (dict(kv_dtype="fp8_e4m3", scale_granularity="tensor", static_scale=True), "static_scale"),
    (dict(kv_dtype="fp8_e4m3", static_scale=0.5), "static_scale"),          # page granularity
    (dict(static_scale=0.5), "static_scale"),                                # no scale at all
    (dict(kv_dtype="fp8_e4m3", scale_granularity="tensor", v_scale_granularity="page",
          static_scale=0.5), "static_scale"),
    (dict(kv_dtype="int4", scale_granularity="tensor"), "scale_granularity"),
    (dict(kv_dtype="fp8_e4m3", v_dtype="int2", scale_granularity="tensor"),
     "scale_granularity"),
    (dict(kv_dtype="fp4_e2m1", scale_granularity="channel", page_size=8), "page_size"),
])
def test_config_combinations_no_format_honours_are_refused(kw, field):
    with pytest.raises(KVConfigError) as e:
        kvcompile.KVConfig(**kw)
    assert e.value.field == field and f"KVConfig.{field}=" in str(e.value)
    assert "\n" not in str(e.value)


def test_config_combinations_that_work_still_accepted():
    kvcompile.KVConfig(kv_dtype="fp8_e4m3", scale_granularity="tensor", static_scale=0.5)
    kvcompile.KVConfig(kv_dtype="fp4_e2m1", scale_granularity="channel", page_size=16)
    kvcompile.KVConfig(kv_dtype="int4", scale_granularity="channel", page_size=8)


# --- formats a site's shape cannot take --------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["fp4_e2m1", "int3"])
def test_format_no_site_can_hold_refused_at_compile(kv_dtype):
    torch._dynamo.reset()
    model = make(SliceCacheAttention, dim=80)            # head_dim 20
    compiled = kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, **KV))
    with pytest.raises(KVConfigError) as e:
        greedy(compiled, _prompt(), 2)
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"KVConfig.kv_dtype='{kv_dtype}' is not allowed"), first
    assert "got 20" in first and "'fp8_e4m3'" in first and "layers.0, layers.1" in first


def test_format_one_site_cannot_hold_warns_once_and_rest_compiles():
    torch._dynamo.reset()
    model = make(SliceCacheAttention, dim=80)            # head_dim 20 in layer 0 ...
    torch.manual_seed(3)
    model.layers[1] = SliceCacheAttention(80, n_head=5)  # ... and 16 in layer 1
    ref = copy.deepcopy(model)
    compiled = kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp4_e2m1", **KV))
    with kv_warnings() as warned:
        tokens, logits = greedy(compiled, _prompt(), 4)
    assert len(warned) == 1, warned   # once, not once per graph
    assert has(warned, r"site layers\.0 of TinyLM alone: KVConfig.kv_dtype='fp4_e2m1' cannot "
                       r"store it: .*got 20.*kvcompile.configure\(module, kv_dtype='fp8_e4m3'\)")
    by = {s.name: s for s in kvcompile.report(model).sites}
    assert by["layers.1"].rewritten and not by["layers.0"].rewritten
    assert "format not applicable" in by["layers.0"].reason
    _, ref_logits = greedy(ref, _prompt(), 4)
    assert rel_err(logits[0], ref_logits[0]) < 0.1   # one layer on fp4 pages


def test_float64_model():
    torch._dynamo.reset()
    model = make(SliceCacheAttention).double()
    ref = copy.deepcopy(model)
    auto = kvcompile.compile(copy.deepcopy(model), kvcompile.KVConfig(**KV))
    with pytest.raises(KVConfigError, match=r"^KVConfig.kv_dtype='auto' .*torch.float64"):
        greedy(auto, _prompt(), 2)
    torch._dynamo.reset()
    compiled = kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp32", **KV))
    tokens, logits = greedy(compiled, _prompt(), 4)
    ref_tokens, ref_logits = greedy(ref, _prompt(), 4)
    assert torch.equal(tokens, ref_tokens) and len(kvcompile.report(model).rewritten) == 2
    for got, want in zip(logits, ref_logits):
        assert_rel_close(got, want, torch.float32, factor=4)   # fp32 pages


# --- nothing rewritten -------------------------------------------------------------------------

def test_model_with_no_site_warns_once_with_its_near_misses():
    torch._dynamo.reset()
    model = make(DistanceAttention)   # softmax over -cdist(q, k): not q·kᵀ
    ref = copy.deepcopy(model)
    compiled = kvcompile.compile(model, kvcompile.KVConfig(**KV))
    with kv_warnings() as warned:
        got = compiled(_prompt(), 0)
        compiled(_prompt(9), 0)                            # a second graph: no second warning
    torch.testing.assert_close(got, ref(_prompt(), 0))
    assert len(warned) == 1, warned
    assert has(warned, r"rewrote no attention site of TinyLM.*no attention site found among "
                       r"2 softmax.*`kvcompile inspect MODEL`")
    rep = kvcompile.report(model)
    assert rep.sites == [] and rep.near_misses
    miss = rep.near_misses[0]
    assert miss.name == "layers.0" and miss.step == "scores" and "masked_fill" in miss.at
    text = str(rep)
    assert "near miss" in text and "masked_fill" in text and "kvcompile inspect" in text


def test_no_warning_without_softmax():
    torch._dynamo.reset()
    mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    with kv_warnings() as warned, torch.no_grad():
        kvcompile.compile(mlp, kvcompile.KVConfig(**KV))(torch.randn(2, 8))
    assert warned == []


# --- unclear errors made one line ------------------------------------------------------------

def test_misspelled_torch_compile_option_is_one_kvconfig_line():
    from torch._dynamo.exc import BackendCompilerFailed

    torch._dynamo.reset()
    model = make(SliceCacheAttention)
    fn = torch.compile(model, backend="kvcompile", options={"kv_dtyp": "fp8_e4m3"})
    with pytest.raises(KVConfigError) as e:
        greedy(fn, _prompt(), 1)
    assert isinstance(e.value, BackendCompilerFailed)   # what Dynamo's callers expect
    first = str(e.value).splitlines()[0]
    assert first.startswith("KVConfig.kv_dtyp='fp8_e4m3' is not allowed")
    assert first.endswith("did you mean 'kv_dtype'?") and e.value.field == "kv_dtyp"


def test_compile_a_non_module():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .* got function; .*"
                                        r"torch.compile\(fn, backend='kvcompile'\)"):
        kvcompile.compile(lambda x: x)


@pytest.fixture(scope="module")
def gpt2():
    torch._dynamo.reset()
    model = make_hf("gpt2")                      # n_positions 512, learned positions
    kvcompile.compile(model, kvcompile.KVConfig(**KV))
    return model


@pytest.mark.parametrize("ids, needle", [
    (torch.zeros(1, 0, dtype=torch.long), r"input_ids is empty \(shape \[1, 0\]\)"),
    (torch.ones(1, 4), r"input_ids has dtype torch.float32.*input_ids.long\(\)"),
    (torch.ones(1, 4, dtype=torch.bool), r"input_ids has dtype torch.bool"),
])
def test_bad_input_ids_are_one_line(gpt2, ids, needle):
    with pytest.raises(InvalidInputError, match=needle) as e, torch.no_grad():
        gpt2(input_ids=ids)
    assert "\n" not in str(e.value)


def test_past_learned_positions_is_one_line(gpt2):
    ids = torch.randint(3, 256, (1, 508), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gpt2.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)   # 512: fits
    with pytest.raises(InvalidInputError, match=r"position 512, past the 512 learned positions "
                                                r"of GPT2LMHeadModel \(config.n_positions=512\)"):
        with torch.no_grad():
            gpt2.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert kvcompile.stats(gpt2)["pages_used"] == 0      # the failed call's pages came back


def test_position_limit_only_for_learned_positions():
    assert position_limit(make_hf("gpt2")) == (512, "n_positions")
    assert position_limit(make_hf("opt")) == (512, "max_position_embeddings")
    assert position_limit(make_hf("llama")) is None      # rotary: extrapolates, not refused
