"""A decode step's weight GEMMs at small M: cuBLAS (F.linear) against kernels/skinny.py's
Triton kernel (the rule's tiles and a small sweep), on the 8-layer Llama-3-8B step's shapes
(q/k/v and gate/up merged as the backend merges them, the LM head). Issue 16 item 5: on the
H200 cuBLAS's M = 16 GEMMs streamed the weights at about 65% of copy bandwidth.

    python benchmarks/bench_skinny_gemm.py [--m 1 16] [--layers 8] [--sweep] [--json F]

Each row: one shape, `--layers` distinct weights (more bytes than the L2 holds, as in a real
step) multiplied in turn inside one CUDA graph, replayed; ms a replay, TB/s of weight bytes,
% of the GPU's datasheet bandwidth (bench_generate.PEAK_TBS; a device copy, timed the same
way, is printed beside it: on the H100 it streamed 2.45 TB/s, below these GEMMs' 2.7-3.0).
Correctness: every variant against F.linear in float64 (rel. error by dtype, REL_ERR).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvcompile.engine.cudagraph import capture  # noqa: E402
from kvcompile.kernels.skinny import pick, skinny_linear  # noqa: E402
from kvcompile.testing import REL_ERR, rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import peak_tbs  # noqa: E402

SHAPES = {  # name: (N, K), 8-layer Llama-3-8B shape, projections merged
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (32000, 4096),
}


def _graph_ms(fn, reps: int = 20) -> float:
    g, _ = capture(fn, torch.device("cuda"), None)   # (warmed up on the side stream first)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return min(times)


def copy_tbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = _graph_ms(lambda: y.copy_(x), reps=5)
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e12


def _sweep(M, N, K, sms):
    rule = pick(M, N, K, sms)
    out = [("rule", rule)]
    seen = {tuple(sorted(rule.items()))}
    for bn in (32, 64, 128):
        for bk in (128, 256):
            for split in sorted({1, rule["split"]}):
                for stages in (3, 6):
                    c = dict(BN=bn, BK=bk, split=split, stages=stages, warps=4)
                    if tuple(sorted(c.items())) not in seen:
                        seen.add(tuple(sorted(c.items())))
                        out.append((f"BN{bn} BK{bk} s{split} st{stages}", c))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="time a sweep of tiles too")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    name = torch.cuda.get_device_name()
    peak = peak_tbs(name) or 4.8
    print(f"# {name}, torch {torch.__version__}, datasheet {peak} TB/s, device copy "
          f"{copy_tbs():.3f} TB/s, {sms} SMs")
    rows = []
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(a.layers)]
        nbytes = a.layers * N * K * 2
        for M in a.m:
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = F.linear(x.double(), ws[0].double())
            variants = [("cuBLAS", None)] + (_sweep(M, N, K, sms) if a.sweep
                                             else [("rule", pick(M, N, K, sms))])
            base = None
            for label, cfg in variants:
                if cfg is None:
                    def fn(x=x, ws=ws):
                        for w in ws:
                            F.linear(x, w)
                    err = rel_err(F.linear(x, ws[0]), ref)
                else:
                    def fn(x=x, cfg=cfg, ws=ws):
                        for w in ws:
                            skinny_linear(x, w, config=cfg)
                    err = rel_err(skinny_linear(x, ws[0], config=cfg), ref)
                ok = err <= REL_ERR[dt]
                try:
                    ms = _graph_ms(fn)
                except Exception as e:   # a tile that does not fit: reported, not fatal
                    print(f"  {name} M{M} {label}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                tbs = nbytes / (ms * 1e-3) / 1e12
                base = base or ms
                row = dict(shape=name, N=N, K=K, M=M, variant=label, config=cfg, ms=ms,
                           tbs=tbs, pct_peak=100 * tbs / peak, x_cublas=base / ms, rel_err=err,
                           ok=ok)
                rows.append(row)
                if not ok:
                    print(f"  {name} M{M} {label}: rel err {err:.2e} above {REL_ERR[dt]}: FAIL")
    print("| shape | M | variant | ms (x layers) | TB/s | % datasheet | x cuBLAS | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        for M in a.m:
            rs = [r for r in rows if r["shape"] == name and r["M"] == M]
            show = [r for r in rs if r["variant"] in ("cuBLAS", "rule")]
            best = max((r for r in rs if r["variant"] != "cuBLAS" and r["ok"]),
                       key=lambda r: r["tbs"], default=None)
            if best is not None and best["variant"] != "rule":
                show.append(best)
            for r in show:
                print(f"| {name} {r['N']}x{r['K']} | {M} | {r['variant']} | {r['ms']:.4f} | "
                      f"{r['tbs']:.3f} | {r['pct_peak']:.1f} | {r['x_cublas']:.3f} | "
                      f"{r['rel_err']:.1e} |")
    # the step's GEMMs, every shape once a layer (lm_head once): cuBLAS vs rule vs best
    for label in ("cuBLAS", "rule", "best"):
        for M in a.m:
            tot = 0.0
            for name in SHAPES:
                rs = [r for r in rows if r["shape"] == name and r["M"] == M and r["ok"]]
                if label == "best":
                    r = min((r for r in rs if r["variant"] != "cuBLAS"), key=lambda r: r["ms"],
                            default=None)
                else:
                    r = next((r for r in rs if r["variant"] == label), None)
                if r is None:
                    break
                tot += r["ms"] / (a.layers if name == "lm_head" else 1)
            else:
                print(f"# a step's GEMMs ({a.layers} layers + LM head), M {M}, {label}: "
                      f"{tot:.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=name, peak_tbs=peak, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
