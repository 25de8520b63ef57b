"""Configurations measured to cost more than a few percent of perplexity warn once, naming the
cost and the key-aware alternative; the measured-good ones stay quiet."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.config import KEY_AWARE_4BIT, KVConfig, quality_warning
from tests.passes.caught import has, kv_warnings


@pytest.mark.parametrize("kw", [dict(kv_dtype="fp4_e2m1"),
                                dict(kv_dtype="fp4_e2m1", rotate="hadamard"),
                                dict(kv_dtype="fp4_e2m1", scale_granularity="token"),
                                dict(kv_dtype="bf16", k_dtype="int3"),
                                dict(kv_dtype="int2", scale_granularity="channel")])
def test_lossy_key_formats_are_named_with_the_alternative(kw):
    msg = quality_warning(KVConfig(**kw))
    assert msg is not None and (kw.get("k_dtype") or kw["kv_dtype"]) in msg
    assert KEY_AWARE_4BIT in msg and "%" in msg


@pytest.mark.parametrize("kw", [dict(), dict(kv_dtype="bf16"), dict(kv_dtype="fp8_e4m3"),
                                dict(kv_dtype="fp8_e5m2", scale_granularity="token"),
                                dict(kv_dtype="int4", scale_granularity="channel", page_size=64,
                                     rotate="hadamard"),
                                dict(kv_dtype="fp4_e2m1", scale_granularity="channel"),
                                dict(kv_dtype="fp4_e2m1", k_dtype="fp8_e4m3")])
def test_measured_good_configs_stay_quiet(kw):
    assert quality_warning(KVConfig(**kw)) is None


def _tiny():
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=64)
    return t.LlamaForCausalLM(cfg).eval()


def test_compile_warns_once_per_model_and_backend_route_too():
    ids = torch.randint(0, 64, (1, 5))
    with kv_warnings() as w:
        kvcompile.compile(_tiny(), KVConfig(kv_dtype="fp4_e2m1", inner="eager"))
    assert sum(has([m], "fp4_e2m1") for m in w) == 1, w
    with kv_warnings() as w:
        kvcompile.compile(_tiny(), KVConfig(kv_dtype="fp8_e4m3", inner="eager"))
    assert not has(w, "raised perplexity"), w
    m = _tiny()
    fwd = torch.compile(m.forward, backend="kvcompile",
                        options={"kv_dtype": "int3", "inner": "eager"})
    with kv_warnings() as w, torch.no_grad():
        fwd(ids)
        fwd(ids)
    assert sum(has([x], "int3") for x in w) == 1, w
