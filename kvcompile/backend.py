"""The `kvcompile` torch.compile backend.

    torch.compile(model.forward, backend="kvcompile", options={"kv_dtype": "fp8_e4m3"})

Dynamo hands each graph to `kvcompile_backend`, which runs the passes (kvcompile/passes) on the
torch-level graph, compiles the result with `options["inner"]` (auto: inductor on CUDA, eager on
the CPU), and wraps it in a `GraphRunner` that binds each call to its pool sequences and sets the
forward context.

Dynamo keeps the GraphRunner as long as the code object it compiled, which on this route is a
transformers function shared by every model: the runner holds its model's state weakly and
finds the caller's state from the parameters it is called with (kvcompile/runtime/ownership.py).
"""

from __future__ import annotations

import copy
import operator
import time
import weakref

import torch

from kvcompile.config import KVConfig, configured_instances
from kvcompile.errors import CacheStateError, KVCompileError
from kvcompile.integrations.tp import tensor_parallel_of_graph
from kvcompile.passes import notices, skinny_linears
from kvcompile.passes.pipeline import _restore, run_passes
from kvcompile.passes.rewrite import _virtual_cat
from kvcompile.runtime import attention_op as _attention_op  # noqa: F401  (registers the op)
from kvcompile.runtime import binding as _binding
from kvcompile.runtime import gated_op as _gated_op  # noqa: F401  (registers the op)
from kvcompile.runtime import skinny_op as _skinny_op  # noqa: F401  (registers the op)
from kvcompile.runtime.context import ForwardContext, current, forward_context, in_packed_step
from kvcompile.runtime.ownership import find_state
from kvcompile.runtime.state import ModelState


def kvcompile_backend(gm: torch.fx.GraphModule, example_inputs, options=None, mode=None,
                      state: ModelState | None = None):
    try:
        return _compile(gm, example_inputs, options, state)
    except KVCompileError as e:
        # Dynamo would wrap it in a BackendCompilerFailed whose message starts with
        # "backend='kvcompile' raised:"; this one is both, and leads with our one line
        raise _backend_error(e).with_traceback(e.__traceback__) from None


def _compile(gm, example_inputs, options, state):
    from kvcompile.integrations import hf as _hf
    from kvcompile.recompiles import raise_limit_for_models

    _hf.install()
    config = state.config if state is not None else KVConfig.from_options(options)
    if state is None:   # torch.compile(..., backend="kvcompile"): the shared transformers code
        state = find_state(example_inputs, config)
        raise_limit_for_models()
    if state.tp is None:   # a hand-sharded model's all_reduce names its group
        state.tp = tensor_parallel_of_graph(gm)
    t0 = time.perf_counter()
    with state.lock:
        merging = _merging(config, example_inputs)
        if merging:
            _lay_out_projections(gm, example_inputs, state)   # may have the frame traced again
        # traced inside this model's engine step: a graph only such steps run (its ops take
        # no mask)
        result = run_passes(gm, example_inputs, state, configured=configured_instances(),
                            packed_steps=in_packed_step(state))
    merged = unmerged = None
    skinny = dynamic = 0
    if merging and result.plan.rewritten:
        unmerged = copy.deepcopy(gm.graph, {})
        merged = _merge(gm, example_inputs, state)
    gemms_key = "decode_gemms_" + ("auto" if config.decode_gemms == "auto" else "triton")
    if config.decode_gemms in ("triton", "auto") and result.plan.rewritten:
        if unmerged is None:
            unmerged = copy.deepcopy(gm.graph, {})
        refused: dict[str, int] = {}
        skinny, dynamic = skinny_linears.rewrite(gm, auto=config.decode_gemms == "auto",
                                                 refusals=refused)
        if skinny:
            state.count(gemms_key, skinny)
        if dynamic:
            state.count(gemms_key + "_dynamic", dynamic)
        skinny_linears.say_refusals(state, refused, config.decode_gemms)
    try:
        try:
            compiled = compile_inner(gm, example_inputs, config.inner)
        except Exception as e:
            from torch._dynamo.exc import RestartAnalysis

            if (merged is None and not skinny) or isinstance(e, RestartAnalysis):
                raise
            # the merge and the decode GEMMs are what this graph's rewrite least needs: drop
            # them first
            _restore(gm, unmerged)
            for k, v in (merged.counts if merged is not None else {}).items():
                state.count(k, -v)   # every counter the merge added
            if skinny:
                state.count(gemms_key, -skinny)
                if dynamic:
                    state.count(gemms_key + "_dynamic", -dynamic)
            what = " and ".join(w for w, on in (("its projections unmerged", merged),
                                                ("its linears on the inner compiler's GEMMs",
                                                 skinny)) if on)
            merged, skinny = None, 0
            line = (str(e).strip().splitlines() or [""])[0]
            notices.warn_once(state, ("unmerged", state.graphs),
                              f"kvcompile ran graph {state.graphs} of {notices.model_name(state)} "
                              f"with {what}: the inner compiler "
                              f"({config.inner}) failed on the rewritten graph: "
                              f"{type(e).__name__}: {line}")
            compiled = compile_inner(gm, example_inputs, config.inner)
    except Exception as e:
        # Dynamo's restart requests are control flow, not failures: inductor raises
        # TensorifyScalarRestartAnalysis to have a float input (HF's self.scaling under dynamic
        # shapes) specialized and the frame traced again; abandoning the rewrite there would
        # leave the graph uncompiled for good
        from torch._dynamo.exc import RestartAnalysis

        if not result.plan.rewritten or isinstance(e, RestartAnalysis):
            raise
        text = str(e).strip().splitlines()
        result.abandon(gm, state, f"the inner compiler ({config.inner}) failed on the "
                       f"rewritten graph: {type(e).__name__}: {text[0] if text else ''}")
        merged = None
        compiled = compile_inner(gm, example_inputs, config.inner)
    state.compile_seconds += time.perf_counter() - t0
    if not result.plan.rewritten:
        # attention left alone (the report says why): count its calls anyway, so that a
        # forward running it does not read as one Dynamo ran eagerly (recompiles.py)
        return _Counted(compiled, state) if result.plan.sites else compiled
    return GraphRunner(compiled, result.plan, state, example_inputs, merged)


def _merging(config: KVConfig, example_inputs) -> bool:
    """KVConfig.merge_projections: True, False, or "auto" (graphs on CUDA)."""
    m = config.merge_projections
    return _on_cuda(example_inputs) if m == "auto" else bool(m)


def _lay_out_projections(gm, example_inputs, state) -> None:
    """Lay out the parameters of this graph's mergeable linears (passes/merge_projections.py)
    as one tensor a group, before the passes: groups not in place are laid out here and the
    frame traced again (its fake inputs describe the old storage). Groups still not in place
    on that retrace are not laid out again (no loop): `_merge` leaves them unmerged and says
    so."""
    from kvcompile.passes import merge_projections as mp

    todo = [g for g in mp.find_groups(gm, example_inputs) if not mp.in_place(g, example_inputs)]
    key = frozenset(id(example_inputs[i]) for g in todo for i in g.params) if todo else None
    if todo and key != state.laid_out:
        state.laid_out = key
        for g in todo:
            mp.lay_out(g, example_inputs)
        state.count("projections_laid_out", len(todo))
        raise mp.retrace()
    state.laid_out = None   # in place (or given up on): a later move lays them out again


def _merge(gm, example_inputs, state):
    """Merge the laid-out groups of the rewritten graph (found again: a pass that failed may
    have restored the graph from its copy); -> the runner's check, or None."""
    from kvcompile.passes import merge_projections as mp

    found = mp.find_groups(gm, example_inputs)
    groups = [g for g in found if mp.in_place(g, example_inputs)]
    if len(groups) < len(found):   # laid out for this trace, and still not in place
        notices.warn_once(state, ("unmerged groups", state.graphs),
                          f"kvcompile left {len(found) - len(groups)} projection group(s) of "
                          f"graph {state.graphs} of {notices.model_name(state)} unmerged: "
                          f"their parameters were not in one tensor after kvcompile laid them "
                          f"out")
    if not groups:
        return None
    copied = mp.merge(gm, groups)
    gated = mp.fuse_gated(gm, groups)
    counts = {"projections_merged": len(groups),
              "projections_linears": sum(len(g.rows) for g in groups),
              "projections_copied": copied, "projections_gated_in_place": gated}
    counts = {k: v for k, v in counts.items() if v}
    for k, v in counts.items():
        state.count(k, v)
    return mp.Merged(groups, counts)


class _Counted:
    """A compiled graph whose attention sites were all left alone."""

    def __init__(self, compiled, state: ModelState):
        self.compiled = compiled
        self._state = weakref.ref(state)

    def __call__(self, *args):
        st = self._state()
        if st is not None:
            st.graph_calls += 1
        return self.compiled(*args)


_BACKEND_ERRORS: dict[type, type] = {}


def _backend_error(e: KVCompileError) -> Exception:
    """`e` as an exception that is both its own class and Dynamo's BackendCompilerFailed (which
    Dynamo re-raises as it is), with e's one-line message."""
    from torch._dynamo.exc import BackendCompilerFailed

    cls = _BACKEND_ERRORS.get(type(e))
    if cls is None:
        cls = type(type(e).__name__, (type(e), BackendCompilerFailed),
                   {"__module__": type(e).__module__, "__init__": Exception.__init__,
                    "__str__": Exception.__str__})
        _BACKEND_ERRORS[type(e)] = cls
    err = cls(str(e))
    err.__dict__.update(e.__dict__)
    err.backend_name, err.inner_exception, err.first_useful_frame = "kvcompile", e, None
    return err


def resolve_inner(inner: str, example_inputs) -> str:
    """KVConfig.inner "auto": inductor where the graph runs on CUDA, eager on the CPU (see
    KVConfig's docstring for what inductor costs there)."""
    if inner != "auto":
        return inner
    return "inductor" if _on_cuda(example_inputs) else "eager"


def _on_cuda(example_inputs) -> bool:
    """The graph runs on CUDA (one of its tensor inputs lives there)."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


def compile_inner(gm, example_inputs, inner: str):
    inner = resolve_inner(inner, example_inputs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    return _call_directly(gm).forward


def _call_directly(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """inner="eager": the graph's kvcompile ops become calls of their Python implementation
    (attention_op.DIRECT_CALLS), which Python runs as the op would, minus its dispatch; the
    cache stubs are made as the binding's own (`_binding_stub_cat`: GraphRunner then has none
    to replace); shape arithmetic whose result nobody reads is dropped (Dynamo's graph of an
    HF decode step computes `1 + past` per layer for nothing: 59 `torch.sym_sum` calls), and
    so are casts to the dtype a tensor has (`_same_dtype_to`)."""
    from kvcompile.passes import rewrite as _rewrite

    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _attention_op.DIRECT_CALLS:
            node.target = _attention_op.DIRECT_CALLS[node.target]
            changed = True
        elif node.op == "call_function" and node.target is _rewrite._virtual_cat:
            node.target = _binding_stub_cat
            changed = True
    for node in list(gm.graph.nodes):
        src = _same_dtype_to(node)
        if src is not None:   # x.to(x.dtype) is x itself: the call goes, not a copy
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            changed = True
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and (
                node.op == "call_function" and node.target in _UNREAD_PURE
                or node.op == "call_method" and node.target in ("numel", "size", "dim")):
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()
    return gm


def _same_dtype_to(node):
    """The input x of a `x.to(dtype)` node (nothing but the dtype given) whose x has that dtype
    already, as Dynamo recorded it (`torch.Tensor.to` returns x itself then); else None. An
    HF fp32 model's RMSNorm casts to fp32 four times a layer."""
    if node.op != "call_method" or node.target != "to" or not node.args:
        return None
    args, kwargs = node.args, node.kwargs
    if len(args) == 2 and not kwargs:
        dtype = args[1]
    elif len(args) == 1 and set(kwargs) == {"dtype"}:
        dtype = kwargs["dtype"]
    else:
        return None
    src = args[0]
    val = src.meta.get("example_value") if isinstance(src, torch.fx.Node) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(val, torch.Tensor):
        return None
    return src if val.dtype == dtype else None


# shape arithmetic that an eager graph may drop when nothing reads it (no side effect)
_UNREAD_PURE = {torch.sym_sum, operator.add, operator.sub, operator.mul, operator.floordiv,
                operator.neg, torch.sym_max, torch.sym_min}


def _binding_stub_cat(past: torch.Tensor, new: torch.Tensor, dim: int | None = -2):
    """rewrite._virtual_cat in an eager graph run by GraphRunner: the stub is made as the
    forward's binding's own (runtime/binding.py `Binding.stub`, one expand), so that
    `GraphRunner._restub` finds it in place (it replaced each plain stub by one: 2 x layers
    tensor ops a decode step). Without a binding (an engine's forward, a graph called
    outside the runner), the plain stub."""
    ctx = current()
    b = None if ctx is None else ctx.binding
    if b is None:
        return _virtual_cat(past, new, dim)
    size = list(new.shape)
    if dim is not None:
        size[dim] += past.shape[dim] if past.dim() == new.dim() else 0
    return b.stub(size, new.dtype)


class GraphRunner:
    """Calls a compiled graph inside the forward context of its cache binding."""

    def __init__(self, compiled, plan, state: ModelState, example_inputs=(), merged=None):
        from kvcompile.runtime.ownership import Layout

        self.compiled = compiled
        self.plan = plan
        self.merged = merged   # merge_projections.Merged: its groups checked before each call
        self._state = weakref.ref(state)
        # the first parameter among the inputs tells whose model calls (None: no parameter in
        # the graph, so no owner to find: then the runner keeps its state alive itself)
        self._param = next((i for i, x in enumerate(example_inputs)
                            if isinstance(x, torch.nn.Parameter)), None)
        self._keep = state if self._param is None else None
        self._layout = Layout.of(state) if self._param is not None else None

    @property
    def state(self) -> ModelState | None:
        return self._state()

    def state_for(self, args) -> ModelState:
        """The state of the model these inputs come from (another model of the same class may
        run this graph: Dynamo's guards check types and shapes)."""
        st = self._state()
        if self._param is None:
            return st
        p = args[self._param]
        if st is not None and id(p) in st.param_ids:
            return st
        from kvcompile.runtime.ownership import state_for_param

        st = state_for_param(p, self._layout)
        self._state = weakref.ref(st)
        return st

    def __call__(self, *args):
        st = self.state_for(args)
        with st.lock:   # one forward of a model at a time (runtime/state.py ModelState.lock)
            st.graph_calls += 1
            if self.merged is not None:
                self.merged.ready(args)
            return self._call(st, args)

    def _call(self, st: ModelState, args):
        outer = current()
        if outer is not None and outer.state is st and (outer.plan is not None
                                                        or outer.engine_warm_up):
            return self.compiled(*args)  # the engine set the context (and runs the hooks)
        b, fresh, ephemeral = self._bind(st, args)
        ctx = ForwardContext(st, b)
        try:
            with forward_context(ctx):
                outs = self.compiled(*args)
        except BaseException:
            self._rollback(ctx, fresh and not b.has_stubs)
            raise
        for hook in st.hooks:
            hook.after_forward(ctx)
        if ephemeral:
            b.release()
        elif self.plan.stub_outputs:
            outs = self._restub(outs, b)
        if fresh:
            # real cache buffers (gpt-fast k_cache, a StaticCache made eagerly) become stubs:
            # their memory is released; the next call recompiles once for the new strides.
            # Buffers the model writes by slice assignment stay (a stub cannot take that
            # write when Dynamo re-traces it): bound by their storage instead
            for i, kind in zip(self.plan.handle_inputs, self.plan.handle_kinds):
                t = args[i]
                if isinstance(t, torch.Tensor) and not _binding.is_stub(t):
                    b.bind_buffer(t) if kind == "slice" else b.adopt(t)
        return outs

    def _bind(self, st: ModelState, args):
        handles = [args[i] for i in self.plan.handle_inputs]
        seq_dims = self.plan.handle_seq_dims or [-2] * len(handles)
        for t, kind, seq in zip(handles, self.plan.handle_kinds, seq_dims):
            b = _binding.binding_of(t)
            if b is not None:
                if b.released and t.shape[seq]:
                    raise CacheStateError(
                        "this cache's pages were given back by kvcompile.release(model); "
                        "start a new cache (a new generate call)")
                # a sliding-window cache object keeps only its window: fewer, never more
                if kind == "cat" and b.seq_len() < t.shape[seq]:
                    raise CacheStateError(
                        f"the cache object holds {t.shape[seq]} tokens but kvcompile's pool "
                        f"holds {b.seq_len()} for it (was the cache modified outside the "
                        f"compiled model, or its pages freed?)")
                return b, False, False
        b = _binding.Binding(st, [], _device(args))
        ephemeral = not handles and not self.plan.stub_outputs
        return b, True, ephemeral

    def _rollback(self, ctx: ForwardContext, release: bool) -> None:
        plan, b = ctx.plan, ctx.binding
        if b is None:
            return
        if release:
            b.release()
        elif plan is not None and ctx.state.pool is not None:
            for sid, past in zip(plan.seq_ids, plan.past_lens):
                ctx.state.pool.truncate(sid, past)

    def _restub(self, outs, b):
        seq = None
        for i in self.plan.stub_outputs:
            t = outs[i]
            # (an eager graph made b's own stubs already: `_binding_stub_cat`)
            if isinstance(t, torch.Tensor) and not b.owns_stub(t):
                if seq is None:
                    seq = list(outs)
                seq[i] = b.stub(t.shape, t.dtype)
        if seq is None:
            return outs
        return type(outs)(seq) if isinstance(outs, tuple) else seq


def _device(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.device
    return torch.device("cpu")


def _install_early() -> None:
    # torch.compile(..., backend="kvcompile") imports this module when it is called, before the
    # model's first generate: patch transformers now (or, when this module was imported before
    # transformers, e.g. by `from kvcompile import stats`, as soon as transformers' generation
    # code is imported), so that even that call frees its pages
    from kvcompile.integrations import hf as _hf

    _hf.install_soon()


_install_early()
