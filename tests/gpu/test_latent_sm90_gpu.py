"""The CUDA latent decode kernel (kernels/cuda/latent_decode.cuh via kernels/latent_sm90.py,
opt-in) on an sm_90 GPU against the paged reference over the same latent pages: DeepSeek-V3's
widths (r 512, rope 64) at 16 / 20 heads (TP 8's shard; 20: a second, partial head block), bf16
and fp8 pages (an fp8 latent beside a bf16 rotary key too), a ragged batch (1, 63, 4097, 700
tokens), the kernel's own splits and others (empty splits included), its variants, 8-warp CTAs
and two CTAs an SM (stages 4). The CPU twin is tests/kernels/test_latent_sm90.py (emulation).

    pytest -s -q -m gpu tests/gpu/test_latent_sm90_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvcompile.testing import assert_rel_close
from tests.gpu.test_latent_decode_gpu import _case as _latent_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

R, DR, P = 512, 64, 16


def _case(c_fmt, r_fmt, lens, heads):
    return _latent_case(c_fmt, r_fmt, lens, heads, seed=len(lens) + heads)


@pytest.mark.parametrize("variant,stages,warps", [
    ("base", None, 4), ("base", None, 8), ("aluk", None, 4), ("alu", None, 4), ("aluv", 4, 4),
    ("alu", 4, 4), ("alu", 4, 8), ("base", 4, 4), ("aluv", None, 4), ("wide", None, 4),
    ("wide", None, 8), ("ksplit", None, 4), ("ksplit", 4, 4), ("aluv+ksplit", 4, 4),
    ("ksplit", 4, 8), ("ksplit", None, 8), ("ostage", None, 4), ("ostage+ksplit", 4, 4),
    ("ostage+ksplit", 4, 8)])
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("heads", [16, 20])
@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "bf16"),
                                         ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_cuda_latent_kernel(c_fmt, r_fmt, heads, splits, variant, stages, warps):
    from kvcompile.kernels import latent_sm90

    if c_fmt == "bf16" and (latent_sm90.variant_bits(variant, 0) & latent_sm90.FP8_BITS
                            or stages is not None):
        pytest.skip("the variants and 4-stage rings are for fp8 latent pages")
    if splits == 1 and (variant, stages) not in (("base", None), ("alu", 4), ("wide", None),
                                                 ("ksplit", 4), ("ostage", None)):
        pytest.skip("one split (the direct write) is checked on base, alu at 4 stages, wide")
    pool, plan, q, lens_t, ref = _case(c_fmt, r_fmt, [1, 63, 4097, 700], heads)
    out = latent_sm90.latent_decode_sm90(q, pool.k[0], pool.v[0], plan.block_tables, lens_t,
                                         0.07, num_splits=splits, stages=stages,
                                         variant=variant, warps=warps, poison=True)
    torch.cuda.synchronize()
    assert_rel_close(out, ref, torch.bfloat16,
                     what=f"{c_fmt}/{r_fmt} h{heads} x {splits} {variant} s{stages} w{warps}")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_run_time_routes_decode_steps_to_the_cuda_kernel(kv_dtype, monkeypatch):
    """A DeepSeek-V3 stack with DeepSeek's widths (r 512, rope 64; 16 heads, 2 layers, random
    bf16 weights) compiled on CUDA: with latent_sm90.ROUTE "cuda" every decode step of every
    layer runs the CUDA kernel (counter latent_decode_cuda), with "triton" the Triton kernel,
    and the teacher-forced logits of the two routes agree within bf16's tolerance."""
    import transformers

    import kvcompile
    from kvcompile.api import state_of
    from kvcompile.kernels import latent_sm90
    from tests.passes.test_hf_families import teacher_forced_logits

    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=R, q_lora_rank=64,
        qk_rope_head_dim=DR, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
        n_group=1, topk_group=1, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(3, 256, (3, 300), generator=torch.Generator().manual_seed(1)).cuda()
    logits, counters = {}, {}
    for route in ("cuda", "triton"):
        model = copy.deepcopy(base)
        monkeypatch.setattr(latent_sm90, "ROUTE", route)
        kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=kv_dtype, inner="eager",
                                                    max_kv_bytes=1 << 28))
        with torch.no_grad():
            logits[route] = teacher_forced_logits(model, ids, prefill=290).float()
        counters[route] = kvcompile.stats(model)["counters"]
        counters[route]["fallbacks"] = sorted(getattr(state_of(model).kernels, "_warned", ()))
        del model
    assert counters["cuda"].get("latent_decode_cuda") == 2 * 10, counters["cuda"]
    assert "latent_decode_cuda" not in counters["triton"], counters["triton"]
    assert counters["triton"].get("latent_decode_triton") == 2 * 10, counters["triton"]
    assert_rel_close(logits["cuda"][:, 290:], logits["triton"][:, 290:], torch.bfloat16,
                     factor=4, what=f"{kv_dtype} logits, CUDA vs Triton route")


@pytest.mark.parametrize("variant,stages,warps", [("base", None, 4), ("base", 4, 4),
                                                  ("alu", 4, 8), ("ksplit", 4, 4),
                                                  ("ksplit", None, 8)])
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("heads", [16, 20])
@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "bf16")])
def test_cuda_latent_key_mask(c_fmt, r_fmt, heads, splits, variant, stages, warps):
    """key_mask (left padding over whole tiles, holes, a row hidden whole, a mask narrower than
    the longest row) and H2O's attn_mass on the CUDA kernel against the Triton kernel with the
    same mask and mass (whose CPU tests check them against plain torch); without the mask the
    output differs."""
    from kvcompile.kernels import latent_sm90
    from kvcompile.kernels.latent_decode import latent_decode_attention

    if c_fmt == "bf16" and (latent_sm90.variant_bits(variant, 0) & latent_sm90.FP8_BITS
                            or stages is not None):
        pytest.skip("the variants and 4-stage rings are for fp8 latent pages")
    lens = [1, 63, 4097, 700]
    pool, plan, q, lens_t, _ = _case(c_fmt, r_fmt, lens, heads)
    g = torch.Generator(device="cuda").manual_seed(heads)
    km = torch.rand(len(lens), 3000, device="cuda", generator=g) > 0.2   # keys 3000.. seen
    km[0] = False            # row 0: its one key hidden (zeros)
    km[2, :700] = False      # left padding: 10 whole tiles and more
    args = (q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07)
    mass, ref_mass = (torch.ones(len(lens), 1, 3500, device="cuda") for _ in range(2))
    out = latent_sm90.latent_decode_sm90(*args, num_splits=splits, stages=stages,
                                         variant=variant, warps=warps, poison=True, key_mask=km,
                                         attn_mass=mass)
    ref = latent_decode_attention(*args, key_mask=km, attn_mass=ref_mass)
    plain = latent_sm90.latent_decode_sm90(*args, num_splits=splits, stages=stages,
                                           variant=variant, warps=warps)
    torch.cuda.synchronize()
    what = f"{c_fmt}/{r_fmt} h{heads} x {splits} {variant} s{stages} w{warps} key mask"
    assert torch.isfinite(out).all() and (out[0] == 0).all(), what
    assert_rel_close(out, ref, torch.bfloat16, what=what)
    assert_rel_close(mass, ref_mass, torch.bfloat16, what=what + ", H2O mass")
    assert (plain[2] - ref[2]).abs().max() > 1e-2, what


def test_left_padded_generate_takes_the_cuda_kernel(monkeypatch):
    """A left-padded batch through generate (its decode steps carry a key mask, so before the
    CUDA kernel took one they all went to the Triton kernel): with latent_sm90.ROUTE "cuda"
    the decode steps run the CUDA kernel and never the Triton one, and the logits agree with
    the Triton route's within bf16's tolerance."""
    import transformers

    import kvcompile
    from kvcompile.kernels import latent_sm90

    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=R, q_lora_rank=64,
        qk_rope_head_dim=DR, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(3, 256, (3, 200), generator=torch.Generator().manual_seed(2)).cuda()
    am = torch.ones_like(ids)
    am[0, :150] = 0   # left padding: the first two tiles and more
    am[2, :7] = 0
    ids = ids.masked_fill(am == 0, 0)
    logits, counters = {}, {}
    for route in ("cuda", "triton"):
        model = copy.deepcopy(base)
        monkeypatch.setattr(latent_sm90, "ROUTE", route)
        kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp8_e4m3", inner="eager",
                                                    max_kv_bytes=1 << 28))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=am, max_new_tokens=9, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        logits[route] = (torch.stack(out.logits, 1).float(), out.sequences)
        counters[route] = kvcompile.stats(model)["counters"]
        del model
    # (decode steps replayed from generate's CUDA graphs count once, at their capture)
    assert counters["cuda"].get("latent_decode_cuda", 0) >= 2, counters["cuda"]
    assert "latent_decode_triton" not in counters["cuda"], counters["cuda"]
    assert counters["triton"].get("latent_decode_triton", 0) >= 2, counters["triton"]
    (lc, sc), (lt, st) = logits["cuda"], logits["triton"]
    # steps up to the first token the routes choose apart (a near-tie): same inputs there
    same = [bool(torch.equal(sc[:, : ids.shape[1] + j], st[:, : ids.shape[1] + j]))
            for j in range(lc.shape[1])]
    n = same.index(False) if False in same else lc.shape[1]
    assert n >= 1
    assert_rel_close(lc[:, :n], lt[:, :n], torch.bfloat16, factor=4,
                     what="left-padded generate, CUDA vs Triton route")


@pytest.mark.parametrize("variant,stages,warps", [("base", None, 4), ("base", 4, 4),
                                                  ("base", 4, 8), ("aluv", 4, 4),
                                                  ("ksplit", None, 4), ("ksplit", 4, 4),
                                                  ("ksplit", 4, 8), ("ostage+ksplit", 4, 4),
                                                  ("ostage+ksplit", None, 4)])
@pytest.mark.parametrize("splits", [None, 7])
@pytest.mark.parametrize("heads", [16, 20])
@pytest.mark.parametrize("c_fmt,r_fmt", [("bf16", "bf16"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("fp8_e5m2", "bf16")])
def test_cuda_latent_fused_merge(c_fmt, r_fmt, heads, splits, variant, stages, warps):
    """fused_merge (mla22k): the last CTA of each head block merges the splits; three launches
    in a row (the arrival counters must be back at 0 after each), outputs poisoned; the third
    with the per-CTA timers on (LAT_VAR_PROF): each CTA's timers in order, its tiles summing to
    the sequences' tiles. Also base:w8 at 4 stages (two 8-warp CTAs an SM) unfused."""
    from kvcompile.kernels import latent_sm90

    if c_fmt == "bf16" and (latent_sm90.variant_bits(variant, 0) & latent_sm90.FP8_BITS
                            or stages is not None):
        pytest.skip("the variants and 4-stage rings are for fp8 latent pages")
    lens = [1, 63, 4097, 700]
    pool, plan, q, lens_t, ref = _case(c_fmt, r_fmt, lens, heads)
    args = (q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07)
    kw = dict(num_splits=splits, stages=stages, variant=variant, warps=warps, poison=True)
    plain = latent_sm90.latent_decode_sm90(*args, **kw)
    assert_rel_close(plain, ref, torch.bfloat16, what=f"unfused {variant} s{stages} w{warps}")
    from kvcompile.kernels.latent_decode import sm_count

    lp = latent_sm90.plan_latent_sm90(*args, num_splits=splits, stages=stages,
                                      sms=sm_count(q.device), variant=variant, warps=warps)
    ctas = lp.grid[0] * lp.grid[1]
    for i in range(3):
        prof = None
        if i == 2:
            n = 2 * len(lens) * 64 * latent_sm90.PROF_SLOTS   # enough for any split count here
            prof = torch.zeros(n, dtype=torch.int64, device="cuda")
        out = latent_sm90.latent_decode_sm90(*args, **kw, fused_merge=True, profile=prof)
        torch.cuda.synchronize()
        assert_rel_close(out, ref, torch.bfloat16,
                         what=f"fused {c_fmt}/{r_fmt} h{heads} x {splits} {variant} launch {i}")
    cnt = latent_sm90.arrivals(q.device, 1)
    assert int(cnt.abs().sum()) == 0, "arrival counters not reset"
    p = prof[:ctas * latent_sm90.PROF_SLOTS].view(ctas, -1).cpu()
    t = p[:, [0, 1, 3, 4, 5]]
    assert bool((t[:, 1:] >= t[:, :-1]).all()), "timers out of order"
    hb = (heads + 15) // 16
    assert int(p[:, 7].sum()) == hb * sum(-(-n // 64) for n in lens)


@pytest.mark.parametrize("c_fmt", ["bf16", "fp8_e4m3"])
def test_cuda_latent_fused_merge_in_graphs(c_fmt, monkeypatch):
    """The fused merge under CUDA graphs, as the run time's decode graphs replay it: captured
    after an eager call (the arrival counters exist), replayed three times (each replay leaves
    them at 0 for the next), the output matches the reference each time. Without counters at
    capture time the fused merge is refused with one warning and the capture still merges (a
    second launch)."""
    from kvcompile.kernels import latent_sm90

    pool, plan, q, lens_t, ref = _case(c_fmt, c_fmt, [63, 4097, 700], 16)
    args = (q, pool.k[0], pool.v[0], plan.block_tables, lens_t, 0.07)
    kw = dict(num_splits=7, fused_merge=True, variant="ksplit",
              stages=4 if c_fmt != "bf16" else None)
    for counters in (True, False):
        if not counters:
            monkeypatch.setattr(latent_sm90, "_arrivals", {})
            monkeypatch.setattr(latent_sm90, "_warned", set())
            # the unfused launch's cubin and merge kernel loaded before the capture
            latent_sm90.latent_decode_sm90(*args, **{**kw, "fused_merge": False})
        else:
            latent_sm90.latent_decode_sm90(*args, **kw)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            if counters:
                with torch.cuda.graph(g):
                    out = latent_sm90.latent_decode_sm90(*args, **kw)
            else:
                with pytest.warns(UserWarning, match="fused_merge refused"):
                    with torch.cuda.graph(g):
                        out = latent_sm90.latent_decode_sm90(*args, **kw)
        torch.cuda.current_stream().wait_stream(side)
        for i in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert_rel_close(out, ref, torch.bfloat16, what=f"{c_fmt} replay {i} ({counters})")
        if counters:
            assert int(latent_sm90.arrivals(q.device, 1).abs().sum()) == 0
