"""benchmarks/plots.py makes the README figures from the benchmark scripts' JSON layouts."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plots():
    spec = importlib.util.spec_from_file_location("kvc_plots",
                                                  os.path.join(ROOT, "benchmarks", "plots.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_all_figures_from_results(tmp_path, capsys):
    res, out = tmp_path / "results", tmp_path / "img"
    res.mkdir()
    kern = {"bf16": {"ms": 0.48, "tbs": 4.4, "ratio": 1.03},
            "fp8_e4m3 page": {"ms": 0.36, "tbs": 2.9, "ratio": 0.77}}
    (res / "bench_decode.json").write_text(json.dumps({"final": [
        {"shape": "B64_L8k", "sdpa_ms": 0.47, "sdpa_tbs": 4.5, "kernels": kern},
        {"shape": "B1_L128k", "sdpa_ms": 0.12, "sdpa_tbs": 4.3, "kernels": kern}]}))
    (res / "bench_prefill.json").write_text(json.dumps({
        "info": {"gpu": "H200", "date": "2026-11-30"},
        "results": {"B4 L8192": [{"name": "sdpa", "ms": 1.0, "tflops": 600.0},
                                 {"name": "kvcompile fp8", "ms": 1.2, "tflops": 500.0}]}}))
    (res / "quality_results.json").write_text(json.dumps({
        "ppl": {"ctx": 1024, "cont": 256, "results": {
            "auto": {"full": {"ppl": 20.0}, "SinkWindow@50": {"ppl": 21.0}},
            "fp8_e4m3": {"full": {"ppl": 20.2}, "SinkWindow@50": {"ppl": 21.3}}}},
        "passkey": {"lengths": [1024], "results": {"full": {"1024": [True, True]},
                                                   "H2O@50": {"1024": [False, True]}}}}))
    assert _plots().main(["--results", str(res), "--out", str(out)]) == 0
    made = sorted(os.listdir(out))
    assert made == ["decode.png", "memory.png", "prefill.png", "quality.png"]
    assert all(_is_png(out / m) for m in made)
    assert "skipped" not in capsys.readouterr().out


def test_missing_and_malformed_inputs_are_skipped(tmp_path, capsys):
    res, out = tmp_path / "results", tmp_path / "img"
    res.mkdir()
    (res / "bench_decode.json").write_text(json.dumps({"something": "else"}))
    plots = _plots()
    plots.HERE = str(tmp_path)  # no fallbacks either
    assert plots.main(["--results", str(res), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert os.listdir(out) == ["memory.png"]  # computed, needs no input
    assert "skipped decode" in text and "unexpected layout" in text
    assert "skipped prefill: no bench_prefill.json" in text
