"""Generation tests compile a model once per module, not once per test (tests/conftest.py
resets Dynamo around every test): compiling is most of their time on the CPU. Every test checks
that its forwards ran on kvcompile's pool, so an eager fallback cannot pass unnoticed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():  # overrides tests/conftest.py's per-test reset
    yield


@pytest.fixture(autouse=True, scope="module")
def _dynamo_per_module():
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = limit


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors only: with intra-op threads, a loaded 2-core CI machine stalls each op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
