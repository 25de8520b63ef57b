"""The `kvcompile` console script on tiny random models: every command, JSON outputs, exit codes
and one-line errors. (SmolLM2 runs are in test_realmodel.py.)"""

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from kvcompile.cli import common
from kvcompile.cli.common import (
    EXIT_INTERNAL,
    EXIT_MODEL,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    EXIT_VERIFY,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tiny-* models: 2 layers, 2 kv heads, head_dim 16; fp8 with page scales (page 16):
# per layer K+V = 2 * 2 heads * (16 code bytes + 4/16 scale bytes) = 65 B; bf16 = 128 B
FP8_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4 / 16)
BF16_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 2
# The inner backend does not change the passes or the cache: most tests skip AOTAutograd's time.
EAGER = ("--inner", "eager")


def _one_line_error(err: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[0].startswith("kvcompile: error: "), err
    assert all(ln.startswith("  hint: ") for ln in lines[1:]), err
    assert "Traceback" not in err


# --- inspect ----------------------------------------------------------------------------------

def test_inspect_json_sites_and_memory_plan(cli_json, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_MERGE_PROJECTIONS", "1")   # ("auto": CUDA graphs only)
    code, out, _ = cli_json("inspect", "tiny-llama", "--batch", 3, "--context", 100, "--tp", 2)
    assert code == EXIT_OK and out["exit_code"] == EXIT_OK
    assert out["rewritten"] == 2 and len(out["sites"]) == 2
    for site in out["sites"]:
        assert site["rewritten"] and site["reason"] == ""
        assert site["pattern"] == "sdpa" and site["cache"] == "cat"
        assert (site["k_format"], site["v_format"]) == ("fp8_e4m3", "fp8_e4m3")
        assert site["name"].startswith("model.layers.")
    mem = out["memory"]
    assert mem["bytes_per_token"] == pytest.approx(FP8_BYTES_PER_TOKEN)
    assert mem["bf16_bytes_per_token"] == pytest.approx(BF16_BYTES_PER_TOKEN)
    assert mem["pages_per_sequence"] == math.ceil(100 / 16) and mem["pages"] == 3 * 7
    assert mem["pool_bytes"] == pytest.approx(21 * 16 * FP8_BYTES_PER_TOKEN)
    assert mem["bf16_cache_bytes"] == pytest.approx(3 * 100 * BF16_BYTES_PER_TOKEN)
    fp4 = [r for r in mem["formats"] if (r["format"], r["granularity"]) == ("fp4_e2m1", "page")]
    assert fp4 and fp4[0]["bytes_per_token"] < mem["bytes_per_token"]
    # --tp 2: a rank holds 1 of the 2 KV heads of each layer (page scales per head): half
    assert mem["tp"] == 2 and {r["kv_heads_per_rank"] for r in mem["layers"]} == {1}
    assert mem["bytes_per_token_per_rank"] == pytest.approx(FP8_BYTES_PER_TOKEN / 2)
    assert mem["pool_bytes_per_rank"] == pytest.approx(mem["pool_bytes"] / 2)
    # q / k / v and gate / up of each layer merged, in each graph (prefill, decode)
    proj = out["projections"]
    assert proj["merged"] >= 2 * 2 and proj["linears"] == 5 * proj["merged"] / 2


def test_inspect_tp_refuses_heads_split_across_ranks(cli):
    # 2 KV heads over 4 ranks: refused, naming the heads and the fix
    code, _, err = cli("inspect", "tiny-llama", "--tp", 4, "--steps", 0, *EAGER)
    assert code == EXIT_USAGE, err
    _one_line_error(err)
    assert "2 KV heads, which do not divide by 4" in err and "num_key_value_heads=2" in err


def test_inspect_text_other_family_and_format(cli):
    code, out, err = cli("inspect", "tiny-gpt2", "--kv-dtype", "bf16", *EAGER)
    assert code == EXIT_OK, err
    assert "2 attention site(s), 2 rewritten" in out
    assert "bf16/bf16" in out and "memory plan" in out
    assert "merged projections" not in out   # GPT-2's c_attn is one linear already
    assert "Traceback" not in err


def test_inspect_passes_shows_the_rewrite_diff(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--passes", "--graph", 2, *EAGER)
    assert code == EXIT_OK
    (graph,) = out["passes"]
    names = [p["pass"] for p in graph["passes"]]
    assert names[:4] == ["find_attention", "find_cache", "resolve_config", "rewrite"]
    by_name = {p["pass"]: p for p in graph["passes"]}
    assert by_name["find_attention"]["lines_changed"] == 0  # analysis only
    diff = by_name["rewrite"]["diff"]
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and "scaled_dot" in ln]
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and "kvcompile.attention" in ln]
    assert len(removed) == 2 and len(added) == 2


def test_inspect_stop_after_a_pass(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--pass", "find_cache", *EAGER)
    assert code == EXIT_OK
    assert out["rewritten"] == 0 and len(out["sites"]) == 2
    assert all(s["cache"] == "cat" for s in out["sites"])
    assert all(s["rewrite"] == "not reached (stopped after find_cache)" for s in out["sites"])
    assert "memory" not in out
    for graph in out["passes"]:
        assert [p["pass"] for p in graph["passes"]] == ["find_attention", "find_cache"]


def test_inspect_stop_after_rewrite(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--pass", "rewrite", *EAGER)
    assert code == EXIT_OK and out["rewritten"] == 2
    assert all(s["rewrite"] == "kvcompile.attention (paged pool)" for s in out["sites"])
    assert out["memory"]["bytes_per_token"] == pytest.approx(FP8_BYTES_PER_TOKEN)
    for graph in out["passes"]:
        assert [p["pass"] for p in graph["passes"]][-1] == "rewrite"


def test_inspect_with_eviction(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--eviction", "sink_window:sinks=4,window=60",
                            "--context", 4096, "--passes", *EAGER)
    assert code == EXIT_OK and out["rewritten"] == 2
    assert all(s["eviction"].startswith("SinkWindow(sinks=4, window=60") for s in out["sites"])
    mem = out["memory"]
    assert mem["tokens_kept_per_sequence"] == 64 and mem["pages_per_sequence"] == 4
    assert mem["pool_bytes"] == pytest.approx(4 * 16 * FP8_BYTES_PER_TOKEN)
    last = out["passes"][-1]["passes"]
    assert last[-1]["pass"] == "eviction"


def test_inspect_factory_model_with_buffer_cache(cli_json):
    code, out, _ = cli_json("inspect", "tests.cli.factories:static_cache", "--kv-dtype", "bf16",
                            *EAGER)
    assert code == EXIT_OK
    (site,) = out["sites"]
    assert site["rewritten"] and site["cache"] in ("index_put", "index_copy")


def test_inspect_pictures(cli, tmp_path):
    dot, svg = tmp_path / "site.dot", tmp_path / "site.svg"
    code, out, err = cli("inspect", "tiny-llama", "--dot", dot, "--svg", svg,
                         "--site", "model.layers.1.self_attn", *EAGER)
    assert code == EXIT_OK, err
    text = dot.read_text()
    assert text.startswith("digraph") and "cluster_b" in text and "cluster_a" in text
    assert "kvcompile.attention" in text and "scaled_dot_product_attention" in text
    assert " -> " in text
    root = ET.fromstring(svg.read_text())  # well-formed XML
    assert root.tag.endswith("svg")
    assert "kvcompile.attention" in svg.read_text()


def test_inspect_picture_unknown_site(cli, tmp_path):
    code, _, err = cli("inspect", "tiny-llama", "--svg", tmp_path / "x.svg", "--site", "nope",
                       *EAGER)
    assert code == EXIT_USAGE
    _one_line_error(err)
    assert "no site named 'nope'" in err and "model.layers.0.self_attn" in err


def test_verify_within_tolerance(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--verify", "--kv-dtype", "bf16",
                            "--steps", 3)
    assert code == EXIT_OK
    v = out["verify"]
    assert v["ok"] and v["first_divergent_layer"] is None and v["compared"] == 2
    for row in v["layers"]:  # bf16 storage of an fp32 model: errors ~ bf16 rounding
        assert row["ok"] and row["storage_ok"] and row["impl_ok"]
        assert 0 < row["storage_rel_err"] < 2 * 1.6e-2 and row["impl_rel_err"] <= 4e-5
        assert 0 < row["local_rel_err"] < 2 * 1.6e-2
        assert "drift_ok" not in row and 0 < row["rel_err"] < 0.1  # lossy: reported only
    assert v["logits"]["positions"] == 24 + 3
    assert v["logits"]["top1_agree"] == 1.0 and v["logits"]["kl_mean"] < 1e-3


def test_verify_names_the_first_divergent_layer(cli_json, monkeypatch):
    """A bug injected into layer 1 only (its values are stored scaled by 1.5) must be found."""
    import kvcompile
    from kvcompile.api import state_of
    from kvcompile.runtime.hooks import RuntimeHook

    class CorruptLayer1(RuntimeHook):
        def before_write(self, ctx, layer, k, v):
            return k, (v * 1.5 if layer == 1 else v)

    real = kvcompile.compile

    def compile_with_bug(model, config=None, **kw):
        out = real(model, config, **kw)
        state_of(model).hooks.append(CorruptLayer1())
        return out

    monkeypatch.setattr(kvcompile, "compile", compile_with_bug)
    code, out, err = cli_json("inspect", "tiny-llama", "--verify", "--kv-dtype", "bf16", *EAGER)
    assert code == EXIT_VERIFY and out["exit_code"] == EXIT_VERIFY
    v = out["verify"]
    assert v["first_divergent_layer"] == "model.layers.1.self_attn"
    rows = {r["layer"]: r for r in v["layers"]}
    assert rows["model.layers.0.self_attn"]["ok"] and not rows["model.layers.1.self_attn"]["ok"]
    bad = rows["model.layers.1.self_attn"]
    assert not bad["storage_ok"] and bad["v_sqnr_db"] < 7 and bad["k_sqnr_db"] > 40
    assert bad["impl_ok"]  # the attention itself is right about what was stored


def test_verify_lossless_storage_judges_drift(cli_json):
    code, out, _ = cli_json("inspect", "tiny-llama", "--verify", "--kv-dtype", "fp32", *EAGER)
    assert code == EXIT_OK
    for row in out["verify"]["layers"]:
        assert row["drift_ok"] and row["rel_err"] < 1e-5 and row["local_rel_err"] < 1e-5


# --- demo -------------------------------------------------------------------------------------

def test_demo_tiny_json(cli_json):
    code, out, _ = cli_json("demo", "--model", "tiny-llama", "--max-new-tokens", 5)
    assert code == EXIT_OK
    assert out["sites"]["found"] == 2 and out["sites"]["rewritten"] == 2
    assert out["new_tokens"] == 5 and isinstance(out["answer"], str) and out["answer"]
    assert out["kv_bytes_per_token"] == pytest.approx(FP8_BYTES_PER_TOKEN)
    assert out["kv_ratio_vs_bf16"] == pytest.approx(FP8_BYTES_PER_TOKEN / BF16_BYTES_PER_TOKEN)
    cache = out["cache_at_last_step"]  # the prompt (16) + 4 tokens are stored at the 5th
    assert cache["tokens"] == 16 + 4 and cache["pages_used"] == 2
    sec = out["seconds"]
    assert sec["compile"] > 0 and sec["generate"] > 0 and out["decode_tokens_per_second"] > 0


def test_demo_text(cli):
    code, out, err = cli("demo", "--model", "tiny-qwen2", "--max-new-tokens", 3,
                         "--kv-dtype", "fp4_e2m1", "--inner", "aot_eager")
    assert code == EXIT_OK, err
    assert "attention sites rewritten: 2 of 2" in out
    assert "KV bytes per token" in out and "tok/s" in out


def test_demo_needs_a_generating_model(cli):
    code, _, err = cli("demo", "--model", "tests.cli.factories:static_cache")
    assert code == EXIT_USAGE
    _one_line_error(err)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, code, needle", [
    (["inspect", "no/such/model"], EXIT_MODEL, "not found"),
    (["inspect", "tiny-bert"], EXIT_MODEL, "unknown tiny model family"),
    (["inspect", "tests.cli.factories:missing"], EXIT_MODEL, "no callable 'missing'"),
    (["inspect", "tests.cli.factories:no_inputs"], EXIT_MODEL, "without example inputs"),
    (["inspect", "tests.cli.factories:not_a_module"], EXIT_MODEL, "not an nn.Module"),
    (["inspect", "no_such_module_xyz:make"], EXIT_MODEL, "cannot import"),
    (["inspect", "tiny-llama", "--pass", "fuse_everything"], EXIT_USAGE, "invalid choice"),
    (["inspect", "tiny-llama", "--frobnicate"], EXIT_USAGE, "unrecognized arguments"),
    (["inspect", "tiny-llama", "--kv-dtype", "fp7"], EXIT_USAGE, "invalid choice"),
    (["inspect", "tiny-llama", "--batch", "0"], EXIT_USAGE, "--batch must be >= 1"),
    (["inspect", "tiny-llama", "--tp", "0"], EXIT_USAGE, "--tp must be >= 1"),
    (["inspect", "tiny-llama", "--full"], EXIT_USAGE, "go with --passes"),
    (["inspect", "tiny-llama", "--svg", "/no/such/dir/x.svg"], EXIT_USAGE, "does not exist"),
    (["demo", "--max-new-tokens", "0"], EXIT_USAGE, "--max-new-tokens must be >= 1"),
    (["inspect", "tiny-llama", "--eviction", "lru"], EXIT_USAGE, "KVConfig.eviction"),
    (["inspect", "tiny-llama", "--eviction", "h2o:budget"], EXIT_USAGE, "not key=value"),
    (["frobnicate"], EXIT_USAGE, "invalid choice"),
    ([], EXIT_USAGE, "no command given"),
])
def test_bad_input_is_one_line_with_exit_code(cli, argv, code, needle):
    got, out, err = cli(*argv)
    assert got == code, err
    _one_line_error(err)
    assert needle in err
    assert out == ""


def test_errors_in_json_mode(cli):
    code, out, err = cli("inspect", "no/such/model", "--json")
    assert code == EXIT_MODEL
    payload = json.loads(out)
    assert payload["exit_code"] == EXIT_MODEL and "not found" in payload["error"]
    assert payload["hint"]


def test_unexpected_errors_are_one_line_unless_debug(cli, monkeypatch):
    from kvcompile.cli import inspect as inspect_cmd

    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(inspect_cmd, "run", boom)
    code, _, err = cli("inspect", "tiny-llama")
    assert code == EXIT_INTERNAL
    _one_line_error(err)
    assert "RuntimeError: boom" in err and "second line" not in err and "--debug" in err
    code, _, err = cli("inspect", "tiny-llama", "--debug")
    assert code == EXIT_INTERNAL and "Traceback" in err


def test_kvcompile_errors_map_to_runtime_code(cli, monkeypatch):
    from kvcompile.cli import inspect as inspect_cmd
    from kvcompile.errors import KVCacheFullError

    def full(args):
        raise KVCacheFullError(4, 1, 8)

    monkeypatch.setattr(inspect_cmd, "run", full)
    code, _, err = cli("inspect", "tiny-llama")
    assert code == common.EXIT_RUNTIME
    _one_line_error(err)
    assert "KV page pool is full" in err


def test_version(cli):
    import kvcompile

    code, out, _ = cli("--version")
    assert code == EXIT_OK and out.strip() == f"kvcompile {kvcompile.__version__}"
    code, out, _ = cli("--version", "--json")
    assert json.loads(out) == {"version": kvcompile.__version__}


def test_python_dash_m_entry_point():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "kvcompile", "inspect", "no/such/model"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == EXIT_MODEL
    _one_line_error(res.stderr)


# --- eval and bench ---------------------------------------------------------------------------

def test_eval_without_harness(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_BENCHMARKS", str(tmp_path))
    code, _, err = cli("eval", "--suite", "ppl")
    assert code == EXIT_UNAVAILABLE
    _one_line_error(err)
    assert "quality.py is missing" in err


def test_eval_fronts_the_harness(cli, tmp_path, monkeypatch):
    (tmp_path / "quality").mkdir()
    (tmp_path / "quality" / "quality.py").write_text(
        "import json, os, sys\n"
        "def main(argv):\n"
        "    print('harness says hi')\n"
        "    path = os.path.join(os.path.dirname(__file__), 'quality_results.json')\n"
        "    json.dump({'ppl': {'argv': argv}}, open(path, 'w'))\n"
        "    return 0 if argv != ['--fail'] else 3\n")
    monkeypatch.setenv("KVCOMPILE_BENCHMARKS", str(tmp_path))
    code, out, err = cli("eval", "--suite", "ppl", "--quick", "--json")
    assert code == EXIT_OK
    payload = json.loads(out)  # the harness's own print went to stderr
    assert "harness says hi" in err
    assert payload["argv"] == ["--suite", "ppl", "--quick"]
    assert payload["results"] == {"ppl": {"argv": ["--suite", "ppl", "--quick"]}}
    code, out, _ = cli("eval", "--fail")
    assert code == 3 and "harness says hi" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_needs_cuda(cli):
    code, out, err = cli("bench", "decode")
    assert code == EXIT_UNAVAILABLE and out == ""
    _one_line_error(err)
    assert "need CUDA" in err and "--dry" in err


def test_bench_list_and_dry_run(cli, cli_json, tmp_path, monkeypatch):
    (tmp_path / "bench_toy.py").write_text(
        '"""Toy benchmark."""\n'
        "import os, sys\n"
        "print('dry' if os.environ.get('KVC_BENCH_DRY') == '1' else 'real', sys.argv[1:])\n"
        "sys.exit(7 if '--fail' in sys.argv else 0)\n")
    monkeypatch.setenv("KVCOMPILE_BENCHMARKS", str(tmp_path))
    code, out, _ = cli_json("bench", "--list")
    assert code == EXIT_OK and list(out["benchmarks"]) == ["toy"]
    code, out, err = cli("bench", "toy", "--dry", "--json", "--n", "3")
    assert code == EXIT_OK
    payload = json.loads(out)
    assert payload["dry_run"] and payload["command"][-2:] == ["--n", "3"]
    code, _, _ = cli("bench", "toy", "--dry", "--fail")
    assert code == 7  # the benchmark's own exit code
    code, _, err = cli("bench", "nope")
    assert code == EXIT_USAGE and "unknown benchmark 'nope'" in err
