"""KVConfig.deferred_stop: `generate` over a compiled model's pool reads its stop decision one
step late (transformers' DeferredStopCheck, integrations/hf.py `_defer_stop_checks`), so the
host can queue a step while the GPU runs the one before.

On the CPU, DEFER_DEVICES is widened to "cpu" and torch.Event (which the CPU backend lacks) is a
stand-in that is always reached: CPU ops run in order on the host, so the deferred check reads
what a CUDA event would let it read. Checked against the same compiled model with the per-step
check (deferred_stop=False) and against eager: the tokens and a streamer's, a rows-all-stop-early
(EOS) call (one extra step run and undone, its pages returned), the cases left on the
per-step check (a returned cache, said in the report; the switch off; the CPU by default).
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from kvcompile.integrations import hf
from tests.engine.tiny import config, make_hf

utils = pytest.importorskip("transformers.generation.utils")
pytestmark = pytest.mark.skipif(not hasattr(utils, "DeferredStopCheck"),
                                reason="this transformers has no DeferredStopCheck")

PROMPTS = torch.tensor([[5, 9, 17, 33, 65, 129, 200, 7], [40, 41, 42, 90, 91, 92, 150, 151]])
NEW = 8


class _HostEvent:
    """torch.Event for the CPU, where every op has finished when the host moves on."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(hf, "DEFER_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", _HostEvent)


class Tokens:
    """A streamer that keeps what it is given, and how many forwards had run by then."""

    def __init__(self, forwards=None):
        self.seen, self.forwards, self.at = [], forwards, []

    def put(self, value):
        self.seen.append(value.tolist())
        self.at.append(len(self.forwards) if self.forwards is not None else None)

    def end(self):
        self.seen.append("end")


def _compiled(**kw):
    model = make_hf("llama")
    kvcompile.compile(model, config(**kw))
    forwards = []
    model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    return model, forwards


def _generate(model, ids=PROMPTS, **kw):
    args = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    args.update(kw)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **args)


def test_deferred_tokens_equal_the_per_step_check_and_eager_and_stream_a_step_late(on_cpu):
    eager = _generate(make_hf("llama"))
    model, forwards = _compiled()
    got = Tokens(forwards)
    assert torch.equal(_generate(model, streamer=got), eager)
    assert kvcompile.stats(model).get("generate_deferred_stop") == 1
    assert len(forwards) == NEW          # stopped by length: no extra step
    off, off_forwards = _compiled(deferred_stop=False)
    want = Tokens(off_forwards)
    assert torch.equal(_generate(off, streamer=want), eager)
    assert "generate_deferred_stop" not in kvcompile.stats(off)
    # the streamer gets every token: the prompt, NEW tokens, end
    assert got.seen == want.seen and len(got.seen) == NEW + 2
    # token k (k = 1..NEW) reaches the streamer after forward k per step, after forward k + 1
    # deferred (the host ran a step ahead); the last one after the loop, with every forward
    assert want.at[1:] == list(range(1, NEW + 1))
    assert got.at[1:] == [*range(2, NEW + 1), NEW]


def test_rows_stopping_early_run_one_step_more_undone_and_return_their_pages(on_cpu):
    ids = PROMPTS[:1]
    free = _generate(make_hf("llama"), ids)[0, ids.shape[1]:].tolist()
    eos = free[3]   # the 4th new token ends the row (it first appears there or earlier)
    stop = free.index(eos) + 1
    eager = _generate(make_hf("llama"), ids, eos_token_id=eos)
    assert eager.shape[1] == ids.shape[1] + stop < ids.shape[1] + NEW
    model, forwards = _compiled()
    out = _generate(model, ids, eos_token_id=eos)
    assert torch.equal(out, eager)
    assert len(forwards) == stop + 1     # one step past the stop, its token undone
    assert kvcompile.stats(model).get("generate_deferred_stop") == 1
    st = kvcompile.api.state_of(model)
    assert st.pool.stats().pages_used == 0, "the extra step's pages were kept"
    off, off_forwards = _compiled(deferred_stop=False)
    assert torch.equal(_generate(off, ids, eos_token_id=eos), eager)
    assert len(off_forwards) == stop


def test_a_returned_cache_keeps_the_per_step_check_and_the_report_says_so(on_cpu):
    model, _ = _compiled()
    out = _generate(model, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _generate(make_hf("llama")))
    assert "generate_deferred_stop" not in kvcompile.stats(model)
    assert "the stop check waits for the GPU every step" in str(kvcompile.report(model))
    # the decision itself, as CUDA would ask it (the default DEFER_DEVICES): this pool's cache
    # defers unless it outlives the call or an assistant model drafts; other caches are
    # transformers' to decide
    from transformers import DynamicCache

    cache = next(getattr(out, k) for k in ("past_key_values", "cache") if hasattr(out, k))
    cuda = torch.device("cuda")
    hf.DEFER_DEVICES = ("cuda",)   # (on_cpu's monkeypatch restores its own value after)
    assert hf._defers(cuda, cache, False, False) is True
    assert hf._defers(cuda, cache, True, False) is False
    assert hf._defers(cuda, cache, False, True) is None
    assert hf._defers(torch.device("cpu"), cache, False, False) is None   # the CPU: not by default
    assert hf._defers(cuda, DynamicCache(), False, False) is None
    assert utils.DeferredStopCheck.is_supported(cuda, cache, False, False) is True
    assert utils.DeferredStopCheck.is_supported(cuda, DynamicCache(), False, False) is False


def test_a_graphs_staging_buffers_alternate_and_wait_for_their_last_upload():
    """generate's graphs (integrations/hf_graphs.py) stage each step's plan in two pinned
    buffers used in turn: a buffer is written again only after the event of its last upload
    (the host runs a step ahead under the deferred stop check: one upload may be queued)."""
    from kvcompile.integrations.hf_graphs import _Graph

    class Event:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def record(self):
            self.log.append(("record", self.name))

        def synchronize(self):
            self.log.append(("wait", self.name))

    g = _Graph("k", 2, 4, 3, "cpu", False, False, None)
    log = []
    g._stages = [(*st[:3], Event(log, i)) for i, st in enumerate(g._stages)]
    g._uploaded = g._stages[0][3]
    buffers = set()
    for _ in range(4):   # a step: switch, write, upload
        g.next_stage()
        buffers.add(id(g.h64))
        g.h64[:2] = [7, 8]
        g.uploaded()
    assert log == [("record", 1), ("record", 0), ("wait", 1), ("record", 1), ("wait", 0),
                   ("record", 0)]
    assert len(buffers) == 2 and g.h64 is g._stages[g._turn][1]


def test_graphed_steps_under_the_deferred_check_equal_the_eager_steps(on_cpu, monkeypatch):
    """generate's decode steps replayed from (emulated) graphs with the stop check deferred:
    the steps alternate staging buffers; the tokens are those of the same model's steps
    without graphs, also when a row ends at EOS (one more step replayed, undone)."""
    from kvcompile.integrations import hf_graphs
    from tests.engine.tiny import make_llama64
    from tests.integrations.graphs_emulated import capture
    from tests.integrations.test_hf_graphs_eviction import _refusal

    monkeypatch.setattr(hf_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    m = make_llama64()
    kvcompile.compile(m, kvcompile.KVConfig(inner="eager", kernels="triton", page_size=8,
                                            max_kv_bytes=1 << 22))
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(4))

    def run(graphs, ids, eos=None):
        m.forward.why_not = (lambda: _refusal(m)) if graphs else (lambda: "off (check)")
        r0 = m.forward.replays
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                         do_sample=False, pad_token_id=0, eos_token_id=eos)
        return out, m.forward.replays - r0

    (g, n), (e, none) = run(True, ids), run(False, ids)
    assert torch.equal(g, e) and n == 9 and none == 0
    # one row ending at EOS: the extra step replays too, and is undone
    row = ids[:1]
    eos = int(run(False, row)[0][0, row.shape[1] + 3])   # the 4th new token (or earlier)
    (g, n), (e, _) = run(True, row, eos), run(False, row, eos)
    stop = e.shape[1] - row.shape[1]
    assert torch.equal(g, e) and stop < 10 and n == stop   # stop - 1 steps and the extra one
    assert kvcompile.stats(m).get("generate_deferred_stop") == 5
