"""The forward context: which pool sequences a forward runs on and where its new tokens go.

The backend wrapper (or the engine) sets it around each call of a compiled graph; every
`torch.ops.kvcompile.attention` call in that graph reads it. The per-forward plan (slots, block
tables, lengths) is built once, by the first attention op, and reused by every layer.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from kvcompile.errors import CacheStateError

_local = threading.local()


@dataclass
class StepPlan:
    """Everything the attention ops of one forward share."""

    seq_ids: list[int]
    batch: int
    new_tokens: int                  # S: new tokens per row (rows of a padded batch)
    past_lens: list[int]             # tokens cached per row before this forward
    slots: torch.Tensor              # [B*S] int64, page * P + offset of each new token
    block_tables: torch.Tensor       # [B, max_pages] int32
    seq_lens: torch.Tensor           # [B] int32, after this forward
    seq_lens_list: list[int]
    kv_start: list[int]              # left-padding offset per row
    packed: bool = False             # engine: q is [1, T] packed over sequences
    cu_seqlens_q: torch.Tensor | None = None   # [B+1] int32 (packed)
    q_lens: list[int] = field(default_factory=list)
    cache: dict = field(default_factory=dict)  # per-forward memo (mask analyses, ...)
    # the eviction runtime steps aside: a decode step whose kept slots need no per-slot rule
    # (eviction/runtime.py `decode_aside`), so that it can replay a CUDA graph
    eviction_aside: bool = False
    # what such a step does for eviction inside it (H2O mass, re-rotated sinks):
    # eviction/aside.py AsideInputs, or None for the plain decode step
    aside: object | None = None
    # each page's new slots are adjacent in `slots` (distinct sequences, each with its own run):
    # the page-scaled append then needs no device sort (kernels/append.py); reserve()'s own
    # slots are known to be so without this flag (cache/pool.py `write`)
    slots_grouped: bool = False
    # the slots as host ints, where reading them cost nothing (a CPU pool's decode step): the
    # reference writer then reads no slot back from the tensor, twice per layer
    slots_host: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.new_tokens <= 8 and min(self.past_lens, default=0) > 0 and not self.packed


class ForwardContext:
    """Set around one call of a compiled graph."""

    def __init__(self, state, binding=None, *, plan: StepPlan | None = None,
                 engine_warm_up: bool = False):
        self.state = state         # backend ModelState: pool, layer index, config
        self.binding = binding     # runtime/binding.Binding, or None for a cache-less forward
        self.plan = plan           # prepared lazily by the first attention op (or given)
        # the engine's first forward (engine/runner.py warm_up): Dynamo traces the graphs of
        # the engine's steps in it, before any pool exists; its ops attend over the given
        # tokens alone (no mask: the output is thrown away) and store nothing
        self.engine_warm_up = engine_warm_up

    @property
    def pool(self):
        return self.state.pool

    def prepare(self, batch: int, new_tokens: int, positions: torch.Tensor | None,
                device: torch.device) -> StepPlan:
        if self.plan is not None:
            if self.plan.packed:
                return self.plan  # the engine laid out the packed batch itself
            if self.plan.batch != batch or self.plan.new_tokens != new_tokens:
                raise CacheStateError(
                    f"attention ops of one forward disagree on the batch: {batch}x{new_tokens} "
                    f"vs {self.plan.batch}x{self.plan.new_tokens}")
            return self.plan
        b = self.binding
        if b is None:
            raise CacheStateError("no cache binding for this forward")
        pool = self.state.ensure_pool(device)
        if positions is not None:
            start = _first_position(positions)
            if start == 0:
                b.restart(batch)
            elif b.released:
                raise CacheStateError(
                    f"cache write at position {start}, but this cache's pages were given back "
                    f"by kvcompile.release(model); start a new cache (a new generate call)")
            elif b.batch != batch:
                raise CacheStateError(
                    f"cache write at position {start} for a batch of {batch}, but kvcompile "
                    f"holds {b.batch} sequence(s) for this cache (a cache filled outside the "
                    f"compiled model cannot be continued)")
            elif b.seq_len() != start:
                raise CacheStateError(
                    f"cache write at position {start}, but {b.seq_len()} tokens are cached; "
                    f"kvcompile caches append (positions must continue the sequence)")
        elif b.batch != batch:
            if b.seq_len() == 0 or not b.seq_ids:
                b.restart(batch)
            else:
                raise CacheStateError(
                    f"the cache holds {b.batch} sequences but the forward has batch {batch}")
        past = [pool.seq_len(s) for s in b.seq_ids]
        slots = pool.reserve(b.seq_ids, new_tokens)
        seq_lens_list = [p + new_tokens for p in past]
        self.plan = StepPlan(
            seq_ids=list(b.seq_ids), batch=batch, new_tokens=new_tokens, past_lens=past,
            slots=slots.to(device), block_tables=pool.block_table(b.seq_ids, device=device),
            seq_lens=torch.tensor(seq_lens_list, dtype=torch.int32, device=device),
            seq_lens_list=seq_lens_list, kv_start=list(b.kv_start),
            slots_host=slots.tolist() if slots.device.type == "cpu" and new_tokens == 1 else None,
        )
        return self.plan


def _first_position(positions: torch.Tensor) -> int:
    p = positions.reshape(-1)[:1]
    return int(p.item()) if p.numel() else 0


def current() -> ForwardContext | None:
    return getattr(_local, "ctx", None)


# the suffix of the attention ops' `tag` in a graph traced inside an engine step (the context's
# plan packed): its ops have no mask input (passes/mask_inputs.py `drop_masks`), so they may
# run only in such steps (`require_packed`)
PACKED_TAG = ":engine-packed"


def in_packed_step(state=None) -> bool:
    """Whether the current forward is an engine step (one row packing its sequences) or the
    engine's warm-up, which traces the graphs of its steps; with `state`, a step of that
    model's engine (another kvcompile model called inside an engine's step or warm-up runs
    its own forwards, with masks)."""
    ctx = current()
    return (ctx is not None and (state is None or ctx.state is state)
            and (ctx.engine_warm_up or ctx.plan is not None and ctx.plan.packed))


def require_packed(tag: str, layer: str) -> None:
    """Refuse a graph traced in an engine step (`PACKED_TAG`) outside one: its ops were
    given no mask, which only an engine step's plan (causal within each packed sequence)
    makes right."""
    if tag.endswith(PACKED_TAG) and not in_packed_step():
        raise CacheStateError(
            f"{layer}: this graph was compiled inside a kvcompile.Engine step, where the "
            f"attention ops take no mask (the engine's plan lays out the sequences), and is "
            f"called outside one; call the model with other inputs than the engine's "
            f"(input_ids [1, T] with position_ids, use_cache=False and a logits_to_keep "
            f"tensor), or torch._dynamo.reset() before this call")


@contextlib.contextmanager
def forward_context(ctx: ForwardContext | None):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev
