"""The rotation pass: randomized Hadamard of q/k after RoPE, V folded into v_proj / o_proj when
the graph proves only views lie between them, explicit otherwise; outputs unchanged in fp32;
never fires where the pattern does not allow it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvcompile
import kvcompile.runtime.attention_op  # noqa: F401  (registers torch.ops.kvcompile.attention)
from kvcompile.cache.formats import KVFormat
from kvcompile.config import SinkWindow
from kvcompile.passes.rotate import _FOLD_MARK, hadamard, hadamard_block, rotation_matrix
from kvcompile.testing import rel_err, sqnr_db
from tests.passes.caught import has, kv_warnings
from tests.passes.zoo import make_hf

ROT_TOL = 1e-5  # issue 9: in fp32, attention with rotation equals attention without, to 1e-5


def _cfg(**kw):
    return kvcompile.KVConfig(**{"inner": "aot_eager", "kernels": "reference",
                                 "max_kv_bytes": 1 << 24, **kw})


def _rotations(model) -> set[str]:
    return {s.rotate for s in kvcompile.report(model).sites}


# --- matrices ----------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [8, 16, 64, 128, 96, 80, 40])
def test_rotation_matrix_orthogonal(d):
    r = rotation_matrix(d, seed=3).double()
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6)
    assert torch.equal(rotation_matrix(d, 3), rotation_matrix(d, 3))
    assert not torch.equal(rotation_matrix(d, 3), rotation_matrix(d, 4))
    b = hadamard_block(d)
    assert b == {96: 32, 80: 16, 40: 8}.get(d, d)
    nz = r[:, :b].abs()
    assert torch.allclose(nz[:b], torch.full((b, b), 1 / math.sqrt(b), dtype=torch.float64))
    assert (r[b:, :b] == 0).all()                                       # block-diagonal
    h = hadamard(16)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))


def test_rotation_spreads_key_outliers():
    # Keys with outlier channels: after the rotation, formats whose scale covers the whole
    # head_dim (per-token int4) lose far less; NVFP4's 16-value micro-blocks already isolate
    # outliers, so its SQNR barely moves.
    g = torch.Generator().manual_seed(0)
    k = torch.randn(256, 2, 64, generator=g)
    k[..., 5] = 15 + k[..., 5]
    k[..., 9] *= 20
    r = rotation_matrix(64, 1)
    err = {}
    for name, gran in (("fp4_e2m1", "page"), ("int4", "token"), ("fp8_e4m3", "page")):
        for rot in (False, True):
            x = k @ r if rot else k
            t = KVFormat(name, gran).allocate(16, 2, 16, 64)
            t.write(torch.arange(256), x)
            y = t.read(torch.arange(16)).permute(0, 2, 1, 3).reshape(256, 2, 64)
            err[name, rot] = sqnr_db(k, y @ r.T if rot else y)
    assert err["int4", True] > err["int4", False] + 6, err
    assert abs(err["fp4_e2m1", True] - err["fp4_e2m1", False]) < 2.5, err
    assert abs(err["fp8_e4m3", True] - err["fp8_e4m3", False]) < 1.5, err


# --- the op: rotated attention equals plain attention ---------------------------------------

@pytest.mark.parametrize("hq, hkv, window, softcap", [(4, 4, 0, 0.0), (8, 2, 5, 0.0),
                                                      (6, 3, 0, 30.0)])
def test_rotated_attention_equals_plain(hq, hkv, window, softcap):
    g = torch.Generator().manual_seed(1)
    B, S, D = 2, 13, 64
    q = torch.randn(B, hq, S, D, generator=g, dtype=torch.float32)
    k = torch.randn(B, hkv, S, D, generator=g) * 3
    v = torch.randn(B, hkv, S, D, generator=g)
    mask = torch.rand(B, 1, S, S, generator=g) > 0.2
    r = rotation_matrix(D, 7)
    op = torch.ops.kvcompile.attention
    ref = op(q, k, v, mask, None, "x", 0.125, True, window, softcap, "")
    got = op(q @ r, k @ r, v @ r, mask, None, "x", 0.125, True, window, softcap, "") @ r.T
    assert rel_err(got, ref) <= ROT_TOL


# --- whole models ------------------------------------------------------------------------------

def _prefill_and_decode(model, ids, steps=3):
    outs = []
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True)
        outs.append(o.logits)
        past = o.past_key_values
        nxt = o.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            o = model(input_ids=nxt, past_key_values=past, use_cache=True)
            outs.append(o.logits)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("family, v_mode", [("llama", "folded"), ("qwen2", "folded"),
                                            ("gpt2", "explicitly")])
def test_hf_logits_unchanged_fp32(family, v_mode):
    base = make_hf(family)
    with torch.no_grad():  # non-zero biases, so that folding the v_proj bias is checked too
        for name, p in base.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(2))
    # plain PyTorch (the uncompiled model; no compile of an unrotated copy): fp32 pages give
    # its logits to about 1e-7 (measured: llama / qwen2 / gpt2 rotated 2.8e-7 / 2.8e-7 /
    # 1.2e-7 from it)
    ref = _prefill_and_decode(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    got = _prefill_and_decode(kvcompile.compile(model, _cfg(kv_dtype="fp32",
                                                            rotate="hadamard")), ids)
    assert rel_err(got, ref) <= ROT_TOL
    rot = _rotations(model)
    desc = rot.pop()
    assert not rot and desc.startswith("hadamard q,k (D=16); V ") and v_mode in desc
    changed = {n for (n, p), q in zip(model.named_parameters(), base.parameters())
               if not torch.equal(p, q)}
    if v_mode == "folded":
        assert changed and all(("v_proj" in n or "o_proj" in n) for n in changed)
        # folding keeps the function: the plain (uncompiled) module still computes the same
        with torch.no_grad():
            plain = copy.deepcopy(model)
            del plain.forward  # drop the compiled forward installed on the instance
            assert rel_err(plain(input_ids=ids).logits, base(input_ids=ids).logits) < 1e-5
    else:
        assert not changed
    layers = kvcompile.report(model).layers
    assert all(m["rotate"].startswith("hadamard") for m in layers)


def test_second_compile_does_not_fold_again():
    base = make_hf("llama")
    model = copy.deepcopy(base)
    kvcompile.compile(model, _cfg(kv_dtype="fp32", rotate="hadamard"))
    ids = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids)
    folded = {n: p.clone() for n, p in model.named_parameters()}
    marks = [getattr(p, _FOLD_MARK, None) for p in model.parameters()]
    assert sum(m is not None for m in marks) == 4                     # 2 layers x (v, o)
    torch._dynamo.reset()
    kvcompile.compile(model, _cfg(kv_dtype="fp8_e4m3", rotate="hadamard"))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        ref = base(input_ids=ids).logits
    assert all(torch.equal(p, folded[n]) for n, p in model.named_parameters())
    assert kl_ok(got, ref)


def kl_ok(got, ref) -> bool:
    return bool((got.softmax(-1) - ref.softmax(-1)).abs().max() < 0.05)


def test_torch_compile_backend_option():
    base = make_hf("llama")
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    model = copy.deepcopy(base)
    fn = torch.compile(model, backend="kvcompile",
                       options={"kv_dtype": "fp32", "rotate": "hadamard", "inner": "aot_eager",
                                "max_kv_bytes": 1 << 24})
    with torch.no_grad():
        got = fn(input_ids=ids, use_cache=False).logits
    assert rel_err(got, ref) <= ROT_TOL
    assert any(getattr(p, _FOLD_MARK, None) for p in model.parameters())


# --- where it must not fire --------------------------------------------------------------------

def _rot_nodes(model) -> int:
    st = kvcompile.api.state_of(model)
    return len(getattr(st, "rotations", {}))


def test_not_fired_without_option_or_with_sink_window():
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(5))
    for kw, reason in ((dict(), None),
                       (dict(rotate="hadamard", eviction=SinkWindow(sinks=4, window=64)),
                        "SinkWindow")):
        torch._dynamo.reset()
        base = make_hf("llama")
        model = copy.deepcopy(base)
        kvcompile.compile(model, _cfg(kv_dtype="fp8_e4m3", **kw))
        with kv_warnings() as warned, torch.no_grad():
            model(input_ids=ids, use_cache=True)
        # a rotation asked for and not applied says so, once per site
        assert len(warned) == (0 if reason is None else 2), warned
        assert all("did not rotate attention site model.layers" in w for w in warned)
        rot = _rotations(model)
        assert _rot_nodes(model) == 0
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))
        if reason is None:
            assert rot == {"none"}
        else:
            assert len(rot) == 1 and rot.pop().startswith(f"not rotated: {reason}")


def test_not_fired_on_small_head_dim_or_disabled_layer():
    base = make_hf("qwen3")                       # head_dim 16: rotatable
    model = copy.deepcopy(base)
    kvcompile.configure(model.model.layers[1].self_attn, rotate=None)
    kvcompile.compile(model, _cfg(kv_dtype="fp8_e4m3", rotate="hadamard"))
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    by_name = {s.name: s.rotate for s in kvcompile.report(model).sites}
    assert by_name["model.layers.0.self_attn"].startswith("hadamard")
    assert by_name["model.layers.1.self_attn"] == "none"
    w0 = model.model.layers[1].self_attn.v_proj.weight
    assert torch.equal(w0, base.model.layers[1].self_attn.v_proj.weight)
    torch._dynamo.reset()
    tiny = TinyAttention(dim=36, heads=3)          # head_dim 12: no Hadamard block >= 8
    compiled = kvcompile.compile(tiny, _cfg(kv_dtype="fp32", rotate="hadamard"))
    x = torch.randn(1, 5, 36)
    with kv_warnings() as warned, torch.no_grad():
        assert rel_err(compiled(x), tiny(x)) <= ROT_TOL
    assert has(warned, "did not rotate attention site <root> of TinyAttention .*head_dim 12")
    rot = _rotations(tiny)
    assert len(rot) == 1 and "no power-of-two Hadamard block" in rot.pop()


class TinyAttention(nn.Module):
    """One attention layer without a cache; `mode` puts something between its projections."""

    def __init__(self, dim=64, heads=4, mode="plain"):
        super().__init__()
        self.h, self.d, self.mode = heads, dim // heads, mode
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        torch.manual_seed(0)
        for m in (self.q, self.k, self.v, self.o):
            nn.init.normal_(m.weight, std=0.3)
            nn.init.normal_(m.bias, std=0.3)

    def forward(self, x):
        B, S, C = x.shape
        split = lambda t: t.view(B, S, self.h, self.d).transpose(1, 2)  # noqa: E731
        vv = self.v(x)
        q, k, v = split(self.q(x)), split(self.k(x)), split(vv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.mode == "gate":           # a nonlinearity between attention and o_proj
            y = torch.tanh(y)
        y = y.transpose(1, 2).reshape(B, S, C)
        out = self.o(y)
        if self.mode == "v_reused":       # v_proj's output read elsewhere
            out = out + vv.mean(-1, keepdim=True)
        return out


@pytest.mark.parametrize("mode, expect", [("plain", "folded"), ("gate", "explicitly"),
                                          ("v_reused", "explicitly")])
def test_fold_only_when_proven(mode, expect):
    base = TinyAttention(mode=mode)
    model = copy.deepcopy(base)
    compiled = kvcompile.compile(model, _cfg(kv_dtype="fp32", rotate="hadamard"))
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, ref = compiled(x), base(x)
    assert rel_err(got, ref) <= ROT_TOL
    rot = _rotations(model)
    assert len(rot) == 1 and expect in rot.pop()
    folded = not torch.equal(model.v.weight, base.v.weight)
    assert folded == (expect == "folded")
    assert torch.equal(model.q.weight, base.q.weight) and torch.equal(model.k.weight,
                                                                       base.k.weight)


def test_channel_scaled_keys_keep_their_basis():
    # With per-channel key scales only V is rotated: the stored keys are byte-identical to an
    # unrotated compile, the stored values are not; SinkWindow is then allowed.
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(7))
    base = make_hf("llama")
    pools = {}
    for rot in (None, "hadamard"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        kvcompile.compile(model, _cfg(kv_dtype="int4", scale_granularity="channel", rotate=rot,
                                      eviction=SinkWindow(sinks=2, window=64)))
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        pools[rot] = (kvcompile.api.state_of(model).pool, out)
        if rot:
            desc = _rotations(model)
            assert len(desc) == 1 and desc.pop().startswith("hadamard V only")
    (p0, _), (p1, _) = pools[None], pools["hadamard"]
    assert p0.has(0) and p1.has(0) and p0.pages_of(0) == p1.pages_of(0)
    k0, v0 = p0.gather(0, 0)
    k1, v1 = p1.gather(0, 0)
    assert torch.equal(k0, k1) and not torch.equal(v0, v1)
