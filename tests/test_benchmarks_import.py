"""Every script in benchmarks/ imports (its module-level code runs; `main` does not): a script
whose import of a sibling breaks fails here rather than on the GPU machine. profile_engine.py
imported `CATEGORIES` from profile_generate.py for two sessions after it moved to
step_profile.py, and no test ran it."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))


def test_the_scripts_are_found():
    assert len(SCRIPTS) > 20 and any(s.endswith("bench_generate.py") for s in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(s) for s in SCRIPTS])
def test_benchmark_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setattr(sys, "argv", [path])
    name = "benchmarks_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # as `import`: __name__ is not "__main__"
