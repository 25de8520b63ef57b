"""The scheduler: which requests run in a step, and how many of their tokens.

Each step has a token budget (`max_num_batched_tokens`), spent in this order:
  1. running requests that decode (one token each), oldest first;
  2. running requests in the middle of a chunked prefill, one chunk each;
  3. swapped-out requests, brought back while pages allow;
  4. waiting requests, first come first served, while pages and the budget allow.
So a long prompt is cut into chunks that share steps with the decodes and never stalls them.
A partial chunk ends on a page boundary where it can, so pages are written in one piece. Where
it cannot (the budget left is under a page) and a token's stored value depends on its page's
other tokens (KVFormat.shares_page: page / channel scales, a bf16 residual), the chunk waits
for a later step: a prompt stores and attends the same values however its neighbours cut the
budget, as it does alone (unless the whole budget is under a page, said once).

An evicting request's prompt stores up to `Request.peak_tokens` before its eviction brings it
down to its budget (the whole prompt, or budget + Engine.prefill_eviction_chunk): with
`reserve_prefill` (the default) it is admitted only when that peak, plus what the evicting
prompts already in prefill still need to reach theirs, plus the watermark, fits in the free
pages, so prompts in prefill together never overcommit the pool (issue 19: with admission on
the first chunk alone, 32k-token prompts preempted each other dozens of times). Requests that
keep every token are admitted on their first chunk.

Pages are reserved here (PagePool.reserve, atomic). When the pool is full, the prefix cache
gives back pages only it holds (least recently used first); when that is not enough, the most
recently admitted running request is preempted: its pages are freed and it is recomputed later
(`preemption_mode="recompute"`), or copied to host memory and copied back ("swap").
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kvcompile.engine.prefix_cache import PrefixCache, page_hashes
from kvcompile.engine.request import Request, Status
from kvcompile.errors import KVCacheFullError

log = logging.getLogger("kvcompile")


@dataclass
class ScheduledSeq:
    req: Request
    start: int              # tokens of the request cached before this step
    n: int                  # tokens computed in this step
    slots: torch.Tensor     # [n] int64 pool slots of those tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # input ids still on the device (overlapped steps, engine/overlap.py `TokenFeed`)
    feed: object = None

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.seqs)


class Scheduler:
    def __init__(self, pool, prefix_cache: PrefixCache | None, max_num_batched_tokens: int,
                 max_num_seqs: int, preemption_mode: str = "recompute",
                 swap_space_bytes: int = 4 << 30, watermark: float = 0.01, count=None,
                 on_start=None, on_swap_out=None, on_swap_in=None):
        self.pool = pool
        self.on_start = on_start or (lambda req: None)   # a request got a new pool sequence
        # an evicting request swapped aside: its eviction bookkeeping leaves with it
        # (-> an object handed back to on_swap_in(req, saved) with its new sequence)
        self.on_swap_out = on_swap_out or (lambda req: None)
        self.on_swap_in = on_swap_in or (lambda req, saved: None)
        self.count = count or (lambda name, n=1: None)   # ModelState.count (telemetry)
        self.cache = prefix_cache
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.mode = preemption_mode
        self.swap_space = swap_space_bytes
        self.swap_used = 0
        self.watermark = max(1, int(watermark * pool.max_pages))
        # pages with a bf16 residual tail (int formats, KVConfig.residual) are recomputed
        self.pool_swappable = not any(getattr(t, "res_slot", None) is not None
                                      for t in pool.k + pool.v)
        # partial chunks end on page boundaries or wait (`_chunk`)
        self.whole_pages = any(t.fmt.shares_page for t in pool.k + pool.v)
        self._said_small = False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        # evicting prompts admitted only when their peak fits (module docstring), counting
        # the pages of evicting requests that their max_tokens ends in time (`_peaks_fit`)
        self.reserve_prefill = True
        self.lifetime_credit = True
        # evicting requests alone: the margin is their known growth, not the watermark
        # (`_margin`), and a prompt evicted every N tokens grows at most N a step
        self.exact_margin = True
        # requests that keep every token admitted by their whole life (`_lifetimes_fit`)
        self.reserve_plain = False
        # an evicting prompt whose peak does not fit while its evicted size does: evicting
        # decoders are swapped to host memory for its prefill (`_swap_aside`; the Engine
        # turns it on where it applies)
        self.swap_aside = False
        # decoders swapped aside for one prompt at most (1: when one does not make room, the
        # prompt waits for an evicting decoder to end instead, which keeps more running)
        self.swap_aside_most = 1
        self._in_flight: dict[int, int] = {}   # id(request) -> tokens scheduled this step
        self.max_model_len = 1 << 62   # (the engine sets its own)

    # -- queues ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def release(self, req: Request) -> None:
        """Take a request out of every queue and free its pages (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
        if req.seq_id is not None:
            self.pool.free([req.seq_id])
            req.seq_id = None
        if req.swapped is not None:
            self.swap_used -= req.swapped.nbytes
            req.swapped = None
            req.aside = None

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens
        done: set[int] = set()
        aside = (self.swap_aside and bool(self.waiting) and not self.swapped
                 and self._swap_aside(self.waiting[0]))
        budget = self._decode_all(out, done, budget)
        # 1-2. running: decodes first, then one chunk of each prefill in progress
        for decode_pass in (True, False):
            for req in list(self.running):
                if budget <= 0:
                    break
                if id(req) in done or req.status is not Status.RUNNING or req.hold:
                    continue
                if (req.to_compute == 1) != decode_pass:
                    continue
                n = self._chunk(req, budget)
                if n == 0:   # a chunk that would end inside a page waits for a later step
                    continue
                slots = self._reserve(req, n)
                while slots is None:
                    victim = self._victim(done, req)
                    if victim is None:
                        break
                    self._preempt(victim, out)
                    if victim is req:
                        break
                    slots = self._reserve(req, n)
                if slots is None:
                    continue
                out.seqs.append(ScheduledSeq(req, req.num_computed, n, slots))
                done.add(id(req))
                budget -= n
        if out.preempted:
            return out  # no admissions while the running ones do not fit
        self._in_flight = {id(q.req): q.n for q in out.seqs}   # (`_prefill_end`)
        # 3. swapped-out requests come back first (not into pages the evicting prompts in
        # prefill still need to reach their peaks: a request swapped aside waits for them)
        while self.swapped and len(self.running) < self.max_seqs:
            if aside:
                break   # (swapped aside in this step for a prompt not admitted yet)
            if self.swapped[0].aside is not None and not self._room_beside_prompts(
                    self.swapped[0]):
                break
            if not self._swap_in(self.swapped[0]):
                break
            self.running.append(self.swapped.popleft())
        # 4. waiting requests, first come first served
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            fresh = req.seq_id is None
            if fresh:
                self._start(req)
            n = self._chunk(req, budget)
            slots = None   # n == 0: a chunk that would end inside a page waits (`_chunk`)
            if n and fresh and req.peak_tokens is None and self.reserve_plain and \
                    self.running and not self._lifetimes_fit(req, n):
                n = 0   # (opt-in: a request that keeps every token, admitted by its lifetime)
            if n and (not fresh or req.peak_tokens is None or not self.reserve_prefill
                      or not self.running or self._peaks_fit(req, n)):
                # (an evicting prompt: room for its peak and the running prompts': docstring)
                slots = self._reserve(req, n, keep=self._margin(req) if self.running else 0)
            if slots is None:
                if fresh:
                    self.pool.free([req.seq_id])
                    req.seq_id, req.num_computed = None, 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed, n, slots))
            budget -= n
        return out

    def _swap_aside(self, req: Request) -> bool:
        """`swap_aside`: `req` is a fresh evicting prompt that waits because its peak (a whole
        prompt before its eviction) does not fit, although its evicted size does: a slot is
        free in the steady state, but not for the prompt's transient. Evicting decoders at
        their budget (the ones with the most tokens left first, at most `swap_aside_most`)
        are swapped to host memory until the peak fits; they come back, bit for bit and with
        their eviction bookkeeping, as soon as the prompt's eviction gives its transient back
        (`_room_beside_prompts`). Not for pages with a bf16 residual (not swappable), nor
        beyond the swap space. Returns whether it swapped any (then the step admits `req`
        before any swapped request comes back)."""
        P, pool = self.pool.page_size, self.pool
        if (req.seq_id is not None or req.peak_tokens is None or req.keep_tokens is None
                or not self.pool_swappable or not self.reserve_prefill
                or len(self.running) >= self.max_seqs or not self.running):
            return False
        # as step 4 will see it: after this step's decodes took their tokens (a page each for
        # a decoder whose pages are full) and their share of the step budget
        dec = [r for r in self.running if r.seq_id is not None
               and r.num_computed >= len(r.prompt_ids) and not r.hold]
        grow = {id(r): int(pool.seq_len(r.seq_id) % P == 0) for r in dec}
        n = min(len(req.prompt_ids), max(self.max_tokens - len(dec), 1))
        if self._peaks_fit(req, n, have=0, extra=sum(grow.values())):
            return False
        # the prompt's evicted size must fit by the end of its prefill (the free pages, and
        # those of the evicting decoders that end by then), so that the decoders swapped
        # aside come back right after it
        steps = -(-len(req.prompt_ids) // self.max_tokens) + 1
        left = self._tokens_left
        decoders = [r for r in dec
                    if r.evicts and r.keep_tokens is not None and not self._grows(r)]
        ending = sum(len(pool.pages_of(r.seq_id)) for r in decoders if left(r) + 1 <= steps)
        steady = -(-req.keep_tokens // P) + 2
        if pool.num_available - self._margin(req) + ending < steady:
            return False
        # (those that end during the prefill are the credit, not candidates)
        cands = [r for r in decoders if left(r) + 1 > steps]
        cands.sort(key=left, reverse=True)
        plan, space, fits = [], self.swap_space - self.swap_used, False
        for r in cands[:self.swap_aside_most]:
            need = self._swap_bytes(r)
            if need > space:
                break
            plan.append(r)
            space -= need
            fits = self._peaks_fit(req, n, have=0, without=plan, extra=sum(grow.values())
                                   - sum(grow.get(id(q), 0) for q in plan))
            if fits:
                break
        if not fits:
            return False
        for r in plan:
            saved = self.on_swap_out(r)
            self.running.remove(r)
            r.swapped = self.pool.swap_out(r.seq_id)
            r.aside = saved if saved is not None else ()   # (not None: swapped aside)
            self.swap_used += r.swapped.nbytes
            r.seq_id = None
            r.status = Status.SWAPPED
            self.swapped.append(r)
            self.count("swapped_aside")
        return True

    def _room_beside_prompts(self, req: Request) -> bool:
        """Whether swapped-out `req` may come back: its pages fit beside what the evicting
        prompts in prefill still add to reach their peaks, and the margin."""
        owed = sum(self._owed_pages(r) for r in self.running
                   if r.seq_id is not None and r.peak_tokens is not None
                   and r.num_computed < len(r.prompt_ids))
        return req.swapped.num_pages + owed + self._margin(req) <= self.pool.num_available

    def _owed_pages(self, r: Request) -> int:
        """Pages evicting prompt `r` (in prefill) still adds to reach its peak store."""
        return max(0, -(-r.peak_tokens // self.pool.page_size) - len(self.pool.pages_of(r.seq_id)))

    def _tokens_left(self, r: Request) -> int:
        """Tokens decoding request `r` may still add (its max_tokens, or max_model_len)."""
        return min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens)

    def _peaks_fit(self, req: Request, n: int, have: int | None = None,
                   without=(), extra: int = 0) -> bool:
        """Whether `req` (an evicting prompt about to reserve its first n tokens) may start:
        the evicting prompts in prefill (the running ones and `req`) can reach their peak
        stores (`Request.peak_tokens`) without preempting anyone. A prompt adds at most one
        step's tokens per step. With `lifetime_credit`, the pages of evicting requests that
        decode are counted as free from the step by which their max_tokens (or
        max_model_len) ends them at the latest: decodes are scheduled first, every step, and
        an evicting sequence holds its pages alone. Requests that keep every token are not
        planned for beyond the watermark (their decodes: a page per page_size steps each).
        have: the tokens `req` stores (None: its sequence's); without: running requests
        counted as gone, their pages free (`_swap_aside`'s plan); extra: pages taken before
        `req` reserves (this step's decodes, when asked before they reserve)."""
        P, pool = self.pool.page_size, self.pool
        if have is None:
            have = pool.seq_len(req.seq_id)
        gone = {id(r) for r in without}   # (`_swap_aside`: decoders it would swap out)
        free = (pool.num_available - self._margin(req) - extra
                - (-(-(have + n) // P) - -(-have // P))
                + sum(len(pool.pages_of(r.seq_id)) for r in without))
        running = [r for r in self.running if id(r) not in gone]
        if free < 0:
            return False
        g = -(-self.max_tokens // P) + 1   # pages a prompt may add in one step

        def rate(r):   # a prompt evicted every N tokens computes at most N of them a step
            return min(g, -(-r.evict_every // P) + 1) if self.exact_margin and r.evict_every \
                else g

        # (pages owed at the peak, pages a step, steps to its last chunk, pages owed after)
        owe = [(max(0, -(-req.peak_tokens // P) - -(-(have + n) // P)), rate(req), None, 0)]
        ends: list[tuple[int, int]] = []   # (steps until its pages are free, pages)
        plain = 0                          # decoding requests that keep every token
        for r in running:
            if r.seq_id is None:
                continue
            if r.num_computed < len(r.prompt_ids):
                if r.peak_tokens is not None:
                    owe.append((self._owed_pages(r), rate(r),
                                *self._prefill_end(r, len(pool.pages_of(r.seq_id)))))
            elif not r.evicts:
                plain += 1
            else:
                if self.exact_margin and self._grows(r):
                    plain += 1   # (an evicting decoder below its budget grows as they do)
                if self.lifetime_credit:
                    ends.append((max(self._tokens_left(r), 0) + 1, len(pool.pages_of(r.seq_id))))
        if not self._chunks_every_step(req, owe):
            owe = [(o, r, None, 0) for o, r, _e, _a in owe]
        steps = max(-(-o // r) for o, r, _e, _a in owe)
        for j in range(1, steps + 1):
            need = sum(min(o, j * r) if e is None or j < e else min(o, a)
                       for o, r, e, a in owe) + plain * -(-j // P)
            credit = sum(pages for end, pages in ends if end <= j)
            if need > free + credit:
                return False
        return True

    def _lifetimes_fit(self, req: Request, n: int) -> bool:
        """`reserve_plain` (opt-in; off by default): a request that keeps every token starts
        only when the pages of its whole life (prompt + max_tokens) and what the running
        requests that keep every token still add until theirs end fit in the free pages, so
        none of them is ever preempted. Beside evicting requests it is not planned (True).
        The capacity bench's bf16 baseline uses it: admitted on their first chunk, bf16
        prompts overcommit the pool, are preempted and recomputed, and count as running
        meanwhile (issue 19: 2.05 sequences "running" in a budget of 2)."""
        P, pool = self.pool.page_size, self.pool

        def life(r):
            return -(-min(len(r.prompt_ids) + r.params.max_tokens, self.max_model_len) // P)

        owe = life(req) - -(-n // P)
        for r in self.running:
            if r.seq_id is None:
                continue
            if r.evicts:
                return True
            owe += max(0, life(r) - len(pool.pages_of(r.seq_id)))
        return owe <= pool.num_available - -(-n // P)

    def _prefill_end(self, r: Request, held: int) -> tuple[int | None, int]:
        """(steps until the last chunk of `r`'s prompt has run, the pages it owes afterwards
        beyond the `held` ones, negative where it gives pages back): a prompt evicted every N
        tokens (N whole pages) computes one N-token chunk a step while `_chunks_every_step`
        (counting the chunk this step already scheduled), then decodes at its policy's budget
        (`Request.keep_tokens`: its pages, plus one a window hides and one its decode step
        adds). (None, 0) where that is not known."""
        P, N = self.pool.page_size, r.evict_every
        if not (self.exact_margin and N and N % P == 0 and r.keep_tokens is not None):
            return None, 0
        done = r.num_computed + self._in_flight.get(id(r), 0)   # (this step's chunk too)
        chunks = -(-len(r.prompt_ids) // N) - done // N
        return chunks + 1, -(-r.keep_tokens // P) + 2 - held   # (< 0: it gives pages back)

    def _chunks_every_step(self, req: Request, owe) -> bool:
        """Whether every prompt in prefill (and the new one) gets its whole chunk each step:
        their chunks and one token per running request fit in the step's budget (decodes,
        then prompts in prefill, are scheduled before any admission)."""
        chunks = sum(r.evict_every for r in self.running
                     if r.seq_id is not None and r.num_computed < len(r.prompt_ids))
        decodes = sum(1 for r in self.running
                      if r.seq_id is not None and r.num_computed >= len(r.prompt_ids))
        return (all(e is not None for _o, _r, e, _a in owe[1:])
                and chunks + (req.evict_every or self.max_tokens) + decodes <= self.max_tokens)

    def _margin(self, req: Request) -> int:
        """Pages an admission leaves free for the running requests' next step. The watermark
        (1% of the pool) covers what requests that keep every token may add; when `req` and
        every running request evict (`exact_margin`), what they add is known: a decoding
        evicting sequence stores one token before its eviction (at most one new page a step),
        and the prompts in prefill are planned by their peaks (`_peaks_fit`). At issue 19's
        32k shape the 1% watermark was 83 fp8 pages, most of the room a prompt's chunk needs
        beside 8 decoders."""
        if not (self.exact_margin and req.evicts
                and not any(self._grows(r) for r in self.running)):
            return self.watermark
        decoders = sum(1 for r in self.running
                       if r.seq_id is not None and r.num_computed >= len(r.prompt_ids))
        return max(1, min(self.watermark, decoders))   # (never more than the watermark)

    def _grows(self, r: Request) -> bool:
        """A running request whose decodes add pages over the steps: one that keeps every
        token, or an evicting one that stores fewer tokens than its policy keeps (a prompt
        shorter than its budget)."""
        if not r.evicts or r.keep_tokens is None:
            return True
        if r.seq_id is None or r.num_computed < len(r.prompt_ids):
            return False   # a prompt in prefill: planned by its peak (`_peaks_fit`)
        return self.pool.seq_len(r.seq_id) < r.keep_tokens

    def _decode_all(self, out: SchedulerOutput, done: set[int], budget: int) -> int:
        """The common case in one reserve call (one host-to-device copy of slots): every
        running decode fits. Otherwise nothing is taken here and the per-request loop decides
        (and preempts)."""
        reqs = [r for r in self.running if r.to_compute == 1 and not r.hold][:budget]
        if len(reqs) < 2:
            return budget
        try:
            slots = self.pool.reserve([r.seq_id for r in reqs], 1)
        except KVCacheFullError:
            return budget
        for i, r in enumerate(reqs):
            out.seqs.append(ScheduledSeq(r, r.num_computed, 1, slots[i:i + 1]))
            done.add(id(r))
        return budget - len(reqs)

    def rollback(self, out: SchedulerOutput) -> None:
        """Undo a step's reservations (the forward failed)."""
        for s in out.seqs:   # (stored lengths: an evicting sequence stores fewer than start)
            if s.req.seq_id is not None:
                sid = s.req.seq_id
                self.pool.truncate(sid, self.pool.seq_len(sid) - s.n)

    # -- helpers --------------------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of `req` to compute in this step (0: none, it waits for a later step)."""
        want = req.to_compute
        if req.evicts:  # evicting: the prompt attends in full, then one token per forward
            prompt = len(req.prompt_ids)
            want = prompt - req.num_computed if req.num_computed < prompt else 1
            if req.evict_every and req.num_computed < prompt:   # evicted at each multiple
                want = min(want, (req.num_computed // req.evict_every + 1) * req.evict_every
                           - req.num_computed)
        n = min(want, budget)
        if n < req.to_compute:  # partial chunk: end on a page boundary if that leaves any
            P = self.pool.page_size
            end = (req.num_computed + n) // P * P
            if end > req.num_computed:
                n = end - req.num_computed
            elif n < want and self.whole_pages:
                # the budget cuts this chunk inside a page: its page's tokens would be stored
                # (scales, residual) and attended otherwise than in one piece
                if self.max_tokens >= P - req.num_computed % P:
                    return 0
                if not self._said_small:
                    self._said_small = True
                    log.warning("kvcompile engine: max_num_batched_tokens=%d is under a page "
                                "(%d tokens): prompt chunks end inside pages, so a request's "
                                "tokens depend on how the step budget is cut (pages of shared "
                                "scales / residual); raise it to at least %d", self.max_tokens,
                                P, P)
        return n

    def _start(self, req: Request) -> None:
        """Give a waiting request a sequence, starting from the longest cached prefix."""
        req.seq_id = self.pool.allocate(1)[0]
        req.num_computed = 0
        req.num_registered = 0
        self.on_start(req)
        if self.cache is None or req.evicts:   # compaction rewrites its pages (engine.py)
            return
        P = self.pool.page_size
        req.page_hashes = page_hashes(req.all_ids, P, req.page_hashes)
        max_pages = (req.num_tokens - 1) // P   # at least one token left to compute
        pages = self.cache.match(req.page_hashes, max_pages)
        if pages:
            self.pool.attach(req.seq_id, pages)
            req.num_computed, req.num_registered = len(pages) * P, len(pages)
        if req.num_preemptions == 0:  # a prompt's first admission: count the lookup
            n = len(req.prompt_ids)
            req.num_cached_tokens = min(len(pages) * P, n)
            self.cache.record(n, req.num_cached_tokens)
            self.count("prefix_query_tokens", n)
            self.count("prefix_hit_tokens", req.num_cached_tokens)

    def _reserve(self, req: Request, n: int, keep: int = 0) -> torch.Tensor | None:
        """Slots for the next n tokens of req, evicting cached pages if needed; None if the pool
        cannot hold them (keeping `keep` pages free)."""
        for _ in range(2):
            try:
                if keep:
                    self._need_free(req, n, keep)
                return self.pool.reserve([req.seq_id], n)
            except KVCacheFullError as e:
                short = e.pages_requested - e.pages_free
                if self.cache is None or self.cache.evict(short) < short:
                    return None
        return None

    def _need_free(self, req: Request, n: int, keep: int) -> None:
        P, have = self.pool.page_size, self.pool.seq_len(req.seq_id)
        need = -(-(have + n) // P) - -(-have // P) + keep
        free = self.pool.num_available   # free pages, plus what a growing pool may add
        if need > free:
            raise KVCacheFullError(need, free, self.pool.max_pages)

    def _victim(self, done: set[int], current: Request) -> Request | None:
        for req in reversed(self.running):
            if id(req) not in done:
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.count("preemptions")
        out.preempted.append(req)
        # an evicting request is recomputed: its eviction bookkeeping stays with the sequence
        if (self.mode == "swap" and req.seq_id is not None and self.pool_swappable
                and not req.evicts):
            need = self._swap_bytes(req)
            if self.swap_used + need <= self.swap_space:
                req.swapped = self.pool.swap_out(req.seq_id)
                self.swap_used += req.swapped.nbytes
                req.seq_id = None
                req.status = Status.SWAPPED
                self.swapped.append(req)
                return
        if req.seq_id is not None:
            self.pool.free([req.seq_id])
        req.seq_id, req.num_computed, req.num_registered = None, 0, 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _swap_bytes(self, req: Request) -> int:
        pages = len(self.pool.pages_of(req.seq_id))
        return int(pages * self.pool.bytes_per_page)

    def _swap_in(self, req: Request) -> bool:
        for _ in range(2):
            try:
                req.seq_id = self.pool.swap_in(req.swapped)
                break
            except KVCacheFullError as e:
                short = e.pages_requested - e.pages_free
                if self.cache is None or self.cache.evict(short) < short:
                    return False
        else:
            return False
        self.on_start(req)
        if req.aside is not None:   # (swapped aside: its eviction bookkeeping comes back)
            self.on_swap_in(req, req.aside or None)
            req.aside = None
        self.swap_used -= req.swapped.nbytes
        req.swapped = None
        req.status = Status.RUNNING
        return True
