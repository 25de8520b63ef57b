"""CUDA-graph decode steps of HF `generate` (integrations/hf_graphs.py) against the same calls
without graphs (CUDA only).

    pytest -s -q -m gpu tests/gpu/test_hf_graphs_gpu.py       # or: gpu_jobs.sh hf_graphs

A tiny Llama (fp32 weights, LM head sharpened so greedy decoding is decided by the model) is
compiled with kvcompile; each case runs `generate` twice, graphs on and graphs off, and
compares the tokens and the per-step logits (`output_logits=True`):
greedy with left padding (B=3), a longer prompt after a shorter one (recapture) and a shorter
one after it (reuse: mask columns past the prompt set to 1), beam search (2 beams: forks,
reorder), sampling with num_return_sequences=2 (seeded), and B=1. Per case: graph captures
and replays, largest relative logit difference, token agreement, pages left in the pool after
the call. Formats: bf16, fp8_e4m3. (Was benchmarks/gpu_check_hf_graphs.py.)
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import kvcompile
from kvcompile import KVConfig
from kvcompile.api import state_of
from tests.gpu.test_engine_graphs_gpu import tiny  # the same tiny Llama, seed 0
from tests.integrations.test_deferred_stop import Tokens  # a streamer that keeps its tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = 2e-3   # graph vs eager steps: the same kernels, other split-K partitions


def inputs(B: int, L: int, pad: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (B, L), generator=g)
    am = torch.ones_like(ids)
    if pad:
        for r in range(B):
            n = (r * 5) % max(L - 2, 1)
            ids[r, :n] = 0
            am[r, :n] = 0
    return ids.cuda(), am.cuda()


CASES = [
    ("greedy B=3 left pad", dict(B=3, L=40, pad=True), dict(do_sample=False)),
    ("longer prompt (recapture)", dict(B=3, L=90, pad=True), dict(do_sample=False)),
    ("shorter prompt (reuse)", dict(B=3, L=20, pad=True), dict(do_sample=False)),
    ("beam search 2", dict(B=2, L=30, pad=True), dict(do_sample=False, num_beams=2)),
    ("sampling x2 seqs", dict(B=2, L=30, pad=False),
     dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2)),
    ("greedy B=1", dict(B=1, L=25, pad=False), dict(do_sample=False)),
]


def run(model, ids, am, kw, graphs: bool, seed: int):
    fwd = model.forward
    fwd._why_not = None if graphs else "off (check)"
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=am, max_new_tokens=16, min_new_tokens=16,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    fwd._why_not = None
    toks, logits = out.sequences[:, ids.shape[1]:], [x.float() for x in out.logits]
    del out
    gc.collect()   # the returned cache sits in reference cycles: its pages go with it
    return toks, logits


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3"])
def compiled(request):
    fmt = request.param
    torch._dynamo.reset()
    # one model, many batch shapes: more recompiles than Dynamo's default cap
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    model = tiny()
    kvcompile.compile(model, KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16))
    yield model
    kvcompile.release(model)
    torch._dynamo.config.recompile_limit = limit


@pytest.fixture(autouse=True)
def _fresh_dynamo(dynamo_per_module):  # overrides tests/conftest.py: one compile per format
    yield


# cases run in order on one compiled model: "recapture" and "reuse" depend on the one before
@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_graph_decode_equals_no_graph_decode(compiled, i):
    model, (name, shape, kw) = compiled, CASES[i]
    fwd = model.forward
    ids, am = inputs(seed=i, **shape)
    c0, r0 = fwd.captures, fwd.replays
    tg, lg = run(model, ids, am, kw, True, seed=i)
    replays = fwd.replays - r0
    pages_left = kvcompile.stats(model).get("pages_used")
    te, le = run(model, ids, am, kw, False, seed=i)
    assert fwd.replays - r0 - replays == 0, "graphs replayed with graphs off"
    # logits compared on the steps before the first token difference
    first = next((j for j in range(tg.shape[1]) if not torch.equal(tg[:, j], te[:, j])),
                 len(lg))
    rel = max([float((a - b).abs().max() / b.abs().max()) for a, b in
               zip(lg[:first], le[:first])] or [0.0])
    print(dict(case=name, captures=fwd.captures - c0, replays=replays, max_rel=rel,
               steps_compared=first, pages_left=pages_left))
    assert replays > 0
    assert rel <= TOL
    assert torch.equal(tg, te)
    assert not pages_left


@pytest.mark.parametrize("eos", [False, True], ids=["to max_new_tokens", "rows end at EOS"])
def test_deferred_stop_check_equals_the_per_step_check(compiled, eos):
    """KVConfig.deferred_stop (the default): graphed steps with the stop decision read a step
    late (the host runs a step ahead; each step's plan in its own staging buffer) give the
    tokens of the per-step check; with an EOS that ends the rows early, one more step runs
    and is undone; a streamer gets every token; no page is left. (transformers' own loop:
    device_loop off, test_device_loop_equals_transformers_loop checks the device loop.)"""
    model = compiled
    st = state_of(model)
    st.config = dataclasses.replace(st.config, device_loop=False)
    ids, am = inputs(B=1 if eos else 3, L=30, pad=not eos, seed=7)   # one row: all end early
    kw = dict(attention_mask=am, max_new_tokens=24, do_sample=False, pad_token_id=0)
    free = model.generate(ids, **kw, eos_token_id=None)[:, ids.shape[1]:]
    # EOS: a token whose first occurrence is the 4th or a later one (random weights repeat
    # tokens: the token at a fixed index may have come first, before any decode step)
    first = [j for j in range(3, free.shape[1]) if int(free[0, j]) not in free[0, :j].tolist()]
    assert not eos or first, f"no token of {free[0].tolist()} comes first after the 3rd"
    kw["eos_token_id"] = int(free[0, first[0]]) if eos else None
    outs, puts = [], []
    for defer in (True, False):
        st.config = dataclasses.replace(st.config, deferred_stop=defer)
        streamer = Tokens()
        d0, r0 = st.counters.get("generate_deferred_stop", 0), model.forward.replays
        outs.append(model.generate(ids, streamer=streamer, **kw))
        puts.append(streamer.seen)
        assert st.counters.get("generate_deferred_stop", 0) - d0 == int(defer)
        assert model.forward.replays > r0
        assert not kvcompile.stats(model).get("pages_used")
    st.config = dataclasses.replace(st.config, deferred_stop=True, device_loop=True)
    assert torch.equal(outs[0], outs[1]) and puts[0] == puts[1]


def _counted(st, before: dict) -> dict:
    """The counters that moved since `before` (a copy of st.counters), by how much."""
    return {k: v - before.get(k, 0) for k, v in st.counters.items() if v != before.get(k, 0)}


def _dropping_graphs_at(n: int, model, reserve):
    """pool.reserve that drops the model's graphs at its n-th call (as a pool growth does)."""
    calls = []

    def growing(*a, **k):
        calls.append(1)
        if len(calls) == n:
            model.forward.release_graphs()
        return reserve(*a, **k)

    return growing


@pytest.mark.parametrize("case", ["to max_new_tokens", "rows end at EOS", "recapture"])
def test_device_loop_equals_transformers_loop(compiled, case):
    """KVConfig.device_loop (the default; integrations/hf_loop.py): greedy `generate` whose
    graphed steps run a forward replay and a captured tail each gives transformers' own loop's
    tokens (device_loop=False, same graphs); with EOS ids that end the rows early (a
    left-padded batch: positions per row) one more step runs and is cropped; a graph
    recaptured mid-call (the graphs dropped as a pool growth drops them) keeps the tokens.
    A streamer gets the same tokens; no page is left."""
    model = compiled
    st = state_of(model)
    ids, am = inputs(B=3, L=30, pad=True, seed=9)
    kw = dict(attention_mask=am, max_new_tokens=24, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    if case == "rows end at EOS":
        free = model.generate(ids, **kw)[:, ids.shape[1]:]
        kw["eos_token_id"] = [int(free[r, 4 + 3 * r]) for r in range(3)]
    outs, counts, puts = [], [], []
    for loop in (True, False):
        st.config = dataclasses.replace(st.config, device_loop=loop)
        before = dict(st.counters)
        kw["streamer"] = streamer = Tokens()
        if case == "recapture" and loop:
            st.pool.reserve = _dropping_graphs_at(8, model, st.pool.reserve)
        try:
            outs.append(model.generate(ids, **kw))
        finally:
            st.pool.__dict__.pop("reserve", None)
        counts.append(_counted(st, before))
        puts.append(streamer.seen)
        assert not kvcompile.stats(model).get("pages_used")
    st.config = dataclasses.replace(st.config, device_loop=True)
    print(case, counts[0])
    assert counts[0].get("generate_device_loop") == 1, counts[0]
    assert counts[0].get("generate_device_loop_steps", 0) > 0, counts[0]
    assert "generate_device_loop" not in counts[1], counts[1]
    if case == "recapture":
        assert counts[0].get("generate_device_loop_recaptures") == 1, counts[0]
    assert torch.equal(outs[0], outs[1]) and puts[0] == puts[1]


def test_device_loop_samples_in_graphs(compiled):
    """Sampling on the device loop (the warpers and the exponential race captured in the
    tail, graph-safe RNG): top_k=1 gives greedy's tokens; a seed repeats a top_k=20 sample;
    two seeds give different samples (the draws advance across replays)."""
    model = compiled
    st = state_of(model)
    ids, am = inputs(B=3, L=30, pad=True, seed=11)
    kw = dict(attention_mask=am, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
    greedy = model.generate(ids, do_sample=False, **kw)
    before = st.counters.get("generate_device_loop", 0)
    assert torch.equal(model.generate(ids, do_sample=True, top_k=1, **kw), greedy)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, do_sample=True, top_k=20, temperature=1.5, **kw))
    assert st.counters.get("generate_device_loop", 0) - before == 4
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    new = runs[0][:, ids.shape[1]:]
    assert len(set(new[0].tolist())) > 1, "every step drew the same token: RNG not advancing"


def _deepseek(dtype):
    """A DeepSeek-V3 stack (MLA: r 512, rope 64, 16 heads, 2 layers, random weights)."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=64,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
        n_group=1, topk_group=1, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().to("cuda", dtype)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_latent_layers_decode_in_graphs(fmt):
    """MLA layers (latent pages, absorbed decode) in generate's CUDA graphs: before, their
    steps ran eagerly (the latent kernel's choice read the decode mask on the host). Left
    padding (a key mask the Triton latent kernel takes) and none, graphs on against off:
    tokens equal, per-step logits within TOL (fp32 weights), every step a replay."""
    torch._dynamo.reset()
    model = _deepseek(torch.float32)
    kvcompile.compile(model, KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16))
    try:
        assert model.forward.why_not() is None or "no CUDA pool" in model.forward.why_not()
        for i, pad in enumerate((True, False)):
            ids, am = inputs(B=3, L=60, pad=pad, seed=10 + i)
            r0 = model.forward.replays
            tg, lg = run(model, ids, am, dict(do_sample=False), True, seed=i)
            replays = model.forward.replays - r0
            te, le = run(model, ids, am, dict(do_sample=False), False, seed=i)
            first = next((j for j in range(tg.shape[1]) if not torch.equal(tg[:, j], te[:, j])),
                         len(lg))
            rel = max([float((a - b).abs().max() / b.abs().max()) for a, b in
                       zip(lg[:first], le[:first])] or [0.0])
            c = kvcompile.stats(model)["counters"]
            print(dict(fmt=fmt, pad=pad, replays=replays, max_rel=rel, steps_compared=first,
                       latent_triton=c.get("latent_decode_triton"),
                       latent_cuda=c.get("latent_decode_cuda"),
                       absorbed=c.get("latent_absorbed"), why_not=model.forward.why_not()))
            assert model.forward.why_not() is None
            assert replays >= 14          # 16 new tokens: the first from the prefill
            assert rel <= TOL
            assert torch.equal(tg, te)
        # every prefill attends by expansion (the padded one under the model's own mask), so
        # the latent reference never runs: 2 layers x 4 prompts
        assert c.get("latent_absorbed", 0) == 0 and c.get("prefill_fresh_sdpa") == 8, c
    finally:
        kvcompile.release(model)


EVICT = [("SinkWindow", lambda: kvcompile.SinkWindow(4, 60), 1, "cache"),
         ("SinkWindow window", lambda: kvcompile.SinkWindow(4, 60), 8, "original"),
         ("SnapKV hold", lambda: kvcompile.SnapKV(budget=64, window=8, hold=True), 4, None),
         ("H2O", lambda: kvcompile.H2O(budget=64, recent=16, sinks=4), 1, None)]


# int4: the 4-bit Pareto format's layout (K int4 channel-scaled, V int4 token-scaled, pages
# of 64), whose moved tokens are re-encoded on the device (sixteenth session)
FORMATS = {"bf16": dict(kv_dtype="bf16", page_size=16),
           "fp8_e4m3": dict(kv_dtype="fp8_e4m3", page_size=16),
           "int4": dict(kv_dtype="int4", scale_granularity="channel", page_size=64)}


@pytest.mark.parametrize("fmt,name,policy,interval,sinks,pad", [
    (f, *e, False) for f in FORMATS for e in EVICT] + [
    # left padding (rows padded by 0, 5 and 10 tokens): once the prompt's eviction drops the
    # padding, the steps replay (sixteenth session); re-rotated sinks compacted to slot 0
    ("fp8_e4m3", *EVICT[0], True), ("fp8_e4m3", *EVICT[2], True)],
    ids=lambda v: v if isinstance(v, str) else None)
def test_eviction_in_generate_graphs(fmt, name, policy, interval, sinks, pad):
    """generate with an eviction policy: decode steps replay CUDA graphs (the eviction runtime
    steps aside, evicts after each replay on the device) against the same call with graphs
    off (its host path): tokens equal, per-step logits within TOL, every step a replay."""
    torch._dynamo.reset()
    model = tiny()
    kvcompile.compile(model, KVConfig(max_kv_bytes=256 << 20, eviction=policy(),
                                      eviction_interval=interval, **FORMATS[fmt]))
    try:
        ids, am = inputs(B=3, L=100, pad=pad, seed=21)
        with torch.no_grad():   # the eviction runtime exists after a first call
            model.generate(ids[:1, :8], max_new_tokens=1, do_sample=False, pad_token_id=0)
        if sinks is not None:
            state_of(model).eviction.sink_positions = sinks
        st = state_of(model)
        c0 = dict(st.counters)
        r0 = model.forward.replays
        tg, lg = run(model, ids, am, dict(do_sample=False), True, seed=0)
        replays = model.forward.replays - r0
        c1 = dict(st.counters)
        te, le = run(model, ids, am, dict(do_sample=False), False, seed=0)
        first = next((j for j in range(tg.shape[1]) if not torch.equal(tg[:, j], te[:, j])),
                     len(lg))
        rel = max([float((a - b).abs().max() / b.abs().max()) for a, b in
                   zip(lg[:first], le[:first])] or [0.0])
        delta = {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}
        print(dict(fmt=fmt, policy=name, pad=pad, replays=replays, max_rel=rel,
                   steps_compared=first, counters=delta))
        assert replays == 15
        assert delta.get("eviction_aside_steps") == 15
        assert delta.get("evicted_tokens", 0) > 0
        assert rel <= TOL
        assert torch.equal(tg, te)
    finally:
        kvcompile.release(model)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("policy", [lambda: kvcompile.SinkWindow(4, 60),
                                    lambda: kvcompile.H2O(budget=64, recent=16, sinks=4)],
                         ids=["SinkWindow", "H2O"])
def test_device_loop_with_eviction_equals_transformers_loop(fmt, policy):
    """An evicting model's device loop (each step through the forward: a graph that steps
    aside) against transformers' loop over the same graphs: tokens and replays equal."""
    torch._dynamo.reset()
    model = tiny()
    kvcompile.compile(model, KVConfig(max_kv_bytes=256 << 20, eviction=policy(),
                                      **FORMATS[fmt]))
    try:
        st = state_of(model)
        ids, am = inputs(B=3, L=100, pad=True, seed=23)
        kw = dict(attention_mask=am, max_new_tokens=24, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
        outs, counts = [], []
        for loop in (True, False):
            st.config = dataclasses.replace(st.config, device_loop=loop)
            before = dict(st.counters)
            outs.append(model.generate(ids, **kw))
            counts.append(_counted(st, before))
        print(fmt, counts[0])
        assert counts[0].get("generate_device_loop") == 1, counts[0]
        assert (counts[0].get("generate_cuda_graph_replays")
                == counts[1].get("generate_cuda_graph_replays")), counts
        assert torch.equal(outs[0], outs[1])
    finally:
        kvcompile.release(model)


def test_engine_latent_steps_take_the_kernel():
    """The engine on MLA layers (DeepSeek-V3 widths, fp32 weights): decode steps in which
    every sequence adds one token run the latent kernel over the packed rows (eagerly: the
    engine's graphs refuse MLA layers until this has run), tokens equal HF greedy."""
    import random

    torch._dynamo.reset()
    ref, model = _deepseek(torch.float32), _deepseek(torch.float32)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 200))] for _ in range(4)]
    eng = kvcompile.Engine(model, config=KVConfig(kv_dtype="bf16", max_kv_bytes=256 << 20),
                           max_num_batched_tokens=1024)
    outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True))
    c = state_of(model).counters
    print(dict(latent_triton=c.get("latent_decode_triton"), latent_cuda=c.get(
        "latent_decode_cuda"), absorbed=c.get("latent_absorbed"),
        graphs_off=eng.runner.graphs.why_not() if eng.runner.graphs is not None else None))
    assert c.get("latent_decode_triton", 0) + c.get("latent_decode_cuda", 0) >= 2 * 10
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            out = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=12,
                               do_sample=False, pad_token_id=0)
            assert o.token_ids == out[0, len(p):].tolist()
    kvcompile.release(model)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("policy", [lambda: kvcompile.SinkWindow(4, 60),
                                    lambda: kvcompile.SnapKV(budget=64, window=8, hold=True),
                                    lambda: kvcompile.H2O(budget=64, recent=8, sinks=4)],
                         ids=["SinkWindow", "SnapKV hold", "H2O"])
def test_latent_eviction_kernels_equal_the_reference(fmt, policy):
    """Eviction on latent pages (DeepSeek-V3 widths, fp32 weights): the compacted rows decode
    through the latent kernels over their stored slots (runtime/dispatch.py
    `_latent_evicting`) in generate's CUDA graphs (stepped aside for, evicting on the device
    after each replay; H2O's mass from the latent kernel's attn_mass output), against the
    same run with kernels="reference" and no graphs (the plain-PyTorch paged reference over
    the same slots, the host path's evictions and mass): tokens equal, per-step logits
    within TOL, tokens evicted, every decode step a replay."""
    runs = {}
    for kernels in ("auto", "reference"):
        torch._dynamo.reset()
        model = _deepseek(torch.float32)
        kvcompile.compile(model, KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16,
                                          eviction=policy(), kernels=kernels))
        try:
            ids, am = inputs(B=3, L=100, pad=False, seed=23)
            with torch.no_grad():   # the runtime exists after a first call
                model.generate(ids[:1, :8], max_new_tokens=1, do_sample=False, pad_token_id=0)
            state_of(model).eviction.sink_positions = "original"
            c0 = dict(state_of(model).counters)
            r0 = model.forward.replays
            # the kernels' run replays generate's CUDA graphs (decode steps stepped aside for)
            toks, logits = run(model, ids, am, dict(do_sample=False), kernels == "auto",
                               seed=0)
            c = state_of(model).counters
            c["replays"] = model.forward.replays - r0
            runs[kernels] = (toks, logits, {k: c[k] - c0.get(k, 0) for k in c
                                            if c[k] != c0.get(k, 0)})
        finally:
            kvcompile.release(model)
    (tk, lk, ck), (tr, lr, cr) = runs["auto"], runs["reference"]
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(lk, lr))
    print(dict(fmt=fmt, max_rel=rel, kernel_counters=ck))
    assert ck.get("evicted_tokens", 0) > 0 and not ck.get("latent_eviction_host_rows")
    assert cr.get("evicted_tokens") == ck["evicted_tokens"]
    assert ck["replays"] == 15 and ck.get("eviction_aside_steps") == 15, ck
    assert ck.get("latent_decode_triton", 0) + ck.get("latent_decode_cuda", 0) > 0, ck
    assert rel <= TOL
    assert torch.equal(tk, tr)


@pytest.mark.parametrize("fmt,policy", [
    ("bf16", None), ("fp8_e4m3", None),
    ("fp8_e4m3", lambda: kvcompile.SnapKV(budget=48, window=8, hold=True)),
    ("bf16", lambda: kvcompile.H2O(budget=48, recent=8, sinks=4)),
], ids=["bf16", "fp8", "fp8 SnapKV hold", "bf16 H2O"])
def test_engine_latent_graphs(fmt, policy):
    """The engine's decode graphs over MLA layers (refused until this passed on the H200,
    2026-12-05): packed decode steps on the latent kernel, captured and replayed, with
    and without eviction (evicting on the device between replays; H2O's mass from the latent
    kernel's attn_mass output), against the same engine with graphs off: tokens equal, steps
    replayed. Mixed prompt lengths, more requests than one batch, fp32 weights."""
    import random

    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(60, 160))]
               for _ in range(6)]
    got = {}
    for graphs in (True, False):
        torch._dynamo.reset()
        model = _deepseek(torch.float32)
        cfg = KVConfig(kv_dtype=fmt, max_kv_bytes=256 << 20, page_size=16,
                       cuda_graphs=graphs, eviction=policy() if policy else None,
                       eviction_interval=4)
        eng = kvcompile.Engine(model, config=cfg, max_num_batched_tokens=512, max_num_seqs=4)
        try:
            outs = eng.generate(prompts, kvcompile.SamplingParams(temperature=0, max_tokens=16,
                                                                  ignore_eos=True))
            g = eng.runner.graphs
            c = state_of(model).counters
            got[graphs] = ([o.token_ids for o in outs], g.replays if g is not None else 0,
                           None if g is None else g.why_not(), dict(c))
        finally:
            eng.close()
            kvcompile.release(model)
    (tg, replays, why, c), (te, _, _, ce) = got[True], got[False]
    print(dict(fmt=fmt, replays=replays, why_not=why,
               evicted=c.get("evicted_tokens", 0) + c.get("eviction_moved_slots", 0),
               latent=c.get("latent_decode_triton", 0) + c.get("latent_decode_cuda", 0)))
    assert why is None and replays >= 16, (why, replays)
    if policy is not None:
        assert c.get("eviction_aside_steps", 0) > 0 and c.get("eviction_device_runs", 0) > 0, c
        assert ce.get("evicted_tokens", 0) > 0, ce   # (graphs off: the host path evicts)
    assert tg == te
