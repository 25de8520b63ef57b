import json

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every CLI call compiles a new model: start each test below Dynamo's recompile limit
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cli(capsys):
    """Run `kvcompile ARGS` in-process: returns (exit code, stdout, stderr)."""
    from kvcompile.cli.main import main

    def run(*argv):
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def cli_json(cli):
    """Run with --json: returns (exit code, parsed stdout, stderr)."""

    def run(*argv):
        code, out, err = cli(*argv, "--json")
        return code, json.loads(out), err

    return run
