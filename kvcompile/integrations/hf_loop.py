"""`generate`'s decode loop on the device (KVConfig.device_loop): greedy and warper sampling.

transformers' `_sample` runs each decode step as: its kwargs update and
`prepare_inputs_for_generation` on the host, the forward (here a CUDA graph replay,
integrations/hf_graphs.py), then, outside the graph, the logits copied to fp32, the logits
processors, argmax, the finished rows' padding, `torch.cat` of the ids, the stopping criteria
and the stop check: about 41 small kernels and 14 copies a step on the GPU besides the graph,
and the host's Python between them (benchmarks/host_gap.py: the step 124 us longer than its
graph at B16 x P4096 on the H100 with the stop check deferred).

For a compiled model whose decode steps replay CUDA graphs, kvcompile takes over `_sample`
(`GenerationMixin._sample` wrapped at install, integrations/hf.py) for greedy decoding and
for sampling through transformers' warpers (temperature, top-k, top-p, min-p) and,
from the first decode step that replayed a graph on, runs each step as two replays and no
Python of transformers':
- the forward's graph (`GraphedForward.step`: the pool's slots reserved, the plan staged and
  uploaded, the replay), its inputs already in the graph's buffers;
- a captured *tail* over the forward graph's static logits: the token chosen in fp32
  (argmax; or the warpers, softmax and a draw, `_Choice`), a finished row's
  token replaced by the pad token, the token stored in the call's output buffer at the step's
  column (a device counter), the next step's inputs written into the forward graph's buffers
  (input ids, position ids + 1, cache position + 1; the attention mask needs nothing: its
  columns past the captured width are ones, which is what `generate` appends), the finished
  rows updated against the EOS ids and the flag "every row finished" set.
The host reads that flag a step late (pinned memory behind an event, as transformers'
DeferredStopCheck does): it queues step n + 1 before step n has finished. A streamer gets each
step's tokens the same way, a step late, and never a token past the stop. A call whose rows
all stop at EOS runs one step more, whose token is dropped and whose cache entry is cropped
(`cache.crop`), as with the deferred check. A length limit is known in advance: no extra step.

The prefill, the first token and any step that did not replay a graph run as `_sample` runs
them (`_prefill`, `prepare_inputs_for_generation`, the model's forward,
`_update_model_kwargs_for_generation`, the same selection in fp32). Greedy tokens are
transformers' own: the same forwards, the same argmax. Sampled tokens follow the same
distribution but not transformers' random draws (`_Choice`: a graph-safe draw instead of
`torch.multinomial`): a seed reproduces kvcompile's samples, not transformers'. The decode
holds the model's lock (the graph's input buffers carry the call's state from step to step):
`generate` calls from several threads decode in turn.

transformers' loop keeps the call (said once in `kvcompile.report`, counted as
`generate_device_loop_refused`) where it needs its host work or its exact behaviour:
logits processors other than the sampling warpers (repetition penalties, forced or
suppressed tokens, minimum lengths: any), stopping criteria other than the length limit and EOS (stop
strings, a time limit), `return_dict_in_generate`, a cache passed in, an assistant's loop,
synced GPUs, a runtime hook (`kvcompile inspect` / `verify`), and `KVConfig.device_loop=False`
(KVCOMPILE_DEVICE_LOOP=0). A model with an eviction policy runs the loop with its steps
through the model's forward (`_evicting`: a graph where the eviction runtime steps aside, the
compiled forward where its rules need the host), inputs from the tail's own buffers. Without CUDA graphs for the
decode steps (their own reason in the report) it is not offered.
"""

from __future__ import annotations

import contextlib

import torch

from kvcompile.integrations.hf_graphs import GraphedForward, cache_of

# the devices whose graphed decode steps the loop runs (the tests add "cpu", with the graphs'
# capture and replay emulated)
LOOP_DEVICES = ("cuda",)
_STOPS = {"MaxLengthCriteria", "EosTokenCriteria"}
# logits processors the tail runs (transformers' own objects, called inside the capture): the
# sampling warpers, pure functions of the scores (none reads the ids or keeps state)
_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
            "MinPLogitsWarper"}


def refusal(model, input_ids, logits_processor, stopping_criteria, generation_config,
            synced_gpus, streamer, model_kwargs) -> tuple[GraphedForward | None, str]:
    """(forward, why not): forward None where the loop is not kvcompile's to offer (not a
    compiled model, not on CUDA, graphs off for its decode steps: transformers' loop,
    nothing said); why "" where it runs, else the reason transformers' loop keeps the call.
    (The pool may not exist yet: a first call's prefill makes it. Where its formats then
    refuse graphs, the loop runs every step as transformers would, stop check deferred.)"""
    fwd = getattr(model, "forward", None)
    if not isinstance(fwd, GraphedForward):
        return None, ""
    st = fwd.state
    dev = input_ids.device
    if (dev.type not in LOOP_DEVICES or not st.config.cuda_graphs or st.config.check_finite
            or not st.kernels.use_triton(dev) or fwd._why_not):
        return None, ""
    cfg = generation_config
    cache = cache_of(model_kwargs)
    names = sorted({type(p).__name__ for p in logits_processor or ()}
                   - (_WARPERS if cfg.do_sample else set()))
    stops = sorted({type(c).__name__ for c in stopping_criteria or ()} - _STOPS)
    why = ""
    if not st.config.device_loop:
        why = "KVConfig.device_loop is False (KVCOMPILE_DEVICE_LOOP=0)"
    elif fwd.loop_off:
        why = fwd.loop_off
    elif names:
        why = f"logits processors ({', '.join(names)})"
    elif stops:
        why = f"stopping criteria ({', '.join(stops)})"
    elif cfg.return_dict_in_generate:
        why = "return_dict_in_generate=True"
    elif getattr(cache, "_is_user_defined", False):
        why = "a cache passed in (it outlives the call)"
    elif getattr(cfg, "is_assistant", False) or synced_gpus:
        why = "an assistant's loop or synced GPUs"
    elif not model_kwargs.get("use_cache", True) or getattr(model.config, "is_encoder_decoder",
                                                             False):
        why = "use_cache=False or an encoder-decoder"
    elif any(h is not st.eviction for h in st.hooks):
        why = "a runtime hook (kvcompile inspect / verify: its steps need the host)"
    if why:
        st.kernels.note(f"generate: transformers' decode loop runs the call, not the device "
                        f"loop ({why})")
        st.count("generate_device_loop_refused")
    return fwd, why


def capture_tail(fn, device, mempool):
    """A CUDA graph of the tail (`_Tail.run`, run once before by `_Tail.capture`), captured
    into the forward graphs' memory pool (replayed after them, in capture order)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        fn()
    return graph


class _EagerTail:
    """A tail whose recapture failed mid-call: `replay` runs its ops (`_Tail.run`) eagerly
    over the same buffers, so the call's tokens and row state carry on."""

    def __init__(self, run):
        self.replay = run


class _Own:
    """The step inputs and logits of an evicting model's loop (`_evicting`): its own buffers,
    since its steps go through the model's forward (a graph, or the compiled forward where
    eviction needs the host), not one graph's buffers."""

    def __init__(self, kw: dict, logits: torch.Tensor):
        self.ids = kw["input_ids"].clone()
        self.pos = kw["position_ids"].clone() if kw.get("position_ids") is not None else None
        self.cp = (kw["cache_position"].clone() if kw.get("cache_position") is not None
                   else None)
        self.logits = logits[:, -1:].clone()


def _logits(bufs) -> torch.Tensor:
    """The logits a tail reads: a forward graph's static output, or `_Own`'s buffer."""
    return bufs.logits if isinstance(bufs, _Own) else bufs.out[1]["logits"]


class _Tail:
    """The captured token selection after a forward: reads `g`'s logits (`_logits`), writes
    the next step's inputs into `g`'s buffers (a forward graph's, or `_Own`'s)."""

    def __init__(self, g, out: torch.Tensor, col: torch.Tensor, unfinished: torch.Tensor,
                 done: torch.Tensor, eos: torch.Tensor | None, pad: torch.Tensor | None,
                 choose: _Choice):
        self.g, self.out, self.col = g, out, col
        self.unfinished, self.done, self.eos, self.pad = unfinished, done, eos, pad
        self.choose = choose
        self.logits = _logits(g)
        self.graph = None

    def over(self, g) -> _Tail:
        """The same tail (its output, counter and row state) over another graph's buffers."""
        return _Tail(g, self.out, self.col, self.unfinished, self.done, self.eos, self.pad,
                     self.choose)

    def run(self) -> None:
        nxt = select(self.logits, self.unfinished, self.eos, self.pad, self.choose, self.g.ids)
        self.out.index_copy_(1, self.col, nxt[:, None])
        self.col.add_(1)
        self.g.ids.copy_(nxt[:, None])
        if self.g.pos is not None:
            self.g.pos.add_(1)
        if self.g.cp is not None:
            self.g.cp.add_(1)
        if self.eos is not None:
            finish_rows(nxt, self.eos, self.unfinished, self.done)

    def capture(self, device, mempool) -> None:
        state = [t for t in (self.out, self.col, self.unfinished, self.done, self.g.ids,
                             self.g.pos, self.g.cp) if t is not None]
        saved = [t.clone() for t in state]
        self.run()                              # lazy initialization, then undone
        for t, s in zip(state, saved):
            t.copy_(s)
        self.graph = capture_tail(self.run, device, mempool)


class _Choice:
    """`_sample`'s token choice: greedy (argmax), or sampling from the softmax of the scores
    after transformers' warpers (its `logits_processor`, only `_WARPERS`), drawn by the
    exponential race: argmax of p / E with E ~ Exp(1) i.i.d., which picks token i with
    probability p_i, as `torch.multinomial(p, 1)` does, with one elementwise RNG op that a
    CUDA graph captures (graph-safe Philox offsets). The draws are not transformers': the
    same seed gives other samples of the same distribution."""

    def __init__(self, sample: bool, processors=None):
        self.sample, self.processors = sample, processors

    def __call__(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.sample:
            return scores.argmax(dim=-1)
        if self.processors:
            scores = self.processors(ids, scores)
        probs = torch.softmax(scores, dim=-1)
        return race(probs)


def race(probs: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `probs` [B, V]: argmax of p / E, E ~ Exp(1)."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def finish_rows(nxt: torch.Tensor, eos: torch.Tensor, unfinished: torch.Tensor,
                done: torch.Tensor) -> None:
    """In place: rows whose token is an EOS id finish (`unfinished` 0); `done` set where every
    row has (transformers' EosTokenCriteria and stop check, without a host read)."""
    unfinished.mul_((~torch.isin(nxt, eos)).long())
    torch.eq(unfinished.amax(), 0, out=done)


def select(logits: torch.Tensor, unfinished: torch.Tensor, eos, pad, choose: _Choice,
           ids: torch.Tensor) -> torch.Tensor:
    """`_sample`'s step after the forward: the last position's logits in fp32, the token
    chosen (`_Choice`); a finished row (where EOS stops rows) takes the pad token."""
    nxt = choose(logits[:, -1].float(), ids)
    if eos is not None:
        nxt = nxt * unfinished + pad * (1 - unfinished)
    return nxt


class _Deferred:
    """What the host learns of each step a step late (transformers' DeferredStopCheck): the
    flag "every row finished" (where EOS stops rows) and the step's tokens (for a streamer),
    copied into pinned memory without blocking behind an event, read when the step after
    next is about to be queued. A token is streamed once its step is read, never one past
    the stop."""

    def __init__(self, device, batch: int, eos, streamer):
        pin = torch.device(device).type == "cuda"
        self.eos, self.streamer = eos, streamer
        self.on = eos is not None or streamer is not None
        self.flag = [torch.zeros(1, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self.tokens = [torch.zeros(batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.pending: list[tuple[int, int]] = []   # (buffer, tokens by that step)

    def record(self, done: torch.Tensor, tokens: torch.Tensor, count: int) -> None:
        """After the step that made the `count`-th token (`tokens` [B], on the device)."""
        if not self.on:
            return
        i = 1 - self.pending[-1][0] if self.pending else 0
        if self.eos is not None:
            self.flag[i].copy_(done, non_blocking=True)
        if self.streamer is not None:
            self.tokens[i].copy_(tokens, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        self.pending.append((i, count))

    def stopped(self, keep_in_flight: int) -> int | None:
        """Reads all but the last `keep_in_flight` recorded steps (streaming their tokens):
        the token count at the first whose flag says every row finished, else None."""
        while len(self.pending) > keep_in_flight:
            i, count = self.pending.pop(0)
            if self.events[i] is not None:
                self.events[i].synchronize()
            if self.streamer is not None:
                self.streamer.put(self.tokens[i].clone())
            if self.eos is not None and bool(self.flag[i]):
                self.pending.clear()
                return count
        return None


def run(model, fwd: GraphedForward, input_ids, logits_processor, stopping_criteria,
        generation_config, model_kwargs, streamer=None):
    """`_sample`'s loop, its graphed steps on the device (module docstring).
    -> the sequences [B, prompt + new] as `_sample` returns them."""
    st = fwd.state
    eos_crit = [c for c in stopping_criteria if hasattr(c, "eos_token_id")]
    device = input_ids.device
    eos = eos_crit[0].eos_token_id.to(device) if eos_crit else None
    pad = generation_config._pad_token_tensor
    pad = pad.to(device) if pad is not None else None
    if eos is not None and pad is None:
        raise ValueError("generate: EOS stops rows but no pad_token_id is set for the "
                         "finished rows; pass pad_token_id=")
    prompt = input_ids.shape[1]
    new_max = stopping_criteria.max_length - prompt
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=device)
    done = torch.zeros((), dtype=torch.bool, device=device)
    flags = _Deferred(device, input_ids.shape[0], eos, streamer)
    choose = _Choice(bool(generation_config.do_sample), logits_processor)
    st.count("generate_device_loop")
    outputs = model._prefill(input_ids, generation_config, model_kwargs,
                             is_first_iteration=True)
    made = 0
    stop = None
    # the forward `_sample` calls (transformers' own compiled call where it would compile)
    auto = getattr(model, "_valid_auto_compile_criteria", None)
    forward = (model.get_compiled_call(generation_config.compile_config)
               if auto is not None and auto(model_kwargs, generation_config) else model)
    decode = getattr(model, "_optimize_model_for_decode", None)
    # the model's lock for the whole decode: the graph's input buffers carry this call's
    # state from one step to the next (written by the tail), which another thread's step of
    # the same graph would overwrite (generate calls from threads then decode in turn)
    with st.lock, decode() if decode is not None else contextlib.nullcontext():
        # transformers' steps (the prefill's token, steps that replay no graph), the stop
        # flag read a step late as in its DeferredStopCheck
        while True:
            model_kwargs = model._update_model_kwargs_for_generation(
                outputs, model_kwargs, is_encoder_decoder=False)
            nxt = select(outputs.logits, unfinished, eos, pad, choose, input_ids)
            del outputs
            input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
            made += 1
            if eos is not None:
                finish_rows(nxt, eos, unfinished, done)
            flags.record(done, nxt, made)
            if made >= new_max:
                break
            stop = flags.stopped(keep_in_flight=1)
            if stop is not None:
                break
            model_inputs = model.prepare_inputs_for_generation(
                input_ids, next_sequence_length=1, **model_kwargs)
            replays = fwd.replays
            outputs = forward(**model_inputs, return_dict=True)
            if fwd.replays > replays and not fwd.loop_off:   # graphed: the rest on the device
                out = torch.empty((input_ids.shape[0], new_max - made), dtype=torch.long,
                                  device=device)
                kw = dict(model_inputs, return_dict=True)
                evicting = st.eviction is not None
                bufs = _Own(kw, outputs.logits) if evicting else fwd.last[0]
                tail = _first_tail(fwd, bufs, out, unfinished, done, eos, pad, choose)
                if tail is not None:
                    del outputs
                    loop = _evicting if evicting else _on_device
                    return loop(fwd, kw, input_ids, prompt, made, tail, flags)
                # (its capture failed, said: this call's steps go on as transformers')
        # (every step ran as transformers runs them)
        if stop is None:
            stop = flags.stopped(keep_in_flight=0)
        return _finish(st, cache_of(model_kwargs), input_ids, prompt, made, stop, streamer)


def _finish(st, cache, ids, prompt: int, made: int, stop: int | None,
            streamer) -> torch.Tensor:
    """The sequences up to the stop; a step run past it has its cache entry cropped where the
    cache can be (a DynamicCache; transformers 5.17's StaticCache cannot, and need not: the
    loop runs only for caches that do not outlive the call, whose pages return with it)."""
    keep = made if stop is None else stop
    if made > keep:
        if getattr(cache, "is_croppable", True):
            cache.crop(keep - made)
        st.count("generate_device_loop_undone", made - keep)
    if streamer is not None:
        streamer.end()
    return ids[:, :prompt + keep]


def _graph_inputs(g, kw: dict) -> dict:
    """The forward's keyword arguments with its tensors the graph's own buffers."""
    kw = dict(kw)
    for name, buf in (("input_ids", g.ids), ("position_ids", g.pos),
                      ("cache_position", g.cp), ("attention_mask", g.mask)):
        if kw.get(name) is not None:
            kw[name] = buf
    return kw


def _first_tail(fwd, bufs, out, unfinished, done, eos, pad, choose) -> _Tail | None:
    """The tail over `bufs` (the graph that just ran, or `_Own`), captured; None where its
    capture failed: said once in the report, and the model's later calls keep transformers'
    loop (`refusal`)."""
    col = torch.zeros(1, dtype=torch.long, device=out.device)
    tail = _Tail(bufs, out, col, unfinished, done, eos, pad, choose)
    try:
        tail.capture(out.device, fwd.mempool)
    except RuntimeError as e:
        fwd.loop_off = f"its tail's CUDA graph capture failed ({type(e).__name__}: {e})"
        fwd.state.kernels.note(f"generate: the device loop is off for this model: "
                               f"{fwd.loop_off}")
        return None
    return tail


def _on_device(fwd, kw, input_ids, prompt: int, made: int, tail, flags):
    """The loop from the first replayed decode step on (`kw` its inputs): its logits are in
    the graph's static output, `tail` captured over it; every later step is a forward replay
    and a tail replay. `made` tokens so far, in input_ids."""
    st = fwd.state
    cache = cache_of(kw)
    g, b = fwd.last
    kw = _graph_inputs(g, kw)

    def forward_step(produced: int, tail: _Tail) -> _Tail:
        nonlocal g, kw
        g2 = fwd.step(kw, cache, b, b.seq_len())   # (under the model's lock: `run`)
        if g2 is g:
            return tail
        # recaptured (the pool grew): the tail follows the new graph's buffers
        g, kw = g2, _graph_inputs(g2, kw)
        tail = tail.over(g)
        st.count("generate_device_loop_recaptures")
        try:
            tail.capture(input_ids.device, fwd.mempool)
        except RuntimeError as e:
            # the call's tokens and row state live in the tail's buffers: the rest of it runs
            # the tail's ops eagerly over them (a few kernel launches a step), and the
            # model's later calls keep transformers' loop, as after a first capture's failure
            tail.graph = _EagerTail(tail.run)
            fwd.loop_off = (f"its tail's CUDA graph recapture failed "
                            f"({type(e).__name__}: {e})")
            st.kernels.note(f"generate: the device loop is off for this model: "
                            f"{fwd.loop_off}; this call's later steps ran its tail eagerly")
            st.count("generate_device_loop_eager_tail")
        return tail

    return _drive(st, cache, input_ids, prompt, made, tail, flags, forward_step)


def _evicting(fwd, kw, input_ids, prompt: int, made: int, tail, flags):
    """`_on_device` for a model with an eviction policy: each step goes through the model's
    forward (`GraphedForward.__call__`: a graph where the eviction runtime steps aside, the
    compiled forward where its rules need the host, its work after the step either way) with
    the tail's own buffers as inputs and the attention mask a growing view of one buffer; its
    logits are copied into the tail's buffer. No transformers Python or per-step kernels, but
    the forward's own input checks and copies."""
    st = fwd.state
    cache = cache_of(kw)
    own = tail.g
    mask = kw.get("attention_mask")
    if mask is not None:   # every later step's mask: a view of this buffer (ones appended)
        grown = torch.ones((mask.shape[0], mask.shape[1] + tail.out.shape[1]),
                           dtype=mask.dtype, device=mask.device)
        grown[:, :mask.shape[1]].copy_(mask)
    logits = own.logits

    def forward_step(produced: int, tail: _Tail) -> _Tail:
        step = dict(kw, input_ids=own.ids)
        if own.pos is not None:
            step["position_ids"] = own.pos
        if own.cp is not None:
            step["cache_position"] = own.cp
        if mask is not None:
            step["attention_mask"] = grown[:, :mask.shape[1] + produced]
        logits.copy_(fwd(**step).logits[:, -1:])
        return tail

    return _drive(st, cache, input_ids, prompt, made, tail, flags, forward_step)


def _drive(st, cache, input_ids, prompt: int, made: int, tail: _Tail, flags, forward_step):
    """The device phase: a tail replay a step (the token of the forward just run, stored at
    its column), the step's flag and tokens recorded, the step before last read, then
    `forward_step(produced, tail)`: the next forward, -> the tail to replay after it. Ends at
    the length limit or a read stop; the sequences as `_sample` returns them."""
    out = tail.out
    new_max = made + out.shape[1]
    stop = None
    launched = produced = 0
    while True:
        tail.graph.replay()
        produced += 1
        flags.record(tail.done, out[:, produced - 1], made + produced)
        if made + produced >= new_max:
            break
        stop = flags.stopped(keep_in_flight=1)
        if stop is not None:
            break
        tail = forward_step(produced, tail)
        launched += 1
    if stop is None:
        stop = flags.stopped(keep_in_flight=0)
    st.count("generate_device_loop_steps", launched)
    ids = torch.cat([input_ids, out[:, :produced]], dim=-1)
    return _finish(st, cache, ids, prompt, made + produced, stop, flags.streamer)
