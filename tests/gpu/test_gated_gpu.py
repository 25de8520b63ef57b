"""The in-place gated product (kernels/gated.py, passes/merge_projections.py `fuse_gated`) on
CUDA:

    pytest -q -m gpu tests/gpu/test_gated_gpu.py

- the Triton kernel against plain PyTorch in fp32 (silu, gelu tanh; bf16, fp16, fp32; a
  Llama-3-8B-wide MLP's rows), the up half and the tail untouched;
- a compiled Llama-shaped model's prefill (bf16, inductor, B4 x 2048): with the merge on
  (the CUDA default) the peak is at most the unmerged one's, the op runs in every layer, and
  the greedy tokens of at least 3 of its 4 rows equal the unmerged model's.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from kvcompile.kernels import gated
from kvcompile.testing import assert_rel_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_ACT = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize("act", gated.ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 7, 2 * 1100 + 5), (2048, 2 * 14336)])
def test_act_mul_cuda_matches_plain_pytorch(act, dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(len(act) + len(shape))
    y = (torch.randn(*shape, generator=g, device="cuda") * 3).to(dtype)
    width = (shape[-1] - (shape[-1] % 2)) // 2
    before = y.clone()
    want = _ACT[act](before[..., :width].float()) * before[..., width:2 * width].float()
    gated.act_mul_(y, 0, width, width, act)
    assert_rel_close(y[..., :width].float(), want, dtype, what=f"{act} {dtype}")
    assert torch.equal(y[..., width:], before[..., width:])


def _llama():
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=4096,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=4096, pad_token_id=0, eos_token_id=2)
    m = t.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m.to("cuda", torch.bfloat16)


def _prefill_peak(merge: bool):
    import kvcompile

    torch._dynamo.reset()
    m = _llama()
    kvcompile.compile(m, kvcompile.KVConfig(merge_projections=merge, max_kv_bytes=1 << 30))
    ids = torch.randint(3, 512, (4, 2048), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        m.generate(ids, **kw)                         # compiles
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = m.generate(ids, **kw)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    counters = kvcompile.report(m).counters
    kvcompile.release(m)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return peak, out, counters


def test_merged_prefill_peak_at_most_the_unmerged_one():
    merged, tok_m, c = _prefill_peak(True)
    unmerged, tok_u, _ = _prefill_peak(False)
    print(f"prefill peak above the start: merged {merged / 2**20:.1f} MiB, unmerged "
          f"{unmerged / 2**20:.1f} MiB; {c.get('projections_gated_in_place')} gated in place")
    assert c.get("projections_gated_in_place", 0) >= 2, c
    assert merged <= unmerged * 1.01 + (1 << 20), (merged, unmerged)
    # the merged GEMMs round differently in bf16: a near tie may flip a row, not most rows
    same = sum(torch.equal(a, b) for a, b in zip(tok_m, tok_u))
    assert same >= 3, (tok_m, tok_u)
