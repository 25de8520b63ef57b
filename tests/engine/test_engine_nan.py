"""NaN in one request on the engine's Triton path (the interpreter on the CPU): the request
whose logits turn NaN finishes with finish_reason="error" and says why; every other request
of the same steps produces the tokens it produces alone. The NaN comes from a forward hook on
the embedding (registered before compiling: Dynamo traces it into the graph), once in a prompt
(the chunked-prefill kernel over the pages) and once at a decode step (the decode kernel);
fp32, fp8 and fp4 pages."""

from __future__ import annotations

import os
import random

import pytest
import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.api import state_of
from tests.engine.tiny import VOCAB, config, make_llama64, random_prompts

# the interpreter's numpy warns on the NaN it computes with
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FIRST3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
POISON = VOCAB - 1      # its embedding turns NaN: no clean prompt or output holds it


def _poisoned_model(kv_dtype, poison: torch.Tensor):
    """The model whose embedding turns NaN on the tokens of `poison` [n] int64; a tensor, which
    Dynamo reads as a graph input: changing it in place changes the poison without a new
    compile (one compile per format, not two)."""
    torch._dynamo.reset()
    m = make_llama64()

    def nan_embedding(module, args, out):
        # out [1, T, hidden]: NaN where the token is one of `poison`
        hit = (args[0][..., None] == poison).any(-1)
        return out.masked_fill(hit[..., None], float("nan"))

    m.get_input_embeddings().register_forward_hook(nan_embedding)
    # prefill_attends="stored": the prompts attend through the Triton prefill kernel over the
    # pages (the path under test), not to their own K/V by SDPA (the default for a step of
    # fresh prompts)
    kvcompile.compile(m, config(kernels="triton", kv_dtype=kv_dtype, page_size=16,
                                prefill_attends="stored"))
    return m


@pytest.mark.parametrize("kv_dtype", [
    "fp32", "fp8_e4m3",
    pytest.param("fp4_e2m1", marks=pytest.mark.skipif(
        not os.environ.get("KVCOMPILE_TEST_FULL"),
        reason="KVCOMPILE_TEST_FULL=1: fp8 pages take the same quantized Triton path"))])
def test_nan_request_fails_alone_on_the_triton_path(kv_dtype, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_PREFILL", "triton")   # the CPU default gathers to SDPA
    rng = random.Random(0)
    prompts = [p for p in random_prompts(rng, 8, 5, 24) if POISON not in p][:4]
    # the decode-time poison: the 3rd token request 3 generates alone, which no other request
    # of the test holds
    poison = torch.tensor([POISON, POISON])
    m = _poisoned_model(kv_dtype, poison)
    probe = Engine(m, max_num_batched_tokens=64)
    # alone: requests 1 and 2 (compared whole), request 3's first three tokens (all it makes
    # before its NaN); request 0 is poisoned in its prompt and makes none
    alone = {i: probe.generate([prompts[i]], FIRST3 if i == 3 else GREEDY)[0].token_ids
             for i in (1, 2, 3)}
    probe.close()
    later = alone[3][2]
    assert later != POISON and later not in prompts[0]
    assert all(later not in prompts[i] + alone[i] for i in (1, 2))

    poison[1] = later                     # the same compiled model, now also poisoned there
    eng = Engine(m, max_num_batched_tokens=64)
    in_prompt = prompts[0][:3] + [POISON] + prompts[0][3:]
    outs = eng.generate([prompts[1], in_prompt, prompts[2], prompts[3]], GREEDY)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert "non-finite logits" in outs[1].error
    # request 3 samples `later` (its 3rd token), whose K/V are NaN: the next logits are NaN
    assert outs[3].finish_reason == "error" and outs[3].token_ids == alone[3][:3]
    assert [outs[0].token_ids, outs[2].token_ids] == [alone[1], alone[2]]
    assert all(o.finish_reason == "length" for o in (outs[0], outs[2]))
    counters = state_of(m).counters
    assert counters.get("prefill_triton", 0) > 0 and counters.get("engine_decode_kernel_calls")
    eng.close()
    assert eng.pool.stats().pages_used == 0
