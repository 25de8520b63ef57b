"""Eviction inserted by the compiler: StreamingLLM sinks + window, H2O heavy hitters, SnapKV.

Set a policy in `KVConfig(eviction=...)` or per module with `kvcompile.configure`; the eviction
pass (passes/eviction.py) binds it to each rewritten attention site, and `EvictionRuntime`
(runtime.py) keeps the bookkeeping, attends over the kept tokens and evicts between forwards;
the pool moves the kept tokens (cache/compaction.py).
"""

from kvcompile.eviction.runtime import EvictionRuntime

__all__ = ["EvictionRuntime"]
