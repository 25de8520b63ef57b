"""The quality harness's own bookkeeping (benchmarks/quality/quality.py, quality_report.py): suites
merged from several processes, a stream cut into parts, reports of runs stopped by a deadline.
No SmolLM2: a tiny random Llama where a model is needed."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "quality"))

quality = pytest.importorskip("quality")
quality_report = pytest.importorskip("quality_report")


def test_segment_bounds_cover_the_scored_tokens_on_curve_points():
    for total, parts in ((75_012, 4), (9216, 3), (3000, 2), (1500, 4)):
        b = quality.segment_bounds(total, 64, parts)
        assert len(b) == parts and b[0][0] == 64 and b[-1][1] == total
        assert all(b[j][1] == b[j + 1][0] for j in range(parts - 1))
        assert all(lo <= hi for lo, hi in b)
        assert all(hi % quality.CURVE_EVERY == 0 or hi in (64, total) for _, hi in b[:-1])


def _part(lo, hi, upto, nll_per_tok=2.0):
    ends = list(range((lo // 1024 + 1) * 1024, upto, 1024)) + [upto]
    curve = [[e, nll_per_tok * (e - lo), e - lo] for e in ends]
    return {"from": lo, "to": hi, "upto": upto, "nll": nll_per_tok * (upto - lo),
            "n": upto - lo, "curve": curve}


def test_combine_parts_covers_the_joined_prefix_only():
    p0, p1, p2 = _part(64, 2048, 2048), _part(2048, 4096, 4096, 3.0), _part(4096, 5000, 5000)
    r = quality.combine_parts({"0": p0, "1": p1, "2": p2})
    assert r["upto"] == 5000 and r["tokens"] == 5000 - 64
    assert r["curve"][-1] == [5000, 2.0 * (2048 - 64) + 3.0 * 2048 + 2.0 * 904, 5000 - 64]
    assert [c[0] for c in r["curve"]] == [1024, 2048, 3072, 4096, 5000]
    assert r["ppl"] == pytest.approx(quality.ppl(r["curve"][-1][1], r["curve"][-1][2]))
    r = quality.combine_parts({"0": p0, "2": p2})             # part 1 missing: up to 2048
    assert r["upto"] == 2048 and r["tokens"] == 2048 - 64
    r = quality.combine_parts({"0": _part(64, 2048, 1024), "1": p1})  # part 0 unfinished
    assert r["upto"] == 1024
    r = quality.combine_parts({"1": p1})                      # no part 0: nothing covered
    assert r["ppl"] is None and r["tokens"] == 0


def test_merge_suite_rows_keys_and_parts():
    old = {"lengths": [1024], "results": {"full": {"1024": [True]}, "a": {"ppl": 1.0},
                                          "s [2 parts]": quality.combine_parts(
                                              {"0": _part(64, 2048, 2048)})}}
    new = {"lengths": [1024, 7680], "results": {
        "full": {"7680": [False]}, "b": {"ppl": 2.0}, "a": {"ppl": 3.0},
        "s [2 parts]": quality.combine_parts({"1": _part(2048, 4096, 4096)})}}
    m = quality.merge_suite(old, new)
    assert m["lengths"] == [1024, 7680]
    assert m["results"]["full"] == {"1024": [True], "7680": [False]}
    assert m["results"]["a"] == {"ppl": 3.0} and m["results"]["b"] == {"ppl": 2.0}
    assert m["results"]["s [2 parts]"]["upto"] == 4096


def test_save_merges_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "RESULTS_PATH", [str(tmp_path / "r.json")])
    monkeypatch.setattr(quality, "TAG", ["_t"])
    quality.save("stream", {"tokens": 10, "chunk": 64, "results": {"x": {"ppl": 1.0}}},
                 merge=True)
    quality.save("stream", {"tokens": 10, "chunk": 64, "results": {"y": {"ppl": 2.0}}},
                 merge=True)
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == {"stream_t"} and set(data["stream_t"]["results"]) == {"x", "y"}


def test_stream_table_compares_a_stopped_row_on_the_common_prefix():
    def row(ppl_per, upto):
        ends = list(range(1024, upto + 1, 1024))
        import math
        curve = [[e, math.log(ppl_per) * (e - 64), e - 64] for e in ends]
        return {"ppl": ppl_per, "tokens": upto - 64, "upto": upto, "curve": curve}

    s = {"tokens": 20480, "chunk": 64, "results": {
        "sink": row(26.0, 20480), "window": row(40.0, 10240),
        "full attention, sliding 1024-token window (stride 64)": row(25.0, 20480),
        "full attention, 2048-token windows": {"ppl": 27.0, "tokens": 20470}}}
    text = "\n".join(quality_report._stream_table("stream_t", s))
    assert "ppl, first 10,240 tokens" in text and "ppl, first 9,216 tokens" in text
    assert "stopped at token 10,240" in text
    assert "+60.0% (same prefix)" in text and "| +4.0% |" in text


def test_parts_of_a_stream_join_into_the_full_stream(tmp_path, monkeypatch):
    """A part whose warm-up reaches back to the start streams exactly what the full stream
    did: the parts' joined curve is the full stream's."""
    from kvcompile.config import SinkWindow
    from kvcompile.models import tiny_model

    monkeypatch.setattr(quality, "RESULTS_PATH", [str(tmp_path / "r.json")])
    monkeypatch.setattr(quality, "CURVE_EVERY", 128)
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(0))
    spec = [("sink", SinkWindow(2, 62), "cache")]
    head = {"tokens": len(ids), "chunk": 64}
    full = quality._stream_rows(model, ids, 64, spec, head,
                                quality.parse(["--device", "cpu", "--kv-gib", "0.01",
                                               "--slide-stride", "64"]))
    parts = {}
    for k in range(2):
        args = quality.parse(["--device", "cpu", "--kv-gib", "0.01", "--slide-stride", "64",
                              "--stream-segment", f"{k}/2", "--stream-warmup", "4096"])
        r = quality._stream_rows(model, ids, 64, spec, head, args)["sink [2 parts]"]
        parts.update(r["parts"])
    joined = quality.combine_parts(parts)
    assert joined["upto"] == full["sink"]["upto"] == 700
    assert [c[0] for c in joined["curve"]] == [c[0] for c in full["sink"]["curve"]]
    for a, b in zip(joined["curve"], full["sink"]["curve"]):
        assert a[2] == b[2] and a[1] == pytest.approx(b[1], rel=1e-6)
    saved = json.loads((tmp_path / "r.json").read_text())["stream"]["results"]
    assert saved["sink [2 parts]"]["upto"] == 700  # merged from the two parts' saves
