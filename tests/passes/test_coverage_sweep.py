"""The coverage sweep (benchmarks/coverage_sweep.py) on a few families, as CI runs it.

Each family runs in its own process, as in the full sweep: a Llama (SDPA, every site rewritten,
eager's tokens), BLOOM (baddbmm over [B*H, T, D] with ALiBi as its bias, scores viewed to
[B, H, T, L] for the mask and back for bmm) and Mamba (no attention: not applicable, no crash);
the table is written with one row each and the summary counts them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "coverage_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("coverage_sweep", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_subset(sweep, tmp_path, monkeypatch):
    rows = {f: sweep._child(f, timeout=120) for f in ("llama", "bloom", "mamba")}
    want = {"llama": "ok", "bloom": "ok", "mamba": "n/a"}
    assert {f: sweep.status(r) for f, r in rows.items()} == want, rows
    for f in ("llama", "bloom"):
        assert rows[f]["rewritten"] == rows[f]["sites"] == 2 and rows[f]["identical"], rows[f]
    monkeypatch.setattr(sweep, "DOC", tmp_path / "coverage.md")
    summary = sweep.write_doc(rows)
    assert "3 families swept; 3 built" in summary and "2 of them rewritten" in summary, summary
    assert "0 crashes; 0 silent" in summary
    table = (tmp_path / "coverage.md").read_text()
    assert "| mamba | n/a |" in table and "| llama | ok | 2 / 2 | yes |" in table


def test_per_layer_lists_cut_to_two_layers(sweep):
    """A config whose lists follow its layer count keeps the first layer of each type (a hybrid
    keeps an attention layer); a list of layer indices is dropped (the default applies)."""
    d = dict(num_hidden_layers=6, layer_types=["mamba", "mamba", "attention"] * 2,
             no_rope_layers=[1, 1, 0, 1, 1, 0], moe_layers=[0, 1, 2, 3, 4, 5], other=[1, 2])
    assert sweep._two_layers(d) == dict(layer_types=["mamba", "attention"],
                                        no_rope_layers=[1, 0], moe_layers=None)
    assert sweep._two_layers(dict(num_hidden_layers=2, layer_types=["a", "b"])) == {}
    assert "sinks" in sweep._cause("left alone: the attention sink column is not one ...")
    assert "recompiles" in sweep._cause("kvcompile: X ran a forward without kvcompile (...) "
                                        "while its cache lives in kvcompile's pool: ...")


def test_a_kvcompile_refusal_is_not_a_crash(sweep):
    refused = dict(family="x", built=True, stage="kvcompile", refused=True,
                   error="kvcompile: CacheStateError: ...")
    crashed = dict(family="y", built=True, stage="kvcompile", refused=False,
                   error="kvcompile: IndexError: ...")
    assert sweep.status(refused) == "refused" and sweep.status(crashed) == "crash"
