"""The `kvcompile` torch.compile backend.

    torch.compile(model.forward, backend="kvcompile", options={"kv_dtype": "fp8_e4m3"})

Dynamo hands each graph to `kvcompile_backend`, which runs the passes (kvcompile/passes) on the
torch-level graph, compiles the result with `options["inner"]` (auto: inductor on CUDA, eager on
the CPU), and wraps it in a `GraphRunner` that binds each call to its pool sequences and sets the
forward context.
"""

from __future__ import annotations

import time

import torch

from kvcompile.cache import binding as _binding
from kvcompile.cache.context import ForwardContext, current, forward_context
from kvcompile.config import KVConfig
from kvcompile.errors import CacheStateError
from kvcompile.kernels import attention as _attention_op  # noqa: F401  (registers the op)
from kvcompile.passes.pipeline import run_passes
from kvcompile.runtime import ModelState, find_state


def kvcompile_backend(gm: torch.fx.GraphModule, example_inputs, options=None, mode=None,
                      state: ModelState | None = None):
    from kvcompile.integrations import hf as _hf

    _hf.install()
    config = state.config if state is not None else KVConfig.from_options(options)
    state = state or find_state(example_inputs, config)
    t0 = time.perf_counter()
    result = run_passes(gm, example_inputs, state)
    compiled = compile_inner(gm, example_inputs, config.inner)
    state.compile_seconds += time.perf_counter() - t0
    if not result.plan.rewritten:
        return compiled
    return GraphRunner(compiled, result.plan, state)


def resolve_inner(inner: str, example_inputs) -> str:
    """KVConfig.inner "auto": inductor where the graph runs on CUDA, eager on the CPU (see
    KVConfig's docstring for what inductor costs there)."""
    if inner != "auto":
        return inner
    cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return "inductor" if cuda else "eager"


def compile_inner(gm, example_inputs, inner: str):
    inner = resolve_inner(inner, example_inputs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward


class GraphRunner:
    """Calls a compiled graph inside the forward context of its cache binding."""

    def __init__(self, compiled, plan, state: ModelState):
        self.compiled = compiled
        self.plan = plan
        self.state = state

    def __call__(self, *args):
        outer = current()
        if outer is not None and outer.state is self.state and outer.plan is not None:
            return self.compiled(*args)  # the engine set the context (and runs the hooks)
        b, fresh, ephemeral = self._bind(args)
        ctx = ForwardContext(self.state, b)
        try:
            with forward_context(ctx):
                outs = self.compiled(*args)
        except BaseException:
            self._rollback(ctx, fresh and not b.has_stubs)
            raise
        for hook in self.state.hooks:
            hook.after_forward(ctx)
        if ephemeral:
            b.release()
        elif self.plan.stub_outputs:
            outs = self._restub(outs, b)
        if fresh:
            # real cache buffers (gpt-fast k_cache, a StaticCache made eagerly) become stubs:
            # their memory is released; the next call recompiles once for the new strides
            for i in self.plan.handle_inputs:
                t = args[i]
                if isinstance(t, torch.Tensor) and not _binding.is_stub(t):
                    b.adopt(t)
        return outs

    def _bind(self, args):
        handles = [args[i] for i in self.plan.handle_inputs]
        for t, kind in zip(handles, self.plan.handle_kinds):
            b = _binding.binding_of(t)
            if b is not None:
                # a sliding-window cache object keeps only its window: fewer, never more
                if kind == "cat" and b.seq_len() < t.shape[-2]:
                    raise CacheStateError(
                        f"the cache object holds {t.shape[-2]} tokens but kvcompile's pool "
                        f"holds {b.seq_len()} for it (was the cache modified outside the "
                        f"compiled model, or its pages freed?)")
                return b, False, False
        b = _binding.Binding(self.state, [], _device(args))
        ephemeral = not handles and not self.plan.stub_outputs
        return b, True, ephemeral

    def _rollback(self, ctx: ForwardContext, release: bool) -> None:
        plan, b = ctx.plan, ctx.binding
        if b is None:
            return
        if release:
            b.release()
        elif plan is not None and self.state.pool is not None:
            for sid, past in zip(plan.seq_ids, plan.past_lens):
                self.state.pool.truncate(sid, past)

    def _restub(self, outs, b):
        seq = list(outs)
        for i in self.plan.stub_outputs:
            t = seq[i]
            if isinstance(t, torch.Tensor):
                seq[i] = b.stub(t.shape, t.dtype)
        return type(outs)(seq) if isinstance(outs, tuple) else seq


def _device(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.device
    return torch.device("cpu")
