"""Every KVCOMPILE_* switch of the package is a KVConfig field whose default the environment
sets, read in config.py only (the CLI may read its own, KVCOMPILE_BENCHMARKS)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcompile.config import KVConfig
from kvcompile.errors import KVConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "kvcompile"
SWITCHES = ("KVCOMPILE_CUDA_GRAPHS", "KVCOMPILE_PREFILL", "KVCOMPILE_PREFILL_TMA",
            "KVCOMPILE_PREFILL_Q_TMA", "KVCOMPILE_PREFILL_SCALE_TMA",
            "KVCOMPILE_PREFILL_WARP_SPEC", "KVCOMPILE_REROT_ASIDE", "KVCOMPILE_WINDOW_EVICTION",
            "KVCOMPILE_CPU_FP8", "KVCOMPILE_GRAPH_CHECK", "KVCOMPILE_DEFERRED_STOP",
            "KVCOMPILE_DECODE_GEMMS")


@pytest.fixture
def clean_env(monkeypatch):
    for var in SWITCHES:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_defaults_without_the_environment(clean_env):
    c = KVConfig()
    assert (c.cuda_graphs, c.prefill, c.prefill_tma, c.prefill_q_tma, c.prefill_scale_tma,
            c.prefill_warp_spec, c.rerotated_sinks_graphs, c.window_eviction, c.cpu_fp8,
            c.graph_check, c.deferred_stop) == (True, "auto", True, True, False, False, True, True,
                                                "auto", False, True)


@pytest.mark.parametrize("var,value,field,expected", [
    ("KVCOMPILE_CUDA_GRAPHS", "0", "cuda_graphs", False),
    ("KVCOMPILE_CUDA_GRAPHS", "", "cuda_graphs", False),
    ("KVCOMPILE_CUDA_GRAPHS", "1", "cuda_graphs", True),
    ("KVCOMPILE_PREFILL", "triton", "prefill", "triton"),
    ("KVCOMPILE_PREFILL", "sdpa", "prefill", "sdpa"),
    ("KVCOMPILE_PREFILL", "reference", "prefill", "sdpa"),   # any value but triton gathers
    ("KVCOMPILE_PREFILL", "", "prefill", "auto"),
    ("KVCOMPILE_PREFILL_TMA", "0", "prefill_tma", False),
    ("KVCOMPILE_PREFILL_TMA", "", "prefill_tma", True),
    ("KVCOMPILE_PREFILL_Q_TMA", "false", "prefill_q_tma", False),
    ("KVCOMPILE_PREFILL_SCALE_TMA", "1", "prefill_scale_tma", True),
    ("KVCOMPILE_PREFILL_WARP_SPEC", "1", "prefill_warp_spec", True),
    ("KVCOMPILE_PREFILL_WARP_SPEC", "yes", "prefill_warp_spec", False),
    ("KVCOMPILE_REROT_ASIDE", "0", "rerotated_sinks_graphs", False),
    ("KVCOMPILE_REROT_ASIDE", "", "rerotated_sinks_graphs", True),
    ("KVCOMPILE_WINDOW_EVICTION", "0", "window_eviction", False),
    ("KVCOMPILE_WINDOW_EVICTION", "", "window_eviction", True),
    ("KVCOMPILE_CPU_FP8", "numpy", "cpu_fp8", "numpy"),
    ("KVCOMPILE_CPU_FP8", "c", "cpu_fp8", "c"),
    ("KVCOMPILE_CPU_FP8", "", "cpu_fp8", "auto"),
    ("KVCOMPILE_GRAPH_CHECK", "1", "graph_check", True),
    ("KVCOMPILE_GRAPH_CHECK", "", "graph_check", False),
    ("KVCOMPILE_DEFERRED_STOP", "0", "deferred_stop", False),
    ("KVCOMPILE_DEFERRED_STOP", "", "deferred_stop", True),
    ("KVCOMPILE_DECODE_GEMMS", "triton", "decode_gemms", "triton"),
    ("KVCOMPILE_DECODE_GEMMS", "auto", "decode_gemms", "auto"),
    ("KVCOMPILE_DECODE_GEMMS", "", "decode_gemms", "torch"),
])
def test_the_environment_sets_the_default(clean_env, var, value, field, expected):
    clean_env.setenv(var, value)
    assert getattr(KVConfig(), field) == expected
    assert getattr(KVConfig(**{field: expected}), field) == expected


def test_an_explicit_field_wins_over_the_environment(clean_env):
    clean_env.setenv("KVCOMPILE_CUDA_GRAPHS", "0")
    clean_env.setenv("KVCOMPILE_PREFILL", "triton")
    c = KVConfig.from_options({"cuda_graphs": True, "prefill": "sdpa"})
    assert c.cuda_graphs is True and c.prefill == "sdpa"


@pytest.mark.parametrize("field,value", [("prefill", "flash"), ("cuda_graphs", "yes"),
                                         ("prefill_tma", 1), ("cpu_fp8", "asm"),
                                         ("graph_check", "1"), ("deferred_stop", 0),
                                         ("decode_gemms", "cublas")])
def test_bad_values_name_the_field(clean_env, field, value):
    with pytest.raises(KVConfigError, match=field):
        KVConfig(**{field: value})


def test_no_switch_is_read_outside_the_config_module():
    # os.environ / os.getenv with a KVCOMPILE_ name, anywhere but config.py and the CLI
    read = re.compile(r"(environ|getenv)[^\n]*KVCOMPILE_")
    bad = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
           if p.name != "config.py" and "cli" not in p.relative_to(PACKAGE).parts
           and read.search(p.read_text())]
    assert bad == []
