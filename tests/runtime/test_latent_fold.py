"""Several queries a row over latent pages on the latent decode kernels (runtime/dispatch.py
`_latent_kernel`, layout "fold"): each query a kernel row of its own, with its sequence's
block-table row and the causal length it sees. Checked against a float64 reference computed
from the values written (fp32 pages) or the paged reference over the stored ones (quantized
pages), on fresh random inputs: a prompt chunk over a cached prefix with left padding, and an
engine step that packs decodes with prompt chunks (a fresh prompt among them). Negative: a
maskless call that is not causal, a window, H2O mass over several queries, and a mask that is
not causal are not folded and say why (the reference attends)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvcompile.cache.formats import KVFormat
from kvcompile.cache.pool import LayerSpec, PagePool
from kvcompile.kernels.dense import paged_reference_attention
from kvcompile.kernels.masks import MaskInfo
from kvcompile.runtime.dispatch import _latent_kernel
from kvcompile.testing import assert_rel_close

R, DR, H, PAGE, SCALE = 32, 16, 16, 8, 0.2


def _state(notes: list[str]):
    return SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda device: True,
                                                   _fallback=notes.append))


def _pages(fmt: str, lens: list[int], g):
    """One layer of latent pages holding `lens` tokens a sequence: (pool, seqs, the values
    written: [(c [n, R], rope [n, DR])] a sequence)."""
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR,
                     k_format=KVFormat(fmt, "page"), v_format=KVFormat(fmt, "page"))
    pool = PagePool([spec], sum(math.ceil(n / PAGE) for n in lens) + 4, PAGE)
    seqs = []
    written = []
    for n in lens:
        pool.allocate(1)                      # a sequence between: tables are not the identity
        seqs += pool.allocate(1)
        c, rope = torch.randn(n, 1, R, generator=g) * 2, torch.randn(n, 1, DR, generator=g)
        pool.write(0, pool.reserve(seqs[-1:], n), c, rope)
        written.append((c[:, 0].double(), rope[:, 0].double()))
    return pool, seqs, written


def _want(q_rows, written, seq_of, lens_of, starts) -> torch.Tensor:
    """float64: row t attends to keys kv_start <= j < lens_of[t] of its sequence."""
    out = []
    for t, (s, n) in enumerate(zip(seq_of, lens_of)):
        c, rope = written[s]
        keys = torch.cat([c, rope], dim=-1)[starts[s]:n]                 # [n', R + DR]
        p = torch.softmax(q_rows[t].double() @ keys.T * SCALE, dim=-1)  # [H, n']
        out.append(p @ c[starts[s]:n])
    return torch.stack(out)                                            # [N, H, R]


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
def test_a_chunk_over_a_cached_prefix_folds_into_kernel_rows(fmt):
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    S = int(torch.randint(2, 7, (1,), generator=g))
    past = [int(x) for x in torch.randint(1, 30, (3,), generator=g)]
    lens = [p + S for p in past]
    starts = [0, min(3, past[1]), 0]                      # row 1 left-padded
    pool, seqs, written = _pages(fmt, lens, g)
    plan = SimpleNamespace(packed=False, q_lens=[], past_lens=past, batch=3, new_tokens=S,
                           seq_lens=torch.tensor(lens, dtype=torch.int32), seq_lens_list=lens,
                           block_tables=pool.block_table(seqs), kv_start=starts, cache={})
    q = torch.randn(3, H, S, R + DR, generator=g)
    info = MaskInfo(None, starts, 0, True)
    notes: list[str] = []
    got, route = _latent_kernel(_state(notes), q, pool.k[0], pool.v[0], plan, info,
                                torch.ones(1), 0, 0.0, SCALE)
    assert route == "triton_rows" and not notes and got.shape == (3, H, S, R)
    again, _ = _latent_kernel(_state(notes), q, pool.k[0], pool.v[0], plan, info,
                              torch.ones(1), 0, 0.0, SCALE)   # the next layer of the forward
    assert torch.equal(again, got)
    assert sum(1 for k in plan.cache if k[0] == "latent_fold") == 1   # rows made once
    if fmt == "fp32":
        rows = q.transpose(1, 2).reshape(3 * S, H, R + DR)
        want = _want(rows, written, [b for b in range(3) for _ in range(S)],
                     [n - S + i + 1 for n in lens for i in range(S)], starts)
        want = want.view(3, S, H, R).transpose(1, 2)
    else:   # the stored (quantized) values: the paged reference over the same pages
        want = paged_reference_attention(pool.k[0], pool.v[0], q, plan, None, True, 0, 0.0,
                                         SCALE, latent=True)
    assert_rel_close(got, want, torch.float32, what=f"{fmt}, S={S}, past={past}")


def test_an_engine_step_with_prompt_chunks_folds_into_kernel_rows():
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    q_lens = [1, int(torch.randint(2, 9, (1,), generator=g)), 3, 1]
    past = [int(torch.randint(1, 40, (1,), generator=g)), 0, 17, 5]   # row 1: a fresh prompt
    lens = [p + n for p, n in zip(past, q_lens)]
    pool, seqs, written = _pages("fp32", lens, g)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    plan = SimpleNamespace(packed=True, q_lens=q_lens, past_lens=past, batch=4,
                           new_tokens=cu[-1], seq_lens=torch.tensor(lens, dtype=torch.int32),
                           seq_lens_list=lens, block_tables=pool.block_table(seqs),
                           kv_start=[0] * 4, cache={},
                           cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    q = torch.randn(1, H, cu[-1], R + DR, generator=g)
    notes: list[str] = []
    got, route = _latent_kernel(_state(notes), q, pool.k[0], pool.v[0], plan, None, None, 0,
                                0.0, SCALE)
    assert route == "triton_rows" and not notes and got.shape == (1, H, cu[-1], R)
    seq_of = [s for s, n in enumerate(q_lens) for _ in range(n)]
    lens_of = [p + i + 1 for p, n in zip(past, q_lens) for i in range(n)]
    want = _want(q[0].transpose(0, 1), written, seq_of, lens_of, [0] * 4)
    assert_rel_close(got[0].transpose(0, 1), want, torch.float32)
    ref = paged_reference_attention(pool.k[0], pool.v[0], q, plan, None, True, 0, 0.0, SCALE,
                                    latent=True)
    assert_rel_close(got, ref, torch.float32)


@pytest.mark.parametrize("case,reason", [
    ("not_causal", "not causal"),
    ("window", "sliding window"),
    ("mass", "H2O mass over several queries"),
    ("mask_with_holes", "not causal"),
])
def test_what_is_not_folded_says_why(case, reason):
    g = torch.Generator().manual_seed(3)
    pool, seqs, _ = _pages("fp32", [12, 15], g)
    plan = SimpleNamespace(packed=False, q_lens=[], past_lens=[8, 11], batch=2, new_tokens=4,
                           seq_lens=torch.tensor([12, 15], dtype=torch.int32),
                           seq_lens_list=[12, 15], block_tables=pool.block_table(seqs),
                           kv_start=[0, 0], cache={})
    q = torch.randn(2, H, 4, R + DR, generator=g)
    kw = dict(mask_info=None, attn_mask=None, window=0, softcap=0.0, scale=SCALE)
    if case == "not_causal":
        kw["is_causal"] = False
    elif case == "window":
        kw["window"] = 4
    elif case == "mass":
        kw["attn_mass"] = torch.zeros(2, 1, 15)
    else:
        kw.update(mask_info=MaskInfo(None, [0, 0], 0, False, "holes"),
                  attn_mask=torch.ones(2, 1, 4, 15, dtype=torch.bool))
    notes: list[str] = []
    assert _latent_kernel(_state(notes), q, pool.k[0], pool.v[0], plan, **kw) is None
    assert len(notes) == 1 and reason in notes[0], notes


@pytest.mark.parametrize("fmt, expands_from", [("bf16", "LATENT_EXPAND_MIN_QUERIES"),
                                                ("fp8_e4m3", "LATENT_EXPAND_MIN_QUERIES_FP8")])
def test_a_chunk_expands_from_its_pages_threshold(fmt, expands_from):
    """A prompt chunk over latent pages expands from the threshold of its pages' element size
    (fp8 pages fold longer chunks: the kernel reads half the bytes), folds below it; never a
    packed step, and never where the threshold of the other format would say so."""
    from kvcompile.runtime import dispatch

    pool, _, _ = _pages(fmt, [40], torch.Generator().manual_seed(5))
    pages = pool.k[0]
    n = getattr(dispatch, expands_from)
    assert dispatch.LATENT_EXPAND_MIN_QUERIES < dispatch.LATENT_EXPAND_MIN_QUERIES_FP8
    assert dispatch.latent_expand_min_queries(pages) == n
    plan = SimpleNamespace(packed=False, is_decode=False)

    def expands(s, p=plan):
        q = torch.zeros(1, H, s, R + DR)
        return dispatch._latent_chunk_expands(q, pages, p, None, None, True, 0, 0.0, None)

    assert expands(n) and not expands(n - 1)
    # between the two thresholds: only 16-bit pages expand
    mid = (dispatch.LATENT_EXPAND_MIN_QUERIES + dispatch.LATENT_EXPAND_MIN_QUERIES_FP8) // 2
    assert expands(mid) == (fmt == "bf16")
    assert not expands(n, SimpleNamespace(packed=True, is_decode=False))


@pytest.mark.parametrize("kernels", [True, False], ids=["latent kernel rows", "reference"])
def test_an_engine_step_with_long_chunks_expands_them_and_equals_the_reference(monkeypatch,
                                                                                kernels):
    """An engine step packing decodes, a short chunk, a fresh prompt and two chunks at the
    expansion threshold or past it (4 here): the long chunks by expansion over their
    sequences' stored latents, the rest as a step of their own (`_attend_latent_split`),
    together equal to the absorbed reference over the whole step; the split made once a
    forward. Negative: a step whose chunks are all shorter is not split."""
    from kvcompile.kernels.latent import absorb_query, latent_output
    from kvcompile.runtime import dispatch

    monkeypatch.setattr(dispatch, "LATENT_EXPAND_MIN_QUERIES", 4)
    monkeypatch.setattr(dispatch, "LATENT_SPLIT_PACKED", True)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    q_lens = [1, 5, 2, 1, int(torch.randint(4, 9, (1,), generator=g)), 3]
    past = [int(torch.randint(1, 40, (1,), generator=g)), 13, 9, 21, 0, 0]
    lens = [p + n for p, n in zip(past, q_lens)]
    pool, seqs, _ = _pages("fp32", lens, g)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    plan = SimpleNamespace(packed=True, q_lens=q_lens, past_lens=past, batch=len(lens),
                           new_tokens=cu[-1], seq_lens=torch.tensor(lens, dtype=torch.int32),
                           seq_lens_list=lens, block_tables=pool.block_table(seqs),
                           kv_start=[0] * len(lens), cache={}, seq_ids=seqs,
                           slots=torch.zeros(0, dtype=torch.int64),
                           cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    nope, dv = 8, 12
    w = torch.randn(H * (nope + dv), R, generator=g) * 0.3
    q = torch.randn(1, H, cu[-1], nope + DR, generator=g)
    counts: list[str] = []
    notes: list[str] = []
    state = SimpleNamespace(pool=pool, count=counts.append, kernels=SimpleNamespace(
        use_triton=lambda device: kernels, _fallback=notes.append))
    split = dispatch._packed_latent_split(q, pool.k[0], plan, None, 0, 0.0, None)
    assert [one.seq_ids for _, one in split[0]] == [[seqs[1]], [seqs[4]]]
    assert split[1].q_lens == [1, 2, 1, 3]
    assert dispatch._packed_latent_split(q, pool.k[0], plan, None, 0, 0.0, None) is split
    got = dispatch._attend_latent_split(SimpleNamespace(state=state), 0, q, plan, split, SCALE,
                                        w, nope)
    q_lat = absorb_query(q, w, nope)
    want = latent_output(paged_reference_attention(pool.k[0], pool.v[0], q_lat, plan, None,
                                                   True, 0, 0.0, SCALE, latent=True), w, nope)
    assert_rel_close(got, want, torch.float32, what=f"q_lens {q_lens}, past {past}")
    assert "latent_chunk_expanded" in counts and not notes
    assert ("latent_decode_triton_rows" if kernels else "latent_absorbed") in counts, counts
    short = SimpleNamespace(**{**vars(plan), "q_lens": [1, 3, 2, 1, 3, 3], "cache": {}})
    assert dispatch._packed_latent_split(q, pool.k[0], short, None, 0, 0.0, None) is None
    # the default (split off: measured slower end to end) folds the long chunks too
    monkeypatch.setattr(dispatch, "LATENT_SPLIT_PACKED", False)
    fresh = SimpleNamespace(**{**vars(plan), "cache": {}})
    assert dispatch._packed_latent_split(q, pool.k[0], fresh, None, 0, 0.0, None) is None
