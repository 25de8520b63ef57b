"""A prompt chunk over latent pages on the GPU: which route should attend S queries a row over
a cached prefix of L tokens (MLA, DeepSeek-V3 widths), and where `LATENT_EXPAND_MIN_QUERIES`
and `LATENT_EXPAND_MIN_QUERIES_FP8` (runtime/dispatch.py: 16-bit and fp8 pages) should sit.

    python benchmarks/bench_latent_chunk.py [--heads 128] [--shapes B16_L8k,B4_L32k]
        [--queries 8,16,32,64,128,255,512] [--formats bf16,fp8_e4m3]
    KVC_BENCH_DRY=1 python benchmarks/bench_latent_chunk.py   # CPU dry run, tiny shapes

Contenders per (shape, S, format), each from the same pages and the same query:
- `fold`: `_latent_kernel`'s "fold" layout, the latent decode kernels with each query as a
  row of its own (absorption and W_UV included), what a chunk under the threshold runs since
  the thirty-fifth session;
- `expand`: `latent.paged_latent_expanded`, each row's stored latents gathered and expanded
  through kv_b_proj, causal SDPA (what a chunk at or past the threshold runs);
- `expand_lr` / `expand_mask`: `expand` under torch's lower-right causal bias / under the
  explicit [S, L] causal mask SDPA took before the 39th session (dense.LOWER_RIGHT_DEVICES
  set / emptied), whatever the default;
- `reference`: the absorbed paged reference (kernels/dense.py, math SDPA in blocks), what
  such a chunk ran before, only where S x L is small (--ref-max, default 2^20 tokens x
  queries a row; 3 timed runs), since it is slow.
Prints ms (median of triton.testing.do_bench), the ratio fold / expand, each route's error
against `expand` in fp32, and per shape the smallest S where expand wins: the threshold.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
if os.environ.get("KVC_BENCH_DRY") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.cache.pool import LayerSpec, PagePool  # noqa: E402
from kvcompile.kernels.dense import paged_reference_attention  # noqa: E402
from kvcompile.kernels.latent import (  # noqa: E402
    absorb_query,
    latent_output,
    paged_latent_expanded,
)
from kvcompile.runtime import dispatch  # noqa: E402
from kvcompile.testing import rel_err  # noqa: E402

DRY = os.environ.get("KVC_BENCH_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
R, DR, DN, DV = (512, 64, 128, 128) if not DRY else (32, 16, 16, 16)
P = 16
SHAPES = {"B16_L8k": (16, 8192), "B4_L32k": (4, 32768), "B16_L32k": (16, 32768),
          "B64_L2k": (64, 2048)}
DRY_SHAPES = {"B2_L40": (2, 40)}


def bench(fn, quick: bool = False) -> float:
    """Median ms of fn(): do_bench's, or (quick: the slow reference) the median of 3 timed
    runs after one."""
    if DRY or quick:
        fn()
        times = []
        for _ in range(1 if DRY else 3):
            if not DRY:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if not DRY:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def pool_of(B: int, L: int, fmt: str, g):
    """One latent layer holding B sequences of L tokens (the chunk's own last S included)."""
    kf = KVFormat(fmt, "page")
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR, k_format=kf, v_format=kf)
    pool = PagePool([spec], B * math.ceil(L / P), P, device=DEV)
    seqs = pool.allocate(B)
    for s in seqs:
        c = torch.randn(L, 1, R, device=DEV, generator=g, dtype=torch.bfloat16)
        rope = torch.randn(L, 1, DR, device=DEV, generator=g, dtype=torch.bfloat16)
        pool.write(0, pool.reserve([s], L), c, rope)
    return pool, pool.block_table(seqs, device=DEV)


def plan_of(B: int, L: int, S: int, tables):
    return SimpleNamespace(packed=False, q_lens=[], batch=B, new_tokens=S,
                           past_lens=[L - S] * B, seq_lens_list=[L] * B, kv_start=[0] * B,
                           seq_lens=torch.full((B,), L, dtype=torch.int32, device=DEV),
                           block_tables=tables, cache={})


def run_case(state, pool, tables, w, B: int, L: int, S: int, H: int, dt, g,
             ref_max: int) -> dict:
    """One (shape, format, S) row: each route's ms and error against `expand`."""
    plan = plan_of(B, L, S, tables)
    q = torch.randn(B, H, S, DN + DR, device=DEV, generator=g).to(dt)
    scale = (DN + DR) ** -0.5

    def fold():
        q_lat = absorb_query(q, w, DN)
        o, _ = dispatch._latent_kernel(state, q_lat, pool.k[0], pool.v[0], plan, None, None,
                                       0, 0.0, scale)
        return latent_output(o.to(q_lat.dtype), w, DN)

    def expand():
        return paged_latent_expanded(pool.k[0], pool.v[0], q, plan, w, DN, scale, 0,
                                     dispatch.LATENT_EXPAND_BYTES)

    def expand_mask():   # the explicit [S, L] causal mask (dense.LOWER_RIGHT_DEVICES emptied)
        return _lower_right((), expand)

    def expand_lr():     # torch's lower-right causal bias (on CUDA)
        return _lower_right(("cuda", "cpu"), expand)

    def reference():
        q_lat = absorb_query(q, w, DN)
        o = paged_reference_attention(pool.k[0], pool.v[0], q_lat, plan, None, True, 0, 0.0,
                                      scale, latent=True)
        return latent_output(o.to(q_lat.dtype), w, DN)

    want = expand().float()
    row: dict = {"S": S}
    for label, fn in (("fold", fold), ("expand", expand), ("expand_lr", expand_lr),
                      ("expand_mask", expand_mask), ("reference", reference)):
        if label == "reference" and S * L > ref_max:
            continue
        try:
            out = fn()
            row[label] = bench(fn, quick=label == "reference")
            row[label + "_err"] = rel_err(out.float(), want)
        except torch.OutOfMemoryError:
            row[label] = "OOM"
        if not DRY:
            torch.cuda.empty_cache()
    return row


def _lower_right(devices, fn):
    """fn() with dense.LOWER_RIGHT_DEVICES set to `devices`."""
    from kvcompile.kernels import dense

    keep, dense.LOWER_RIGHT_DEVICES = dense.LOWER_RIGHT_DEVICES, devices
    try:
        return fn()
    finally:
        dense.LOWER_RIGHT_DEVICES = keep


def _cell(row: dict, key: str, fmt: str = ".3f") -> str:
    v = row.get(key)
    return format(v, fmt) if isinstance(v, float) else (v or "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8 if DRY else 128)
    ap.add_argument("--shapes", default=",".join(DRY_SHAPES if DRY else
                                                 ["B16_L8k", "B4_L32k", "B64_L2k"]))
    ap.add_argument("--queries", default="4,9" if DRY else "8,16,32,64,128,255,512")
    ap.add_argument("--formats", default="bf16" if DRY else "bf16,fp8_e4m3")
    ap.add_argument("--ref-max", type=int, default=1 << 20)
    args = ap.parse_args()
    H = args.heads
    shapes = {**SHAPES, **DRY_SHAPES}
    dt = torch.float32 if DRY else torch.bfloat16
    notes: list[str] = []
    state = SimpleNamespace(kernels=SimpleNamespace(use_triton=lambda d: True,
                                                    _fallback=notes.append))
    print(f"torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if not DRY else 'cpu (dry run)'}, heads {H}, "
          f"r {R}, rope {DR}, nope {DN}, v {DV}, page {P}")
    rows = []
    for name in args.shapes.split(","):
        B, L = shapes[name]
        for fmt in args.formats.split(","):
            g = torch.Generator(device=DEV).manual_seed(0)
            pool, tables = pool_of(B, L, fmt, g)
            w = (torch.randn(H * (DN + DV), R, device=DEV, generator=g) / R ** 0.5).to(dt)
            for S in [int(s) for s in args.queries.split(",")]:
                row = {"shape": name, "fmt": fmt,
                       **run_case(state, pool, tables, w, B, L, S, H, dt, g, args.ref_max)}
                rows.append(row)
                print(row, flush=True)
            del pool, tables
    print("\n| shape | format | S | fold ms | expand ms | expand, lower-right ms | "
          "expand, mask ms | reference ms | fold / expand | fold err | lower-right err | "
          "mask err | reference err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = (f"{r['fold'] / r['expand']:.2f}" if isinstance(r.get("fold"), float)
                 and isinstance(r.get("expand"), float) else "-")
        print(f"| {r['shape']} | {r['fmt']} | {r['S']} | {_cell(r, 'fold')} | "
              f"{_cell(r, 'expand')} | {_cell(r, 'expand_lr')} | {_cell(r, 'expand_mask')} | "
              f"{_cell(r, 'reference')} | {ratio} | {_cell(r, 'fold_err', '.1e')} | "
              f"{_cell(r, 'expand_lr_err', '.1e')} | {_cell(r, 'expand_mask_err', '.1e')} | "
              f"{_cell(r, 'reference_err', '.1e')} |")
    for name in args.shapes.split(","):
        for fmt in args.formats.split(","):
            wins = [r["S"] for r in rows if r["shape"] == name and r["fmt"] == fmt
                    and isinstance(r.get("fold"), float) and isinstance(r.get("expand"), float)
                    and r["expand"] < r["fold"]]
            now = (dispatch.LATENT_EXPAND_MIN_QUERIES_FP8 if fmt.startswith("fp8")
                   else dispatch.LATENT_EXPAND_MIN_QUERIES)
            print(f"{name} {fmt}: expand is faster from S = {min(wins) if wins else 'never'} "
                  f"(the threshold now {now})")
    if notes:
        print("fallbacks:", sorted(set(notes)))


if __name__ == "__main__":
    main()
