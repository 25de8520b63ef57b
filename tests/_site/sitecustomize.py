"""Put on PYTHONPATH by tests/gguf_cache.share_with for a test's subprocess: the process loads
GGUF files through the test run's shared folder (see tests/gguf_cache.py)."""

import os

if os.environ.get("KVCOMPILE_TEST_GGUF_CACHE"):
    import importlib.util
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "_kvcompile_test_gguf_cache", os.path.join(os.path.dirname(_here), "gguf_cache.py"))
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install_on_import(os.environ["KVCOMPILE_TEST_GGUF_CACHE"])
