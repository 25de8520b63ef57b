"""What one eviction event costs in the Engine: torch ops, host syncs, bytes moved, host time.

    python benchmarks/eviction_event_cost.py                 # CPU: tiny Llama, fp8 token pages
    python benchmarks/eviction_event_cost.py --device cuda   # the same on a GPU (no graphs)

A 4-layer Llama (2 kv heads, head_dim 32, random weights), B sequences of `--prompt` tokens
decoding `--new` tokens through kvcompile.Engine with eviction at 50% of the prompt, every
`--interval` steps. Every aten op run inside the eviction runtime's per-step work is counted
(TorchDispatchMode): inside `after_decode_step` (where decode-time eviction happens) and inside
`decode_aside` + `aside_inputs` (the per-step host work before each step). Printed per policy:
eviction events (sequence x event), aten ops per event and per step (views apart: no kernel on
a GPU), host syncs
(`_local_scalar_dense`, `nonzero`, copies to the CPU from the device), bytes written into the
pool's storage per event against the bytes of the tokens evicted; then the same generate again
without counting, for host milliseconds (per event, and per step outside the events).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import kvcompile  # noqa: E402
from kvcompile import Engine, KVConfig, SamplingParams  # noqa: E402
from kvcompile.api import state_of  # noqa: E402
from kvcompile.config import H2O, SinkWindow, SnapKV  # noqa: E402

_WRITES = {"index_put_", "index_put", "_index_put_impl_", "scatter_", "scatter", "copy_",
           "index_copy_", "index_copy", "masked_scatter_"}
_SYNCS = {"_local_scalar_dense", "nonzero", "item"}


class _Count(TorchDispatchMode):
    """Counts aten ops, host syncs and bytes written into `targets` (the pool's storage)."""

    def __init__(self, targets):
        super().__init__()
        self.targets = {t.untyped_storage().data_ptr() for t in targets}
        self.ops = self.views = self.syncs = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.is_view or name in ("t", "transpose", "detach", "alias"):
            self.views += 1   # metadata only: no kernel on a GPU
        else:
            self.ops += 1
        if name in _SYNCS:
            self.syncs += 1
        out = func(*args, **kwargs)
        if name in _WRITES and args and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage().data_ptr() in self.targets:
            vals = args[2] if name.startswith("index_put") or name == "_index_put_impl_" \
                else args[-1]
            if isinstance(vals, torch.Tensor):
                n = vals.numel() if name != "copy_" else args[0].numel()
                self.bytes += n * args[0].element_size()
        if name == "_to_copy" and isinstance(out, torch.Tensor) and args \
                and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" \
                and out.device.type == "cpu":
            self.syncs += 1
        return out


def make_model(device, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device).eval()


def run(policy, sinks: str, args, device) -> dict:
    torch._dynamo.reset()
    model = make_model(device, args.layers)
    cfg = KVConfig(inner="eager", kernels="reference" if device.type == "cpu" else "auto",
                   kv_dtype=args.kv_dtype, scale_granularity="token", page_size=args.page,
                   max_kv_bytes=64 << 20, eviction=policy)
    kvcompile.compile(model, cfg)
    eng = Engine(model, None, max_num_batched_tokens=args.batch * args.prompt,
                 max_num_seqs=args.batch, eviction_interval=args.interval,
                 enable_prefix_caching=False)
    st = state_of(model)
    rt = st.eviction
    rt.sink_positions = sinks
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 256, (args.batch, args.prompt), generator=g).tolist()
    pool = eng.pool
    targets = [t for pt in pool.k + pool.v for t in (pt.data, pt.scale) if t is not None]
    rec = dict(step_ops=0, step_views=0, step_syncs=0, step_ms=0.0, steps=0, ev_ops=0,
               ev_views=0, ev_syncs=0,
               ev_bytes=0, ev_ms=0.0, calls=0)
    orig = {n: getattr(rt, n) for n in ("after_decode_step", "decode_aside", "aside_inputs")}

    counting = [True]

    def wrap(name, kind):
        def f(*a, **k):
            if not counting[0]:   # the timed pass: no dispatch mode
                t0 = time.perf_counter()
                out = orig[name](*a, **k)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rec[f"{kind}_ms"] += (time.perf_counter() - t0) * 1e3
                return out
            c = _Count(targets)
            with c:
                out = orig[name](*a, **k)
            rec[f"{kind}_ops"] += c.ops
            rec[f"{kind}_views"] += c.views
            rec[f"{kind}_syncs"] += c.syncs
            if kind == "ev":
                rec["ev_bytes"] += c.bytes
                rec["calls"] += 1
            elif name == "decode_aside":
                rec["steps"] += 1
            return out
        return f

    rt.after_decode_step = wrap("after_decode_step", "ev")
    rt.decode_aside = wrap("decode_aside", "step")
    rt.aside_inputs = wrap("aside_inputs", "step")
    c0 = dict(st.counters)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    eng.generate(prompts, params)
    c1 = dict(st.counters)
    counting[0] = False
    eng.generate(prompts, params)   # the same run again, timed without the dispatch mode
    d = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("eviction_runs", "evicted_tokens",
                                                  "eviction_device_runs", "evicted_pages",
                                                  "eviction_moves")}
    # events during decode (the prompt-end eviction is not in after_decode_step)
    events = max(1, d["eviction_device_runs"] or d["eviction_runs"] - args.batch)
    per_tok = pool.bytes_per_token   # every layer, K and V
    evicted_decode = d["evicted_tokens"] - args.batch * max(0, args.prompt - _budget(policy))
    eng.close()
    kvcompile.release(model)
    return dict(policy=f"{type(policy).__name__}" + (f" ({sinks})" if isinstance(
        policy, SinkWindow) else ""), steps=rec["steps"], events=events,
        ops_per_event=rec["ev_ops"] / events, view_ops_per_event=rec["ev_views"] / events,
        syncs_per_event=rec["ev_syncs"] / events,
        bytes_moved_per_event=rec["ev_bytes"] / events,
        bytes_evicted_per_event=max(0, evicted_decode) * per_tok / events,
        host_ms_per_event=rec["ev_ms"] / events,
        step_ops=rec["step_ops"] / max(1, rec["steps"]),
        step_syncs=rec["step_syncs"] / max(1, rec["steps"]),
        step_host_ms=rec["step_ms"] / max(1, rec["steps"]),
        evict_host_ms_per_step=rec["ev_ms"] / max(1, rec["steps"]),
        evicted_pages=d["evicted_pages"])


def _budget(p) -> int:
    return p.sinks + p.window if isinstance(p, SinkWindow) else p.budget


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--policies", default="sink,sink_rot,h2o,snapkv")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    half = args.prompt // 2
    pols = dict(sink=(SinkWindow(4, half - 4), "original"),
                sink_rot=(SinkWindow(4, half - 4), "cache"),
                h2o=(H2O(budget=half, recent=max(1, half // 4), sinks=4), "original"),
                snapkv=(SnapKV(budget=half), "original"))
    rows = [run(*pols[name], args, device) for name in args.policies.split(",")]
    cols = list(rows[0])
    print(f"B={args.batch} prompt={args.prompt} new={args.new} interval={args.interval} "
          f"layers={args.layers} page={args.page} {args.kv_dtype} on {device}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                                for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
