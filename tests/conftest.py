"""Test session setup shared by every test folder."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo caches compiled code on code objects."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Tiny tensors only: with intra-op threads, a loaded 2-core CI machine stalls each op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def dynamo_per_module():
    """For folders that compile a model once per module instead of once per test (compiling
    is most of their time on the CPU): they override `_fresh_dynamo` and use this."""
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = limit


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
