"""The test run keeps torch's logs out of failure reports (tests/conftest.py)."""

import logging

import torch


def test_compiling_captures_no_torch_trace_records(caplog):
    caplog.set_level(logging.DEBUG)
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    fn(torch.randn(4))
    trace = [r for r in caplog.records if r.name == "torch.__trace"]
    assert not trace, f"{len(trace)} torch.__trace records captured"
