import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: intra-op threads only slow a loaded 2-core machine down."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
