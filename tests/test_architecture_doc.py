"""docs/architecture.md's ownership table names every package file (issue 18, item 7), and its
table of what is around the package names every benchmark script and GPU test file.

A row's first cell lists files in backticks: a path from the package root
(`kernels/decode.py`; from the repository root in the second table), then names in the same
folder (`decode_kernels.py`). A file added without a row fails here, with the file named."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = (".py", ".cuh", ".cpp", ".h", ".c")


def _owned(start: str = "## Who owns what", end: str = "## Data flow") -> set[str]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index(start):doc.index(end) if end else None]
    owned = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", row.split("|")[1])
        folder = ""
        for name in names:
            if "/" in name:
                folder = name.rpartition("/")[0]
                owned.add(name)
            else:
                owned.add(f"{folder}/{name}" if folder else name)
    return owned


def test_every_package_file_has_an_owner_row():
    pkg = ROOT / "kvcompile"
    files = {str(p.relative_to(pkg)) for p in pkg.rglob("*")
             if p.is_file() and p.suffix in SOURCES and "__pycache__" not in p.parts}
    missing = sorted(files - _owned())
    assert not missing, f"docs/architecture.md 'Who owns what' has no row for: {missing}"


def test_rows_name_files_that_exist():
    pkg = ROOT / "kvcompile"
    gone = sorted(f for f in _owned() if not (pkg / f).exists())
    assert not gone, f"docs/architecture.md 'Who owns what' names files that do not exist: {gone}"


AROUND = "## Around the package"
SCRIPTS = (".py", ".sh")


def _around_files() -> set[str]:
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
             if p.is_file() and p.suffix in SCRIPTS and "__pycache__" not in p.parts}
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("*.py")}
    return files


def test_every_benchmark_script_and_gpu_test_has_a_row():
    missing = sorted(_around_files() - _owned(AROUND, ""))
    assert not missing, f"docs/architecture.md '{AROUND}' has no row for: {missing}"


def test_around_rows_name_files_that_exist():
    gone = sorted(f for f in _owned(AROUND, "") if not (ROOT / f).exists())
    assert not gone, f"docs/architecture.md '{AROUND}' names files that do not exist: {gone}"
