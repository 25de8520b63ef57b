import os

import pytest
import torch

# Kernel paths run through the Triton interpreter without a GPU; Triton reads this when a kernel
# is decorated, so it must be set before kvcompile.kernels loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: intra-op threads only slow a loaded 2-core machine down."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
