"""The chunked-prefill route through a compiled model (KVConfig.prefill_chunk_route): a chunk
over cached pages runs the gathered route (kernels/prefill_gather.py) or the paged kernel as the
rule says, with the same logits, and the report counts and explains the choice."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcompile  # noqa: E402
from kvcompile.api import state_of  # noqa: E402
from kvcompile.errors import KVConfigError  # noqa: E402
from kvcompile.testing import assert_rel_close  # noqa: E402
from tests.passes import research  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@torch.no_grad()
def _two_chunks(route: str, calls: list | None = None, kernels: str = "triton", **kv):
    """A 7-token prefill, then a 16-token chunk over its pages (fp8 pages unless `kv` says
    otherwise, head_dim 64, GQA 4/2): (logits of the chunk, counters, report text). `calls`
    collects the route rule's calls."""
    torch._dynamo.reset()
    model = research.make(research.WhereIndexCopyGQA, dim=256, n_head=4, n_kv=2)
    kv = kv or dict(kv_dtype="fp8_e4m3")
    cfg = kvcompile.KVConfig(inner="eager", max_kv_bytes=1 << 22, kernels=kernels,
                             prefill="triton", prefill_chunk_route=route, **kv)
    compiled = kvcompile.compile(copy.deepcopy(model).to(DEV), cfg)
    ids = torch.randint(3, 256, (2, 23), generator=torch.Generator().manual_seed(4)).to(DEV)
    compiled(ids[:, :7], 0)
    from kvcompile.kernels import prefill_gather as G

    rule = G.choose_route
    def counted(*a, **k):
        if calls is not None:
            calls.append(a[0])
        return rule(*a, **k)
    G.choose_route = counted
    try:
        logits = compiled(ids[:, 7:], 7)
    finally:
        G.choose_route = rule
    st = state_of(compiled)
    return logits, dict(st.counters), str(kvcompile.report(compiled))


def test_gather_and_paged_routes_agree_and_are_reported():
    calls_g, calls_a = [], []
    gathered, c_g, rep_g = _two_chunks("gather", calls_g)
    auto, c_a, rep_a = _two_chunks("auto", calls_a)
    # the rule runs once per forward (the plan's memo), not once per layer and again inside
    # the kernel: two layers, one chunk forward each
    assert calls_g == ["gather"] and calls_a == ["auto"], (calls_g, calls_a)
    assert c_g.get("prefill_gather", 0) == 2 and not c_g.get("prefill_triton"), c_g
    assert "gather route (prefill_chunk_route='gather')" in rep_g, rep_g
    # the rule must not gather a 16-token chunk (32 query rows per kv head)
    assert not c_a.get("prefill_gather") and c_a.get("prefill_triton", 0) == 2, c_a
    assert "paged route (short chunk" in rep_a, rep_a
    assert not c_g.get("reference_fallback") and not c_a.get("reference_fallback")
    # fp32 model: on CUDA tl.dot takes fp32 as tf32 (fp16's mantissa), and the two routes round
    # different operands (codes vs dequantized values)
    tol = torch.float16 if DEV == "cuda" else torch.float32
    assert_rel_close(gathered, auto, tol, factor=8, what="chunk logits")


INT4 = dict(kv_dtype="int4", scale_granularity="channel", page_size=32)


def test_int_pages_prefill_chunks_by_gathering():
    """Int pages have no paged prefill kernel: a chunk over them takes the gather route
    whatever its length (the rule would keep a 16-token chunk on the paged kernel), with the
    reference attention's logits over the same pages; where the gather cannot run
    (prefill_chunk_route='paged' here) the reference attends and the report says why."""
    got, c, rep = _two_chunks("auto", **INT4)
    assert c.get("prefill_gather", 0) == 2 and not c.get("reference_fallback"), c
    assert "gather route (no paged prefill kernel reads these pages)" in rep, rep
    ref, c_ref, _ = _two_chunks("auto", kernels="reference", **INT4)
    assert not c_ref.get("prefill_gather"), c_ref
    assert_rel_close(got, ref, torch.float16 if DEV == "cuda" else torch.float32, factor=8,
                     what="chunk logits")
    forced, c_p, rep_p = _two_chunks("paged", **INT4)
    assert c_p.get("reference_fallback", 0) == 2 and not c_p.get("prefill_gather"), c_p
    assert "no paged prefill kernel, and the gather route cannot run here" in rep_p, rep_p
    assert_rel_close(forced, ref, torch.float32, factor=8, what="chunk logits")


def test_route_config_is_validated():
    with pytest.raises(KVConfigError, match="prefill_chunk_route"):
        kvcompile.KVConfig(prefill_chunk_route="fast")
    with pytest.raises(KVConfigError, match="prefill_gather_bytes"):
        kvcompile.KVConfig(prefill_gather_bytes=0)
