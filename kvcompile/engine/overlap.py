"""Overlapped engine steps: the host prepares step n+1 while the device runs step n.

    step n:    schedule | launch forward + sampling (device) | ...device runs n...
    step n+1:           schedule | launch, ids <- step n's tokens (device to device) | read n

A step is *launched*: its forward and its sampling are queued on the device, the sampled
tokens stay there (`PendingStep.tokens`) and are copied, without blocking, into pinned host
memory behind an event. Each request that sampled gets a placeholder output id, so the
scheduler sees it as decoding and plans the next step: its input id is written on the device
from the tokens of the step before (`TokenFeed`). Only then does the host wait for step n's
event and read its tokens back (`Engine._resolve`): placeholders become tokens, prefix-cache
pages are offered, stop conditions are checked, outputs are emitted. In a steady decode loop
the host never waits for the device before the next step is queued.

Stop conditions take effect one step late: a request that sampled EOS (or a stop string) at
step n also ran in step n+1, whose token is discarded. Length limits are known in advance
(`Request.hold`): such a request is not scheduled again. The outputs are those of the
synchronous loop because the next step is launched before the read-back only when the
synchronous loop would schedule the same decodes (`continuable`): nothing waits or is swapped
out (admission would depend on the pages a stopping request frees), every running request
decodes, the decodes fit in the token budget and in the free pages without preemption or
prefix-cache eviction. Otherwise the pending step is read first and the engine goes on as the
synchronous loop does. The one difference: a step after a request stopped on a token not yet
read carries that request's row too (the other rows' arithmetic is row-wise, but a batch of
another size may pick another GEMM kernel on CUDA, as vLLM's async scheduling accepts).

A step after which nothing can run (every request ends at its read-back by a length limit,
nothing waits) is read back in the call that queued it (`ends_here`): that call's outputs carry
two tokens of each such request, and no step() call is left that only reads back.

An abort drops the aborted request's token in flight (it never waits for the device): its
output is what it had delivered, one token short of the synchronous loop's at most.

Some features need the host between steps and keep the synchronous loop (`sync_reason`, said
once in `kvcompile.report` and counted in `EngineStats.sync_reasons`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.engine.params import SamplingParams
from kvcompile.engine.request import Request
from kvcompile.engine.sampling import _on
from kvcompile.engine.scheduler import SchedulerOutput

PLACEHOLDER = -1   # an output id sampled on the device, not read back yet


@dataclass
class TokenFeed:
    """Input ids that are still on the device: row `rows[j]` of the step's packed ids takes
    `tokens[src[j]]`, a token the step before sampled."""

    tokens: torch.Tensor   # [B_prev] int64, on the device
    rows: list[int]
    src: list[int]

    def apply(self, ids: torch.Tensor) -> None:
        # ids: [T] int64, the step's packed input ids (a view the forward reads)
        k = len(self.rows)
        if self.rows == self.src == list(range(k)):   # the steady loop: same rows, same order
            ids[:k].copy_(self.tokens[:k])
            return
        ids.index_copy_(0, _on(self.rows, ids.device),
                        self.tokens.index_select(0, _on(self.src, ids.device)))


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are not read back yet."""

    out: SchedulerOutput
    reqs: list[Request]            # the rows that sampled, in order
    index: list[int]               # where each row's token goes in its request's output_ids
    params: list[SamplingParams]
    upto: list[int]                # each row's request's computed tokens after the step
    tokens: torch.Tensor           # [B] int64 on the device: the next step's input ids
    host: torch.Tensor             # sampling.pack's rows, on the host (pinned on CUDA)
    ready: torch.cuda.Event | None

    def read(self) -> list[list[float]]:
        """Wait for the step's event (CUDA) and read its rows (sampling.read_back's input)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def read_later(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """packed [R, B] on the device -> (a host copy that is valid once the event has
    completed, the event). On the CPU the copy is the tensor itself and there is no event."""
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def engine_reason(engine) -> str | None:
    """Why no step of this engine overlaps (fixed for its life), or None."""
    if not engine.overlap:
        return "Engine(async_steps=False)"
    if engine.state.tp is not None:
        return "tensor parallelism (rank 0's tokens are broadcast through the host)"
    if engine.state.config.check_finite:
        return "KVConfig.check_finite (each step reads its finiteness check on the host)"
    return None


def request_reason(req: Request) -> str | None:
    """Why a step with this request cannot overlap the next one, or None."""
    if req.params.repetition_penalty != 1.0:
        return "repetition_penalty (the penalty reads the previous token on the host)"
    if req.evicts:
        return ("eviction (its per-step bookkeeping is decided on the host; not yet checked "
                "with overlapped steps)")
    return None


def sync_reason(engine, out: SchedulerOutput) -> str | None:
    """Why step `out` runs synchronously (None: it may be launched and read back later)."""
    reason = engine_reason(engine)
    if reason is None:
        reason = next((r for r in map(request_reason, (s.req for s in out.seqs)) if r), None)
    return reason


def continuable(engine) -> bool:
    """Whether the next step may be scheduled and launched before the pending step's tokens are
    read: the synchronous loop would schedule the same decodes (module docstring)."""
    s, pool = engine.scheduler, engine.pool
    if s.waiting or s.swapped or not s.running:
        return False
    decodes = 0
    new_pages = 0
    P = pool.page_size
    for r in s.running:
        if r.to_compute != 1 or r.num_computed < len(r.prompt_ids) or r.seq_id is None:
            return False   # a prompt in prefill: its chunk depends on the decodes' budget
        if request_reason(r) is not None:
            return False
        if r.hold:
            continue
        decodes += 1
        new_pages += pool.seq_len(r.seq_id) % P == 0
    return 0 < decodes <= s.max_tokens and new_pages <= pool.num_free


def hold_finished_by_length(engine) -> None:
    """A request whose placeholders reach max_tokens or max_model_len ends at the next
    read-back whatever its token: it is not scheduled again (`Request.hold`)."""
    for r in engine.scheduler.running:
        r.hold = bool(r.unresolved) and (len(r.output_ids) >= r.params.max_tokens
                                         or r.num_tokens >= engine.max_model_len)


def ends_here(engine) -> bool:
    """After a launch: every request still running ends at its read-back (a length limit)
    and nothing waits, so no step can be queued behind it."""
    s = engine.scheduler
    if s.waiting or s.swapped:
        return False
    hold_finished_by_length(engine)
    return all(r.hold or r.finished for r in s.running)


def feed_for(out: SchedulerOutput, pending: PendingStep | None) -> TokenFeed | None:
    """The rows of `out` whose input id is a placeholder, fed from `pending`'s tokens."""
    if pending is None:
        return None
    where = {id(r): i for i, r in enumerate(pending.reqs)}
    rows, src, row = [], [], 0
    for s in out.seqs:
        i = where.get(id(s.req))
        if i is not None and s.start == len(s.req.prompt_ids) + pending.index[i]:
            rows.append(row + s.n - 1)
            src.append(i)
        row += s.n
    return TokenFeed(pending.tokens, rows, src) if rows else None
