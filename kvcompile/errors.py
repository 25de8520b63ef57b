"""Every error kvcompile raises on purpose.

Each message names the problem and the fix. All derive from `KVCompileError` so callers can catch
the family; each also derives from the builtin that fits it (ValueError, RuntimeError, MemoryError).
"""

from __future__ import annotations


class KVCompileError(Exception):
    """Base class of kvcompile's errors."""


class KVCompileWarning(UserWarning):
    """kvcompile left part of a model as it was (an attention site, a rotation, the whole model)
    and says why, once, with the fix."""


class KVConfigError(KVCompileError, ValueError):
    """A config field has a bad value. The message names the field and the allowed values."""

    def __init__(self, field: str, value, allowed: str, hint: str = ""):
        self.field, self.value, self.allowed = field, value, allowed
        msg = f"KVConfig.{field}={value!r} is not allowed; allowed: {allowed}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


class KVCacheFullError(KVCompileError, MemoryError):
    """The page pool cannot hold the requested tokens. The pool is left exactly as it was."""

    def __init__(self, pages_requested: int, pages_free: int, pages_total: int, detail: str = ""):
        self.pages_requested = pages_requested
        self.pages_free = pages_free
        self.pages_total = pages_total
        msg = (
            f"KV page pool is full: {pages_requested} page(s) requested, {pages_free} free of "
            f"{pages_total}. Raise KVConfig.max_kv_bytes / memory_fraction, lower the batch size "
            f"or context, use a smaller kv_dtype (fp8_e4m3, fp4_e2m1), or add an eviction policy."
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class NonFiniteKVError(KVCompileError, FloatingPointError):
    """NaN or Inf reached the KV cache while `KVConfig(check_finite=True)`."""

    def __init__(self, layer: int, which: str, seq_index: int, position: int, head: int):
        self.layer, self.which, self.seq_index, self.position, self.head = (
            layer, which, seq_index, position, head)
        super().__init__(
            f"non-finite {which} value entering the KV cache at layer {layer}, batch row "
            f"{seq_index}, position {position}, kv head {head}. The cache was not modified. "
            f"Look for an overflow upstream (fp16 activations are a common cause; try bf16), or "
            f"set KVConfig(check_finite=False) to store it (it stays confined to its own block)."
        )


class SequenceTooLongError(KVCompileError, ValueError):
    """A sequence would grow past `KVConfig.max_seq_len`."""

    def __init__(self, length: int, max_seq_len: int):
        self.length, self.max_seq_len = length, max_seq_len
        super().__init__(
            f"sequence length {length} exceeds KVConfig.max_seq_len={max_seq_len}. Raise "
            f"max_seq_len, shorten the prompt / max_new_tokens, or add an eviction policy "
            f"(kvcompile.SinkWindow) to bound the cache."
        )


class InvalidInputError(KVCompileError, ValueError):
    """A compiled model was called with inputs it cannot take (empty or non-integer input_ids,
    a sequence past the model's learned positions). The message names the input and the fix."""


class UnsupportedShapeError(KVCompileError, ValueError):
    """A kernel was asked for a shape or dtype it does not implement."""


class CacheStateError(KVCompileError, RuntimeError):
    """The cache seen by a compiled graph does not match what kvcompile holds for it."""


class TensorParallelError(KVCompileError, ValueError):
    """A tensor-parallel model whose attention heads do not split evenly over its ranks, or
    Engine ranks whose schedules differ (they must be fed the same requests in the same order)."""
