"""Evaluation drivers of the quality harness: every policy runs through the compiler.

The model is compiled once per storage format (`kvcompile.compile`, a placeholder policy that
never evicts on every layer); each policy under test is then set per sequence
(`EvictionRuntime.set_sequence_policy`) on forks of one prefill, so that a context is prefilled
once and evicted by every policy side by side (the pages are shared until compaction copies
them). Rows of a batch are independent sequences of the pool.

    ev = Evaluator(model)
    rt = ev.compile("fp8_e4m3")
    rows = ev.prefill_and_fork(ctx_ids, [None, SinkWindow(4, 508), ...])   # one row each
    logits = ev.step(rows, next_ids)                                        # [K, C, V]
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.config import H2O, KVConfig, SinkWindow, SnapKV
from kvcompile.runtime.binding import binding_of

# Never over budget: every layer is managed by the eviction runtime, nothing is evicted unless
# a sequence gets a real policy.
PLACEHOLDER = SinkWindow(sinks=0, window=1 << 30)


# Named storage configurations beside the plain kv_dtype strings (Evaluator.compile,
# `kvcompile eval --formats / --kv`): the 4-bit Pareto point of benchmarks/RESULTS.md
# ("key-aware quantization": K int4 with channel scales, V int4 with token scales, pages of 64,
# values rotated by the Hadamard pass; 4.5 bits per element with scales).
NAMED_FORMATS = {
    "int4-kc-vt-p64-rot": dict(kv_dtype="int4", k_dtype="int4", v_dtype="int4",
                               scale_granularity="channel", page_size=64, rotate="hadamard"),
}


def format_fields(kv: str, page_size: int = 16) -> dict:
    """KVConfig fields of a storage format: a NAMED_FORMATS name or a kv_dtype string."""
    if kv in NAMED_FORMATS:
        return dict(NAMED_FORMATS[kv])
    return dict(kv_dtype=kv, page_size=page_size)


# Rows of the harness by name: budget b tokens -> policy. The SnapKV rows spell out every
# field, so that they keep their meaning whatever SnapKV's defaults are.
ROWS = {
    "SinkWindow": lambda b, g: SinkWindow(sinks=4, window=b - 4, granularity=g),
    "H2O": lambda b, g: H2O(budget=b, recent=b // 2, sinks=4, granularity=g),
    # SnapKV as published: the last 32 queries, pooled over 5 keys, one choice per kv head
    "SnapKV": lambda b, g: SnapKV(budget=b, window=32, kernel=5, per_head=True),
    "SnapKV-shared": lambda b, g: SnapKV(budget=b, window=32, kernel=5, per_head=False),
    "SnapKV-w8-shared": lambda b, g: SnapKV(budget=b, window=8, kernel=5, per_head=False),
    # TOVA-like: the last query's attention, summed over the heads of a layer, no pooling
    "TOVA-like": lambda b, g: SnapKV(budget=b, window=1, kernel=1, per_head=False),
    "SnapKV-w1k5-shared": lambda b, g: SnapKV(budget=b, window=1, kernel=5, per_head=False),
    # issue 19's 4-bit row: observation window and pooling around the default (w8 k5 shared)
    "SnapKV-w16-shared": lambda b, g: SnapKV(budget=b, window=16, kernel=5, per_head=False),
    "SnapKV-w4-shared": lambda b, g: SnapKV(budget=b, window=4, kernel=5, per_head=False),
    "SnapKV-w8k3-shared": lambda b, g: SnapKV(budget=b, window=8, kernel=3, per_head=False),
    "SnapKV-w8k9-shared": lambda b, g: SnapKV(budget=b, window=8, kernel=9, per_head=False),
    "SnapKV-w8k1-shared": lambda b, g: SnapKV(budget=b, window=8, kernel=1, per_head=False),
    # one choice per kv head (the same budget in every head: the pages of the shared row)
    "SnapKV-w8-head": lambda b, g: SnapKV(budget=b, window=8, kernel=5, per_head=True),
}
DEFAULT_ROWS = ("SinkWindow", "H2O", "SnapKV", "SnapKV-shared")
PAGE_ROWS = ("SinkWindow", "H2O")  # the policies with a page granularity


def policies_at(ratio: float, context: int, page: bool = False, names=DEFAULT_ROWS) -> dict:
    """The policies compared at compression `ratio` of a `context`-token prompt (budget =
    (1 - ratio) * context tokens kept), {name: policy}."""
    b = max(8, round((1 - ratio) * context))
    g = "page" if page else "token"
    return {n: row_policy(n, b, g) for n in names if not page or n in PAGE_ROWS}


def row_policy(name: str, budget: int, granularity: str = "token"):
    """The policy of row `name` at `budget`; a SnapKV row's name + "-hold" is the same policy
    holding its budget while decoding (SnapKV(hold=True))."""
    if name.endswith("-hold") and name[:-5] in ROWS:
        base = ROWS[name[:-5]](budget, granularity)
        if not isinstance(base, SnapKV):
            raise ValueError(f"row {name!r}: only SnapKV rows hold their budget ({base!r})")
        return replace(base, hold=True)
    if name not in ROWS:
        raise ValueError(f"unknown row {name!r}: one of {sorted(ROWS)} (SnapKV rows + '-hold')")
    return ROWS[name](budget, granularity)


class Rows:
    """A batch of forked sequences: the HF cache, their pool ids and per-row labels."""

    def __init__(self, cache, labels: list[str], last_logits: torch.Tensor):
        self.cache, self.labels, self.last_logits = cache, labels, last_logits

    @property
    def seq_ids(self) -> list[int]:
        return binding_of(self.cache.layers[0].keys).seq_ids


class Evaluator:
    def __init__(self, model, max_kv_bytes: int = 3 << 30):
        self.model = model
        self.max_kv_bytes = max_kv_bytes
        self.rt = None

    def compile(self, kv_dtype: str = "auto", page_size: int = 16):
        """Compile the model for `kv_dtype` (a kv_dtype string or a NAMED_FORMATS name; fresh
        Dynamo state); returns self."""
        m = self.model
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_kvcompile_state", None)
        torch._dynamo.reset()
        kvcompile.compile(m, KVConfig(**format_fields(kv_dtype, page_size), inner="eager",
                                      max_kv_bytes=self.max_kv_bytes, eviction=PLACEHOLDER))
        self.rt = None
        self.kv_dtype = kv_dtype
        from transformers import DynamicCache

        dev = next(m.parameters()).device
        self._forward(torch.tensor([[1, 2]], device=dev), DynamicCache())  # runs the passes
        return self

    @property
    def state(self):
        return state_of(self.model)

    def _forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        if self.rt is None:
            self.rt = self.state.eviction
        return out.logits.float()

    def prefill_and_fork(self, ctx_ids: torch.Tensor, policies: dict, observe: int = 32,
                         sink_positions: dict | None = None) -> Rows:
        """Prefill ctx_ids [T] once (recording H2O mass and SnapKV scores), fork one row per
        policy ({label: policy or None}) and evict each row with its policy."""
        from transformers import DynamicCache

        cache = DynamicCache()
        self.rt.observe_all = observe
        try:
            logits = self._forward(ctx_ids[None], cache)
        finally:
            self.rt.observe_all = 0
        labels = list(policies)
        cache.batch_repeat_interleave(len(labels))
        rows = Rows(cache, labels, logits[:, -1].expand(len(labels), -1))
        rt = self.rt
        sinkpos = sink_positions or {}
        for sid, label in zip(rows.seq_ids, labels):
            rt.set_sequence_policy(sid, policies[label], sinkpos.get(label))
            rt.evict(sid, rt.books[sid])
            rt.books[sid].obs.clear()
        return rows

    def prefill_chunked(self, ctx_ids: torch.Tensor, policies: dict, chunk: int) -> Rows:
        """Engine(prefill_eviction_chunk=chunk)'s semantics: one row per policy, the prompt fed
        `chunk` tokens per forward and each row evicted by its policy after every forward (so
        prompt queries see the kept tokens of earlier chunks, not all of them). The first
        chunk is fed before the rows get their policies: it must not exceed any budget (it
        evicts nothing then either)."""
        from transformers import DynamicCache

        from kvcompile.eviction.policies import budget_of

        least = min((budget_of(p) for p in policies.values() if p is not None), default=chunk)
        if chunk > least:
            raise ValueError(f"prefill chunk {chunk} > the smallest budget {least}: the first "
                             f"chunk is fed under the placeholder policy; use a smaller chunk")
        labels = list(policies)
        ids = ctx_ids[None].expand(len(labels), -1).contiguous()
        cache = DynamicCache()
        logits = self._forward(ids[:, :chunk], cache)
        rows = Rows(cache, labels, logits[:, -1])
        for sid, label in zip(rows.seq_ids, labels):
            self.rt.set_sequence_policy(sid, policies[label])
        for t in range(chunk, ids.shape[1], chunk):
            logits = self._forward(ids[:, t:t + chunk], cache)
        rows.last_logits = logits[:, -1]
        return rows

    def step(self, rows: Rows, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [C] (teacher forcing, same tokens for every row) or [K, C]: logits."""
        if ids.dim() == 1:
            ids = ids[None].expand(len(rows.labels), -1)
        return self._forward(ids.contiguous(), rows.cache)

    def kept(self, rows: Rows) -> dict:
        """Fraction of the logical tokens each row stores."""
        pool = self.state.pool
        return {lab: pool.seq_len(s) / pool.logical_len(s)
                for lab, s in zip(rows.labels, rows.seq_ids)}

    def release(self, rows: Rows) -> None:
        rows.cache = None


def nll_and_agreement(logits: torch.Tensor, targets: torch.Tensor, ref_row: int = 0):
    """logits [K, C, V], targets [C] -> per row: (sum nll, sum KL vs ref row, top-1 matches)."""
    lp = torch.log_softmax(logits.double(), -1)
    nll = -lp.gather(-1, targets[None, :, None].expand(lp.shape[0], -1, 1))[..., 0].sum(-1)
    ref = lp[ref_row:ref_row + 1]
    kl = (ref.exp() * (ref - lp)).sum(-1).sum(-1)
    top1 = (lp.argmax(-1) == ref.argmax(-1)).sum(-1)
    return nll, kl, top1


def greedy(ev: Evaluator, rows: Rows, first_ids: torch.Tensor, max_new: int) -> list[list[int]]:
    """Greedy decoding of every row after feeding first_ids [C]; returns generated ids."""
    logits = ev.step(rows, first_ids)[:, -1]
    out = []
    for _ in range(max_new):
        nxt = logits.argmax(-1)
        out.append(nxt)  # stays on the device: one copy to the host at the end
        if len(out) < max_new:  # the last token's logits are never read
            logits = ev.step(rows, nxt[:, None])[:, -1]
    return torch.stack(out, 1).tolist() if out else [[] for _ in rows.labels]


def ppl(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / max(1, count))
