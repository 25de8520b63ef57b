"""CUDA graphs of Hugging Face `generate`'s decode steps on a kvcompile-compiled model.

`kvcompile.compile(model)` wraps the compiled `model.forward` in `GraphedForward`. Inside a
`generate` call (integrations/hf.py marks it), a decode step of a `DynamicCache` bound to the
pool (`input_ids [B, 1]`) is replayed from a CUDA graph captured once per batch size and
attention-mask width; every other call goes to the compiled forward as before. A decode step
of a compiled model launches a few hundred kernels; on the H200 their host time, not the GPU,
set the step time (benchmarks/RESULTS.md, "Generation").

How a step replays (the engine's decode graphs, engine/cudagraph.py, work the same way):
- the graph was captured with static device buffers for every input: token ids, position ids,
  cache_position, the 2-D attention mask (width W fixed at capture), and the step plan that
  the attention ops read (slots of the new tokens, block tables as wide as the pool's or the
  model's maximum length, sequence lengths). A step reserves its slots in the pool (host
  bookkeeping), writes the buffers (device copies, one pinned host-to-device copy, one gather
  of the block-table rows) and replays;
- the attention ops saw `key_mask = mask[:, :W]` while capturing: keys past W are seen by
  every row, which is what `generate` asks for (it appends ones), and the left padding of a
  prompt lies inside W (W is at least the prompt's length + 1; a longer prompt recaptures);
- the cache object's stubs (runtime/binding.py) grow by one token after the replay, as the
  compiled graph's own side effects would have done;
- capture-time warm-up runs write a scratch sequence of the pool only (one slot per row),
  freed once the graph is captured.

A growing pool (cache/sizing.py) replaces its storage tensors, which the graphs captured: a
growth (`pool.generation`) drops every graph, and the next step captures again. So does
`kvcompile.release(model)` (`release_graphs`).

Eviction: a model with an eviction policy replays its decode steps too when the eviction
runtime steps aside for them (eviction/runtime.py `decode_aside`: no left padding, no prompt
mask with holes, one policy layout its graph can take), as the engine's steps do: the captured
step attends over the stored (kept) slots, with what eviction needs inside the step as static
inputs (H2O's mass rows, re-rotated sinks, a window's hidden slots: eviction/aside.py
`AsideSpec`, which keys the graph), and the runtime evicts after each replay
(`after_decode_step`: every `KVConfig.eviction_interval` steps, on the device where the
format moves tokens exactly). The HF decode mask, whose columns are logical positions, is not
applied to the kept slots: in `generate` it is all ones past the prompt.

Graphs are used only where nothing in the step needs the host: CUDA, the Triton kernels for
every layer's formats and shapes (`kernel_formats.graph_refusal`: the reference attention
would read the capture's host lengths), no runtime hook but an eviction runtime that steps
aside (`kvcompile inspect` / `verify` keep the steps eager), no `check_finite`, a plain
`DynamicCache` whose rows are the binding's sequences, and the keyword arguments `generate`
passes for a decode step (anything else, e.g. output_attentions, runs as before).
MLA layers take the latent decode kernel, with the decode mask as its key mask under capture.
`KVConfig.cuda_graphs=False` (KVCOMPILE_CUDA_GRAPHS=0) turns them off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref

import torch

from kvcompile.engine.cudagraph import Staged, capture, upload_plan
from kvcompile.eviction.aside import AsideInputs
from kvcompile.recompiles import check_forward, recompile_budget
from kvcompile.runtime.binding import binding_of, is_stub
from kvcompile.runtime.context import ForwardContext, StepPlan, forward_context
from kvcompile.runtime.kernel_formats import graph_refusal

log = logging.getLogger("kvcompile")

_local = threading.local()
CACHE_KEYS = ("past_key_values", "cache")
_TENSOR_KEYS = {"input_ids", "position_ids", "attention_mask", "cache_position"}
_PLAIN_KEYS = {"use_cache": (True,), "return_dict": (True, None),
               "output_attentions": (False, None), "output_hidden_states": (False, None)}


@contextlib.contextmanager
def generating():
    """Marks a `generate` call: only its decode steps may replay graphs."""
    prev = getattr(_local, "generate", False)
    _local.generate = True
    try:
        yield
    finally:
        _local.generate = prev


def in_generate() -> bool:
    return getattr(_local, "generate", False)


class _Graph(Staged):
    def __init__(self, key, B: int, width: int, table_width: int, device, has_pos: bool,
                 has_cp: bool, mask_dtype, spec=None):
        self.key, self.B, self.width = key, B, width
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=device) if has_pos else None
        self.cp = torch.zeros(1, dtype=torch.long, device=device) if has_cp else None
        self.mask = (torch.ones(B, width, dtype=mask_dtype, device=device)
                     if mask_dtype is not None else None)
        # slots | block-table rows | (eviction stepped aside for: mass rows | sink shifts |
        # re-rotated sink counts | hidden slots' lo | hi) (int64, one copy), lengths (int32)
        self.spec = spec   # None: no eviction runtime; else eviction/aside.py AsideSpec
        n64 = 7 * B if spec is not None else 2 * B
        # staged in turn, each buffer rewritten after its last upload's event (Staged): under
        # a deferred stop check (KVConfig.deferred_stop) the host prepares step n + 1 while
        # step n's host-to-device copy may still be queued
        self._stage(n64, B, device, events=True)   # dev64 [n64], seq_lens [B]: one upload
        self.slots = self.dev64[:B]
        self.rows = self.dev64[B:2 * B]
        self.aside = None
        if spec:
            self.aside = AsideInputs(spec, *(self.dev64[i * B:(i + 1) * B] for i in range(2, 7)))
        self.block_tables = torch.zeros(B, table_width, dtype=torch.int32, device=device)
        self.graph = None
        self.out = None          # (output class, its fields but the cache; logits in the pool)
        self.generation = -1     # the pool's storage generation the graph captured


def cache_of(kwargs: dict):
    """The cache object among a forward's or `generate`'s keyword arguments, or None."""
    return next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)


def _cache_in_pool(kwargs: dict) -> bool:
    """Whether the call's cache object holds kvcompile stubs (or bound buffers): its tokens
    live in the pool, so a forward that runs without kvcompile reads no real K/V."""
    for key in CACHE_KEYS:
        for layer in getattr(kwargs.get(key), "layers", None) or ():
            if binding_of(getattr(layer, "keys", None)) is not None:
                return True
    return False


def mark_decode_dynamic(kwargs: dict) -> None:
    """A decode step's growing dimensions (its cache stubs' length, the 2-D attention mask's
    width) marked dynamic for Dynamo before the call: the first decode step then compiles the
    graph every later step runs. Unmarked, the first step compiled a graph for its length only
    and the second recompiled with these dimensions dynamic (Dynamo's automatic dynamic
    shapes): three graphs for a first `generate` (prefill, two decode) where two serve. A
    prefill (more than one new token) is left as it is: its first graph stays static. Only
    caches in kvcompile's pool, and only at the first decode step of each (a cache's later
    steps find the graph; a mark costs about 1 us a tensor, 2 x layers of them)."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
        return
    for key in CACHE_KEYS:
        layers = getattr(kwargs.get(key), "layers", None) or ()
        b = binding_of(getattr(layers[0], "keys", None)) if layers else None
        if b is None or b.decode_marked:
            continue
        for layer in layers:
            for attr in ("keys", "values"):
                t = getattr(layer, attr, None)
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(mask, 1)
        b.decode_marked = True


class GraphedForward:
    """`model.forward` of a kvcompile-compiled HF model: the compiled forward, plus decode
    steps of `generate` replayed from CUDA graphs (module docstring)."""

    def __init__(self, compiled, state, model, frame=None, original=None):
        # name, doc, __wrapped__ (so inspect.signature sees the model's forward); not the
        # compiled function's attributes (Dynamo refuses to wrap a callable carrying them)
        functools.update_wrapper(self, compiled, updated=())
        self.compiled = compiled
        self.frame = frame            # the function Dynamo compiles (recompiles.own_frame)
        self.original = original      # the model's own forward (a second compile starts here)
        self.state = state
        self.model_name = type(model).__name__
        self.model_max_len = getattr(getattr(model, "config", None), "max_position_embeddings",
                                     None)
        self.graphs: dict = {}
        self.mempool = None
        self.scratch = None          # (pool, seq id, slots, row)
        self.replays = 0
        self.captures = 0
        self.last = None             # (graph, binding) of the last replay
        self.loop_off = None         # why the device loop is off for this model (hf_loop.py)
        self._why_not = None
        self._store = None           # the eviction mass store the graphs with mass captured
        state.release_hooks.append(weakref.WeakMethod(self.release))

    def __call__(self, *args, **kwargs):
        st = self.state
        with st.lock:   # one forward of a model at a time (runtime/state.py ModelState.lock)
            if in_generate() and not args:
                step = self._eligible(kwargs)
                if step is not None:
                    return self._run(kwargs, *step)
            before = st.graph_calls
            pooled = _cache_in_pool(kwargs)
            mark_decode_dynamic(kwargs)
            with recompile_budget():
                out = self.compiled(*args, **kwargs)
            check_forward(st, before, self.frame, self.model_name, pooled)
            return out

    def __get__(self, obj, objtype=None):   # stays a plain callable on the instance
        return self

    def __deepcopy__(self, memo):
        # a deep copy of a compiled model shares its compiled forward (and pool) with it
        return self

    def release_graphs(self) -> None:
        """Drop every captured graph, its static buffers and the scratch sequence (a pool
        growth, or kvcompile.release)."""
        pool = self.scratch[0] if self.scratch is not None else None
        if pool is not None and pool is self.state.pool and pool.has(self.scratch[1]):
            pool.free([self.scratch[1]])
        self.scratch = None
        self.graphs.clear()
        self.last = None

    def release(self) -> None:
        """kvcompile.release(model): the graphs, and their private memory pool."""
        self.release_graphs()
        self.mempool = None
        self._why_not = None   # asked again of the next pool
        self.loop_off = None

    # -- eligibility --------------------------------------------------------------------------
    def why_not(self) -> str | None:
        """None when decode steps may be graphed here (per model), else the reason."""
        if self._why_not is not None:
            return self._why_not or None
        st = self.state
        reason = ""
        if not st.config.cuda_graphs:
            reason = "KVConfig.cuda_graphs is False (KVCOMPILE_CUDA_GRAPHS=0)"
        elif st.pool is None or st.device is None or st.device.type != "cuda":
            return "no CUDA pool yet"            # asked again at the next step
        elif not st.kernels.use_triton(st.device):
            reason = "the reference kernels are selected"
        elif st.config.check_finite:
            reason = "check_finite syncs with the host"
        else:
            for k, v, meta in zip(st.pool.k, st.pool.v, st.layer_meta):
                reason = graph_refusal(k, v, latent=bool(meta.get("latent")))
                if reason:
                    break
        self._why_not = reason
        if reason:
            # kvcompile.report shows it, once per reason
            st.kernels.note(f"generate: decode steps run eagerly, without CUDA graphs ({reason})")
        return reason or None

    def _eligible(self, kw):
        # (a model an Engine serves keeps generate's steps eager, as it did when the engine's
        # packed decode was a hook in state.hooks)
        st = self.state
        if self.why_not() is not None or st.serving:
            return None
        ev = st.eviction
        if any(h is not ev for h in st.hooks):
            return None   # a hook may read or change K/V, or attend, on the host
        cache = None
        dev = self.state.device
        for k, v in kw.items():
            if k in CACHE_KEYS:
                cache = v
            elif k in _TENSOR_KEYS:   # on the pool's device (why_not: a CUDA one)
                if v is not None and not (isinstance(v, torch.Tensor) and dev is not None
                                          and v.device.type == dev.type):
                    return None
            elif k == "logits_to_keep":
                if not isinstance(v, int):
                    return None
            elif k in _PLAIN_KEYS:
                if v not in _PLAIN_KEYS[k]:
                    return None
            elif v is not None:
                return None
        ids = kw.get("input_ids")
        if cache is None or ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            return None
        if type(cache).__name__ != "DynamicCache":
            return None
        layers = getattr(cache, "layers", None)
        if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            return None
        if not all(is_stub(layer.keys) and is_stub(layer.values) for layer in layers):
            return None
        b = binding_of(layers[0].keys)
        B = ids.shape[0]
        if b is None or b.state is not self.state or b.batch != B or not b.seq_ids:
            return None
        past = b.seq_len()
        pool = self.state.pool
        if past == 0:
            return None
        aside = ev is not None and ev in st.hooks
        if aside and not ev.decode_aside(b.seq_ids):
            return None   # (it says why, once)
        if not aside and any(pool.evicted(s) for s in b.seq_ids):
            return None
        if any(layer.keys.shape[-2] != past or layer.keys.shape[0] != B for layer in layers):
            return None
        if len({pool.seq_len(s) for s in b.seq_ids}) != 1:
            return None
        mask = kw.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or mask.shape != (B, past + 1)):
            return None
        pos = kw.get("position_ids")
        if pos is not None and tuple(pos.shape) != (B, 1):
            return None
        cp = kw.get("cache_position")
        if cp is not None and tuple(cp.shape) != (1,):
            return None
        return cache, b, past, aside

    # -- replay -------------------------------------------------------------------------------
    def _run(self, kw, cache, b, past, aside=False):
        g = self.step(kw, cache, b, past, aside)
        cls, captured = g.out
        fields = dict(captured)
        fields["logits"] = captured["logits"].clone()
        names = getattr(cls, "__dataclass_fields__", {})
        for k in CACHE_KEYS:   # transformers < 5.20 name it past_key_values, later `cache`
            if k in names:
                fields[k] = cache
        return cls(**fields)

    def step(self, kw, cache, b, past: int, aside: bool = False) -> _Graph:
        """One decode step replayed: the pool's slots reserved, the plan staged and uploaded,
        `kw`'s inputs loaded into the graph's buffers (captured first where no graph fits),
        the graph replayed, eviction's after-step work, the cache's stubs grown. -> the graph
        (its static outputs valid until the next replay). kw's tensors may be the graph's
        own buffers (`_load_inputs` then leaves them: integrations/hf_loop.py's device loop,
        whose captured tail writes each step's inputs there)."""
        B = b.batch
        mask = kw.get("attention_mask")
        L = past + 1
        pool = self.state.pool
        ev = self.state.eviction if aside else None
        pool.reserve(b.seq_ids, 1, slots=False)   # first: it may grow the pool (drops graphs)
        slots, rows, lens = pool.decode_slots(b.seq_ids)
        stored = [n - 1 for n in lens]   # (< past once evicted)
        try:
            # eviction steps aside (eviction/runtime.py decode_aside): what it needs inside
            # the step (H2O's mass rows, re-rotated sinks, hidden slots) keys the graph
            inputs = ev.aside_inputs(b.seq_ids, pool.device) if ev is not None else None
            spec = inputs[0] if inputs is not None else None
            key = (B, kw.get("position_ids") is not None, kw.get("cache_position") is not None,
                   None if mask is None else mask.dtype, kw.get("logits_to_keep"),
                   tuple(sorted(k for k, v in kw.items() if v is not None)), spec)
            store = ev.store if ev is not None else None
            if spec is not None and spec.mass_len and store is not self._store:
                # the mass store is new or grew: graphs with mass read the old one
                self.graphs = {k: g for k, g in self.graphs.items()
                               if not (g.spec and g.spec.mass_len)}
                self._store = store
            g = self.graphs.get(key)
            if g is not None and g.generation != pool.generation:
                self.release_graphs()   # the pool grew: every graph read the old storage
                g = None
            if g is not None and mask is not None and L > g.width and b is not getattr(
                    g, "bound", None):
                g = None   # a longer prompt than the capture's mask width: recapture
            if g is None:
                g = self._capture(key, kw, cache, b, past, spec)
            g.bound = b
            g.next_stage()
            g.h64[:B] = slots
            g.h64[B:2 * B] = rows
            if spec is not None:
                for i, seg in enumerate(inputs[1:], start=2):
                    g.h64[i * B:(i + 1) * B] = seg
            g.h32[:] = lens
            upload_plan(g, pool, rows_key=tuple(rows))
            g.uploaded()
            _load_inputs(g, kw)
            g.graph.replay()
        except BaseException:
            for sid, n in zip(b.seq_ids, stored):
                pool.truncate(sid, n)
            raise
        self.replays += 1
        self.last = (g, b)   # (the device loop, hf_loop.py, goes on from here)
        self.state.count("generate_cuda_graph_replays")
        if ev is not None:   # evicts those due, on the device where it can (no host sync)
            ev.after_decode_step(list(b.seq_ids))
        _grow_stubs(cache, b, past + 1)
        return g

    # -- capture ------------------------------------------------------------------------------
    def _scratch_for(self, rows: int):
        pool = self.state.pool
        if self.scratch is not None and (self.scratch[0] is not pool or
                                         not pool.has(self.scratch[1])):
            self.scratch = None
        if self.scratch is None or len(self.scratch[2]) < rows:
            if self.scratch is not None:
                pool.free([self.scratch[1]])
            sid = pool.allocate(1)[0]
            pool.reserve([sid], rows)
            slots, row = pool.sequence_slots(sid)
            self.scratch = (pool, sid, slots, row)
        return self.scratch

    def _capture(self, key, kw, cache, b, past, spec=None):
        pool = self.state.pool
        dev = self.state.device
        B = b.batch
        L = past + 1
        max_len = pool.max_seq_len or self.model_max_len or pool.num_pages * pool.page_size
        table_width = -(-max(max_len, L) // pool.page_size)
        mask = kw.get("attention_mask")
        g = _Graph(key, B, L, table_width, dev, kw.get("position_ids") is not None,
                   kw.get("cache_position") is not None,
                   None if mask is None else mask.dtype, spec)
        _, _, slots, row = self._scratch_for(B)
        g.h64[:B] = slots[:B]
        g.h64[B:2 * B] = row
        if spec is not None:   # warm-up rows: the store's scratch mass row, nothing rotated
            store = self.state.eviction.store    # or hidden
            g.h64[2 * B:3 * B] = store.scratch if store is not None else 0
            g.h64[3 * B:] = 0
        g.h32[:] = 1
        upload_plan(g, pool, non_blocking=False)
        _load_inputs(g, kw)
        plan = StepPlan(
            seq_ids=list(b.seq_ids), batch=B, new_tokens=1, past_lens=[past] * B,
            slots=g.slots, block_tables=g.block_tables, seq_lens=g.seq_lens,
            seq_lens_list=[L] * B, kv_start=list(b.kv_start),
            slots_grouped=True,   # one new slot per sequence (capture: adjacent scratch slots)
            eviction_aside=spec is not None, aside=g.aside)
        ctx = ForwardContext(self.state, b, plan=plan)
        call = {k: v for k, v in kw.items()}
        call.update(input_ids=g.ids)
        for name, buf in (("position_ids", g.pos), ("cache_position", g.cp),
                          ("attention_mask", g.mask)):
            if buf is not None:
                call[name] = buf
        saved = [(layer, layer.keys, layer.values) for layer in cache.layers]

        def step():
            ctx.plan.cache.clear()   # a per-forward memo: captured ops must not be memoized
            try:
                with forward_context(ctx):
                    return self.compiled(**call)
            finally:   # the graph's cache side effects: undone (the replays grow the stubs)
                for layer, k, v in saved:
                    layer.keys, layer.values = k, v

        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        generation = pool.generation   # (the scratch sequence's reserve may have grown it)
        graph, out = capture(step, dev, self.mempool)
        # keep the output's fields but not the capture-time cache object: it would hold that
        # call's pool sequences for the graph's life
        g.graph = graph
        g.generation = generation
        g.out = (type(out), {k: v for k, v in out.items() if k not in CACHE_KEYS})
        self.graphs[key] = g
        # the scratch slots served the warm-up only (replays have no padding rows)
        if self.scratch is not None and pool.has(self.scratch[1]):
            pool.free([self.scratch[1]])
        self.scratch = None
        self.captures += 1
        self.state.count("generate_cuda_graph_captures")
        log.info("kvcompile: captured generate's decode step (batch %d, mask width %d)", B, L)
        return g


def _load_inputs(g: _Graph, kw) -> None:
    """The step's inputs into the graph's static buffers. The mask's columns past the width
    captured are ones in `generate`; columns past this step's width (a shorter prompt than
    the capture's) are set to one: keys there are past every row's length, never read. An
    input that is the graph's own buffer already (the device loop's) is not copied."""
    for buf, name in ((g.ids, "input_ids"), (g.pos, "position_ids"),
                      (g.cp, "cache_position")):
        if buf is not None and kw[name] is not buf:
            buf.copy_(kw[name])
    if g.mask is not None and kw["attention_mask"] is not g.mask:
        mask = kw["attention_mask"]
        n = min(mask.shape[1], g.width)
        g.mask[:, :n].copy_(mask[:, :n])
        if n < g.width:
            g.mask[:, n:].fill_(1)


def _grow_stubs(cache, b, length: int) -> None:
    """Every layer's key and value stubs `length` tokens long, one stub per distinct shape
    shared by the layers that have it (zero-byte views: a stub per layer and tensor was 60
    views a step of a 30-layer model, host time after each replay)."""
    made: dict = {}
    for layer in cache.layers:
        for attr in ("keys", "values"):
            t = getattr(layer, attr)
            key = (tuple(t.shape[:-2]), t.shape[-1], t.dtype)
            stub = made.get(key)
            if stub is None:
                shape = list(t.shape)
                shape[-2] = length
                stub = made[key] = b.stub(shape, t.dtype)
            setattr(layer, attr, stub)
