"""Exit codes and one-line messages of the inputs that used to exit 1 ("looks like a bug"), the
near misses of `inspect`, the bench hints, and the docs matching the command line."""

import fractions
import os
import re

import pytest
import torch

from kvcompile.cli.common import EXIT_MODEL, EXIT_OK, EXIT_USAGE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line_error(err: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[0].startswith("kvcompile: error: "), err
    assert all(ln.startswith("  hint: ") for ln in lines[1:]), err
    assert "Traceback" not in err and "looks like a bug" not in err


@pytest.fixture
def truncated_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00\x05")   # magic and version, then nothing
    return path


@pytest.fixture
def pickle_checkpoint(tmp_path):
    """A Hugging Face folder whose pytorch_model.bin holds an object torch.load refuses."""
    from kvcompile.models import tiny_model

    model = tiny_model("llama").model
    model.config.save_pretrained(tmp_path)
    state = dict(model.state_dict())
    state["note"] = fractions.Fraction(1, 3)
    torch.save(state, tmp_path / "pytorch_model.bin")
    return tmp_path


@pytest.mark.parametrize("argv, code, needle", [
    (["inspect", "{gguf}"], EXIT_MODEL, "cannot read the GGUF file .*struct.error"),
    (["inspect", "tests.cli.factories:needs_arguments"], EXIT_MODEL,
     "cannot call tests.cli.factories:needs_arguments: .*missing 1 required positional"),
    (["inspect", "tiny-llama", "--max-kv-mib", "inf"], EXIT_USAGE,
     "--max-kv-mib must be a finite number of MiB > 0, got inf"),
    (["inspect", "tiny-llama", "--eviction", "sink_window:sinkz=4"], EXIT_USAGE,
     r"KVConfig.eviction.sinkz=4 .*Did you mean 'sinks'\?"),
    (["inspect", "{pickle}"], EXIT_MODEL,
     "torch.load refused its pickle checkpoint: Unsupported global: GLOBAL fractions.Fraction"),
])
def test_inputs_exit_with_their_documented_code(cli, truncated_gguf, pickle_checkpoint, argv,
                                                code, needle):
    argv = [a.format(gguf=truncated_gguf, pickle=pickle_checkpoint) for a in argv]
    got, out, err = cli(*argv, "--inner", "eager")
    assert got == code, err
    _one_line_error(err)
    assert re.search(needle, err), err
    assert out == ""


def test_inspect_lists_near_misses(cli_json, cli):
    code, out, err = cli_json("inspect", "tests.cli.factories:distance_attention",
                              "--inner", "eager")
    assert code == EXIT_OK and out["rewritten"] == 0
    misses = {(m["name"], m["step"]) for m in out["near_misses"]}
    assert misses == {("layers.0", "scores"), ("layers.1", "scores")}
    assert all("masked_fill" in m["at"] for m in out["near_misses"])
    # the warning is one line of ours, not Python's two-line default with the source line
    assert re.search(r"^kvcompile: warning: kvcompile rewrote no attention site of TinyLM",
                     err, re.M), err
    assert "warn_once(" not in err
    code, text, _ = cli("inspect", "tests.cli.factories:distance_attention", "--inner", "eager")
    assert "2 near miss(es)" in text and "the scores are not q·kᵀ" in text


# --- bench -------------------------------------------------------------------------------------

@pytest.fixture
def calls(monkeypatch):
    """The benchmark processes `kvcompile bench` would start (not started)."""
    from kvcompile.cli import bench

    seen = []

    def call(cmd, env=None, cwd=None, stdout=None):
        seen.append((cmd, env))
        return 0

    monkeypatch.setattr(bench.subprocess, "call", call)
    return seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only hint")
def test_bench_hint_runs_as_written(cli, calls):
    code, _, err = cli("bench", "decode")
    hint = re.search(r"`(kvcompile bench [^`]+)`", err).group(1)
    assert hint == "kvcompile bench decode --dry"
    code, _, err = cli(*hint.split()[1:])
    assert code == EXIT_OK, err
    (cmd, env), = calls
    assert cmd[1].endswith("bench_decode.py") and cmd[2] == "run"   # its required command
    assert env["KVC_BENCH_DRY"] == "1"
    out = cmd[cmd.index("--out") + 1]
    assert os.path.isdir(out)


def test_bench_dry_switches_each_benchmark_on(cli, calls):
    assert cli("bench", "append", "--dry")[0] == EXIT_OK
    assert cli("bench", "generate", "--dry")[0] == EXIT_OK
    assert calls[0][0][2:] == ["--dry"] and calls[1][0][2:] == ["--smoke"]
    code, _, err = cli("bench", "prefill", "--dry")
    assert code == EXIT_USAGE and "has no CPU dry run" in err and not calls[2:]


def test_bench_out_folder_is_created_up_front(cli, calls, tmp_path):
    out = tmp_path / "a" / "b"
    assert cli("bench", "decode", "--dry", "run", "--out", str(out))[0] == EXIT_OK
    assert out.is_dir() and calls[0][0][-2:] == ["--out", str(out)]
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = cli("bench", "decode", "--dry", "run", f"--out={blocker}/x")
    assert code == EXIT_USAGE and "cannot create the folder" in err and len(calls) == 1


def test_bench_list_speaks_to_a_user(cli):
    code, text, _ = cli("bench", "--list")
    assert code == EXIT_OK
    assert not re.search(r"issue \d", text, re.I), text
    assert "(--dry)" in text


# --- docs ------------------------------------------------------------------------------------

def test_cli_doc_names_every_pass_and_format():
    from kvcompile.config import KV_DTYPES
    from kvcompile.passes.pipeline import PASS_NAMES

    doc = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for name in PASS_NAMES:
        assert f"`{name}`" in doc, name
    row = next(ln for ln in doc.splitlines() if ln.startswith("| `--kv-dtype`"))
    assert all(d in row for d in KV_DTYPES)


def test_every_eval_option_has_help(monkeypatch):
    import argparse

    from kvcompile.cli.evaluate import _load_main

    main = _load_main(os.path.join(ROOT, "benchmarks", "quality", "quality.py"))

    class Built(Exception):
        pass

    def capture(self, args=None, namespace=None):
        raise Built(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Built) as e:
        main.__globals__["parse"]([])
    missing = [a.option_strings[0] for a in e.value.args[0]._actions
               if a.option_strings and not a.help]
    assert missing == []
