"""kernels/move_cells.py on CUDA: compaction moves into fp8 page-scaled pages in three launches,
against compaction's PyTorch path on the same pools, bit for bit (the CPU test's cases: page
scales that grow, NaN sources, values near the subnormal range; tests/eviction/
test_compaction_device.py `check_cell_kernel`). compaction.CELL_KERNEL["cuda"] is on since this
passed on an H100 (2026-12-05; its first run failed on the test's own max_cells, below the
distinct cells, which CUDA's scatter resolved differently from run to run).

    pytest -q -m gpu tests/gpu/test_move_cells_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.eviction.test_compaction_device import check_cell_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["grow", "nan", "tiny"])
def test_cell_kernel_equals_the_pytorch_moves_on_cuda(name, case, monkeypatch):
    check_cell_kernel(name, case, monkeypatch, "cuda")
