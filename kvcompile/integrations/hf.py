"""Hugging Face cache objects holding kvcompile stubs.

After the rewrite, a `DynamicCache` / `StaticCache` holds zero-byte stubs (runtime/binding.py)
instead of K/V. These patches make the cache object's own operations act on the pool when its
tensors are stubs, and leave every other cache untouched:

    reorder_cache(beam_idx)       beam search: rows select/fork pool sequences (no copies)
    batch_repeat_interleave(n)    num_return_sequences: fork each row n times
    batch_select_indices(idx)     contrastive search / row selection
    crop(n)                       assisted decoding: HF's own crop on the stubs, then the
                                  sequences are cut to the length the cache now holds
    reset()                       StaticCache reuse: free the sequences (no zero_ on stubs)

Every `generate` call (GenerationMixin.generate, patched by `install`, on every route) returns
the pages of the caches it made when it returns, in the thread that made them (a call scope,
runtime/binding.py): HF cache objects sit in reference cycles, so without it the pages would wait
for the garbage collector, and calls in other threads are left alone. The patch must be in
place before the first `generate` starts: the backend's first compile happens inside that call,
too late for it. `install_soon()` (run when kvcompile.backend is imported, which
`torch.compile(..., backend="kvcompile")` and `from kvcompile import stats` both do) patches
now when transformers is loaded, else the moment transformers' generation code is imported.

`wrap_generate(model)` (installed by `kvcompile.compile`) makes num_return_sequences / beam
search prefill each distinct prompt once and fork it (HF would prefill and store every copy).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import threading

import torch

from kvcompile.integrations import hf_graphs as _hf_graphs
from kvcompile.integrations import hf_loop as _hf_loop
from kvcompile.integrations import hf_prefill as _hf_prefill
from kvcompile.integrations.hf_graphs import generating
from kvcompile.runtime.binding import binding_of, call_scope, is_stub

_installed = False
_GENERATION = "transformers.generation.utils"   # defines GenerationMixin, imports cache_utils
_log = logging.getLogger("kvcompile")


def install_soon() -> None:
    """`install()` now if transformers is loaded; else as soon as `transformers.generation.utils`
    has been imported (an import hook that removes itself), so that the first `generate` call
    already frees its pages. (Without it, `from kvcompile import stats` before `import
    transformers` left the first call on the torch.compile route holding its pages until the
    garbage collector ran.)"""
    if _installed:
        return
    if "transformers" in sys.modules:
        install()
        return
    if not any(isinstance(f, _InstallOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Finds `transformers.generation.utils` with the other finders and runs `install()` right
    after the module has executed; does nothing for any other module."""

    def find_spec(self, name, path, target=None):
        if name != _GENERATION:
            return None
        _remove_hook()
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            install()
        except Exception as e:  # noqa: BLE001  (never break the user's import)
            _log.warning("kvcompile: could not patch transformers' generate: %s", e)

    def __getattr__(self, name):   # get_source, get_filename, ... of the real loader
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _InstallOnImport)]


def install() -> None:
    global _installed
    if _installed:
        return
    try:
        from transformers import cache_utils
    except ImportError:
        return
    _installed = True
    _remove_hook()
    cache = cache_utils.Cache
    _wrap(cache, "reorder_cache", _reorder)
    _wrap(cache, "batch_repeat_interleave", _repeat)
    _wrap(cache, "batch_select_indices", _select)
    _wrap(cache, "crop", _crop)
    _wrap(cache, "reset", _reset)
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return
    if not getattr(GenerationMixin.generate, "_kvcompile_owns_pages", False):
        GenerationMixin.generate = _own_pages(GenerationMixin.generate)
    sample = getattr(GenerationMixin, "_sample", None)
    if sample is not None and not getattr(sample, "_kvcompile_loop", False):
        GenerationMixin._sample = _device_sample(sample)
    prepare = getattr(GenerationMixin, "prepare_inputs_for_generation", None)
    if prepare is not None and not getattr(prepare, "_kvcompile_marks", False):
        GenerationMixin.prepare_inputs_for_generation = _mark_decode(prepare)
    _defer_stop_checks()


# the devices on which a compiled model's `generate` defers its stop check (the tests add "cpu",
# where it changes nothing but the order of the host's work)
DEFER_DEVICES = ("cuda",)


def _defer_stop_checks() -> None:
    """Let `generate` on a compiled model's pool read its stop decision one step late on CUDA
    (KVConfig.deferred_stop). transformers (5.17 and later) has DeferredStopCheck: the flag
    "all rows finished" (and a streamer's tokens) copied without blocking and read a step
    later, so the host queues step n + 1 while the GPU runs step n; it turns it on for "mps"
    only. Without it the host waits for the GPU at the end of every step, then prepares the
    next one (its Python, kvcompile's step bookkeeping, the graph launch) while the GPU is
    idle: 0.35-0.4 ms a step at B16 on the H100 (benchmarks/host_gap.py). A transformers
    without the class keeps its own stop check."""
    try:
        from transformers.generation import utils
    except ImportError:
        return
    cls = getattr(utils, "DeferredStopCheck", None)
    supported = getattr(cls, "is_supported", None) if cls is not None else None
    if supported is None or getattr(supported, "_kvcompile", False):
        return

    def is_supported(device, cache, cache_is_returned, is_assistant):
        defer = _defers(device, cache, cache_is_returned, is_assistant)
        if defer is not None:
            return defer
        return supported(device, cache, cache_is_returned, is_assistant)

    is_supported._kvcompile = True
    cls.is_supported = staticmethod(is_supported)


def _defers(device, cache, cache_is_returned: bool, is_assistant: bool) -> bool | None:
    """Whether `generate`'s stop check over this cache is deferred; None: not a cache of a
    compiled model's pool (transformers decides)."""
    b = _binding_of_cache(cache) if cache is not None else None
    if b is None or b.state is None:
        return None
    st = b.state
    if not st.config.deferred_stop or torch.device(device).type not in DEFER_DEVICES:
        return None
    if is_assistant:
        return None
    if cache_is_returned:
        st.kernels.note("generate: the stop check waits for the GPU every step (the cache "
                        "outlives the call: return_dict_in_generate=True or a cache passed in)")
        return False
    st.count("generate_deferred_stop")
    return True


def _own_pages(generate):
    """`generate` that frees, when it returns, the pages of the caches the call made in this
    thread, except those the caller holds: passed in (`past_key_values=` / `cache=`) or given
    back (`return_dict_in_generate=True`); those return when that object is dropped. A
    StaticCache that HF keeps on the model for reuse is released too: its next use resets it."""

    @functools.wraps(generate)
    def run(*args, **kwargs):
        result = None
        with call_scope() as made:
            try:
                with generating():   # its decode steps may replay CUDA graphs (hf_graphs.py)
                    result = generate(*args, **kwargs)
                return result
            finally:
                if made:
                    keep = {id(b) for b in (_binding_of_cache(c)
                                            for c in _caches(kwargs, result)) if b is not None}
                    for b in made:
                        if id(b) not in keep:
                            b.release()

    run._kvcompile_owns_pages = True
    return run


def _device_sample(sample):
    """transformers' `_sample` (greedy search and sampling), whose greedy calls on a compiled
    model with graphed decode steps run their steps on the device (hf_loop.py,
    KVConfig.device_loop); every other call, and those it refuses (said in the report), as
    transformers runs them."""

    @functools.wraps(sample)
    def run(self, input_ids, logits_processor, stopping_criteria, generation_config,
            synced_gpus=False, streamer=None, **model_kwargs):
        fwd, why = _hf_loop.refusal(self, input_ids, logits_processor, stopping_criteria,
                                    generation_config, synced_gpus, streamer, model_kwargs)
        if fwd is None or why:
            return sample(self, input_ids, logits_processor, stopping_criteria,
                          generation_config, synced_gpus=synced_gpus, streamer=streamer,
                          **model_kwargs)
        return _hf_loop.run(self, fwd, input_ids, logits_processor, stopping_criteria,
                            generation_config, model_kwargs, streamer=streamer)

    run._kvcompile_loop = True
    return run


def _mark_decode(prepare):
    """`prepare_inputs_for_generation` whose decode inputs over kvcompile's pool come out with
    their growing dimensions marked dynamic (hf_graphs.mark_decode_dynamic): a model compiled
    by `torch.compile(..., backend="kvcompile")` is called by Dynamo without kvcompile's
    wrapper, and this is where its inputs pass through kvcompile before Dynamo sees them. A
    model compiled by `kvcompile.compile` is left to its forward (GraphedForward marks the
    steps it compiles, not those it captures into CUDA graphs)."""

    @functools.wraps(prepare)
    def run(self, *args, **kwargs):
        inputs = prepare(self, *args, **kwargs)
        if isinstance(inputs, dict) and not isinstance(getattr(self, "forward", None),
                                                       _hf_graphs.GraphedForward):
            _hf_graphs.mark_decode_dynamic(inputs)
        return inputs

    run._kvcompile_marks = True
    return run


def _wrap(cls, name: str, handler) -> None:
    original = getattr(cls, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        b = _binding_of_cache(self)
        if b is None:
            return original(self, *args, **kwargs)
        if handler is _crop:  # crop reshapes the stubs the way HF's own crop does
            return handler(self, b, functools.partial(original, self), *args, **kwargs)
        return handler(self, b, *args, **kwargs)

    setattr(cls, name, method)


def _stub_layers(cache):
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        if is_stub(keys):
            yield layer


def _binding_of_cache(cache):
    for layer in _stub_layers(cache):
        return binding_of(layer.keys)
    return None


def _reshape_stubs(cache, b, batch: int | None = None, length: int | None = None) -> None:
    for layer in _stub_layers(cache):
        for attr in ("keys", "values"):
            t = getattr(layer, attr)
            shape = list(t.shape)
            if batch is not None:
                shape[0] = batch
            if length is not None:
                shape[-2] = min(shape[-2], length) if not _is_static(layer) else shape[-2]
            setattr(layer, attr, b.stub(shape, t.dtype))


def _is_static(layer) -> bool:
    return type(layer).__name__.startswith("Static")


def _reorder(cache, b, beam_idx: torch.Tensor) -> None:
    rows = [int(i) for i in beam_idx.tolist()]
    b.select(rows)
    _reshape_stubs(cache, b, batch=len(rows))


def _repeat(cache, b, repeats: int) -> None:
    rows = [r for r in range(b.batch) for _ in range(repeats)]
    b.select(rows)
    _reshape_stubs(cache, b, batch=len(rows))


def _select(cache, b, indices: torch.Tensor) -> None:
    rows = [int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()]
    b.select(rows)
    _reshape_stubs(cache, b, batch=len(rows))


def _crop(cache, b, original, tokens_to_remove: int) -> None:
    """HF's own crop slices the stubs (and moves static caches' `cumulative_length`); the pool
    sequences are then cut to the length the cache now holds. Negative = remove that many
    tokens; positive = keep that many (the legacy meaning, older transformers); 0 = nothing
    (sliding layers may shrink to their window: the pool keeps those tokens)."""
    length = b.seq_len()
    original(tokens_to_remove)
    full = [layer.keys.shape[-2] for layer in _stub_layers(cache)
            if not _is_static(layer) and not getattr(layer, "is_sliding", False)]
    static = [layer.cumulative_length for layer in getattr(cache, "layers", [])
              if _is_static(layer) and hasattr(layer, "cumulative_length")]
    if full:
        new_len = max(full)
    elif static:
        new_len = int(static[0])
    elif tokens_to_remove < 0:
        new_len = length + tokens_to_remove
    else:
        new_len = tokens_to_remove or length
    if 0 <= new_len < length:
        b.crop(new_len)


def _reset(cache, b) -> None:
    b.release()
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "cumulative_length"):
            if isinstance(layer.cumulative_length, int):
                layer.cumulative_length = 0
            else:
                layer.cumulative_length.zero_()
        if not _is_static(layer):
            layer.keys = layer.values = None
            layer.is_initialized = False


# --- generate ----------------------------------------------------------------------------------


def wrap_generate(model) -> None:
    """Make `model.generate` share prompt pages among the copies HF makes of each prompt.

    For `num_return_sequences` and beam search, HF repeats every prompt row
    (`_expand_inputs_for_generation`) before the prefill. The wrapped `_prefill` runs each
    distinct row once and forks its sequence (`batch_repeat_interleave`, pages shared), so a
    shared prefix is never computed or stored twice. (Pages return at the call's end through
    the patched GenerationMixin.generate, `install`.)
    """
    install()
    if getattr(model.generate, "_kvcompile_wrapped", False):
        return
    original = model.generate
    expand = threading.local()   # per thread: concurrent calls expand independently

    @functools.wraps(original)
    def generate(*args, **kwargs):
        expand.size = 1
        return original(*args, **kwargs)

    expand_inputs = model._expand_inputs_for_generation
    prefill = getattr(model, "_prefill", None)
    if prefill is not None:  # long prompt batches are prefilled in chunks (hf_prefill.py)
        prefill = functools.partial(_hf_prefill.prefill, prefill, model)

    @functools.wraps(expand_inputs)
    def expand_inputs_recorded(*args, **kwargs):
        size = kwargs.get("expand_size", args[0] if args else 1)
        expand.size = int(size) if isinstance(size, int) else 1
        return expand_inputs(*args, **kwargs)

    def prefill_shared(input_ids, generation_config, model_kwargs, *args, **kwargs):
        g = getattr(expand, "size", 1)
        shared = _shared_prefill_inputs(input_ids, generation_config, model_kwargs, g)
        if shared is None:
            return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        ids_u, kwargs_u, cache = shared
        out = prefill(ids_u, generation_config, kwargs_u, *args, **kwargs)
        b = _binding_of_cache(cache)
        if b is None or b.batch != ids_u.shape[0]:
            raise RuntimeError("kvcompile: shared prefill did not bind its cache")
        cache.batch_repeat_interleave(g)                  # forks: pages shared, not copied
        for k, v in kwargs_u.items():                     # what the model's forward added
            if k not in model_kwargs:
                model_kwargs[k] = v
        return _repeat_outputs(out, g, ids_u.shape[0])

    generate._kvcompile_wrapped = True
    model.generate = generate
    model._expand_inputs_for_generation = expand_inputs_recorded
    if prefill is not None:
        model._prefill = prefill_shared


def _shared_prefill_inputs(input_ids, generation_config, model_kwargs, g: int):
    """(distinct rows of input_ids, model_kwargs for them, cache) when a prefill may run each
    repeated prompt once, else None (then nothing is shared and HF runs as usual)."""
    if g <= 1 or input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] % g:
        return None
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return None
    if model_kwargs.get("inputs_embeds") is not None:
        return None
    cache = _hf_graphs.cache_of(model_kwargs)
    if cache is None or type(cache).__name__ != "DynamicCache" or cache.get_seq_length() != 0:
        return None
    B = input_ids.shape[0]
    out = {}
    for k, v in model_kwargs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B:
            u = v[::g]
            if not torch.equal(u.repeat_interleave(g, dim=0), v):
                return None   # rows are not repeats of each other
            out[k] = u
        else:
            out[k] = v
    u = input_ids[::g]
    if not torch.equal(u.repeat_interleave(g, dim=0), input_ids):
        return None
    return u, out, cache


def _repeat_outputs(out, g: int, rows: int):
    """Model outputs of the distinct rows -> outputs of every repeated row (batch-dim tensors,
    also inside tuples: hidden states, attentions)."""
    def rep(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            return v.repeat_interleave(g, dim=0)
        if isinstance(v, tuple) and v and all(isinstance(x, torch.Tensor) for x in v):
            return tuple(rep(x) for x in v)
        return v

    for k in list(out.keys()):
        out[k] = rep(out[k])
    return out


def _caches(kwargs: dict, result) -> list:
    out = [kwargs.get(k) for k in _hf_graphs.CACHE_KEYS]
    # the output's cache field: `cache` from transformers 5.25 (where reading the old name
    # warns that it is deprecated), `past_key_values` before
    fields = getattr(type(result), "__dataclass_fields__", None) or {}
    name = "cache" if "cache" in fields else "past_key_values"
    out.append(getattr(result, name, None))
    return [c for c in out if c is not None and hasattr(c, "layers")]
