"""The CPU decode step (runtime/cpu_decode.py) stores and attends as the general path does: a
compiled tiny Llama generates the same logits, token by token, with it and without it (bf16,
fp32, fp8 E4M3 and E5M2 pages; fp8 under a bf16 model too), and it is not taken for a
left-padded batch."""

import pytest
import torch

import kvcompile
from kvcompile.runtime import cpu_decode
from tests.engine.tiny import config, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(model, ids, am):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _counting(monkeypatch):
    calls = {"attend": 0}
    real = cpu_decode.CpuDecodeStep.attend

    def attend(self, *args):
        out = real(self, *args)
        calls["attend"] += out is not None
        return out

    monkeypatch.setattr(cpu_decode.CpuDecodeStep, "attend", attend)
    return calls


@pytest.mark.parametrize("kv,dtype", [("bf16", torch.float32), ("fp32", torch.float32),
                                      ("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.float32),
                                      ("fp8_e4m3", torch.bfloat16)])
def test_cpu_decode_step_equals_general_path(kv, dtype, monkeypatch):
    """fp8 pages take the route KVCOMPILE_CPU_FP8 picks (unset: the C one, kernels/cpu_fp8.py;
    =numpy: the numpy one; tests/kernels/test_cpu_fp8_c.py compares the two byte for byte)."""
    model = make_hf("llama", "sdpa", dtype=dtype)
    kvcompile.compile(model, config(kv_dtype=kv))
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    calls = _counting(monkeypatch)
    seq, logits = _generate(model, ids, am)
    assert calls["attend"] > 0, "the CPU decode step did not run"
    monkeypatch.setattr(cpu_decode, "for_forward", lambda *a: None)   # the general path
    seq_ref, logits_ref = _generate(model, ids, am)
    assert torch.equal(seq, seq_ref)
    assert torch.equal(logits, logits_ref)


def test_cpu_decode_step_not_taken_for_a_padded_batch(monkeypatch):
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype="bf16"))
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :4] = 0
    calls = _counting(monkeypatch)
    _generate(model, ids, am)
    assert calls["attend"] == 0
