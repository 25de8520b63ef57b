"""`kvcompile.Engine`: continuous batching over the paged, quantized KV pool.

    engine = kvcompile.Engine(model, tokenizer, KVConfig(kv_dtype="fp8_e4m3"),
                              max_num_batched_tokens=2048)
    outs = engine.generate(["Hello", "Tell me"], SamplingParams(temperature=0, max_tokens=64))
    for delta in engine.stream("Once upon a time", SamplingParams(max_tokens=128)):
        print(delta.new_text, end="")

Requests may be added at any time (`add_request`, thread-safe); each `step()` runs one forward
over a token budget (scheduler.py), samples, and returns what each request produced. Bad input
raises `RequestError` at `add_request`. A request whose logits turn non-finite, whose forward
raises, or that can never get its pages finishes with `finish_reason="error"` and says why in
`error` (faults.py); the others are not affected.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator

from kvcompile.engine import faults, inputs, overlap
from kvcompile.engine.params import RequestError, SamplingParams
from kvcompile.engine.prefix_cache import PrefixCache, page_hashes
from kvcompile.engine.request import Request, RequestOutput
from kvcompile.engine.runner import ModelRunner
from kvcompile.engine.sampling import make_generator, pack, read_back, sample, sample_on_device
from kvcompile.engine.scheduler import Scheduler
from kvcompile.engine.stats import EngineStats, StepStats
from kvcompile.errors import NonFiniteKVError

log = logging.getLogger("kvcompile.engine")


class Engine:
    """model: a Hugging Face causal LM (compiled here with `config` unless already compiled with
    kvcompile). tokenizer: needed for string prompts, text output and stop strings.
    max_num_batched_tokens: tokens per step (prefill chunks + decodes). max_num_seqs: running
    requests at most. max_model_len: prompt + output tokens at most (default: the model's
    max_position_embeddings, capped by KVConfig.max_seq_len and the pool).
    preemption_mode: "recompute" or "swap" (host memory, at most swap_space_bytes).
    cuda_graphs: replay decode steps from CUDA graphs on CUDA (engine/cudagraph.py; also
    KVConfig.cuda_graphs=False turns them off).

    Eviction (KVConfig.eviction, per request SamplingParams.eviction): a prompt attends in
    full, however it is chunked, and is evicted at its end; each decode step then evicts, or
    every `eviction_interval` steps (a sequence holds at most budget + interval - 1 tokens;
    None: KVConfig.eviction_interval, 1 by default).
    Decode steps whose kept slots need no per-slot rule (SinkWindow, its sinks re-rotated or
    not, H2O, SnapKV; eviction/runtime.py `decode_aside` logs each exception once) run the
    decode kernel over the stored slots, from a CUDA graph where one applies, with H2O's mass
    and the sinks' rotation inside the step (eviction/aside.py), and evict after it on the
    device, without a host sync, for formats that move tokens exactly (unquantized, token- or
    tensor-scaled). H2O's mass store takes max_num_seqs + 1 rows of (budget + interval) fp32
    per layer and kv head, outside the pool's budget. Evicting requests neither read nor offer
    prefix-cache pages and are preempted by recompute (which replays each eviction).

    prefill_eviction_chunk (0: off, the default): N > 0 evicts an evicting request's prompt
    after every N of its tokens (at prompt positions N, 2N, ...; chunks are cut there), so a
    prompt holds at most its policy's budget + N tokens (+ a page) instead of all its tokens
    until its end. Prompt queries then see the kept tokens of the earlier chunks, not all of
    them: StreamingLLM's own semantics for SinkWindow, a per-chunk observation window for
    SnapKV (H2O: the mass so far). It changes outputs (benchmarks/RESULTS.md, "issue 19,
    evict19f", measures the quality) and is the same for any step budget and neighbours (the
    eviction points are fixed by N). It is off by default because it changes what a prompt
    attends to. Admission: an evicting prompt is admitted only when its peak (the whole prompt,
    or budget + N with this option), plus what the evicting prompts already in prefill still
    need, fits in the free pages (scheduler.py, `reserve_prefill`); requests that keep every
    token are admitted on their first chunk.

    swap_aside (default None: on wherever it applies, since the sixteenth session; False
    turns it off, True says when it cannot apply): when an evicting prompt waits because its
    peak does not fit
    although its evicted size does (a slot is free in the steady state, not for the prompt's
    transient), an evicting decoder at its budget is copied to host memory (within
    swap_space_bytes) for the prompt's prefill and comes back, bit for bit with its eviction
    bookkeeping, once the prompt's eviction gives the transient back (scheduler.py
    `_swap_aside`). Outputs are unchanged; the host copies cost two transfers of the
    decoder's pages.
    Not for pages with a bf16 residual (KVConfig.residual), which are not swapped.

    Tensor parallelism (a model sharded over ranks, README "Multi-GPU"): one Engine per rank,
    each fed the same requests in the same order; every step's schedule is compared across the
    ranks before the forward (TensorParallelError when they differ) and rank 0's sampled tokens
    are used on every rank.

    async_steps (default False until its GPU check has run: the overlap, its pinned copies and
    double-buffered graph inputs are tested on the CPU only): a step is queued on the device and
    the next one is scheduled
    and queued before the first one's tokens are read back (engine/overlap.py); outputs are
    those of the synchronous loop, each delivered one `step()` call later. Where a feature
    needs the host between steps (repetition_penalty, eviction, tensor parallelism,
    check_finite) those steps run synchronously; `kvcompile.report` says so once per reason
    and `stats.sync_reasons` counts them. False: every step reads its tokens before returning."""

    def __init__(self, model, tokenizer=None, config=None, *, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 swap_space_bytes: int = 4 << 30, seed: int = 0, log_every: int = 0,
                 cuda_graphs: bool = True, eviction_interval: int | None = None,
                 prefill_eviction_chunk: int = 0, async_steps: bool = False,
                 swap_aside: bool | None = None):
        from kvcompile.api import _STATE_ATTR
        from kvcompile.api import compile as kv_compile

        for name, v in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs), ("swap_space_bytes", swap_space_bytes),
                        ("eviction_interval", 1 if eviction_interval is None
                         else eviction_interval)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RequestError(f"Engine {name}={v!r}: must be an int >= 1")
        v = prefill_eviction_chunk
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RequestError(f"Engine prefill_eviction_chunk={v!r}: must be an int >= 0 (0: "
                               f"a prompt attends in full and is evicted at its end)")
        self.prefill_eviction_chunk = v
        if not isinstance(async_steps, bool):
            raise RequestError(f"Engine async_steps={async_steps!r}: must be True or False")
        self.overlap = async_steps
        self._pending: overlap.PendingStep | None = None   # launched, tokens not read yet
        if preemption_mode not in ("recompute", "swap"):
            raise RequestError(f"Engine preemption_mode={preemption_mode!r}: allowed: "
                               f"'recompute', 'swap'")
        state = model.__dict__.get(_STATE_ATTR)   # compiled by kvcompile.compile(model)
        if state is None:
            kv_compile(model, config)
            state = model.__dict__[_STATE_ATTR]
        elif config is not None:
            raise RequestError("this model is already compiled with kvcompile; pass config=None "
                               "(the engine uses the model's own KVConfig)")
        self.model, self.tokenizer, self.state = model, tokenizer, state
        self.runner = ModelRunner(model, state, max_batch=max_num_seqs, cuda_graphs=cuda_graphs)
        if state.pool is None:
            self.runner.warm_up()
        self.pool = state.pool
        # the layers an eviction policy manages (KVConfig.eviction); requests may override
        # the policy (SamplingParams.eviction)
        self.eviction = state.eviction if state.eviction is not None and \
            state.eviction.policies else None
        if self.eviction is not None:
            self.eviction.interval = (eviction_interval if eviction_interval is not None
                                      else state.config.eviction_interval)
            self.eviction.set_aside_rows(max_num_seqs)   # H2O mass of decoding sequences
        self.max_model_len = inputs.max_model_len(model, state, max_model_len)
        if self.runner.graphs is not None:
            self.runner.graphs.max_len = self.max_model_len
            # every decode bucket captured up front (CUDA only): no step pays a capture
            self.runner.graphs.capture_all()
        self.prefix_cache = PrefixCache(self.pool) if enable_prefix_caching else None
        if self.eviction is not None and self.prefix_cache is not None:
            log.info("kvcompile engine: requests that evict neither read nor offer prefix-cache "
                     "pages (compaction rewrites a sequence's pages in place)")
        self.scheduler = Scheduler(self.pool, self.prefix_cache, max_num_batched_tokens,
                                   max_num_seqs, preemption_mode, swap_space_bytes,
                                   count=state.count, on_start=self._on_start,
                                   on_swap_out=self._on_swap_out, on_swap_in=self._on_swap_in)
        applies = self.eviction is not None and self.scheduler.pool_swappable
        self.scheduler.swap_aside = applies if swap_aside is None else bool(swap_aside)
        if swap_aside and not applies:
            why = ("the model evicts nothing (no KVConfig.eviction)" if self.eviction is None
                   else "its pages have a bf16 residual tail, which is not swapped")
            log.warning("kvcompile engine: swap_aside=True does nothing here: %s; evicting "
                        "prompts wait for their peak to fit instead", why)
        self.scheduler.max_model_len = self.max_model_len
        self.eos_ids = inputs.eos_ids(model, tokenizer)
        self.vocab_size = inputs.vocab_size(model)
        self.seed = seed
        self.log_every = log_every
        self.stats = EngineStats()
        self.history: deque[StepStats] = deque(maxlen=4096)
        self.on_step: list = []                # callbacks(StepStats)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, on_output=None) -> str:
        """Queue a request: `prompt` is a string (needs the tokenizer) or token ids. Returns its
        id. `on_output(RequestOutput)` is called after every step that changes it."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = inputs.token_ids(prompt, self.tokenizer)
        inputs.check_request(ids, params, self.vocab_size, self.max_model_len, self.pool)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer: Engine(model, tokenizer)")
        evicts = self._check_eviction(params)
        peak = self._peak_tokens(ids, params) if evicts else None
        with self._lock:
            n = next(self._ids)
            if request_id is None:  # skip numbers an explicit id already took
                while str(n) in self._requests:
                    n = next(self._ids)
            rid = str(n) if request_id is None else str(request_id)
            if rid in self._requests:
                raise RequestError(f"request id {rid!r} is already in use")
            seed = params.seed if params.seed is not None else hash((self.seed, n)) % (1 << 62)
            gen = make_generator(seed, self.runner.device)
            req = Request(rid, ids, params, gen, self.tokenizer, on_output)
            req.evicts = evicts
            if evicts:
                req.evict_every = self.prefill_eviction_chunk
                req.peak_tokens = peak
                req.keep_tokens = self._keep_tokens(params)
            self._requests[rid] = req
            self.scheduler.add(req)
            self.stats.requests_added += 1
            self.stats.prompt_tokens += len(ids)
        return rid

    def _check_eviction(self, params: SamplingParams) -> bool:
        """Whether the request evicts; RequestError for a policy the engine cannot run."""
        policy = params.eviction
        if policy == "model":
            return self.eviction is not None
        if policy is None:
            return False
        if self.eviction is None:
            raise RequestError(f"SamplingParams.eviction={policy!r} needs a model compiled with "
                               f"an eviction policy (KVConfig(eviction=...): the layers it "
                               f"manages); this model keeps every token")
        from kvcompile.errors import KVConfigError
        from kvcompile.eviction.policies import rules_of

        try:
            rules_of(policy)
        except KVConfigError as e:
            raise RequestError(f"SamplingParams.eviction={policy!r}: {e}") from None
        return True

    def _peak_tokens(self, ids, params: SamplingParams) -> int:
        """Tokens an evicting request stores at most while its prompt is computed: the whole
        prompt, or (prefill_eviction_chunk N) its policy's largest budget + N + a page (the
        scheduler's admission, `Scheduler.reserve_prefill`)."""
        from kvcompile.eviction.policies import budget_of

        n = len(ids)
        pols = self._request_policies(params)
        if not self.prefill_eviction_chunk or pols is None:
            return n   # (None: a layer without a policy keeps every token)
        # (+ a page: a window evicted without moving tokens hides some in a page it keeps)
        return min(n, max(budget_of(p) for p in pols) + self.prefill_eviction_chunk
                   + self.pool.page_size)

    def _keep_tokens(self, params: SamplingParams) -> int | None:
        """The most tokens an evicting request stores once evicted (its policies' largest
        budget), or None where a layer keeps every token or a policy does not evict while
        decoding (SnapKV without `hold` grows by every decoded token): the scheduler's margin,
        `Scheduler._margin`, plans such a decoder as one that grows."""
        from kvcompile.eviction.policies import decode_budget

        pols = self._request_policies(params)
        if pols is None:
            return None
        budgets = [decode_budget(p) for p in pols]
        return None if None in budgets else max(budgets)

    def _request_policies(self, params: SamplingParams) -> list | None:
        """The policies an evicting request's layers evict by, or None where a layer has no
        policy (it keeps every token)."""
        if len(self.eviction.policies) < len(self.state.layer_specs):
            return None
        return (list(self.eviction.policies.values()) if params.eviction == "model"
                else [params.eviction])

    def _on_start(self, req: Request) -> None:
        """The scheduler gave `req` a new pool sequence: its eviction policy follows it."""
        if self.eviction is not None and req.params.eviction != "model":
            self.eviction.set_sequence_policy(req.seq_id, req.params.eviction)

    def _on_swap_out(self, req: Request):
        """An evicting request is swapped aside (scheduler.py `_swap_aside`): its eviction
        bookkeeping leaves its pool sequence with it."""
        return self.eviction.detach(req.seq_id) if self.eviction is not None else None

    def _on_swap_in(self, req: Request, saved) -> None:
        if self.eviction is not None:
            self.eviction.attach(req.seq_id, saved)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already finished. With
        overlapped steps its token in flight, not yet delivered, is dropped."""
        with self._lock:
            req = self._requests.get(str(request_id))
            if req is None or req.finished:
                return False
            # (a token of it still in flight is dropped: abort never waits for the device)
            self.scheduler.release(req)
            req.finish("abort")
            self._done(req)
            self._emit(req)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- driving --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; the outputs of the requests that changed. With
        overlapped steps (async_steps) the step is queued on the device and the outputs are
        those of the step before it, read back once this one is queued."""
        with self._lock:
            t0 = time.perf_counter()
            changed: list[Request] = []
            generated = 0
            pending, self._pending = self._pending, None
            if pending is not None:
                overlap.hold_finished_by_length(self)
                if not overlap.continuable(self):   # the synchronous loop's next step differs
                    generated += self._resolve(pending, changed)
                    pending = None
            out = self.scheduler.schedule()
            if self.state.tp is not None:   # before the forward: its all-reduces would hang
                self._check_same_schedule(out)
            if out.seqs:
                generated += self._run(out, changed, pending)
            elif pending is not None:
                generated += self._resolve(pending, changed)
            elif faults.stalled(self, out):
                changed.append(faults.fail_unschedulable(self))
            changed = list({id(r): r for r in changed}.values())
            for req in changed:
                if req.finished:
                    self._done(req)
            outputs = [self._emit(req) for req in changed]
            self._record(out, time.perf_counter() - t0, generated)
            return outputs

    def generate(self, prompts, params: SamplingParams | list | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion (with whatever else is queued); outputs in prompt order."""
        if hasattr(prompts, "tolist"):   # a tensor or array of token ids
            prompts = prompts.tolist()
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0],
                                                                           numbers.Number))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        final: dict[str, RequestOutput] = {}
        rids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                rids.append(self.add_request(p, sp, on_output=lambda o: o.finished and
                                             final.setdefault(o.request_id, o)))
        except BaseException:  # a bad prompt: none of this call's requests stays queued
            for rid in rids:
                self.abort(rid)
            raise
        while any(r not in final for r in rids):
            self.step()
        return [final[r] for r in rids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a request's output after every step that adds to it (new_token_ids, new_text);
        the last one has finished=True. Other requests in flight progress meanwhile."""
        q: deque[RequestOutput] = deque()
        rid = self.add_request(prompt, params, on_output=q.append)
        finished = False
        try:
            while not finished:
                while not q:
                    self.step()
                o = q.popleft()
                finished = o.finished
                yield o
        finally:
            if not finished:
                self.abort(rid)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template, with the assistant's
        generation prompt."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer: Engine(model, tokenizer)")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if not isinstance(ids, list):   # a BatchEncoding (transformers 5 returns a dict)
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: the tokenizer's chat template with a generation prompt."""
        return self.generate([self.chat_prompt(messages)], params)[0]

    def close(self) -> None:
        """Abort everything and drop the prefix cache: the engine's pages return to the pool."""
        with self._lock:
            self._flush()   # (a launched step's kernels would write the pages freed below)
            for rid in list(self._requests):
                self.abort(rid)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            if self.runner.graphs is not None:
                self.runner.graphs.close()

    # -- internals ------------------------------------------------------------------------------
    def _run(self, out, changed: list[Request], pending=None) -> int:
        """The step's forward and sampling; a failure stays with its request (faults.py).
        pending: the launched step before it (its tokens feed this step's placeholder ids);
        read back here once this step is queued."""
        reason = overlap.sync_reason(self, out)
        if reason is not None:
            self._note_sync(reason)
        try:
            out.feed = overlap.feed_for(out, pending)
            fed = len(out.feed.rows) if out.feed is not None else 0
            assert fed == sum(1 for x in out.seqs if x.req.unresolved), \
                "a placeholder input id is not fed from the device"
            logits = self.runner.forward(out)
        except NonFiniteKVError as e:
            self.scheduler.rollback(out)
            changed.append(self._fail_at(out, e))
            return 0
        except Exception as e:  # noqa: BLE001  (isolated to the request that causes it)
            self.scheduler.rollback(out)
            if pending is not None:   # read it, then run the step as the synchronous loop does
                return self._resolve(pending, changed) + self._retry_synchronously(changed)
            return faults.forward_failed(self, out, e, changed)
        except BaseException:   # KeyboardInterrupt and the like: the step did not happen
            self.scheduler.rollback(out)
            if pending is not None:
                self._resolve(pending, changed)
            raise
        if reason is not None:
            assert pending is None, "a synchronous step after a launched one"
            return self._advance(out, logits, changed)
        self._launch(out, logits)
        generated = 0
        if pending is not None:
            self.stats.overlapped_steps += 1
            generated = self._resolve(pending, changed)
        if self._pending is not None and overlap.ends_here(self):
            # nothing can run after it: read it now rather than in a step() of its own
            generated += self._resolve(self._pending, changed)
            self._pending = None
        return generated

    def _flush(self) -> None:
        """Read the launched step back now (abort, close): its outputs are emitted."""
        if self._pending is None:
            return
        changed: list[Request] = []
        pending, self._pending = self._pending, None
        self._resolve(pending, changed)
        for req in changed:
            if req.finished:
                self._done(req)
            self._emit(req)

    def _retry_synchronously(self, changed: list[Request]) -> int:
        out = self.scheduler.schedule()
        if not out.seqs:
            return 0
        try:
            logits = self.runner.forward(out)
        except NonFiniteKVError as e:
            self.scheduler.rollback(out)
            changed.append(self._fail_at(out, e))
            return 0
        except Exception as e:  # noqa: BLE001
            self.scheduler.rollback(out)
            return faults.forward_failed(self, out, e, changed)
        return self._advance(out, logits, changed)

    def _sampled_rows(self, out) -> tuple[list[int], list[Request], list[int]]:
        """The step's rows that reach their request's last token (and sample), their requests
        and how many tokens each request has computed after the step."""
        rows, reqs, upto = [], [], []
        for i, s in enumerate(out.seqs):
            s.req.num_computed = s.start + s.n
            if s.req.num_computed == s.req.num_tokens:
                rows.append(i)
                reqs.append(s.req)
                upto.append(s.req.num_computed)
        return rows, reqs, upto

    def _sampling_inputs(self, logits, out, rows, reqs):
        sel = logits if len(rows) == len(out.seqs) else logits[rows]
        return (sel, [r.params for r in reqs], [r.generator for r in reqs],
                [r.all_ids if r.params.repetition_penalty != 1.0 else [] for r in reqs],
                [self._banned(r) for r in reqs])

    def _launch(self, out, logits) -> None:
        """Queue the step's sampling on the device and its read-back; each request that
        sampled gets a placeholder output id (overlap.py)."""
        rows, reqs, upto = self._sampled_rows(out)
        if not rows:
            return
        inputs = self._sampling_inputs(logits, out, rows, reqs)
        tokens, bad, lps = sample_on_device(*inputs)
        host, ready = overlap.read_later(pack(tokens, bad, lps))
        index = []
        for r in reqs:
            index.append(len(r.output_ids))
            r.output_ids.append(overlap.PLACEHOLDER)
            r.unresolved += 1
        self._pending = overlap.PendingStep(out, reqs, index, inputs[1], upto, tokens, host,
                                            ready)
        self.stats.launched_steps += 1

    def _resolve(self, pending, changed: list[Request]) -> int:
        """Read a launched step's tokens (waiting for it) and take them as `_advance` does."""
        tokens, lps, ok = read_back(pending.read(), pending.params)
        taken = self._take(pending.reqs, tokens, lps, ok, changed, pending.index, pending.upto)
        for req in pending.reqs:   # out of the queues now: the next schedule may follow at once
            if req.finished:
                self.scheduler.release(req)
        return taken

    def _advance(self, out, logits, changed: list[Request]) -> int:
        rows, reqs, upto = self._sampled_rows(out)
        if not rows:
            return 0
        tokens, lps, ok = sample(*self._sampling_inputs(logits, out, rows, reqs))
        if self.state.tp is not None:   # rank 0 samples for all (identical logits or not)
            tokens = self.state.tp.broadcast_tokens(tokens)
            ok = [t >= 0 for t in tokens]
        return self._take(reqs, tokens, lps, ok, changed, [len(r.output_ids) for r in reqs],
                          upto)

    def _take(self, reqs, tokens, lps, ok, changed: list[Request], index: list[int],
              upto: list[int]) -> int:
        """Each request's sampled token (at output index `index`: a placeholder, or the next
        id), its stop conditions; upto: its computed tokens after the step that sampled."""
        now = time.perf_counter()
        taken = 0
        for req, i, n, tok, lp, good in zip(reqs, index, upto, tokens, lps, ok):
            if req.finished:   # it stopped on the step before (overlapped): discarded
                continue
            changed.append(req)
            if not good:
                req.finish("error", f"non-finite logits at token {len(req.prompt_ids) + i} of "
                           f"request {req.id}; this request was stopped, the others go on")
                self.stats.requests_failed += 1
                continue
            self._register(req, n)
            if i < len(req.output_ids):
                assert req.output_ids[i] == overlap.PLACEHOLDER and \
                    i == len(req.output_ids) - req.unresolved, "tokens read back out of order"
                req.output_ids[i] = tok
                req.unresolved -= 1
            else:
                req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.logprobs is not None:
                req.logprobs.append(lp)
            self._check_stop(req, tok)
            taken += 1
        self.stats.generated_tokens += taken
        return taken

    def _note_sync(self, reason: str) -> None:
        """A step runs synchronously for `reason`: counted, and said once in the report."""
        r = self.stats.sync_reasons
        r[reason] = r.get(reason, 0) + 1
        if r[reason] == 1 and self.overlap:
            self.state.kernels.note(f"engine: steps run synchronously, not overlapped ({reason})")

    def _check_same_schedule(self, out) -> None:
        """Tensor parallelism: every rank runs its own scheduler over its own pool shard, fed
        the same requests in the same order; they must decide the same step (requests, token
        counts, pages), or the ranks' forwards would no longer match. TensorParallelError on
        every rank when they do not."""
        step = [(s.req.id, s.start, s.n, tuple(self.pool.pages_of(s.req.seq_id)))
                for s in out.seqs] + [("preempted", r.id) for r in out.preempted]
        self.state.tp.check_same(
            f"schedule at step {self.stats.steps + 1}", zlib.crc32(repr(step).encode()),
            "every rank must add the same requests (same prompts, SamplingParams and ids) in "
            "the same order, with the same Engine arguments, and step together")

    def _banned(self, req: Request) -> list[int]:
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            return []
        return ([] if p.ignore_eos else list(self.eos_ids)) + list(p.stop_token_ids)

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        stop_str = req.detok.add(tok) if req.detok is not None else None
        n = len(req.output_ids) - req.unresolved
        if n >= p.min_tokens and stop_str is not None:
            req.finish("stop", stop_string=True)
        elif n >= p.min_tokens and (tok in p.stop_token_ids
                                    or (not p.ignore_eos and tok in self.eos_ids)):
            req.finish("stop")
        elif n >= p.max_tokens or len(req.prompt_ids) + n >= self.max_model_len:
            req.finish("length")

    def _register(self, req: Request, computed: int) -> None:
        """Offer the request's newly filled pages (of its first `computed` tokens) to the
        prefix cache."""
        if self.prefix_cache is None or req.seq_id is None or req.evicts:
            return   # compaction rewrites an evicting sequence's pages in place
        P = self.pool.page_size
        full = computed // P
        if full <= req.num_registered:
            return
        req.page_hashes = page_hashes(req.tokens(0, full * P), P, req.page_hashes[:full])
        pages = self.pool.pages_of(req.seq_id)
        lo = req.num_registered
        self.prefix_cache.insert(req.page_hashes[lo:full], pages[lo:full])
        req.num_registered = full

    def _fail_at(self, out, e: NonFiniteKVError) -> Request:
        """NonFiniteKVError (KVConfig.check_finite) in a packed step: fail the request whose
        token it was; the step is retried without it."""
        pos = e.position
        for s in out.seqs:
            pos -= s.n
            if pos < 0:
                break
        req = s.req
        self.scheduler.release(req)
        req.finish("error", f"non-finite {e.which} entering the KV cache (layer {e.layer}); "
                   f"this request was stopped, the others go on")
        self.stats.requests_failed += 1
        return req

    def _done(self, req: Request) -> None:
        self.scheduler.release(req)
        self._requests.pop(req.id, None)
        self.stats.requests_finished += 1

    def _emit(self, req: Request) -> RequestOutput:
        o = req.output()
        if req.on_output is not None:
            req.on_output(o)
        return o

    def _record(self, out, dt: float, generated: int) -> None:
        s = self.stats
        s.steps += 1
        s.preemptions += len(out.preempted)
        s.computed_tokens += out.num_tokens
        s.busy_s += dt
        decode = sum(1 for x in out.seqs if x.n == 1 and x.start >= len(x.req.prompt_ids))
        st = StepStats(
            step=s.steps, duration_s=dt, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_swapped=len(self.scheduler.swapped),
            num_scheduled=len(out.seqs), prefill_tokens=out.num_tokens - decode,
            decode_tokens=decode, generated_tokens=generated, pages_used=self.pool.num_pages
            - self.pool.num_free, pages_free=self.pool.num_free,
            pages_cached=len(self.prefix_cache) if self.prefix_cache is not None else 0,
            preemptions=len(out.preempted),
            tokens_per_s=out.num_tokens / dt if dt > 0 else 0.0,
            generated_per_s=generated / dt if dt > 0 else 0.0,
            prefix_hit_rate=self.prefix_cache.hit_rate if self.prefix_cache is not None else 0.0)
        self.history.append(st)
        for cb in self.on_step:
            cb(st)
        if self.log_every and s.steps % self.log_every == 0:
            log.info("%s", st)
