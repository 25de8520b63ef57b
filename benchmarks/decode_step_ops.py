"""Torch ops of one Engine decode step's attention, per layer and per step, by eviction policy
(issue 19: which ops a SinkWindow step runs that a step without eviction does not).

    TRITON_INTERPRET=1 python benchmarks/decode_step_ops.py      # CPU, a few seconds

A tiny bf16 Llama (head_dim 64, 4 layers by default, GQA 2/1), fp8_e4m3 pages with token scales,
pages of 16, kernels="triton" (the interpreter on the CPU), greedy decoding through
kvcompile.Engine with eviction every 4 steps. The last decode step of each run is counted
(TorchDispatchMode) inside `dispatch.attend` (each layer's attention: eviction's and the
packed decode path) and `attention_op._as_promised` (the cast and copy to the op's promised
output); views are left out (no kernel on a GPU), the decode kernel's launch is counted as one
op named by what it takes (its interpreter's own torch work is left out). On sm_90 the CUDA
kernel widens a bool key mask into a uint8 one per call (decode_sm90.py `_padded_mask`): its
ops for the step's mask are counted apart, per layer. No CUDA graphs here (the CPU); on the
GPU the per-layer ops are what a replay runs, the per-step ones (the key mask) run once.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import kvcompile  # noqa: E402
from kvcompile import Engine, KVConfig, SamplingParams  # noqa: E402
from kvcompile.api import state_of  # noqa: E402
from kvcompile.config import H2O, SinkWindow  # noqa: E402

_VIEWS = {"t", "transpose", "detach", "alias", "view", "unsqueeze", "squeeze", "expand",
          "slice", "select", "permute", "_unsafe_view"}


class OpCounter(TorchDispatchMode):
    """aten ops by name (views apart); `paused` skips what runs inside (a kernel's launch)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and not func.is_view and name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def make_model(layers: int, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval().to(dtype)


def step_ops(policy, sink_positions: str = "original", layers: int = 4, batch: int = 2,
             prompt: int = 40, new: int = 14, kernels: str = "triton",
             logits: list | None = None) -> tuple[collections.Counter, dict]:
    """Ops of the last decode step's attention (all layers) and the step's counters' change;
    `logits` (a list) gets every step's logits [B, V] (for tests)."""
    import kvcompile.kernels.decode as D
    import kvcompile.runtime.attention_op as A
    import kvcompile.runtime.dispatch as R

    torch._dynamo.reset()
    m = make_model(layers)
    kvcompile.compile(m, KVConfig(inner="eager", kernels=kernels, page_size=16,
                                  kv_dtype="fp8_e4m3", scale_granularity="token",
                                  max_kv_bytes=1 << 22, eviction=policy))
    eng = Engine(m, max_num_batched_tokens=128, eviction_interval=4)
    st = state_of(m)
    if st.eviction is not None:
        st.eviction.sink_positions = sink_positions
    counter = OpCounter()
    last: list = [None, None]
    attend, promised, launch = R.attend, A._as_promised, D.launch_decode
    fwd = eng.runner.forward

    def counted_attend(*a, **k):
        with counter:
            return attend(*a, **k)

    def counted_promised(*a, **k):
        with counter:
            return promised(*a, **k)

    def counted_launch(*a, **k):
        km, mass = a[9], a[10]
        tag = "+".join(["decode_kernel"] + (["key_mask"] if km is not None else [])
                       + (["attn_mass"] if mass is not None else [])
                       + (["rot"] if k.get("rot") is not None else []))
        counter.ops[tag] += 1
        counter.paused += 1
        try:
            return launch(*a, **k)
        finally:
            counter.paused -= 1

    def forward(out):
        counter.ops = collections.Counter()
        before = dict(st.counters)
        lg = fwd(out)
        if logits is not None:
            logits.append(lg.float().clone())
        if all(s.n == 1 for s in out.seqs):
            delta = {k: v - before.get(k, 0) for k, v in st.counters.items()
                     if v != before.get(k, 0)}
            last[:] = [counter.ops, delta]
        return lg

    eng.runner.forward = forward
    R.attend, A._as_promised, D.launch_decode = counted_attend, counted_promised, counted_launch
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 128, (prompt,), generator=gen).tolist()
                   for _ in range(batch)]
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    finally:
        R.attend, A._as_promised, D.launch_decode = attend, promised, launch
        eng.close()
    ops, delta = last
    mask = _step_mask(st)
    if mask is not None:   # what the sm_90 kernel does with the step's key mask, per layer
        from kvcompile.kernels.decode_sm90 import _padded_mask

        pm = OpCounter()
        with pm:
            _padded_mask(mask, 1 << 20)
        for name, n in pm.ops.items():
            ops[f"sm90 _padded_mask: {name}"] += n * layers
    return ops, delta


_MASKS: list = []


def _step_mask(st):
    return _MASKS[-1] if _MASKS else None


def _spy_masks():
    """Keep the last key mask a decode step built (aside.py AsideInputs.key_mask)."""
    from kvcompile.eviction import aside

    real = aside.AsideInputs.key_mask

    def key_mask(self):
        m = real(self)
        if m is not None:
            _MASKS.append(m)
        return m

    aside.AsideInputs.key_mask = key_mask


RUNS = {
    "no eviction": (None, "original"),
    "SinkWindow, sinks at text positions": (SinkWindow(4, 20), "original"),
    "SinkWindow, re-rotated sinks": (SinkWindow(4, 20), "cache"),
    "H2O": (H2O(budget=24, recent=8, sinks=2), "original"),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _spy_masks()
    base = None
    for name, (pol, where) in RUNS.items():
        _MASKS.clear()
        ops, delta = step_ops(pol, where, layers=args.layers)
        total = sum(ops.values())
        if base is None:
            base = ops
        extra = ops - base
        print(f"## {name}: {total} ops in one step's attention ({args.layers} layers), "
              f"{total - sum(base.values()):+d} vs no eviction")
        print("   extra ops: " + (", ".join(f"{k} x{v}" for k, v in sorted(extra.items()))
                                  or "none"))
        print("   missing:   " + (", ".join(f"{k} x{v}" for k, v in sorted((base - ops).items()))
                                  or "none"))
        keys = [k for k in delta if k.startswith(("eviction", "engine_decode", "decode_"))]
        print("   counters:  " + ", ".join(f"{k} {delta[k]}" for k in sorted(keys)))


if __name__ == "__main__":
    main()
