"""Hugging Face cache objects holding kvcompile stubs.

After the rewrite, a `DynamicCache` / `StaticCache` holds zero-byte stubs (cache/binding.py)
instead of K/V. These patches make the cache object's own operations act on the pool when its
tensors are stubs, and leave every other cache untouched:

    reorder_cache(beam_idx)       beam search: rows select/fork pool sequences (no copies)
    batch_repeat_interleave(n)    num_return_sequences: fork each row n times
    batch_select_indices(idx)     contrastive search / row selection
    crop(n)                       assisted decoding: truncate sequences
    reset()                       StaticCache reuse: free the sequences (no zero_ on stubs)
"""

from __future__ import annotations

import functools

import torch

from kvcompile.cache.binding import binding_of, is_stub

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    try:
        from transformers import cache_utils
    except ImportError:
        return
    _installed = True
    cache = cache_utils.Cache
    _wrap(cache, "reorder_cache", _reorder)
    _wrap(cache, "batch_repeat_interleave", _repeat)
    _wrap(cache, "batch_select_indices", _select)
    _wrap(cache, "crop", _crop)
    _wrap(cache, "reset", _reset)


def _wrap(cls, name: str, handler) -> None:
    original = getattr(cls, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        b = _binding_of_cache(self)
        if b is None:
            return original(self, *args, **kwargs)
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


def _crop(cache, b, tokens_to_remove: int) -> None:
    length = b.seq_len()
    new_len = length - abs(tokens_to_remove) if tokens_to_remove < 0 else tokens_to_remove
    if new_len >= length:
        return
    b.crop(new_len)
    _reshape_stubs(cache, b, length=new_len)
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "cumulative_length") and isinstance(layer.cumulative_length, int):
            layer.cumulative_length = new_len


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
