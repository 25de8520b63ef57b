"""The layers keep their rules (issue 18): no import cycle among the package's modules, and the
kernels take tensors and constants: they import neither the run time nor the pool."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcompile"


def _import_cycles_module():
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  ROOT / "scripts" / "import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _graph():
    ic = _import_cycles_module()
    known = ic.modules(PACKAGE)
    return ic, {m: ic.imports(p, m, known) for m, p in known.items()}


def test_no_import_cycle():
    ic, graph = _graph()
    assert ic.cycles(graph) == []


def test_the_cycle_finder_finds_one(tmp_path):
    ic = _import_cycles_module()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    known = ic.modules(pkg)
    graph = {m: ic.imports(p, m, known) for m, p in known.items()}
    assert ic.cycles(graph) == [["pkg.a", "pkg.b"]]


def test_kernels_import_neither_the_run_time_nor_the_pool():
    _, graph = _graph()
    bad = {m: sorted(d for d in deps if d.startswith("kvcompile.runtime")
                     or d == "kvcompile.cache.pool")
           for m, deps in graph.items() if m.startswith("kvcompile.kernels")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_passes_import_no_cli_and_read_no_global_registry():
    """Passes get their config passed in: they import neither the CLI nor the run time's
    registries, and the `@configure` instances reach them from the backend (run_passes's
    `configured`), not from config's module-global set."""
    _, graph = _graph()
    bad = {m: sorted(d for d in deps if d.startswith(("kvcompile.cli", "kvcompile.runtime.state",
                                                      "kvcompile.runtime.ownership")))
           for m, deps in graph.items() if m.startswith("kvcompile.passes")}
    assert {m: d for m, d in bad.items() if d} == {}
    readers = [p.name for p in (PACKAGE / "passes").glob("*.py")
               if "configured_instances" in p.read_text()]
    assert readers == []
