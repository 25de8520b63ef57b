"""The layers keep their rules (issue 18): no import cycle among the package's modules, and the
kernels take tensors and constants: they import neither the run time nor the pool."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def _unshipped(root: Path, package_data: dict) -> list[str]:
    """Files of the package `root` (kvcompile/) that are neither Python nor matched by
    pyproject's [tool.setuptools.package-data] globs (a wheel would leave them out)."""
    missing = []
    for f in sorted(root.rglob("*")):
        if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        package = ".".join(f.parent.relative_to(root.parent).parts)
        if not any(f.match(g) for g in package_data.get(package, [])):
            missing.append(str(f.relative_to(root.parent)))
    return missing


def test_every_kernel_source_ships_in_the_wheel(tmp_path):
    """The CUDA / C sources are compiled at first use from the installed package: each must be
    in pyproject's package data (a wheel built without them ran no CUDA C++ kernel)."""
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = data["tool"]["setuptools"]["package-data"]
    assert _unshipped(ROOT / "kvcompile", package_data) == []
    # negative: a new source beside none of the globs is found
    (tmp_path / "kvcompile" / "kernels").mkdir(parents=True)
    (tmp_path / "kvcompile" / "kernels" / "new.cu").write_text("")
    assert _unshipped(tmp_path / "kvcompile", package_data) == ["kvcompile/kernels/new.cu"]
