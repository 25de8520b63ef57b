"""Telemetry: `kvcompile.stats()` figures, rates, a Prometheus exporter, and the `kvcompile` logger.

    kvcompile.stats(model)            # {'pages_used': .., 'fill_ratio': .., 'evictions_per_s': ..}
    kvcompile.telemetry.start_prometheus(port=9400)   # needs prometheus_client
    kvcompile.telemetry.enable_logging("INFO")        # the `kvcompile` logger is silent by default

Run-time parts feed counters through `ModelState.count(name, n)`; this module turns them into
gauges and rates. The counter names it reads (a contract with eviction/ and engine/):

    eviction_runs            policy invocations that dropped tokens      (eviction/runtime.py)
    evicted_tokens           tokens dropped by eviction                  (eviction/runtime.py)
    preemptions              sequences preempted (swapped / recomputed)  (engine)
    prefix_hit_tokens        prompt tokens served from the prefix cache  (engine)
    prefix_query_tokens      prompt tokens looked up in the prefix cache (engine)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

LOGGER_NAME = "kvcompile"
logger = logging.getLogger(LOGGER_NAME)
# A library stays quiet until its user asks: no output unless a handler is configured (here with
# enable_logging, or on the root logger by the application).
if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
    logger.addHandler(logging.NullHandler())

RATE_COUNTERS = {  # rate field -> counter it differentiates
    "evictions_per_s": "eviction_runs",
    "evicted_tokens_per_s": "evicted_tokens",
    "preemptions_per_s": "preemptions",
}
RATE_WINDOW_S = 60.0
_MAX_SAMPLES = 512  # per model: a caller polling every token keeps a bounded history

_history: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> deque of samples
_lock = threading.Lock()


def enable_logging(level: int | str = "INFO", stream=None) -> logging.Handler:
    """Send the `kvcompile` logger's records at `level` or above to `stream` (stderr)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def state_stats(state, now: float | None = None) -> dict:
    """Every telemetry field of one compiled model (see `kvcompile.stats`)."""
    now = time.monotonic() if now is None else now
    counters = dict(state.counters)
    out: dict = {
        "pages_total": 0, "pages_used": 0, "pages_free": 0, "pages_shared": 0, "pages_max": 0,
        "fill_ratio": 0.0, "internal_waste": 0.0, "sequences": 0, "tokens": 0,
        "bytes_total": 0, "bytes_used": 0, "bytes_per_token": 0.0,
    }
    if state.pool is not None:
        ps = state.pool.stats()
        out.update(ps.__dict__)
        out["fill_ratio"] = ps.pages_used / ps.pages_total if ps.pages_total else 0.0
    # tensor parallelism: the figures above are this rank's pool shard. Every rank holds the
    # same pages for its own kv heads (the same steps on the same layout), so the whole
    # model's pool is this rank's times the tp size, known without a collective
    tp = getattr(state, "tp", None)
    out["tp_rank"], out["tp_size"] = (tp.rank, tp.size) if tp is not None else (0, 1)
    for key in ("bytes_total", "bytes_used", "bytes_per_token"):
        out[f"{key}_all_ranks"] = out[key] * out["tp_size"]
    hits = counters.get("prefix_hit_tokens", 0)
    queried = counters.get("prefix_query_tokens", 0)
    out["prefix_cache_hit_rate"] = hits / queried if queried else 0.0
    out.update(_rates(state, counters, now))
    out["layers"] = len(state.layer_specs)
    out["graphs"] = state.graphs
    out["counters"] = counters
    out.update(counters)  # flat as well, as `stats()` always returned them
    return out


def _rates(state, counters: dict, now: float) -> dict:
    """Per-second rates over the last RATE_WINDOW_S seconds of `stats()` calls (since the first
    call when the history is shorter)."""
    sample = (now, {c: counters.get(c, 0) for c in RATE_COUNTERS.values()})
    with _lock:
        hist = _history.get(state)
        if hist is None:
            born = getattr(state, "created_at", None)
            hist = deque([(born if born is not None else now, dict.fromkeys(sample[1], 0))],
                         maxlen=_MAX_SAMPLES)
            _history[state] = hist
        hist.append(sample)
        while len(hist) > 2 and now - hist[1][0] >= RATE_WINDOW_S:
            hist.popleft()
        t0, first = hist[0]
    dt = now - t0
    return {field: (sample[1][c] - first.get(c, 0)) / dt if dt > 0 else 0.0
            for field, c in RATE_COUNTERS.items()}


# --- Prometheus -------------------------------------------------------------------------------

GAUGES = {  # metric suffix -> (stats field, help)
    "pages_total": ("pages_total", "Pages in the KV page pool"),
    "pages_used": ("pages_used", "Pages holding cached tokens"),
    "pages_free": ("pages_free", "Free pages"),
    "fill_ratio": ("fill_ratio", "Fraction of the pool's pages in use (KV-cache saturation)"),
    "internal_waste": ("internal_waste", "Fraction of slots in used pages that hold no token"),
    "sequences": ("sequences", "Sequences holding pages"),
    "tokens": ("tokens", "Tokens cached (a shared token counts once per sequence)"),
    "bytes_used": ("bytes_used", "Bytes of the pool in used pages"),
    "bytes_per_token": ("bytes_per_token", "Bytes per cached token, all layers, K+V, scales"),
    "evictions_per_second": ("evictions_per_s", "Eviction runs per second (60 s window)"),
    "evicted_tokens_per_second": ("evicted_tokens_per_s", "Evicted tokens per second"),
    "preemptions_per_second": ("preemptions_per_s", "Preemptions per second"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prompt tokens served by the prefix "
                                                       "cache / tokens looked up"),
}
COUNTERS = ("eviction_runs", "evicted_tokens", "preemptions", "prefix_hit_tokens",
            "prefix_query_tokens", "attention_rewritten", "reference_fallback", "swapped_aside")


class KVCompileCollector:
    """A prometheus_client collector: one sample per compiled model (label `model`), read at
    scrape time from `kvcompile.stats()`; nothing runs between scrapes."""

    def __init__(self, prefix: str = "kvcompile"):
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        per_model = _all_stats()
        for suffix, (key, doc) in GAUGES.items():
            g = GaugeMetricFamily(f"{self.prefix}_{suffix}", doc, labels=["model"])
            for label, st in per_model.items():
                g.add_metric([label], float(st.get(key, 0)))
            yield g
        for name in COUNTERS:
            c = CounterMetricFamily(f"{self.prefix}_{name}", f"kvcompile counter {name}",
                                    labels=["model"])
            for label, st in per_model.items():
                c.add_metric([label], float(st["counters"].get(name, 0)))
            yield c


def _all_stats() -> dict[str, dict]:
    from kvcompile.runtime.state import all_states

    return {str(i): state_stats(st) for i, st in enumerate(all_states())}


def prometheus_collector(registry=None, prefix: str = "kvcompile") -> KVCompileCollector:
    """Register a `KVCompileCollector` on `registry` (the default one) and return it."""
    try:
        from prometheus_client import REGISTRY
    except ImportError as e:
        raise ImportError("the Prometheus exporter needs prometheus_client: "
                          "pip install 'kvcompile[prometheus]'") from e
    collector = KVCompileCollector(prefix)
    (registry or REGISTRY).register(collector)
    return collector


def start_prometheus(port: int = 9400, addr: str = "127.0.0.1", registry=None):
    """Serve /metrics on `addr:port` from a daemon thread; returns the collector."""
    from prometheus_client import REGISTRY, start_http_server

    registry = registry or REGISTRY
    collector = prometheus_collector(registry)
    start_http_server(port, addr=addr, registry=registry)
    logger.info("kvcompile Prometheus metrics on http://%s:%d/metrics", addr, port)
    return collector
