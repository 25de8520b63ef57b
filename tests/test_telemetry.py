"""kvcompile.stats() fields and rates, the Prometheus collector, the silent `kvcompile` logger."""

import math
import os
import subprocess
import sys

import pytest
import torch

import kvcompile
from kvcompile import telemetry
from kvcompile.config import KVConfig
from kvcompile.runtime.state import ModelState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cached_model():
    """A compiled tiny Llama holding one 37-token sequence in its pool (the cache is kept)."""
    from kvcompile.models import load_model

    torch._dynamo.reset()
    lm = load_model("tiny-llama")
    kvcompile.compile(lm.model, KVConfig(kv_dtype="fp8_e4m3", max_kv_bytes=1 << 20,
                                         inner="eager"))
    ids = lm.random_prompt(37)
    with torch.inference_mode():
        out = lm.model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    yield lm.model, cache
    torch._dynamo.reset()


def test_stats_fields(cached_model):
    model, _cache = cached_model
    st = kvcompile.stats(model)
    assert st["tokens"] == 37 and st["sequences"] == 1
    assert st["pages_used"] == math.ceil(37 / 16)
    assert st["pages_used"] + st["pages_free"] == st["pages_total"]
    assert st["fill_ratio"] == pytest.approx(st["pages_used"] / st["pages_total"])
    assert st["internal_waste"] == pytest.approx((3 * 16 - 37) / (3 * 16))
    assert st["bytes_per_token"] == pytest.approx(2 * 2 * 2 * (16 + 4 / 16))
    assert st["layers"] == 2 and st["attention_rewritten"] >= 2
    for field in ("evictions_per_s", "evicted_tokens_per_s", "preemptions_per_s",
                  "prefix_cache_hit_rate"):
        assert st[field] == 0.0
    assert kvcompile.stats()  # all models: keyed 0, 1, ...
    assert any(v["tokens"] == 37 for v in kvcompile.stats().values())


def test_rates_and_hit_rate():
    st = ModelState(KVConfig())
    st.created_at = 100.0
    st.count("eviction_runs", 3)
    st.count("evicted_tokens", 300)
    st.count("preemptions", 1)
    st.count("prefix_query_tokens", 120)
    st.count("prefix_hit_tokens", 30)
    a = telemetry.state_stats(st, now=110.0)  # since creation: 10 s
    assert a["evictions_per_s"] == pytest.approx(0.3)
    assert a["evicted_tokens_per_s"] == pytest.approx(30.0)
    assert a["preemptions_per_s"] == pytest.approx(0.1)
    assert a["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert a["pages_total"] == 0 and a["fill_ratio"] == 0.0  # no pool yet
    st.count("eviction_runs", 7)
    b = telemetry.state_stats(st, now=120.0)
    assert b["evictions_per_s"] == pytest.approx(10 / 20)
    # the window slides: samples older than RATE_WINDOW_S stop counting
    st.count("eviction_runs", 60)
    late = 120.0 + telemetry.RATE_WINDOW_S + 30
    telemetry.state_stats(st, now=late - 1)
    c = telemetry.state_stats(st, now=late)
    assert c["evictions_per_s"] < (70 / (late - 100.0)) * 1.5
    assert c["evictions_per_s"] > 0


def test_prometheus_collector(cached_model):
    prom = pytest.importorskip("prometheus_client")
    model, _cache = cached_model
    registry = prom.CollectorRegistry()
    telemetry.prometheus_collector(registry)
    text = prom.generate_latest(registry).decode()
    pages = kvcompile.stats(model)["pages_used"]
    lines = [ln for ln in text.splitlines() if ln.startswith("kvcompile_pages_used{")]
    assert any(ln.endswith(f" {float(pages)}") for ln in lines), lines
    for name in ("kvcompile_fill_ratio", "kvcompile_evictions_per_second",
                 "kvcompile_preemptions_per_second", "kvcompile_prefix_cache_hit_rate",
                 "kvcompile_evicted_tokens_total", "kvcompile_bytes_per_token"):
        assert name in text


def test_prometheus_missing_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prom(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError("no prometheus_client")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_prom)
    with pytest.raises(ImportError, match=r"pip install 'kvcompile\[prometheus\]'"):
        telemetry.prometheus_collector()


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_logger_silent_by_default_and_enabled_on_request():
    quiet = _python("import logging, kvcompile.telemetry\n"
                    "logging.getLogger('kvcompile').warning('should not show')\n")
    assert quiet.returncode == 0 and "should not show" not in quiet.stderr
    loud = _python("import logging, kvcompile.telemetry as t\nt.enable_logging('INFO')\n"
                   "logging.getLogger('kvcompile').info('pool built')\n")
    assert loud.returncode == 0 and "kvcompile INFO pool built" in loud.stderr
