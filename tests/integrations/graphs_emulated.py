"""CUDA graphs of `generate`'s decode steps emulated on the CPU (hf_graphs.capture replaced):
a captured step re-runs on replay over the same static buffers and plan, its logits copied into
the captured output (as a CUDA graph's replay refills its static outputs). Used by
test_hf_graphs_eviction.py and test_device_loop.py."""

from __future__ import annotations


class Replay:
    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.logits.copy_(self.step().logits)


def capture(step, device, mempool):
    step()
    step()   # capture()'s two warm-up runs
    out = step()
    return Replay(step, out), out
