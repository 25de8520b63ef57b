"""Decode-step GEMMs separate or merged (issue 16 item 5): a decoder layer's projections at
small M, q / k / v and gate / up as separate F.linear calls (Hugging Face's Llama) against one
call on their concatenated weights, each variant captured in a CUDA graph over `--layers`
layers of distinct weights (more bytes than the L2 holds, as in a real step) and replayed.
Prints ms a replay and TB/s of weight bytes, and merged / separate.

    python benchmarks/gemm_merge.py [--m 1 16 64] [--layers 8] [--hidden 4096 ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvcompile.engine.cudagraph import capture  # noqa: E402


def _layers(n, hidden, q, kv, inter, merged, dev, dt):
    out = []
    for _ in range(n):
        w = dict(o=torch.randn(hidden, q, device=dev, dtype=dt) * 0.01,
                 d=torch.randn(hidden, inter, device=dev, dtype=dt) * 0.01)
        if merged:
            w["qkv"] = torch.randn(q + 2 * kv, hidden, device=dev, dtype=dt) * 0.01
            w["gu"] = torch.randn(2 * inter, hidden, device=dev, dtype=dt) * 0.01
        else:
            for k, r in (("q", q), ("k", kv), ("v", kv), ("g", inter), ("u", inter)):
                w[k] = torch.randn(r, hidden, device=dev, dtype=dt) * 0.01
        out.append(w)
    return out


def _step(x, layers, merged, q, kv, inter):
    for w in layers:
        if merged:
            a = F.linear(x, w["qkv"])
            qq = a[:, :q]
            g, u = F.linear(x, w["gu"]).split(inter, dim=-1)
        else:
            qq = F.linear(x, w["q"])
            F.linear(x, w["k"])
            F.linear(x, w["v"])
            g, u = F.linear(x, w["g"]), F.linear(x, w["u"])
        x = x + F.linear(qq, w["o"])
        x = x + F.linear(F.silu(g) * u, w["d"])
    return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--q", type=int, default=4096)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--replays", type=int, default=50)
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    wbytes = a.layers * 2 * a.hidden * (2 * a.q + 2 * a.kv + 3 * a.inter)
    print(f"GEMM bytes a step: {wbytes / 1e9:.2f} GB ({a.layers} layers), "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| M | separate ms | merged ms | separate TB/s | merged TB/s | merged / separate |")
    print("|---|---|---|---|---|---|")
    for m in a.m:
        ms = {}
        for merged in (False, True):
            layers = _layers(a.layers, a.hidden, a.q, a.kv, a.inter, merged, dev, dt)
            x = torch.randn(m, a.hidden, device=dev, dtype=dt)
            # warmed up on the side stream, then captured, as the runtime's graphs are
            g, _ = capture(functools.partial(_step, x, layers, merged, a.q, a.kv, a.inter),
                           torch.device(dev), None)
            for _ in range(5):
                g.replay()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = float("inf")
            for _ in range(5):
                e0.record()
                for _ in range(a.replays):
                    g.replay()
                e1.record()
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1) / a.replays)
            ms[merged] = best
            del g, layers
            torch.cuda.empty_cache()
        sep, mer = ms[False], ms[True]
        print(f"| {m} | {sep:.4f} | {mer:.4f} | {wbytes / sep / 1e9:.2f} | "
              f"{wbytes / mer / 1e9:.2f} | {mer / sep:.3f} |")


if __name__ == "__main__":
    main()
