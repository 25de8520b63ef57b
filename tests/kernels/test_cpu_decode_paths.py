"""The CPU reference attention's fast paths give the plain reference's numbers bit for bit.

`kernels/dense.py` gathers a layer's pages with `_gather` (fp8: fp8_widen's integer ops by
numpy on the page-heads' codes, then the fp16 -> fp32 widening and the scale product; other
formats: PagedTensor.read, heads-first copy). Here the same attention runs again with the pages
read row by row by `kernels/reference.py` `gather_pages` (PagedTensor.read, the formats'
reference decoders), over rows of different lengths, left padding (kv_start), a decode step and
a chunk of queries, in bf16, fp8 and 4-bit formats; then a compiled tiny Llama decodes a left-
padded batch with that decode and with the whole-page fp8 route (`_gather_fp8_widened`), with
identical logits at every step.
"""

import pytest
import torch

import kvcompile
from kvcompile.cache.formats import KVFormat
from kvcompile.kernels import dense
from kvcompile.kernels.reference import gather_pages
from kvcompile.runtime.context import StepPlan
from tests.engine.tiny import config, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = [("bf16", None), ("fp8_e4m3", "page"), ("fp8_e5m2", "token"), ("fp8_e4m3", "tensor"),
           ("fp4_e2m1", None), ("int4", None)]


def _reference_gather(paged, idx, b, total, dtype, rows=None):
    # the pages of b rows idx [b * n] -> [b, H, total, D], each row by PagedTensor.read
    return torch.stack([gather_pages(paged, row, total) for row in idx.view(b, -1)]).to(dtype)


def _pool(fmt, lens, H, D, P, g):
    """K and V pages for rows of the given lengths (pages shuffled; page 0 unused, where the
    block table's padding points), written as a prefill then one token at a time."""
    n_pages = [(n + P - 1) // P for n in lens]
    pages = 1 + torch.randperm(sum(n_pages), generator=g)
    kc, vc = fmt.allocate(sum(n_pages) + 1, H, P, D), fmt.allocate(sum(n_pages) + 1, H, P, D)
    bt = torch.zeros(len(lens), max(n_pages), dtype=torch.int32)
    first = 0
    for b, n in enumerate(lens):
        mine = pages[first:first + n_pages[b]]
        first += n_pages[b]
        bt[b, :n_pages[b]] = mine.int()
        slots = (mine[:, None] * P + torch.arange(P)[None]).reshape(-1)[:n]
        k, v = torch.randn(n, H, D, generator=g) * 3, torch.randn(n, H, D, generator=g)
        for a, z in ((0, n - 2), (n - 2, n - 1), (n - 1, n)):
            kc.write(slots[a:z], k[a:z])
            vc.write(slots[a:z], v[a:z])
    return kc, vc, bt


@pytest.mark.parametrize("name,gran", FORMATS)
@pytest.mark.parametrize("lens,starts", [([37, 37, 37], [0, 5, 17]), ([37, 20, 33], [0, 3, 0])],
                         ids=["padded", "ragged"])
@pytest.mark.parametrize("s", [1, 3])
def test_gather_equals_reference_read(name, gran, lens, starts, s, monkeypatch):
    fmt = KVFormat(name) if gran is None else KVFormat(name, gran)
    g = torch.Generator().manual_seed(len(name) + 10 * s + lens[1])
    H, Hq, D, P = 3, 9, 64, 16
    kc, vc, bt = _pool(fmt, lens, H, D, P, g)
    B = len(lens)
    q = torch.randn(B, Hq, s, D, generator=g)
    plan = StepPlan(list(range(B)), B, s, [n - s for n in lens], torch.zeros(B * s,
                    dtype=torch.long), bt, torch.tensor(lens, dtype=torch.int32), list(lens),
                    list(starts))
    got = dense.paged_reference_attention(kc, vc, q, plan, None, True, 0, 0.0, 0.125)
    plan.cache.clear()
    monkeypatch.setattr(dense, "_gather", _reference_gather)
    want = dense.paged_reference_attention(kc, vc, q, plan, None, True, 0, 0.0, 0.125)
    assert bool(torch.isfinite(want).all())
    assert torch.equal(got, want), f"{name}/{gran}: max diff {(got - want).abs().max()}"


def test_generate_fp8_numpy_widening_equals_previous_route(monkeypatch):
    """A compiled tiny Llama, fp8 pages, left-padded batch of 3: the logits of every step with
    the numpy widening of the page-heads (dense._fp8_rows_host) equal those of the fp8_widen
    route on whole pages (`_gather_fp8_widened`)."""
    model = make_hf("llama", "sdpa")
    kvcompile.compile(model, config(kv_dtype="fp8_e4m3"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (3, 19), generator=g)
    am = torch.ones_like(ids)
    am[1, :6], am[2, :3] = 0, 0
    ids[am == 0] = 0
    calls = {"rows": 0}
    rows_host = dense._fp8_rows_host

    def counted(*args):
        calls["rows"] += 1
        return rows_host(*args)

    def run():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    monkeypatch.setattr(dense, "_fp8_rows_host", counted)
    seq, logits = run()
    assert calls["rows"] > 0, "the numpy widening did not run"
    monkeypatch.setattr(dense, "_widen_rows_applies", lambda paged: False)   # previous route
    calls["rows"] = 0
    seq_old, logits_old = run()
    assert calls["rows"] == 0, "the previous route used the numpy widening"
    assert torch.equal(seq, seq_old)
    assert torch.equal(logits, logits_old)
