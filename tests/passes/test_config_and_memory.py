"""Per-module overrides, memory held during generate, recompiles, the backend entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

import kvcompile
from kvcompile.runtime.binding import is_stub
from tests.passes.zoo import make_hf

GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _llama(layers=3, hidden=128, dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def _ids(batch=2, length=16):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(0))


def test_instance_override_applied_reported_and_changes_bytes():
    base = _llama()
    kvcompile.compile(base, kvcompile.KVConfig(kv_dtype="fp8_e4m3", inner="eager",
                                               max_kv_bytes=1 << 24))
    base.generate(_ids(), max_new_tokens=4, **GEN)
    uniform = kvcompile.report(base)
    torch._dynamo.reset()

    model = _llama()
    kvcompile.configure(model.model.layers[0], kv_dtype="bf16")
    kvcompile.configure(model.model.layers[2].self_attn, k_dtype="bf16")
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp8_e4m3", inner="eager",
                                                max_kv_bytes=1 << 24))
    model.generate(_ids(), max_new_tokens=4, **GEN)
    rep = kvcompile.report(model)
    formats = {s.name: (s.k_format, s.v_format) for s in rep.sites}
    assert formats == {"model.layers.0.self_attn": ("bf16", "bf16"),
                       "model.layers.1.self_attn": ("fp8_e4m3", "fp8_e4m3"),
                       "model.layers.2.self_attn": ("bf16", "fp8_e4m3")}, formats
    assert "bf16/bf16" in str(rep)
    assert rep.pool["bytes_per_token"] > uniform.pool["bytes_per_token"] * 1.4


def test_class_override_and_disabled_module(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaAttention, "_kvcompile_overrides",
                        {"kv_dtype": "fp4_e2m1"}, raising=False)
    model = _llama()
    kvcompile.configure(model.model.layers[1], enabled=False)
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp8_e4m3", inner="eager",
                                                max_kv_bytes=1 << 24))
    ids = _ids()
    ref_model = _llama()
    out = model.generate(ids, max_new_tokens=4, **GEN)
    assert out.shape == ref_model.generate(ids, max_new_tokens=4, **GEN).shape
    rep = kvcompile.report(model)
    by = {s.name: s for s in rep.sites}
    assert by["model.layers.0.self_attn"].k_format == "fp4_e2m1"
    assert not by["model.layers.1.self_attn"].rewritten
    assert "disabled" in by["model.layers.1.self_attn"].reason


def test_configure_rejects_global_fields_and_bad_values():
    m = _llama(layers=1)
    with pytest.raises(kvcompile.KVConfigError, match="page_size"):
        kvcompile.configure(m, page_size=32)
    with pytest.raises(kvcompile.KVConfigError, match="kv_dtype"):
        kvcompile.configure(m, kv_dtype="int5")


def _hf_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("kv_dtype,limit", [("fp8_e4m3", 0.52), ("fp4_e2m1", 0.30)])
@torch.no_grad()
def test_kv_bytes_held_during_generate(kv_dtype, limit):
    ids = _ids(batch=2, length=17)  # 17 + 47 cached = 64 tokens: four full pages
    ref = _llama(dtype=torch.bfloat16).generate(ids, max_new_tokens=48,
                                                return_dict_in_generate=True, **GEN)
    bf16_bytes = _hf_cache_bytes(ref.past_key_values)
    model = _llama(dtype=torch.bfloat16)
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, inner="eager",
                                                max_kv_bytes=1 << 24))
    out = model.generate(ids, max_new_tokens=48, return_dict_in_generate=True, **GEN)
    cache = out.past_key_values
    assert all(is_stub(layer.keys) and is_stub(layer.values) for layer in cache.layers)
    assert cache.get_seq_length() == ref.past_key_values.get_seq_length()
    st = kvcompile.stats(model)
    held = st["pages_used"] * (st["bytes_total"] / st["pages_total"]) + _hf_cache_bytes(cache)
    ratio = held / bf16_bytes
    assert ratio <= limit, f"{kv_dtype}: {ratio:.3f} of the bf16 DynamicCache"
    del out, cache
    import gc

    gc.collect()
    assert kvcompile.stats(model)["pages_used"] == 0  # freed with the cache object


@torch.no_grad()
def test_no_recompiles_over_64_decode_steps():
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, kvcompile.KVConfig(inner="aot_eager", max_kv_bytes=1 << 24))
    model.generate(_ids(length=5), max_new_tokens=66, **GEN)
    # prefill, the first decode step (static length), then one dynamic-length decode graph
    assert kvcompile.report(model).graphs <= 3


@torch.no_grad()
def test_inductor_inner_backend():
    model = make_hf("llama", "sdpa")
    ids = _ids(length=9)
    ref = model.generate(ids, max_new_tokens=12, **GEN)
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="auto", max_kv_bytes=1 << 24))
    assert torch.equal(model.generate(ids, max_new_tokens=12, **GEN), ref)
    assert len(kvcompile.report(model).rewritten) == 2


def test_backend_name_resolves_in_a_fresh_process():
    code = (
        "import sys, torch\n"
        "assert 'kvcompile' not in sys.modules\n"
        "f = torch.compile(lambda x: torch.softmax(x, -1) * 2, backend='kvcompile',\n"
        "                  options={'kv_dtype': 'fp8_e4m3', 'page_size': 16})\n"
        "print(f(torch.ones(3)).sum().item())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "2.0"


def test_options_dict_validation():
    with pytest.raises(kvcompile.KVConfigError, match="page_size"):
        kvcompile.KVConfig.from_options({"page_size": 12})
    with pytest.raises(kvcompile.KVConfigError, match="unknown|Unknown"):
        kvcompile.KVConfig.from_options({"kv_type": "fp8_e4m3"})
    cfg = kvcompile.KVConfig.from_options({"kv_dtype": "fp4_e2m1",
                                           "eviction": {"policy": "sink_window", "window": 64}})
    assert isinstance(cfg.eviction, kvcompile.SinkWindow) and cfg.eviction.window == 64


def test_value_scale_granularity_separate_from_keys():
    """v_scale_granularity gives values their own scales (keys page, values token); None keeps
    the old rule (under "channel" keys: token int values, page fp ones)."""
    cfg = kvcompile.KVConfig
    assert cfg(scale_granularity="channel", kv_dtype="int4").value_granularity == "token"
    assert cfg(scale_granularity="channel", kv_dtype="fp8_e4m3").value_granularity == "page"
    assert cfg(scale_granularity="page", v_scale_granularity="token").value_granularity == "token"
    with pytest.raises(kvcompile.KVConfigError, match="v_scale_granularity"):
        cfg(v_scale_granularity="channel")
    model = _llama()
    kvcompile.compile(model, cfg(kv_dtype="fp8_e4m3", scale_granularity="page",
                                 v_scale_granularity="token", inner="eager",
                                 max_kv_bytes=1 << 24))
    out = model.generate(_ids(), max_new_tokens=4, **GEN)
    pool = kvcompile.api.state_of(model).pool
    assert {(pool.k[i].fmt.granularity, pool.v[i].fmt.granularity) for i in range(3)} == {
        ("page", "token")}
    assert out.shape == (2, 20)
