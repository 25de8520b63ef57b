"""The plain-PyTorch attention used at run time (kernels/dense.py): the SDPA path against the
exact fp32 path, NaN / Inf against eager attention, and the paged path over every format."""


import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.kernels.dense import (
    attend_fp32,
    attend_sdpa,
    dense_attention,
    exact_attention,
    paged_reference_attention,
    sdpa_attention,
    sdpa_rows,
)
from kvcompile.kernels.reference import gather_pages
from kvcompile.runtime.context import StepPlan
from kvcompile.testing import assert_rel_close

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
def test_sdpa_path_matches_fp32_path(hq, hkv, mask):
    g = torch.Generator().manual_seed(hq * 10 + len(mask))
    S, L, D = 7, 23, 32
    q = torch.randn(hq, S, D, generator=g)
    k = torch.randn(hkv, L, D, generator=g)
    v = torch.randn(hkv, L, D, generator=g)
    allowed = additive = None
    causal = False
    if mask == "causal":
        allowed = torch.arange(L)[None] <= torch.arange(L - S, L)[:, None]
    elif mask == "bool":
        allowed = torch.rand(S, L, generator=g) > 0.3
        allowed[2] = False  # a query that sees no key gives 0 in both paths
    elif mask == "additive":
        additive = torch.randn(S, L, generator=g)
    ref = attend_fp32(q, k, v, allowed, additive, 0.17, 0.0)
    got = attend_sdpa(q, k, v, allowed, additive, 0.17, causal)
    assert_rel_close(got, ref, torch.float32, factor=10, what=f"sdpa path, {mask}")
    if mask == "bool":
        assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2]))


def test_sdpa_causal_fast_path():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 16, 32, generator=g) for _ in range(3))
    allowed = torch.ones(16, 16).tril().bool()
    ref = attend_fp32(q, k, v, allowed, None, 0.2, 0.0)
    assert_rel_close(attend_sdpa(q, k, v, allowed, None, 0.2, causal=True), ref, torch.float32,
                     factor=10)
    # causal over the last S of L keys (a chunk after cached tokens): not SDPA's top-left rule
    k2, v2 = torch.randn(4, 20, 32, generator=g), torch.randn(4, 20, 32, generator=g)
    allowed2 = torch.arange(20)[None] <= torch.arange(4, 20)[:, None]
    assert_rel_close(attend_sdpa(q, k2, v2, None, None, 0.2, causal=True),
                     attend_fp32(q, k2, v2, allowed2, None, 0.2, 0.0), torch.float32, factor=10)


@pytest.mark.parametrize("hq,hkv,dv", [(4, 4, 32), (4, 4, 24), (8, 2, 32)])
def test_chunk_causal_lower_right(monkeypatch, hq, hkv, dv):
    """Causal S < L with no mask (a prompt chunk after its cached prefix): on the devices of
    LOWER_RIGHT_DEVICES, one K/V head a query head, sdpa_attention runs SDPA under torch's
    lower-right causal bias and builds no [S, L] mask; elsewhere (GQA here) the explicit mask.
    Both equal the fp32 reference over the causal mask of the last S positions; `_masks`
    hands such a chunk over as causal (no mask) on those devices only."""
    from kvcompile.kernels import dense

    monkeypatch.setattr(dense, "LOWER_RIGHT_DEVICES", ("cpu",))
    built = []
    real_causal = dense._causal
    monkeypatch.setattr(dense, "_causal", lambda *a: built.append(a) or real_causal(*a))
    g = torch.Generator().manual_seed(hq + dv)
    S, L = 9, 30
    q = torch.randn(2, hq, S, 32, generator=g)
    k = torch.randn(2, hkv, L, 32, generator=g)
    v = torch.randn(2, hkv, L, dv, generator=g)
    assert dense._masks(None, S, L, True, 0, None, q.device) == (None, None, True)
    allowed = torch.arange(L)[None] <= torch.arange(L - S, L)[:, None]
    ref = torch.stack([attend_fp32(q[b], k[b], v[b], allowed, None, 0.2, 0.0) for b in range(2)])
    got = sdpa_attention(q, k, v, None, None, 0.2, True)
    assert_rel_close(got, ref, torch.float32, factor=10, what=f"lower right {hq}/{hkv}")
    assert bool(built) == (hq != hkv), built     # the explicit mask only where GQA needs it
    monkeypatch.setattr(dense, "LOWER_RIGHT_DEVICES", ())
    allowed2, _, causal2 = dense._masks(None, S, L, True, 0, None, q.device)
    assert not causal2 and torch.equal(allowed2[0, 0], allowed)   # off: the mask, as before
    built.clear()
    assert_rel_close(sdpa_attention(q, k, v, None, None, 0.2, True), ref, torch.float32,
                     factor=10, what="explicit mask")
    assert built


# --- NaN / Inf: eager attention over the keys each query sees ----------------------------------

def eager_rows(q, k, v, allowed, scale: float) -> torch.Tensor:
    """Eager attention (matmul, softmax in fp32, matmul; HF's eager_attention_forward), each query
    over the keys it may see. q [B, Hq, S, D], k/v [B, Hkv, L, D], allowed [B|1, Hq|1, S, L] ->
    [B, Hq, S, Dv] fp32; a query that sees no key gives 0."""
    B, Hq, S, _ = q.shape
    rep = Hq // k.shape[1]
    allowed = allowed.expand(B, Hq, S, k.shape[2])
    out = torch.zeros(B, Hq, S, v.shape[-1])
    for b in range(B):
        for h in range(Hq):
            for i in range(S):
                keys = allowed[b, h, i].nonzero()[:, 0]
                if keys.numel():
                    s = (q[b, h, i].float() @ k[b, h // rep, keys].float().T) * scale
                    out[b, h, i] = torch.softmax(s, -1) @ v[b, h // rep, keys].float()
    return out


def assert_matches_eager(got, ref, dtype, what: str) -> None:
    got = got.float()
    for name, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(f(got), f(ref)), (
            f"{what}: {name} at {int(f(got).sum())} places, eager has {int(f(ref).sum())}")
    fin = torch.isfinite(ref)
    assert_rel_close(got[fin], ref[fin], dtype, factor=10, what=what)


CASES = ["v_nan_seen", "v_inf_seen", "v_both_inf", "k_nan_seen", "k_inf_seen", "masked_nan",
         "later_nan", "row_empty", "finite"]


def _case(case: str, mask: str, g):
    B, Hq, Hkv, S, L, D = 2, 4, 2, 5, 12, 16
    q = torch.randn(B, Hq, S, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    allowed = (torch.arange(L)[None] <= torch.arange(L - S, L)[:, None])[None, None]
    allowed = allowed.expand(B, 1, S, L).clone()                     # causal, [B, 1, S, L]
    allowed[1, :, :, :3] = False                                      # row 1: left padding
    if case == "v_nan_seen":
        v[0, 1, 4, 3] = float("nan")
    elif case == "v_inf_seen":
        v[1, 0, 6, 2] = float("inf")
    elif case == "v_both_inf":
        v[0, 0, 2, 5], v[0, 0, 5, 5] = float("inf"), float("-inf")
    elif case == "k_nan_seen":
        k[1, 1, 5, 0] = float("nan")
    elif case == "k_inf_seen":
        k[0, 0, 3, 7] = float("inf")
    elif case == "masked_nan":  # under row 1's padding: inert
        k[1, 0, 1, 0] = v[1, 1, 0, 2] = float("nan")
    elif case == "later_nan":   # the last key: only the last query sees it
        v[0, 0, L - 1, 1] = float("nan")
    elif case == "row_empty":
        allowed[0, :, 2] = False
    if mask == "additive":
        return q, k, v, allowed, None, torch.where(allowed, 0.0, float("-inf"))
    return q, k, v, allowed, allowed, None


@pytest.mark.parametrize("mask", ["bool", "additive"])
@pytest.mark.parametrize("case", CASES)
def test_nonfinite_kv_as_eager(case, mask):
    g = torch.Generator().manual_seed(CASES.index(case))
    q, k, v, seen, allowed, additive = _case(case, mask, g)
    ref = eager_rows(q, k, v, seen, 0.25)
    assert_matches_eager(exact_attention(q, k, v, allowed, additive, 0.25, 0.0), ref,
                         torch.float32, f"exact, {case}")
    assert_matches_eager(sdpa_attention(q, k, v, allowed, additive, 0.25), ref,
                         torch.float32, f"sdpa, {case}")
    got = sdpa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), allowed, additive, 0.25)
    assert got.dtype == torch.bfloat16
    ref16 = eager_rows(q.bfloat16(), k.bfloat16(), v.bfloat16(), seen, 0.25)
    assert_matches_eager(got, ref16, torch.bfloat16, f"sdpa bf16, {case}")
    if case == "masked_nan":
        assert bool(torch.isfinite(ref).all())
    if case in ("v_nan_seen", "k_nan_seen", "later_nan"):
        assert bool(torch.isnan(ref).any()) and not bool(torch.isnan(ref).all())


ROW_CASES = ["finite", "v_nan_seen", "k_inf_seen", "masked_nan", "later_nan", "all_pad"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROW_CASES)
def test_sdpa_rows_is_left_padded_causal_attention(case, dtype):
    """sdpa_rows (a left-padded fresh prompt, one SDPA call per row) against eager attention
    under the padded causal mask, NaN / Inf included: a padding key is inert, a padding query
    (no key to see) gives 0, a row of padding only gives 0."""
    g = torch.Generator().manual_seed(40 + ROW_CASES.index(case))
    B, Hq, Hkv, S, D = 3, 4, 2, 9, 16
    q = torch.randn(B, Hq, S, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, 8, generator=g)          # (Dv != D: MLA's expanded values)
    starts = [0, 4, S if case == "all_pad" else 1]
    if case == "v_nan_seen":
        v[1, 1, 6, 3] = float("nan")
    elif case == "k_inf_seen":
        k[2, 0, 3, 5] = float("inf")
    elif case == "masked_nan":                         # under row 1's padding
        k[1, 0, 2, 0] = v[1, 1, 3, 2] = float("nan")
    elif case == "later_nan":                          # only the last query sees it
        v[0, 0, S - 1, 1] = float("nan")
    j = torch.arange(S)
    seen = torch.stack([(j[None] <= j[:, None]) & (j[None] >= s0) for s0 in starts])[:, None]
    ref = eager_rows(q.to(dtype), k.to(dtype), v.to(dtype), seen, 0.3)
    got = sdpa_rows(q.to(dtype), k.to(dtype), v.to(dtype), starts, 0.3)
    assert got.dtype == dtype and got.shape == (B, Hq, S, 8)
    assert got.transpose(1, 2).is_contiguous()   # the attention op's layout: no copy to it
    assert_matches_eager(got, ref, dtype, f"sdpa_rows, {case}")
    assert torch.equal(got[1, :, :4], torch.zeros_like(got[1, :, :4]))   # padding queries
    if case == "masked_nan":
        assert bool(torch.isfinite(got).all())


PACKED_CASES = ["finite", "v_nan_seen", "k_inf_seen", "later_nan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PACKED_CASES)
def test_sdpa_packed_is_causal_attention_per_prompt(case, dtype, monkeypatch):
    """sdpa_packed (the Engine's step of fresh prompts: prompts packed along the sequence, each
    attending causally to its own keys) against eager attention under the block-diagonal
    causal mask, NaN / Inf included (a prompt's NaN stays in that prompt); finite outputs take
    one finiteness check for all the prompts, not one a prompt, and one SDPA call for each run
    of adjacent prompts of one length."""
    from kvcompile.kernels import dense
    from kvcompile.kernels.dense import sdpa_packed

    g = torch.Generator().manual_seed(60 + PACKED_CASES.index(case))
    lens, Hq, Hkv, D = [5, 5, 1, 9, 4, 4, 4], 4, 2, 16
    T = sum(lens)
    q = torch.randn(1, Hq, T, D, generator=g)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, 8, generator=g)          # (Dv != D)
    if case == "v_nan_seen":
        v[0, 1, 12, 3] = float("nan")                  # prompt 3's second token
    elif case == "k_inf_seen":
        k[0, 0, 2, 5] = float("inf")                   # prompt 0's third token
    elif case == "later_nan":
        v[0, 0, T - 1, 1] = float("nan")               # only prompt 6's last query sees it
    pid = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    j = torch.arange(T)
    seen = ((j[None] <= j[:, None]) & (pid[None] == pid[:, None]))[None, None]
    checks, calls = [], []
    real, real_sdpa = dense._all_finite, dense._sdpa
    monkeypatch.setattr(dense, "_all_finite", lambda x: checks.append(1) or real(x))
    monkeypatch.setattr(dense, "_sdpa", lambda *a: calls.append(a[0].shape[0]) or real_sdpa(*a))
    got = sdpa_packed(q.to(dtype), k.to(dtype), v.to(dtype), lens, 0.3)
    ref = eager_rows(q.to(dtype), k.to(dtype), v.to(dtype), seen, 0.3)
    assert got.dtype == dtype and got.shape == (1, Hq, T, 8)
    assert got.transpose(1, 2).is_contiguous()   # the attention op's layout: no copy to it
    assert_matches_eager(got, ref, dtype, f"sdpa_packed, {case}")
    if case == "finite":
        assert len(checks) <= 2, f"{len(checks)} finiteness checks for {len(lens)} prompts"
        assert calls == [2, 1, 1, 3], calls   # a batched call a run of equal lengths
        # where no fused kernel would take the batch views: a call a prompt, the same output
        calls.clear()
        monkeypatch.setattr(dense, "_fused_takes", lambda *a: False)
        again = sdpa_packed(q.to(dtype), k.to(dtype), v.to(dtype), lens, 0.3)
        assert calls == [1] * len(lens), calls
        assert torch.equal(again, got)
    else:   # the NaN stays in its prompt
        bad = {"v_nan_seen": 3, "k_inf_seen": 0, "later_nan": 6}[case]
        assert bool(torch.isfinite(got[:, :, pid != bad]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_output_whose_sum_overflows(dtype, monkeypatch):
    """The finiteness check is one fp32 sum: a finite output of values near fp32's top
    overflows it, takes the exact path, and must come out the same (finite, as eager)."""
    from kvcompile.kernels import dense
    from kvcompile.kernels.dense import sdpa_packed

    g = torch.Generator().manual_seed(71)
    lens, Hq, Hkv, D = [6, 6, 3], 2, 1, 8
    T = sum(lens)
    q = torch.randn(1, Hq, T, D, generator=g)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = (1.0 + torch.rand(1, Hkv, T, 8, generator=g)) * 1e38   # each finite, their sum not
    exact = []
    real = dense.sdpa_attention
    monkeypatch.setattr(dense, "sdpa_attention", lambda *a, **kw: exact.append(1) or real(*a, **kw))
    pid = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    j = torch.arange(T)
    seen = ((j[None] <= j[:, None]) & (pid[None] == pid[:, None]))[None, None]
    got = sdpa_packed(q.to(dtype), k.to(dtype), v.to(dtype), lens, 0.3)
    ref = eager_rows(q.to(dtype), k.to(dtype), v.to(dtype), seen, 0.3)
    assert exact, "the overflowing sum did not take the exact path"
    assert bool(torch.isfinite(got).all())
    assert_matches_eager(got, ref, dtype, "sdpa_packed, sum overflow")


def test_nonfinite_softcap_and_unmasked():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), *(torch.randn(1, 2, 6, 8, generator=g)
                                                      for _ in range(2))
    v[0, 1, 2, 0] = float("nan")
    ref = eager_rows(q, k, v, torch.ones(1, 1, 3, 6, dtype=torch.bool), 0.3)
    assert_matches_eager(sdpa_attention(q, k, v, None, None, 0.3), ref, torch.float32, "no mask")
    # softcap: exact path only; with a large cap it is plain attention
    assert_matches_eager(sdpa_attention(q, k, v, None, None, 0.3, softcap=1e4), ref,
                         torch.float32, "softcap")
    # dense_attention (a graph run without a cache) with the model's mask
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    mask[..., 2] = False  # the NaN key masked: inert
    out = dense_attention(q, k, v, mask, 0.3, False, 0, 0.0)
    assert bool(torch.isfinite(out).all())
    assert_matches_eager(out, eager_rows(q, k, v, mask, 0.3), torch.float32, "dense masked")


# --- the paged path: every format ---------------------------------------------------------------

FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp32", "page"), ("fp8_e4m3", "page"),
           ("fp8_e4m3", "token"), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "channel"),
           ("fp8_e5m2", "page"), ("fp4_e2m1", "page"),
           ("fp4_e2m1", "token"), ("int4", "page"), ("int4", "token"), ("int3", "token"),
           ("int2", "page")]
PLAIN = ("bf16", "fp16", "fp32")


def _paged(fmt: KVFormat, k, v, P: int):
    # k/v [L, Hkv, D] -> pages of one sequence (shuffled, spare pages filled with NaN)
    L, H, D = k.shape
    n = (L + P - 1) // P
    kc, vc = fmt.allocate(n + 2, H, P, D), fmt.allocate(n + 2, H, P, D)
    for c in (kc, vc):
        if c.data.dtype.is_floating_point:
            c.data.fill_(float("nan"))
    pages = torch.randperm(n + 2, generator=torch.Generator().manual_seed(L))[:n]
    slots = (pages[:, None] * P + torch.arange(P)[None]).reshape(-1)[:L]
    for a, z in ((0, L - 3), (L - 3, L - 1), (L - 1, L)):  # appends, like a prefill + decode
        kc.write(slots[a:z], k[a:z])
        vc.write(slots[a:z], v[a:z])
    return kc, vc, pages.int()[None]


@pytest.mark.parametrize("where", ["v_seen", "k_seen", "v_masked", "none"])
@pytest.mark.parametrize("name,gran", FORMATS)
def test_paged_reference_nan_as_eager(name, gran, where):
    """NaN written into one token of the pages reaches exactly the queries that see it, as
    eager attention over what the format decodes (PagedTensor.read): masked tokens (left
    padding, kv_start) are inert. Decoders keep NaN in its own value (fp8, bf16), its micro
    block (fp4) or its scale group (int: the group decodes NaN, a page for page scales)."""
    fmt = KVFormat(name) if name in PLAIN else KVFormat(name, gran)
    g = torch.Generator().manual_seed(len(name) * 7 + len(where))
    L, H, Hq, D, P, S = 37, 2, 4, 32, 16, 4
    k, v = torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
    if where == "v_seen":
        v[20, 1, 5] = float("nan")
    elif where == "k_seen":
        k[34, 0, 2] = float("nan")  # a key the chunk's last queries see, the first does not
    elif where == "v_masked":
        v[1, 0, 3] = float("nan")   # under kv_start
    kc, vc, bt = _paged(fmt, k, v, P)
    kd, vd = gather_pages(kc, bt[0], L)[None], gather_pages(vc, bt[0], L)[None]  # decoded
    start = 4 if where == "v_masked" else 0
    for s in (1, S):  # a decode step, then a chunk of S queries (the last S positions)
        q = torch.randn(1, Hq, s, D, generator=g)
        plan = StepPlan([0], 1, s, [L - s], torch.zeros(s, dtype=torch.long), bt,
                        torch.tensor([L]), [L], [start])
        got = paged_reference_attention(kc, vc, q, plan, None, True, 0, 0.0, 0.2)
        seen = (torch.arange(L)[None] <= torch.arange(L - s, L)[:, None]) & (
            torch.arange(L)[None] >= start)
        ref = eager_rows(q, kd, vd, seen[None, None], 0.2)
        assert_matches_eager(got, ref, torch.float32, f"{name}/{gran} {where} S={s}")
        if where == "v_seen":
            assert bool(torch.isnan(got).any())
        local = not (fmt.is_int and gran == "page")  # int page scales: the page decodes NaN
        if where == "k_seen" and s == S and local:
            assert bool(torch.isfinite(got[:, :, 0]).all()) and bool(torch.isnan(got).any())
        if where in ("v_masked", "none") and local:
            assert bool(torch.isfinite(got).all())


def test_paged_reference_bf16_is_sdpa_on_the_stored_values():
    """bf16 pages, bf16 queries: the same SDPA call on the same values as eager, bit for bit."""
    g = torch.Generator().manual_seed(3)
    L, H, Hq, D, P = 45, 3, 9, 64, 16
    k = torch.randn(L, H, D, generator=g).bfloat16()
    v = torch.randn(L, H, D, generator=g).bfloat16()
    kc, vc, bt = _paged(KVFormat("bf16"), k, v, P)
    q = torch.randn(1, Hq, 1, D, generator=g).bfloat16()
    plan = StepPlan([0], 1, 1, [L - 1], torch.zeros(1, dtype=torch.long), bt,
                    torch.tensor([L]), [L], [0])
    got = paged_reference_attention(kc, vc, q, plan, None, False, 0, 0.0, 0.125)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=0.125, enable_gqa=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref)


@pytest.mark.parametrize("packed", [False, True])
def test_paged_reference_rows_of_different_lengths(packed):
    """Rows of a batch (or sequences of an engine's packed batch) with different lengths: each
    attends over its own tokens, as eager over its K/V alone."""
    g = torch.Generator().manual_seed(11)
    fmt, H, Hq, D, P = KVFormat("fp8_e4m3", "page"), 2, 4, 32, 16
    lens, s = [37, 20, 37], 3
    kvs = [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)) for n in lens]
    n_pages = [(n + P - 1) // P for n in lens]
    kc, vc = fmt.allocate(sum(n_pages) + 1, H, P, D), fmt.allocate(sum(n_pages) + 1, H, P, D)
    bt = torch.zeros(len(lens), max(n_pages), dtype=torch.int32)
    first = 1  # page 0 unused: block-table padding points at it
    for b, ((k, v), n) in enumerate(zip(kvs, lens)):
        pages = torch.arange(first, first + n_pages[b])
        first += n_pages[b]
        bt[b, :n_pages[b]] = pages.int()
        slots = (pages[:, None] * P + torch.arange(P)[None]).reshape(-1)[:n]
        kc.write(slots, k)
        vc.write(slots, v)
    q = torch.randn(len(lens), Hq, s, D, generator=g)
    lens_t = torch.tensor(lens)
    if packed:
        plan = StepPlan([0, 1, 2], 3, s, [n - s for n in lens], torch.zeros(1), bt, lens_t,
                        lens, [0] * 3, packed=True,
                        cu_seqlens_q=torch.arange(0, 3 * s + 1, s, dtype=torch.int32))
        got = paged_reference_attention(kc, vc, q.transpose(0, 1).reshape(1, Hq, 3 * s, D)
                                        .contiguous(), plan, None, True, 0, 0.0, 0.2)
        got = got.reshape(Hq, 3, s, D).transpose(0, 1)
    else:
        plan = StepPlan([0, 1, 2], 3, s, [n - s for n in lens], torch.zeros(1), bt, lens_t,
                        lens, [0] * 3)
        got = paged_reference_attention(kc, vc, q, plan, None, True, 0, 0.0, 0.2)
    for b, n in enumerate(lens):
        kd, vd = gather_pages(kc, bt[b], n)[None], gather_pages(vc, bt[b], n)[None]
        seen = torch.arange(n)[None] <= torch.arange(n - s, n)[:, None]
        ref = eager_rows(q[b:b + 1], kd, vd, seen[None, None], 0.2)
        assert_matches_eager(got[b:b + 1], ref, torch.float32, f"row {b}, packed={packed}")


@pytest.mark.parametrize("case", ["mla_causal_chunk", "gqa_bool_per_row", "mha_d288_additive",
                                  "causal_square_d288", "per_head_bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_blocks_equal_plain_attention(monkeypatch, case, dtype):
    """A call only torch's math SDPA takes (head dim > 256, or shared K/V heads under a mask)
    past MATH_BLOCK_BYTES of scores runs a K/V head at a time, the group's query heads folded
    into the rows, the rows in blocks (`_sdpa_blocks`): equal to plain attention (fp32 softmax
    over the masked scores), with the blocks forced small and the route seen taken. Negative:
    a call the fused kernels take (head dim 64, no mask) is not blocked at the same bound."""
    import kvcompile.kernels.dense as dense

    g = torch.Generator().manual_seed(len(case) * 7 + (dtype == torch.bfloat16))
    B, S, L = 3, 6, 29
    hq, hkv, D, Dv = {"mla_causal_chunk": (8, 1, 288, 256), "gqa_bool_per_row": (8, 2, 64, 64),
                      "mha_d288_additive": (3, 3, 288, 288), "causal_square_d288": (4, 1, 288, 32),
                      "per_head_bool": (6, 2, 64, 48)}[case]
    if case == "causal_square_d288":
        L = S
    q = torch.randn(B, hq, S, D, generator=g).to(dtype)
    k = torch.randn(B, hkv, L, D, generator=g).to(dtype)
    v = torch.randn(B, hkv, L, Dv, generator=g).to(dtype)
    causal = case == "causal_square_d288"
    ok = torch.arange(L)[None] <= torch.arange(L - S, L)[:, None]              # [S, L]
    mask = None
    if case == "mla_causal_chunk":
        mask = ok[None, None]
    elif case == "gqa_bool_per_row":
        mask = (torch.rand(B, 1, S, L, generator=g) > 0.3) & ok
    elif case == "mha_d288_additive":
        mask = torch.where(torch.rand(1, 1, S, L, generator=g) > 0.2, 0.0,
                           float("-inf")).to(dtype)
        mask[..., 0] = 0.0
    elif case == "per_head_bool":
        mask = torch.rand(B, hq, S, L, generator=g) > 0.4
        mask[..., -1] = True
    allowed = ok if causal else (mask if mask is None or mask.dtype == torch.bool
                                 else mask == 0)
    rep = hq // hkv
    s = torch.einsum("bhsd,bhld->bhsl", q.float(), k.float().repeat_interleave(rep, 1))
    s = s / D ** 0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    ref = torch.einsum("bhsl,bhld->bhsd", s.softmax(-1), v.float().repeat_interleave(rep, 1))

    calls = []
    blocks = dense._sdpa_blocks
    monkeypatch.setattr(dense, "_sdpa_blocks", lambda *a: calls.append(1) or blocks(*a))
    monkeypatch.setattr(dense, "MATH_BLOCK_BYTES", 4 * B * (hq // hkv) * L * 2)   # 2 rows
    out = dense._sdpa(q, k, v, mask, D ** -0.5, causal)
    assert calls, "the blocked route was not taken"
    assert out.dtype == dtype and out.shape == (B, hq, S, Dv)
    assert_rel_close(out.float(), ref, dtype, what=case)
    # negative: head dim 64 without a mask is a fused-kernel call, never blocked
    calls.clear()
    q64, k64 = q[..., :64].contiguous(), k[..., :64].contiguous()
    dense._sdpa(q64, k64, v, None, 0.125, False)
    assert not calls
