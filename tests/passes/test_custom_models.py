"""The compiler on models that are not Hugging Face: gpt-fast buffers and nanoGPT attention."""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.runtime.binding import is_stub
from kvcompile.testing import kl_divergence
from tests.passes.zoo import GptFast, NanoGPT, gptfast_generate, seeded


def test_gptfast_buffers_rewritten_and_released():
    idx = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = gptfast_generate(seeded(GptFast), idx, 48)
    model = seeded(GptFast)
    compiled = kvcompile.compile(model, kvcompile.KVConfig(inner="aot_eager",
                                                           max_kv_bytes=1 << 24))
    out = gptfast_generate(compiled, idx, 48)
    assert torch.equal(out, ref)
    rep = kvcompile.report(model)
    assert len(rep.rewritten) == 2 and {s.cache for s in rep.rewritten} == {"index_put"}, rep
    assert {s.gqa for s in rep.rewritten} == {"repeat_interleave"}
    for layer in model.layers:  # the full-precision buffers are gone: zero-byte stubs remain
        assert is_stub(layer.k_cache) and layer.k_cache.untyped_storage().nbytes() <= 16
    assert kvcompile.stats(model)["tokens"] == 2 * (9 + 47)
    # a second generation restarts at position 0 and reuses the binding's pages
    out2 = gptfast_generate(compiled, idx, 48)
    assert torch.equal(out2, ref)
    assert kvcompile.stats(model)["tokens"] == 2 * (9 + 47)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_nanogpt_handwritten_attention(kv_dtype):
    model = seeded(NanoGPT)
    idx = torch.randint(3, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(idx)
    compiled = kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, inner="aot_eager",
                                                           max_kv_bytes=1 << 24))
    with torch.no_grad():
        got = compiled(idx)
    rep = kvcompile.report(model)
    assert len(rep.rewritten) == 2 and {s.pattern for s in rep.rewritten} == {"eager"}
    assert {s.cache for s in rep.rewritten} == {"none"} and {s.mask for s in rep.rewritten} == {
        "bool_inverted"}
    if kv_dtype == "auto":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        assert 0 < kl_divergence(ref, got) < 1e-2
    # a cache-less forward borrows pages only for its own duration
    assert kvcompile.stats(model)["tokens"] == 0
