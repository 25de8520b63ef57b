"""H2O's prompt-mass kernels (kernels/prompt_mass.py) on CUDA, where tl.dot runs bf16 (the
interpreter's bf16 dot is broken, triton#11584) and fp32 as tf32: against the fp32 path's mass
(`attend_kept`) on the same stored values, with the CPU test's rows (tests/eviction/
test_prompt_mass.py: a prompt, a chunk over earlier keys, a padded prompt, one query), GQA 4,
head_dim 128, 64 and 576 (an MLA layer's absorbed width: Q K^T in chunks), window and soft-capping. Negative: a causal mass against the non-causal
reference is far outside the tolerance.

    pytest -q -m gpu tests/gpu/test_prompt_mass_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kvcompile.testing import kernel_rel_err, rel_err
from tests.eviction.test_prompt_mass import _inputs, _kernel, _want

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [128, 64, 576])
@pytest.mark.parametrize("kw", [dict(), dict(window=24), dict(softcap=20.0)],
                         ids=["causal", "window", "softcap"])
def test_kernel_mass_equals_fp32_path_on_cuda(dtype, d, kw):
    qs, ks = _inputs(hq=8, hkv=2, d=d, seed=d, dtype=dtype, device="cuda")
    scale = d ** -0.5
    want = _want(qs, ks, scale, **kw)
    got = _kernel(qs, ks, scale, **kw)
    tol = kernel_rel_err(dtype, "cuda")
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= tol, (errs, tol)


def test_causal_mass_is_not_the_noncausal_one_on_cuda():
    qs, ks = _inputs(hq=8, hkv=2, d=128, seed=1, dtype=torch.bfloat16, device="cuda")
    got = _kernel(qs, ks, 128 ** -0.5)
    want = _want(qs, ks, 128 ** -0.5, causal=False)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert min(errs[:3]) > 10 * kernel_rel_err(torch.bfloat16, "cuda"), errs
