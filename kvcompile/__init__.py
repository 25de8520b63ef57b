"""kvcompile: a torch.compile backend that moves any model's KV cache onto a paged, quantized pool.

    import kvcompile
    kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="fp8_e4m3"))
    # or: model.forward = torch.compile(model.forward, backend="kvcompile",
    #                                   options={"kv_dtype": "fp8_e4m3", "page_size": 16})
"""

import kvcompile.telemetry  # noqa: F401,E402  (installs the silent `kvcompile` logger)
from kvcompile.config import H2O, EvictionPolicy, KVConfig, SinkWindow, SnapKV, configure
from kvcompile.errors import (
    CacheStateError,
    KVCacheFullError,
    KVCompileError,
    KVConfigError,
    NonFiniteKVError,
    SequenceTooLongError,
    TensorParallelError,
    UnsupportedShapeError,
)

__version__ = "0.1.0"

# Entry points that pull in torch._dynamo / transformers are imported on first use, so that
# `import kvcompile` stays light and free of import cycles.
_LAZY = {
    "compile": ("kvcompile.api", "compile"),
    "release": ("kvcompile.api", "release"),
    "report": ("kvcompile.api", "report"),
    "stats": ("kvcompile.api", "stats"),
    "Engine": ("kvcompile.engine", "Engine"),
    "SamplingParams": ("kvcompile.engine", "SamplingParams"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcompile' has no attribute {name!r}")


__all__ = [
    "KVConfig", "configure", "compile", "release", "report", "stats", "Engine", "SamplingParams",
    "EvictionPolicy", "SinkWindow", "H2O", "SnapKV",
    "KVCompileError", "KVConfigError", "KVCacheFullError", "NonFiniteKVError",
    "SequenceTooLongError", "UnsupportedShapeError", "CacheStateError", "TensorParallelError",
]
