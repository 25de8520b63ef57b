"""Multi-head latent attention (MLA): DeepSeek-V2 / V3 as transformers ships them.

- every site found as MLA and rewritten onto latent pages (one kv head: the latent, width r,
  as keys; the rotary key, width dr, as values): greedy `generate` equals eager with fp32
  pages, and the pool's bytes per token are exactly layers x (r + dr) x element bytes;
- decode steps attend in the latent space (the absorbed query), a fresh prompt by expansion;
- logits within fp32 tolerance of eager (fp32 pages), within the KL bounds of the other
  families for bf16 / fp8 pages;
- the absorbed math equals the expanded one on fresh random inputs (float64 reference);
- negative cases: cross-attention over a latent of other states is not MLA of this sequence
  (left alone, said why); a projection with a bias, and rotation on latent pages, are refused
  with the reason and the fix.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import kvcompile
from kvcompile.api import state_of
from kvcompile.kernels.latent import absorb_query, expand_latent, latent_output
from kvcompile.testing import assert_rel_close, kl_divergence
from tests.passes.caught import has, kv_warnings
from tests.passes.test_hf_families import KL_BOUND, teacher_forced_logits

RANK, ROPE, NOPE, VDIM, HEADS, LAYERS = 16, 8, 8, 16, 4, 2
FULL_ONLY = pytest.mark.skipif(not os.environ.get("KVCOMPILE_TEST_FULL"),
                               reason="KVCOMPILE_TEST_FULL=1: the left-padded case takes the "
                               "same route, padding included")


def make_mla(family: str, attn: str, seed: int = 0, rope: int = ROPE):
    """A two-layer DeepSeek-V2 / V3 with random weights (MoE in layer 1, as the real ones)."""
    cls = {"deepseek_v2": transformers.DeepseekV2Config,
           "deepseek_v3": transformers.DeepseekV3Config}[family]
    cfg = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=RANK,
              q_lora_rank=32, qk_rope_head_dim=rope, qk_nope_head_dim=NOPE, v_head_dim=VDIM,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # greedy decided by the model
    return model


def _prompt(batch=2, length=10, pad=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding on the second row
    ids[1, :pad] = 0
    return ids, mask


def _compile(model, **kw):
    return kvcompile.compile(model, kvcompile.KVConfig(inner="eager", max_kv_bytes=1 << 24,
                                                       **kw))


@pytest.mark.parametrize("family,attn,cache", [("deepseek_v3", "sdpa", "dynamic"),
                                               ("deepseek_v2", "eager", "static")])
def test_greedy_generate_is_token_identical(family, attn, cache):
    """DynamicCache (the latent cat onto the past) and StaticCache (index_copy_ into latent
    buffers, released)."""
    model = make_mla(family, attn)
    ids, mask = _prompt()
    kw = dict(max_new_tokens=12, do_sample=False, attention_mask=mask, pad_token_id=0,
              eos_token_id=None, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    with kv_warnings() as warned:
        _compile(model, kv_dtype="auto")
        with torch.no_grad():
            out = model.generate(ids, **kw)
    assert torch.equal(out, ref), f"{family}/{attn}: tokens differ from eager"
    assert not warned, warned
    rep = kvcompile.report(model)
    assert len(rep.sites) == LAYERS and len(rep.rewritten) == LAYERS, str(rep)
    op = {"dynamic": "cat", "static": "index_copy"}[cache]
    assert all(s.gqa == "mla" and s.cache == op for s in rep.rewritten), str(rep)
    assert all((s.num_kv_heads, s.head_dim) == (1, RANK) for s in rep.rewritten)
    st = kvcompile.stats(model)
    assert st["bytes_per_token"] == LAYERS * (RANK + ROPE) * 4   # fp32 latent + rotary key
    assert st["counters"]["latent_absorbed"] >= LAYERS * 11      # every decode step absorbed
    # the left-padded prompt attends by expansion under the model's own mask, not over the
    # pages in the latent space (q_lat and its fp32 output for every prompt token at once)
    assert st["counters"]["prefill_fresh_sdpa"] == LAYERS
    assert rep.graphs <= 4, f"{rep.graphs} graphs for 12 decode steps: recompiling per step"


def test_fresh_prompt_expands_decode_absorbs_and_logits_match():
    """An unpadded prompt attends by expansion (fresh prefill); decode steps in the latent
    space; teacher-forced logits of both stay within fp32 tolerance of eager."""
    model = make_mla("deepseek_v3", "sdpa")
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = teacher_forced_logits(model, ids, prefill=6)
        _compile(model, kv_dtype="auto")
        got = teacher_forced_logits(model, ids, prefill=6)
    assert_rel_close(got, ref, torch.float32, factor=4, what="logits")
    c = kvcompile.stats(model)["counters"]
    assert c["prefill_fresh_sdpa"] == LAYERS and c["latent_absorbed"] == LAYERS * 6, c


def test_decode_steps_run_the_triton_latent_kernel():
    """KVConfig(kernels="triton") (the interpreter here; CUDA's default): unpadded decode steps
    run kernels/latent_decode.py, tokens equal eager's with fp32 pages; a left-padded batch's
    steps run it too, with the step's key row as its key mask (before: the reference), and
    its tokens equal eager's on the same padded batch."""
    model = make_mla("deepseek_v3", "sdpa", rope=16)   # the kernel's dots need widths >= 16
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids),
              pad_token_id=0, eos_token_id=None)
    pids, pmask = _prompt()
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        pref = model.generate(pids, **{**kw, "attention_mask": pmask})
        _compile(model, kernels="triton")
        out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    c = kvcompile.stats(model)["counters"]
    assert c["latent_decode_triton"] == LAYERS * 4 and "latent_absorbed" not in c, c
    with torch.no_grad():
        got = model.generate(pids, **{**kw, "attention_mask": pmask})
    assert torch.equal(got, pref)
    c = kvcompile.stats(model)["counters"]
    assert c["latent_decode_triton"] == LAYERS * 8, c
    # the padded prompt: expanded under the model's own mask (fresh), as the unpadded one
    assert "latent_absorbed" not in c and c["prefill_fresh_sdpa"] == 2 * LAYERS, c
    assert "reference_fallback" not in c, c


@pytest.mark.parametrize("kv_dtype,elem", [("bf16", 2.0), ("fp8_e4m3", 1.0)])
def test_quantized_latent_pages_stay_close(kv_dtype, elem):
    """Prefill attends to the stored pages too (prefill_attends="stored"), so every logit
    sees the quantized latent; KL against eager within the bound of the other families."""
    model = make_mla("deepseek_v2", "sdpa")
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = teacher_forced_logits(model, ids, prefill=8)
        _compile(model, kv_dtype=kv_dtype, prefill_attends="stored")
        got = teacher_forced_logits(model, ids, prefill=8)
    kl = kl_divergence(ref, got)
    assert 0 < kl < KL_BOUND[kv_dtype], f"{kv_dtype}: KL {kl:.2e}"
    bpt = kvcompile.stats(model)["bytes_per_token"]
    page = state_of(model).pool.page_size
    scales = 0.0 if kv_dtype == "bf16" else 2 * 4 / page     # one fp32 page scale, K and V
    assert bpt == pytest.approx(LAYERS * ((RANK + ROPE) * elem + scales)), bpt


@pytest.mark.parametrize("mask_kind", ["none", "causal_padded"])
def test_absorbed_equals_expanded(mask_kind):
    """q_nope W_UK against the latent, output through W_UV: the same attention as expanding
    the latent through kv_b_proj (float64 reference on fresh random inputs)."""
    g = torch.Generator().manual_seed(4)
    B, S, L = 3, 2, 11
    q = torch.randn(B, HEADS, S, NOPE + ROPE, generator=g)
    c = torch.randn(B, 1, L, RANK, generator=g)
    rope = torch.randn(B, 1, L, ROPE, generator=g)
    w = torch.randn(HEADS * (NOPE + VDIM), RANK, generator=g) / RANK ** 0.5
    allowed = None
    if mask_kind == "causal_padded":
        allowed = torch.ones(B, 1, S, L, dtype=torch.bool).tril(L - S)
        allowed[1, ..., :4] = False
    k, v = expand_latent(c.double(), rope.double(), w.double(), NOPE, HEADS)
    ref = F.scaled_dot_product_attention(q.double(), k, v, attn_mask=allowed, scale=0.3)
    q_lat = absorb_query(q, w, NOPE)                                   # [B, H, S, r + dr]
    kv_lat = torch.cat([c, rope], dim=-1)                              # one kv head
    o_lat = F.scaled_dot_product_attention(q_lat, kv_lat, c, attn_mask=allowed, scale=0.3,
                                           enable_gqa=True)
    out = latent_output(o_lat, w, NOPE)
    assert out.shape == (B, HEADS, S, VDIM)
    assert_rel_close(out, ref, torch.float32)


# --- negative cases ----------------------------------------------------------------------------

class LatentBlock(nn.Module):
    """MLA's expansion (HF's `expand_kv`) over a latent projected from `memory`: this
    sequence's own tokens (self-attention, no cache) or another sequence's (cross-attention)."""

    def __init__(self, dim=64, bias=False):
        super().__init__()
        self.q = nn.Linear(dim, HEADS * (NOPE + ROPE), bias=False)
        self.kv_a = nn.Linear(dim, RANK + ROPE, bias=False)
        self.kv_b = nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=bias)
        self.o = nn.Linear(HEADS * VDIM, dim, bias=False)

    def forward(self, x, memory):
        B, S, _ = x.shape
        M = memory.shape[1]
        q = self.q(x).view(B, S, HEADS, NOPE + ROPE).transpose(1, 2)
        c, rope = self.kv_a(memory).split([RANK, ROPE], dim=-1)
        c, rope = c.view(B, 1, M, RANK), rope.view(B, 1, M, ROPE)
        kv = self.kv_b(c).view(B, M, -1, NOPE + VDIM).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, VDIM], dim=-1)
        k = torch.cat((k_nope, rope.expand(-1, HEADS, -1, -1)), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class SelfLatent(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.attn = LatentBlock(bias=bias)

    def forward(self, x):
        return self.attn(x, x)


class CrossLatent(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LatentBlock()

    def forward(self, x, memory):
        return self.attn(x, memory)


def _run(model, *inputs):
    torch._dynamo.reset()
    want = copy.deepcopy(model)(*inputs)
    with kv_warnings() as warned:
        compiled = kvcompile.compile(model, kvcompile.KVConfig(inner="eager",
                                                               max_kv_bytes=1 << 22))
        got = compiled(*inputs)
    return want, got, kvcompile.report(model), warned


@torch.no_grad()
def test_self_attention_over_its_own_latent_is_mla():
    """The positive twin of the negative cases below: the same block over its own tokens is
    found as MLA (no cache: attention over this forward's latent) and rewritten."""
    torch.manual_seed(5)
    x = torch.randn(2, 6, 64)
    want, got, rep, warned = _run(SelfLatent().eval(), x)
    assert len(rep.rewritten) == 1 and rep.rewritten[0].gqa == "mla", str(rep)
    assert_rel_close(got, want, torch.float32)


@torch.no_grad()
def test_cross_attention_over_a_latent_is_not_mla():
    torch.manual_seed(6)
    x, memory = torch.randn(2, 5, 64), torch.randn(2, 9, 64)
    want, got, rep, warned = _run(CrossLatent().eval(), x, memory)
    assert len(rep.sites) == 1 and not rep.rewritten, str(rep)
    assert "query's tokens" in rep.sites[0].reason, rep.sites[0].reason
    assert torch.equal(got, want)   # left exactly as it was


@torch.no_grad()
def test_kv_b_proj_with_a_bias_is_refused_with_the_reason():
    torch.manual_seed(7)
    x = torch.randn(2, 6, 64)
    want, got, rep, warned = _run(SelfLatent(bias=True).eval(), x)
    assert not rep.rewritten and "kv_b_proj has a bias" in rep.sites[0].reason, str(rep)
    assert torch.equal(got, want)


def test_rotation_on_latent_pages_is_refused_with_the_fix():
    """rotate="hadamard" on latent pages: left alone, with the reason and the fix (eviction on
    latent pages is supported: tests/eviction/test_latent_eviction.py)."""
    model = make_mla("deepseek_v3", "sdpa")
    ids, mask = _prompt()
    kw = dict(max_new_tokens=2, do_sample=False, attention_mask=mask, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    with kv_warnings() as warned:
        _compile(model, kv_dtype="int4", rotate="hadamard")
        with torch.no_grad():
            out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    rep = kvcompile.report(model)
    assert not rep.rewritten and all("not supported on latent pages" in s.reason
                                     for s in rep.sites), str(rep)
    assert has(warned, r"configure\(module, rotate=None\)"), warned


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_engine_serves_latent_pages_with_eager_tokens(kernels):
    """The continuous-batching engine (packed steps, use_cache=False: "none" caches, the
    rotary key joined from its halves in this forward) on latent pages: greedy tokens of
    prompts packed together are eager Hugging Face's, decode steps absorbed. With
    kernels="triton" (CUDA's default; the interpreter here) a step in which every sequence
    adds one token runs the latent decode kernel over the packed rows, and a step with
    prompt chunks the same kernel with each packed token as a row (before: the reference)."""
    import random

    from tests.engine.tiny import config, hf_greedy, random_prompts

    torch._dynamo.reset()
    prompts = random_prompts(random.Random(1), 3, 3, 20)
    ref = make_mla("deepseek_v3", "sdpa", rope=16)   # the kernel's dots need widths >= 16
    model = make_mla("deepseek_v3", "sdpa", rope=16)
    eng = kvcompile.Engine(model, config=config(page_size=8, kernels=kernels),
                           max_num_batched_tokens=64)
    outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 8)
    rep = kvcompile.report(model)
    assert len(rep.rewritten) == LAYERS and all(s.gqa == "mla" for s in rep.rewritten)
    c = state_of(model).counters
    if kernels == "reference":
        assert c["latent_absorbed"] >= LAYERS * 7 and "latent_decode_triton" not in c, c
    else:   # 7 decode steps of the 3 sequences together (the 8th token: the last step's)
        assert c.get("latent_decode_triton", 0) >= LAYERS * 7, c
        assert c.get("latent_decode_triton_rows", 0) >= LAYERS, c   # decodes + a chunk
        assert "latent_absorbed" not in c and "reference_fallback" not in c, c
    assert "latent_chunk_expanded" not in c, c   # no chunk reaches the expansion threshold


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_engine_long_prompt_chunks_expand_beside_the_other_rows(monkeypatch, kernels):
    """An engine step that packs a prompt chunk of the expansion threshold's length or more
    (4 here) with decodes and shorter chunks over latent pages: the long chunk attends by
    expansion over its sequence's stored latents, as generate's chunks do, the other rows
    as a step of their own (the latent kernel's rows with kernels="triton", the reference
    otherwise). Greedy tokens equal eager Hugging Face's; negative: the test above, at the
    default threshold, expands nothing."""
    import random

    from kvcompile.runtime import dispatch
    from tests.engine.tiny import config, hf_greedy, random_prompts

    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 4)
    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES_FP8", 4)
    monkeypatch.setattr(dispatch, "LATENT_SPLIT_PACKED", True)
    torch._dynamo.reset()
    prompts = random_prompts(random.Random(4), 4, 2, 30)
    ref = make_mla("deepseek_v3", "sdpa", rope=16)
    model = make_mla("deepseek_v3", "sdpa", rope=16)
    eng = kvcompile.Engine(model, config=config(page_size=8, kernels=kernels),
                           max_num_batched_tokens=12)   # prompts in chunks beside decodes
    outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 6)
    c = state_of(model).counters
    assert c.get("latent_chunk_expanded", 0) >= LAYERS, c
    if kernels == "triton":
        assert c.get("latent_decode_triton", 0) + c.get("latent_decode_triton_rows", 0) > 0, c
        assert "reference_fallback" not in c and "latent_absorbed" not in c, c


def test_engine_steps_fold_long_chunks_by_default(monkeypatch):
    """The packed split is off by default (dispatch.LATENT_SPLIT_PACKED, measured slower end
    to end): an engine step with a chunk past the expansion threshold (4 here) folds it onto
    the latent rows with the rest; greedy tokens equal eager Hugging Face's."""
    import random

    from kvcompile.runtime import dispatch
    from tests.engine.tiny import config, hf_greedy, random_prompts

    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 4)
    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES_FP8", 4)
    torch._dynamo.reset()
    prompts = random_prompts(random.Random(4), 4, 2, 30)
    ref = make_mla("deepseek_v3", "sdpa", rope=16)
    model = make_mla("deepseek_v3", "sdpa", rope=16)
    eng = kvcompile.Engine(model, config=config(page_size=8, kernels="reference"),
                           max_num_batched_tokens=12)
    outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 6)
    c = state_of(model).counters
    assert "latent_chunk_expanded" not in c, c
    assert c.get("latent_absorbed", 0) > 0, c


def test_decode_mask_that_hides_no_key_lets_the_latent_kernel_run():
    """transformers 5.17 passes an all-True [B, 1, 1, L] bool mask to every MLA decode step
    (5.25 passes None): the latent kernels run without a key mask when the step's key row
    hides nothing, read once per forward; a row with one hidden key (padding), leading keys
    masked by the binding, or an exact mask with a window do not pass this test (the kernels
    then take the key row, or the reference attends)."""
    from types import SimpleNamespace

    from kvcompile.kernels.masks import MaskInfo
    from kvcompile.runtime.dispatch import mask_hides_no_key

    g = torch.Generator().manual_seed(3)
    L = int(torch.randint(5, 40, (1,), generator=g))
    row = torch.ones(2, L, dtype=torch.bool)
    plan = SimpleNamespace(cache={})
    assert mask_hides_no_key(plan, MaskInfo(row, [0, 0], 0, False, "decode"))
    assert len(plan.cache) == 1                          # one host read per forward
    assert mask_hides_no_key(plan, MaskInfo(row, [0, 0], 0, False, "decode"))
    assert len(plan.cache) == 1
    hidden = row.clone()
    hidden[1, int(torch.randint(0, L, (1,), generator=g))] = False
    assert not mask_hides_no_key(SimpleNamespace(cache={}),
                                 MaskInfo(hidden, [0, 0], 0, False, "decode"))
    assert not mask_hides_no_key(SimpleNamespace(cache={}),
                                 MaskInfo(row, [0, 2], 0, False, "decode"))
    assert not mask_hides_no_key(SimpleNamespace(cache={}),
                                 MaskInfo(row, [0, 0], 0, False, "mask with per-head structure"))
    assert mask_hides_no_key(SimpleNamespace(cache={}), MaskInfo(None, [0, 0], 0, True))
    assert not mask_hides_no_key(SimpleNamespace(cache={}), MaskInfo(None, [0, 0], 8, True))
    assert not mask_hides_no_key(SimpleNamespace(cache={}), None)


def _generate_like(model, ids, kw, ref, what: str) -> dict:
    """`generate` whose tokens equal `ref`'s and whose per-step logits are within fp32
    tolerance of them -> the counters it moved."""
    before = dict(kvcompile.stats(model)["counters"])
    got = model.generate(ids, **kw)
    c = {k: v - before.get(k, 0) for k, v in kvcompile.stats(model)["counters"].items()}
    assert torch.equal(got.sequences, ref.sequences), what
    for g, r in zip(got.logits, ref.logits):
        assert_rel_close(g, r, torch.float32, factor=4, what=f"logits, {what}")
    return c


@pytest.mark.parametrize("pad", [pytest.param(False, marks=FULL_ONLY), True],
                         ids=["unpadded", "left_padded"])
def test_prompt_chunks_over_latent_pages_expand(monkeypatch, pad):
    """A prompt prefilled in chunks of 12 (HF's prefill_chunk_size, as kvcompile sets it when
    a batch's activations would not fit): the first chunk attends fresh, every later chunk of
    9+ tokens over the latent pages of the chunks before. From LATENT_EXPAND_MIN_QUERIES
    queries a row (1 here) such a chunk attends by expansion, as the model does
    (latent.paged_latent_expanded: the rows' stored latents through kv_b_proj, causal SDPA
    from each row's padding on), and with LATENT_EXPAND_BYTES = 1 a row at a time, the fresh
    chunk too. Logits of every step within fp32 tolerance of eager's (fp32 latent pages),
    tokens equal; negative: at the default threshold (256 queries) the same chunks absorb,
    here with the paged reference's math SDPA forced into blocks (dense._sdpa_blocks: a
    32-token chunk over 32k latents at 128 heads asked for 144 GiB at once)."""
    from kvcompile.kernels import dense
    from kvcompile.runtime import dispatch

    blocks, sdpa_blocks = [], dense._sdpa_blocks
    model = make_mla("deepseek_v3", "sdpa")
    ids, mask = _prompt(batch=3, length=34, pad=5 if pad else 0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
              eos_token_id=None, output_logits=True, return_dict_in_generate=True,
              prefill_chunk_size=12)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        _compile(model, kv_dtype="auto")
        for expand in (True, False):
            if expand:
                monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 1)
                monkeypatch.setattr(dispatch, "LATENT_EXPAND_BYTES", 1)
            else:   # absorbed: the paged reference's math SDPA in blocks of a few rows
                monkeypatch.undo()
                monkeypatch.setattr(dense, "MATH_BLOCK_BYTES", 256)
                monkeypatch.setattr(dense, "_sdpa_blocks", lambda *a: blocks.append(1) or
                                    sdpa_blocks(*a))
            c = _generate_like(model, ids, kw, ref, f"expand={expand}")
            # chunks of 12, 12 and 10 tokens: the first fresh, the two others over pages
            assert c.get("prefill_fresh_sdpa") == LAYERS, c
            if expand:
                assert c.get("latent_chunk_expanded") == 2 * LAYERS, c
            else:
                assert c.get("latent_chunk_expanded", 0) == 0, c
                assert c.get("latent_absorbed", 0) >= 2 * LAYERS, c
                assert blocks


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left_padded"])
def test_prompt_chunks_over_latent_pages_fold_into_kernel_rows(monkeypatch, pad):
    """KVConfig(kernels="triton") (CUDA's default; the interpreter here): a prompt chunk over
    latent pages of fewer than LATENT_EXPAND_MIN_QUERIES queries a row runs the latent decode
    kernel with each query as a row of its own (the causal length it sees, its row's left
    padding as the key mask; before: the paged reference's math SDPA). Tokens equal eager's,
    logits of every step within fp32 tolerance. Negative: from LATENT_EXPAND_MIN_QUERIES on
    (1 here) the same chunks expand instead and no rows are folded."""
    from kvcompile.runtime import dispatch

    model = make_mla("deepseek_v3", "sdpa", rope=16)   # the kernel's dots need widths >= 16
    ids, mask = _prompt(batch=3, length=30, pad=5 if pad else 0)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
              eos_token_id=None, output_logits=True, return_dict_in_generate=True,
              prefill_chunk_size=10)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        _compile(model, kernels="triton")
        for expand in (False, True):
            if expand:
                monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 1)
            c = _generate_like(model, ids, kw, ref, f"expand={expand}")
            # chunks of 10 tokens: the first fresh, the two others over pages
            assert c.get("prefill_fresh_sdpa") == LAYERS, c
            assert not c.get("reference_fallback") and not c.get("latent_absorbed"), c
            assert c.get("latent_decode_triton") == 2 * LAYERS, c     # the 2 decode steps
            if expand:
                assert c.get("latent_chunk_expanded") == 2 * LAYERS, c
                assert not c.get("latent_decode_triton_rows"), c
            else:
                assert c.get("latent_decode_triton_rows") == 2 * LAYERS, c
                assert not c.get("latent_chunk_expanded"), c


@pytest.mark.parametrize("mask_rows", [1, 5])
def test_fresh_latent_rows_in_groups_equal_one_call(monkeypatch, mask_rows):
    """dispatch._fresh_latent_rows with one row a group (LATENT_EXPAND_BYTES = 1) equals the
    whole batch expanded and attended at once: causal, left-padded, and under a custom bool
    mask that broadcasts over the batch ([1, 1, S, S]) or has a row each ([5, 1, S, S])."""
    from types import SimpleNamespace

    from kvcompile.kernels.dense import sdpa_attention
    from kvcompile.runtime import dispatch

    g = torch.Generator().manual_seed(mask_rows)
    B, S = 5, 9
    c, rope = torch.randn(B, 1, S, RANK, generator=g), torch.randn(B, 1, S, ROPE, generator=g)
    w = torch.randn(HEADS * (NOPE + VDIM), RANK, generator=g) / RANK ** 0.5
    q = torch.randn(B, HEADS, S, NOPE + ROPE, generator=g)
    allowed = torch.rand(mask_rows, 1, S, S, generator=g) > 0.4
    allowed |= torch.eye(S, dtype=torch.bool)                 # every query sees one key
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda device: False),
                            config=SimpleNamespace(prefill_attends="fresh"))
    k, v = expand_latent(c, rope, w, NOPE, HEADS)
    starts = [0, 3, 0, 8, 1]
    j = torch.arange(S)
    padded = torch.stack([(j[None] <= j[:, None]) & (j[None] >= s) for s in starts])[:, None]
    want = {"causal": sdpa_attention(q, k, v, None, None, 0.3, True),
            "starts": sdpa_attention(q, k, v, padded, None, 0.3),
            "masked": sdpa_attention(q, k, v, allowed, None, 0.3)}
    monkeypatch.setattr(dispatch, "LATENT_EXPAND_BYTES", 1)
    for how, kw in (("causal", dict(causal=True, starts=None, masked=None)),
                    ("starts", dict(causal=None, starts=starts, masked=None)),
                    ("masked", dict(causal=None, starts=None, masked=(allowed, None)))):
        got = dispatch._fresh_latent_rows(state, q, (c, rope), w, NOPE, 0.3, **kw)
        assert_rel_close(got, want[how], torch.float32, factor=4, what=how)
