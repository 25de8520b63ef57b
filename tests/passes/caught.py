"""Catching kvcompile's warnings (KVCompileWarning) in a test, every one of them."""

from __future__ import annotations

import contextlib
import re
import warnings

from kvcompile.errors import KVCompileWarning


@contextlib.contextmanager
def kv_warnings():
    """Yields the list of KVCompileWarning messages (str) raised inside the block; other
    warnings pass through."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", KVCompileWarning)
        yield messages
    for w in rec:
        if issubclass(w.category, KVCompileWarning):
            messages.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def has(messages: list[str], pattern: str) -> bool:
    return any(re.search(pattern, m) for m in messages)
