"""Generation tests compile a model once per module, not once per test (tests/conftest.py
resets Dynamo around every test): compiling is most of their time on the CPU. Every test checks
that its forwards ran on kvcompile's pool, so an eager fallback cannot pass unnoticed."""

import pytest


@pytest.fixture(autouse=True)
def _fresh_dynamo(dynamo_per_module, one_thread):  # overrides tests/conftest.py's per-test reset
    yield
