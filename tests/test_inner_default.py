"""KVConfig.inner="auto" (the default): eager on the CPU, inductor on CUDA."""

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

import kvcompile
from kvcompile.backend import resolve_inner
from kvcompile.errors import KVConfigError


def test_auto_is_the_default_and_resolves_by_device():
    assert kvcompile.KVConfig().inner == "auto"
    cpu = [torch.zeros(2), 3]
    with FakeTensorMode():
        cuda = [torch.zeros(2, device="cuda"), torch.zeros(2, dtype=torch.long)]
    assert resolve_inner("auto", cpu) == "eager"
    assert resolve_inner("auto", cuda) == "inductor"
    for name in ("inductor", "aot_eager", "eager"):
        assert resolve_inner(name, cpu) == name == kvcompile.KVConfig(inner=name).inner
    with pytest.raises(KVConfigError, match="inner"):
        kvcompile.KVConfig(inner="cpp")


def test_default_config_does_not_run_inductor_on_the_cpu(monkeypatch):
    import torch._inductor.compile_fx as cfx

    def refuse(*a, **k):
        raise AssertionError("inductor ran on the CPU with the default KVConfig")

    monkeypatch.setattr(cfx, "compile_fx", refuse)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 8))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    kvcompile.compile(model, kvcompile.KVConfig(max_kv_bytes=1 << 22))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(kvcompile.report(model).rewritten) == 2
    assert torch.equal(out, ref)
