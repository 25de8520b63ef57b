"""A kernel asked for and not taken says so: where `KVConfig(kernels="triton")` cannot run a
layer's attention on a kernel and the reference attends instead, the count goes to
kvcompile.report's kernels line and the reason to its notes, once per reason (not only to the
log at INFO, where nobody sees it)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcompile  # noqa: E402
from tests.engine.tiny import config, make_llama64  # noqa: E402
from tests.passes.zoo import make_hf  # noqa: E402


def _run(model):
    torch._dynamo.reset()
    kvcompile.compile(model, config(kernels="triton", kv_dtype="fp32"))
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                   do_sample=False, pad_token_id=0)
    return kvcompile.stats(model)["counters"], str(kvcompile.report(model))


def test_reference_fallback_is_reported_once_with_its_reason():
    counters, report = _run(make_hf("llama"))   # head_dim 16: the kernel takes 64 / 128 / 256
    assert counters.get("reference_fallback", 0) >= 3, counters   # one a decode step
    notes = [line for line in report.splitlines() if "reference attention used" in line]
    assert len(notes) == 1 and "head_dim 16" in notes[0], report
    kernels = next(line for line in report.splitlines() if line.startswith("kernels: "))
    assert f"reference_fallback {counters['reference_fallback']}" in kernels, report


def test_no_fallback_no_note():
    counters, report = _run(make_llama64())   # head_dim 64: the kernels run
    assert not counters.get("reference_fallback") and counters.get("decode_triton"), counters
    assert "reference attention used" not in report and "reference_fallback" not in report
