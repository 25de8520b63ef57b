"""`inspect --verify`: the verdict on the final logits (verify.judge_logits, LOGIT_BOUNDS), the
summary line that says what was judged, and the exit code that follows it."""

import math

import pytest
import torch

from kvcompile.cli import verify
from kvcompile.cli.common import EXIT_OK, EXIT_VERIFY
from kvcompile.cli.verify import LOGIT_BOUNDS, judge_logits, summary_line

EAGER = ("--inner", "eager")


def _stats(kl_mean: float, top1: float, finite: bool = True, positions: int = 31) -> dict:
    return {"finite": finite, "positions": positions, "max_abs_err": 1.0, "rel_err": 0.1,
            "kl_mean": kl_mean, "kl_max": 4 * kl_mean, "top1_agree": top1}


@pytest.mark.parametrize("fmt", sorted(LOGIT_BOUNDS))
def test_each_format_passes_inside_its_bounds_and_fails_outside(fmt):
    kl_bound, top1_bound = LOGIT_BOUNDS[fmt]
    inside = judge_logits(_stats(kl_bound / 2, top1_bound), [fmt])
    assert inside["verdict"] == "pass" and inside["failed"] == []
    assert inside["bound_format"] == fmt
    assert (inside["kl_mean_bound"], inside["top1_bound"]) == (kl_bound, top1_bound)

    kl = judge_logits(_stats(kl_bound * 1.5, 1.0), [fmt])
    assert kl["verdict"] == "fail" and kl["failed"] == ["kl_mean"]
    assert "KL mean" in kl["reason"] and f"{kl_bound:g}" in kl["reason"]

    if top1_bound > 0:
        low = judge_logits(_stats(0.0, top1_bound - 0.04), [fmt])
        assert low["verdict"] == "fail" and low["failed"] == ["top1_agree"]
        assert low["reason"].startswith("top-1 agreement")


def test_bounds_are_ordered_by_how_much_each_format_loses():
    order = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int3", "int2"]
    kl = [LOGIT_BOUNDS[f][0] for f in order]
    top1 = [LOGIT_BOUNDS[f][1] for f in order]
    assert kl == sorted(kl) and top1 == sorted(top1, reverse=True)
    assert set(LOGIT_BOUNDS) == {"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1",
                                 "int4", "int3", "int2"}     # every KVConfig.kv_dtype


# Measured with `kvcompile inspect smollm2 --verify` (the comment above LOGIT_BOUNDS): the
# default prompt (31 positions) unless a count is given: (format, KL mean, top-1, positions)
MEASURED = [("fp32", 4.9e-13, 1.0, 31), ("fp32", 6.8e-13, 1.0, 90), ("fp16", 1.0e-6, 1.0, 31),
            ("bf16", 1.3e-4, 1.0, 31), ("bf16", 2.4e-5, 0.989, 90),
            ("fp8_e4m3", 0.034, 0.839, 31), ("fp8_e4m3", 0.0091, 0.922, 90),
            ("fp8_e4m3", 0.038, 0.903, 31),       # plain-PyTorch rounding to fp8, simulated
            ("fp8_e4m3", 0.0176, 0.786, 14), ("fp8_e4m3", 0.0107, 1.0, 5),
            ("fp8_e5m2", 0.091, 0.677, 31), ("fp8_e5m2", 0.029, 0.867, 90),
            ("fp4_e2m1", 0.137, 0.710, 31), ("fp4_e2m1", 0.075, 0.811, 90),
            ("fp4_e2m1", 0.222, 0.8, 5), ("int4", 0.88, 0.613, 31), ("int4", 0.47, 0.556, 90),
            ("int3", 3.08, 0.222, 90), ("int2", 8.92, 0.033, 90)]


@pytest.mark.parametrize("fmt,kl,top1,positions", MEASURED)
def test_correct_caches_of_smollm2_pass(fmt, kl, top1, positions):
    assert judge_logits(_stats(kl, top1, positions=positions), [fmt])["verdict"] == "pass"


def test_top1_is_not_judged_over_few_positions():
    few = verify.TOP1_MIN_POSITIONS - 1
    res = judge_logits(_stats(0.01, 0.5, positions=few), ["fp8_e4m3"])
    assert res["verdict"] == "pass" and res["top1_bound"] is None
    assert f"top-1 not judged over {few} positions" in res["reason"]
    res = judge_logits(_stats(0.01, 0.5, positions=few + 1), ["fp8_e4m3"])
    assert res["verdict"] == "fail" and res["failed"] == ["top1_agree"]


@pytest.mark.parametrize("claimed,costs_like", [
    ("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp8_e4m3"), ("fp8_e4m3", "fp4_e2m1"),
    ("fp8_e5m2", "int4"), ("fp4_e2m1", "int4"), ("int4", "int3"), ("int3", "int2")])
def test_a_cache_that_costs_what_a_coarser_format_costs_fails(claimed, costs_like):
    """A cache that claims `claimed` but moves the logits as much as `costs_like` does on the
    default prompt (its measured SmolLM2 figures) is broken: the verdict must say so."""
    default = {"fp16": (1.0e-6, 1.0), "bf16": (1.3e-4, 1.0), "fp8_e4m3": (0.034, 0.839),
               "fp4_e2m1": (0.137, 0.710), "int4": (0.88, 0.613), "int3": (2.6, 0.355),
               "int2": (6.4, 0.065)}
    kl, top1 = default[costs_like]
    res = judge_logits(_stats(kl, top1), [claimed])
    assert res["verdict"] == "fail" and res["bound_format"] == claimed


def test_the_issue_example_fails_for_bf16_pages_and_passes_for_fp8():
    """The figures of the issue (top-1 87.1%, KL max 0.16, KL mean ~0.03) are what fp8 pages
    give on SmolLM2 (a correct cache), and far beyond what bf16 pages may cost."""
    stats = _stats(0.03, 0.871)
    assert judge_logits(stats, ["fp8_e4m3"])["verdict"] == "pass"
    res = judge_logits(stats, ["bf16"])
    assert res["verdict"] == "fail" and res["failed"] == ["kl_mean", "top1_agree"]


def test_the_loosest_format_and_the_model_dtype_set_the_bound():
    # mixed K / V formats: the coarser one
    res = judge_logits(_stats(0.0, 1.0), ["fp8_e4m3", "int4"])
    assert res["bound_format"] == "int4"
    # fp32 pages in a bf16 model: the model computes in bf16
    res = judge_logits(_stats(1e-4, 1.0), ["fp32"], torch.bfloat16)
    assert res["bound_format"] == "bf16" and res["verdict"] == "pass"
    assert judge_logits(_stats(1e-4, 1.0), ["fp32"], torch.float32)["verdict"] == "fail"
    # no rewritten layer: compiled must equal eager up to the model's rounding
    assert judge_logits(_stats(0.0, 1.0), [])["bound_format"] == "fp32"
    # a tie between the pages' format and the model dtype's: the pages' format is named
    assert judge_logits(_stats(0.0, 1.0), ["bf16"], torch.bfloat16)["bound_format"] == "bf16"


@pytest.mark.parametrize("stats,why_not,verdict,reason", [
    (_stats(0.0, 1.0, finite=False), None, "fail", "NaN/Inf"),
    (_stats(math.nan, 1.0), None, "fail", "KL mean nan"),
    (_stats(-1.0, 1.0), None, "pass", "KL mean -1"),      # KL < 0: rounding; nothing wrong
    ({"finite": True, "error": "shapes differ: (1, 4) vs (1, 5)"}, None, "fail",
     "shapes differ"),
    (_stats(10.0, 0.0), "an eviction policy drops tokens", "not judged", "eviction"),
    ({"finite": True, "positions": 1, "max_abs_err": 0.1, "rel_err": 0.1}, None,
     "not judged", "no next-token distributions"),
])
def test_what_is_not_judged_or_cannot_pass(stats, why_not, verdict, reason):
    res = judge_logits(stats, ["fp8_e4m3"], why_not=why_not)
    assert res["verdict"] == verdict and reason in res["reason"]


def test_a_format_without_a_measured_bound_is_not_judged():
    res = judge_logits(_stats(0.0, 1.0), ["fp6_e3m2"])
    assert res["verdict"] == "not judged" and "fp6_e3m2" in res["reason"]


def _res(logits: dict, first_bad=None, rows_ok=(True, True)) -> dict:
    rows = [{"layer": f"model.layers.{i}.self_attn", "ok": ok} for i, ok in enumerate(rows_ok)]
    compared = sum(1 for r in rows if r["ok"] is not None)
    return {"layers": rows, "logits": logits, "first_divergent_layer": first_bad,
            "compared": compared, "within_tolerance": sum(1 for r in rows if r["ok"])}


def test_summary_line_says_what_was_judged():
    stats = _stats(0.034, 0.871)
    stats.update(judge_logits(stats, ["bf16"]))
    assert summary_line(_res(stats)) == (
        "layers: 2 of 2 within tolerance; logits: FAIL, KL mean 0.034 > 0.001 nats, top-1 "
        "agreement 87.1% < 95% (bf16 threshold)")
    stats = _stats(0.034, 0.871)
    stats.update(judge_logits(stats, ["fp8_e4m3"]))
    kl_bound, top1_bound = LOGIT_BOUNDS["fp8_e4m3"]
    assert summary_line(_res(stats, rows_ok=(True, None))) == (
        f"layers: 1 of 1 within tolerance (1 not compared); logits: pass (KL mean 0.034 <= "
        f"{kl_bound:g} nats, top-1 agreement 87.1% >= {verify._pct(top1_bound)}, fp8_e4m3 "
        f"threshold)")
    stats = _stats(0.034, 0.871)
    stats.update(judge_logits(stats, ["fp8_e4m3"], why_not="an eviction policy drops tokens"))
    line = summary_line(_res(stats, "model.layers.1.self_attn", (True, False)))
    assert line == ("layers: 1 of 2 within tolerance, first divergent: model.layers.1.self_attn; "
                    "logits: not judged (an eviction policy drops tokens)")


# --- through the command ----------------------------------------------------------------------

def test_logits_verdict_decides_the_exit_code(cli_json, cli, monkeypatch):
    """Every layer within tolerance but the logits beyond their bound: exit code 4, and the
    summary line says which part failed."""
    code, out, _ = cli_json("inspect", "tiny-llama", "--verify", "--kv-dtype", "bf16",
                            "--steps", 2, *EAGER)
    v = out["verify"]
    assert code == EXIT_OK and v["ok"] and v["logits"]["verdict"] == "pass"
    assert v["logits"]["bound_format"] == "bf16" and v["within_tolerance"] == v["compared"] == 2

    monkeypatch.setitem(LOGIT_BOUNDS, "bf16", (1e-12, 1.0))     # a bound bf16 pages cannot meet
    monkeypatch.setitem(LOGIT_BOUNDS, "fp32", (1e-13, 1.0))     # (the fp32 model's: tighter)
    torch._dynamo.reset()
    code, out, _ = cli_json("inspect", "tiny-llama", "--verify", "--kv-dtype", "bf16",
                            "--steps", 2, *EAGER)
    v = out["verify"]
    assert code == EXIT_VERIFY and out["exit_code"] == EXIT_VERIFY
    assert v["first_divergent_layer"] is None and not v["ok"]
    assert v["logits"]["verdict"] == "fail" and v["logits"]["failed"] == ["kl_mean"]
    assert v["logits"]["bound_format"] == "bf16"

    torch._dynamo.reset()
    code, text, _ = cli("inspect", "tiny-llama", "--verify", "--kv-dtype", "bf16", "--steps", 2,
                        *EAGER)
    assert code == EXIT_VERIFY
    assert "layers: 2 of 2 within tolerance; logits: FAIL, KL mean " in text
    assert "> 1e-12 nats (bf16 threshold)" in text
