"""Where one CPU decode step goes: kvcompile's compiled model against HF eager, part by part.

    python benchmarks/cpu_step_breakdown.py                      # hf, bf16 and fp8_e4m3 pages
    python benchmarks/cpu_step_breakdown.py --kv bf16 --repeats 5 --steps 32

SmolLM2-135M (kvcompile.models, fp32), a 256-token prompt of the Lee corpus, greedy, 1 thread,
inner eager. Thread CPU time (`time.thread_time_ns`, so other processes on a shared machine move
it little) of wrappers put around each part; per decode step = (generate(1 + steps) -
generate(1)) / steps; the paths run in turn within each repetition; min and median over the
repetitions. Each wrapper costs ~1 us of its own (two clock reads), counted in its part.

    step          the whole decode step (generate's loop included)
    loop          generate's own work between forwards (step - forward)
    forward       model.forward: HF's modules / kvcompile's CheckedForward + Dynamo + runner
    wrappers      (kvcompile) CheckedForward / GraphedForward around the compiled forward
    frame         (kvcompile) Dynamo's frame: guards, pre/post-graph bytecode (compiled
                  forward - runner)
    runner        (kvcompile) GraphRunner: binding, forward context, restubbing (runner - graph)
    graph         the math between attention calls (forward - attention; kvcompile: graph -
                  attention)
    attention     all layers' attention: HF's sdpa_attention_forward + DynamicLayer.update;
                  kvcompile's attention op (write, gather, SDPA and the op's own Python)
    write/gather/sdpa  (kvcompile) inside `attention`: the token's write, the K / V gather,
                  SDPA; "write+gather (C)" where one C call does both (kernels/cpu_fp8.py)
    kvc_*         with KVC_BREAKDOWN_C=1: the C functions' own time (the ctypes calls)
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import kvcompile  # noqa: E402
from kvcompile.models import load_smollm2  # noqa: E402

_acc: dict[str, int] = {}
_now = time.thread_time_ns


def _timed(name, fn):
    @functools.wraps(fn)
    def call(*a, **k):
        t0 = _now()
        try:
            return fn(*a, **k)
        finally:
            _acc[name] = _acc.get(name, 0) + _now() - t0
    return call


def _patch_method(cls, attr, name):
    setattr(cls, attr, _timed(name, getattr(cls, attr)))


_hf_parts: list = []   # (object, attribute or key, wrapper)


class hf_parts:
    """HF's wrapped parts in place for the block (then the originals again)."""

    def __enter__(self):
        self.saved = [(o, k, _get(o, k)) for o, k, _ in _hf_parts]
        for o, k, fn in _hf_parts:
            _set(o, k, fn)

    def __exit__(self, *exc):
        for o, k, fn in self.saved:
            _set(o, k, fn)


def _get(o, k):
    return o[k] if isinstance(o, dict) else getattr(o, k)


def _set(o, k, v):
    if isinstance(o, dict):
        o[k] = v
    else:
        setattr(o, k, v)


def instrument():
    """Wrap the parts (module-level: every model of the process)."""
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvcompile import backend
    from kvcompile.kernels import cpu_fp8
    from kvcompile.runtime import attention_op, cpu_decode

    # HF's parts are wrapped only around HF's own runs (`hf_parts`): a compiled model's
    # guards cover the transformers functions its frame traced, and would fail on wrappers
    m = ALL_ATTENTION_FUNCTIONS._global_mapping
    _hf_parts.extend([(m, "sdpa", _timed("attention", m["sdpa"])),
                      (cache_utils.DynamicLayer, "update",
                       _timed("attention", cache_utils.DynamicLayer.update))])
    _patch_method(backend.GraphRunner, "__call__", "runner")
    orig_call = backend.GraphRunner._call

    def _call(self, st, args):
        c = self.__dict__.get("compiled")
        if not getattr(c, "_timed", False):
            self.compiled = _timed("graph", c)
            self.compiled._timed = True
        return orig_call(self, st, args)

    backend.GraphRunner._call = _call
    attention_op._cached_attention = _timed("attention", attention_op._cached_attention)
    _patch_method(cpu_decode.CpuDecodeStep, "_write_fp8", "write")
    _patch_method(cpu_decode.CpuDecodeStep, "_gather_fp8", "gather")
    from kvcompile.cache.paged import PagedTensor
    _patch_method(PagedTensor, "write_token", "write")
    cpu_decode._gather = _timed("gather", cpu_decode._gather)
    cpu_decode._sdpa = _timed("sdpa", cpu_decode._sdpa)
    if hasattr(cpu_fp8, "bf16_step"):   # (a tree before it: bf16 by torch ops)
        cpu_fp8.bf16_step = _timed("write+gather (C)", cpu_fp8.bf16_step)
    plain_write, fused_write = cpu_fp8.write_tokens, _timed("write+gather (C)",
                                                            cpu_fp8.write_tokens)

    def write_tokens(*a, **k):   # fp8: the write + gather by one call (timed apart)
        return (fused_write if len(a) > 6 or k.get("gather") else plain_write)(*a, **k)

    cpu_fp8.write_tokens = write_tokens
    if os.environ.get("KVC_BREAKDOWN_C"):   # the C functions themselves (ctypes calls)
        lib = cpu_fp8.library("auto")
        if lib is not None:
            for f in ("kvc_fp8_write", "kvc_fp8_gather", "kvc_fp8_step", "kvc_bf16_step"):
                if hasattr(lib, f):
                    setattr(lib, f, _timed(f, getattr(lib, f)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, _ = load_smollm2(torch.float32)
    from quality_data import lee_corpus_ids
    ids = lee_corpus_ids(tok)[:args.prompt][None]

    def gen(m, n):
        with torch.no_grad():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    models = {"hf": model}
    for kv in args.kv:
        m = copy.deepcopy(model)
        kvcompile.compile(m, kvcompile.KVConfig(kv_dtype=kv, inner="eager",
                                                max_kv_bytes=1 << 28))
        models[kv] = m
    for name, m in models.items():
        if name != "hf":   # CheckedForward: the compiled forward (Dynamo's frame) inside it
            m.forward.compiled = _timed("dynamo", m.forward.compiled)
        m.forward = _timed("forward", m.forward)
    instrument()
    for m in models.values():
        gen(m, 3), gen(m, 3)
    names = list(models)
    res = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            parts = []
            for steps in (1, 1 + args.steps):
                _acc.clear()
                t0 = _now()
                if n == "hf":
                    with hf_parts():
                        gen(models[n], steps)
                else:
                    gen(models[n], steps)
                _acc["step"] = _now() - t0
                parts.append(dict(_acc))
            one, full = parts
            res[n].append({k: (full.get(k, 0) - one.get(k, 0)) / args.steps / 1e6
                           for k in full})
    cols = ["step", "loop", "forward", "wrappers", "frame", "runner", "graph", "attention", "write",
            "gather", "write+gather (C)", "sdpa", "attn other"]
    cols += [c for c in ("kvc_fp8_write", "kvc_fp8_gather", "kvc_fp8_step", "kvc_bf16_step")
             if any(c in d for r in res.values() for d in r)]
    print(f"# ms per decode step, thread CPU time, {args.repeats} repetitions, "
          f"{args.steps} steps, min / median; load {os.getloadavg()[0]:.1f}")
    print("| path | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for n in names:
        rows = []
        for d in res[n]:
            g = d.get("graph", d["forward"])
            e = dict(d)
            e["loop"] = d["step"] - d["forward"]
            e["wrappers"] = d["forward"] - d["dynamo"] if "runner" in d else None
            e["frame"] = d["dynamo"] - d["runner"] if "runner" in d else None
            e["runner"] = d["runner"] - d["graph"] if "runner" in d else None
            e["graph"] = g - d["attention"]
            e["attn other"] = (d["attention"] - d.get("write", 0) - d.get("gather", 0)
                               - d.get("sdpa", 0) - d.get("write+gather (C)", 0)
                               ) if "runner" in d else None
            rows.append(e)
        cells = []
        for c in cols:
            xs = [e.get(c) for e in rows]
            xs = [x for x in xs if x is not None]
            cells.append(f"{min(xs):.2f} / {statistics.median(xs):.2f}" if xs else "-")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
