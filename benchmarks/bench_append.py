"""Quantize-and-append bandwidth (target: at least 70% of copy bandwidth on bulk
prefill appends), every format the append kernel writes, against device copies in the same run.

    python benchmarks/bench_append.py [--tokens 65536 --heads 8 --dim 128 --page 16]
                                      [--json OUT/bench_append.json]
    python benchmarks/bench_append.py --dry        # CPU: interpreter, tiny shapes, wall clock
    python benchmarks/bench_append.py --sweep      # + tile shapes / warps of the new kernels

A bulk prefill append: T tokens x H kv heads x D of bf16 input, written into shuffled whole
pages (slots of one page adjacent, pages in random order), as the runtime's writer does
(`quantize_append(..., direct=True)`). Page-scaled rows are timed twice: with the kernel's own
device sort of the slots (`grouped=False`, what a caller with arbitrary slots gets) and with
`grouped=True` (slots in PagePool.reserve's order: no sort), so the sort's share is visible.
Plus one decode step (64 tokens, one per page).

Bytes = input read (T*H*D*2) + bytes stored (codes, micro scales, scales:
KVFormat.bytes_per_token).
Baselines: `copy` = dst.copy_(x) of the bf16 input (its GB/s counts read + write); `same-bytes
copy` = a uint8 copy moving the same total bytes as the append. "x copy" = append GB/s / copy
GB/s (the target's ratio); "x same" = same-bytes copy ms / append ms.
Each row is timed with the default kernels first, then with the other kernel variants (old
paths and candidates, `variants`: append-module settings) side by side; the target line counts
the default rows. Times: median of CUDA-graph replays (triton.testing.do_bench_cudagraph;
do_bench if graphs fail).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
DRY = "--dry" in sys.argv
SWEEP = "--sweep" in sys.argv   # also time other tile shapes / warps of the new kernels
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.kernels.append import quantize_append  # noqa: E402

DEV = "cpu" if DRY else "cuda"
# (name, granularity, grouped)
ROWS = [("bf16", "page", False),
        ("fp8_e4m3", "page", False), ("fp8_e4m3", "page", True),
        ("fp8_e4m3", "token", False), ("fp8_e4m3", "tensor", False),
        ("fp8_e5m2", "page", True),
        ("fp4_e2m1", "page", False), ("fp4_e2m1", "page", True),
        ("fp4_e2m1", "token", False), ("fp4_e2m1", "tensor", False),
        # the 4-bit format's parts (kernels/append_int.py): K int4 channel, V int4 token
        ("int4", "channel", True), ("int4", "token", False)]


def variants(name: str, gran: str, grouped: bool) -> list:
    """(label suffix, append-module settings) of each kernel variant timed for a row: the
    default first, then the others (old paths and candidates) side by side. Settings are the
    module attributes of kvcompile.kernels.append: PAGE_BULK (bulk page-scaled kernel: "runs",
    "windows", "tiles", "split"), FP4_PAIR_LOADS (False: the split loads before append16b),
    CALIBRATE_PROGRAMS (1 << 30: one program per block, as before append16b)."""
    import kvcompile.kernels.append as app

    out = [("", {})]
    if gran == "page" and name not in ("bf16", "fp16"):
        bulk = ["runs", "tiles", "split"] + (["windows"] if grouped else [])
        out += [(f", {k} kernel", {"PAGE_BULK": k}) for k in bulk if k != app.PAGE_BULK]
        out.append((f", tiles, x read {'after' if app.PAGE_TILE_SPEC else 'before'} the page "
                    "test", {"PAGE_BULK": "tiles", "PAGE_TILE_SPEC": not app.PAGE_TILE_SPEC}))
        if name == "fp4_e2m1":
            pairs = not app.FP4_PAIR_LOADS
            out.append((f", runs kernel, {'pair' if pairs else 'split'} loads",
                        {"PAGE_BULK": "runs", "FP4_PAIR_LOADS": pairs}))
        if name == "fp4_e2m1" and grouped:
            cap = app.PAGE_TILE_MAXNREG
            out.append((", tiles, registers " + ("uncapped" if cap[1] else "capped at 128"),
                         {"PAGE_BULK": "tiles",
                          "PAGE_TILE_MAXNREG": (cap[0], None if cap[1] else 128)}))
        if SWEEP and grouped:
            for kind in ("tiles", "split"):
                for elems, warps in ((2048, (2, 2)), (2048, (4, 4)), (4096, (2, 2)), (4096, (4, 4)),
                                     (4096, (8, 8)), (16384, (4, 4)), (16384, (8, 8))):
                    if (elems, warps) != (app.PAGE_TILE_ELEMS, app.PAGE_TILE_WARPS):
                        out.append((f", {kind} {elems // 128} x 128, {warps[0]} warps",
                                    {"PAGE_BULK": kind, "PAGE_TILE_ELEMS": elems,
                                     "PAGE_TILE_WARPS": warps}))
    elif name == "fp4_e2m1":
        pairs = not app.FP4_PAIR_LOADS
        out.append((f", {'pair' if pairs else 'split'} loads", {"FP4_PAIR_LOADS": pairs}))
    if SWEEP and gran != "page" and not name.startswith("int"):
        fp4 = name == "fp4_e2m1"
        now = app.FP4_ROW_TILE if fp4 else (app.ROW_TILE_ELEMS, app.ROW_TILE_WARPS)
        out += [(f", rows tile {e // 128} x 128, {w} warps",
                 {"FP4_ROW_TILE": (e, w)} if fp4 else {"ROW_TILE_ELEMS": e, "ROW_TILE_WARPS": w})
                for e in (2048, 4096, 8192) for w in (1, 2, 4, 8) if (e, w) != now]
    if gran == "tensor":
        out.append((", calibration grid per block (old)", {"CALIBRATE_PROGRAMS": 1 << 30}))
    if name.startswith("int") and gran == "token":   # append_int's token tile
        import kvcompile.kernels.append_int as app_int

        tiles = ((2048, 2), (4096, 2), (8192, 4), (8192, 8), (16384, 4), (16384, 8)) if SWEEP \
            else ((4096, 4), (8192, 8))
        out += [(f", tokens tile {e // 128} x 128, {w} warps",
                 {"int.TOKEN_TILE_ELEMS": e, "int.TOKEN_TILE_WARPS": w})
                for e, w in tiles if (e, w) != (app_int.TOKEN_TILE_ELEMS,
                                                app_int.TOKEN_TILE_WARPS)]
    if name.startswith("int") and gran != "token":   # append_int's bulk kernels
        import kvcompile.kernels.append_int as app_int

        other = "runs" if app_int.PAGE_BULK == "tiles" else "tiles"
        out.append((f", {other} kernel", {"int.PAGE_BULK": other}))
        out.append((f", x read {'after' if app_int.TILE_SPEC else 'before'} the page test",
                    {"int.TILE_SPEC": not app_int.TILE_SPEC}))
        out.append((f", tiles in {'one launch' if app_int.TILE_SPLIT else 'two launches'}",
                    {"int.TILE_SPLIT": not app_int.TILE_SPLIT}))
        out += [(f", tiles of {n} pages, {w} warps", {"int.PAGE_BULK": "tiles",
                                                       "int.TILE_PAGES": n,
                                                       "int.TILE_WARPS": w})
                for n, w in ((4, 4), (8, 8), (16, 8)) + (((2, 2), (4, 2), (8, 2), (16, 4))
                                                         if SWEEP else ())
                if (n, w) != (app_int.TILE_PAGES, app_int.TILE_WARPS)]
    return out


@contextlib.contextmanager
def set_knobs(knobs: dict):
    # names "int.X" are attributes of kvcompile.kernels.append_int, the others of append
    import kvcompile.kernels.append as app
    import kvcompile.kernels.append_int as app_int

    def where(k):
        return (app_int, k[4:]) if k.startswith("int.") else (app, k)

    before = {k: getattr(*where(k)) for k in knobs}
    for k, v in knobs.items():
        setattr(*where(k), v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(*where(k), v)


def bench(fn) -> float:
    """Median ms of fn."""
    fn()
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    except Exception as e:  # noqa: BLE001 - graph capture failed: plain launches
        print(f"  (cuda graph failed: {type(e).__name__}: {str(e)[:120]}; do_bench)", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=50, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="time only the rows whose label holds this")
    ap.add_argument("--defaults", action="store_true",
                    help="time only each row's default kernel (no variants)")
    a = ap.parse_args()
    T, H, D, P = a.tokens, a.heads, a.dim, a.page
    if DRY:
        T, H, D = 256, 2, 64
        import kvcompile.kernels.append as app

        app.BULK_TOKENS = 0   # the bulk page-scaled kernels at the dry run's 256 tokens
        import kvcompile.kernels.append_int as app_int

        app_int.BULK_TOKENS = 0
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
    N = T // P
    perm = torch.randperm(N, device=DEV, generator=gen)
    slots = (perm[:, None] * P + torch.arange(P, device=DEV)).reshape(-1).contiguous()
    in_bytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    copy_ms = bench(lambda: dst.copy_(x))
    copy_gbs = 2 * in_bytes / copy_ms / 1e6
    dev = "cpu (dry run)" if DRY else torch.cuda.get_device_name()
    import triton

    print(f"append bench: {dev}, torch {torch.__version__}, triton {triton.__version__}; "
          f"T={T} H={H} D={D} page={P}, bf16 input; copy {copy_ms:.4f} ms = "
          f"{copy_gbs:.0f} GB/s (read + write)", flush=True)
    res = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
           "T": T, "H": H, "D": D, "P": P, "copy_ms": copy_ms, "copy_gbs": copy_gbs,
           "rows": []}
    same_cache: dict[int, float] = {}

    def same_bytes_copy_ms(total: float) -> float:
        n = int(total // 2) // 16 * 16
        if n not in same_cache:
            s = torch.empty(n, dtype=torch.uint8, device=DEV)
            d = torch.empty_like(s)
            same_cache[n] = bench(lambda: d.copy_(s))
            del s, d
        return same_cache[n]

    def row(label, fmt, sl, xx, grouped, default=True, before=None):
        if a.only not in label or (a.defaults and not default):
            return
        c = fmt.allocate(N, H, P, D, DEV)
        if before is not None:   # tokens written first (untimed): (slots, x)
            quantize_append(c, before[0], before[1], True, direct=True)
        stored = sl.numel() * fmt.bytes_per_token(H, D, P)
        total = xx.numel() * xx.element_size() + stored
        try:
            ms = bench(lambda: quantize_append(c, sl, xx, grouped, direct=True))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"| {label} | FAILED {type(e).__name__}: {str(e)[:200]} |", flush=True)
            return
        gbs = total / ms / 1e6
        same = same_bytes_copy_ms(total)
        r = {"row": label, "default": default, "ms": ms, "bytes": total, "gbs": gbs,
             "x_copy": gbs / copy_gbs,
             "same_bytes_copy_ms": same, "x_same": same / ms}
        res["rows"].append(r)
        print(f"| {label} | {ms:.4f} | {total / 1e6:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | "
              f"{same:.4f} | {same / ms:.2f} |", flush=True)

    print("\n| append (bulk prefill) | ms | MB moved | GB/s | x copy | same-bytes copy ms | "
          "x same |")
    print("|---|---|---|---|---|---|---|")
    for name, gran, grouped in ROWS:
        fmt = KVFormat(name) if name in ("bf16", "fp16") else KVFormat(name, gran)
        label = name if name in ("bf16", "fp16") else f"{name} {gran}"
        if gran in ("page", "channel") and name not in ("bf16", "fp16"):
            label += ", grouped (no sort)" if grouped else ", sorted on device"
        for tag, knobs in variants(name, gran, grouped):
            with set_knobs(knobs):
                row(label + tag, fmt, slots, x, grouped, not tag)
    # a batch of 16 prompts of odd lengths in reserve order: page runs start off the kernel's
    # windows, so each window also has a run that crosses its end (written by the per-run path)
    B = 16
    L = T // B - 3
    per = (L + P - 1) // P
    seq_slots = [(perm[b * per:(b + 1) * per, None] * P + torch.arange(P, device=DEV)).reshape(-1)
                 [:L] for b in range(B)]
    odd = torch.cat(seq_slots).contiguous()
    xo = x[:odd.numel()].contiguous()
    for name in ("fp8_e4m3", "fp4_e2m1"):
        for tag, knobs in variants(name, "page", False):
            with set_knobs(knobs):
                row(f"{name} page, grouped, {B} prompts of {L}{tag}", KVFormat(name, "page"),
                    odd, xo, True, not tag)
    # a decode step: one token into each of 64 pages (page-scaled fp8, the runtime's decode)
    dec_slots = slots[:: max(1, T // 64)][:64].contiguous()
    xd = x[:dec_slots.numel()].contiguous()
    for name, gran in (("fp8_e4m3", "page"), ("fp4_e2m1", "page"), ("int4", "channel")):
        row(f"decode step, 64 tokens, {name} {gran}", KVFormat(name, gran), dec_slots, xd, True)
    # the steady state of a decode step over int4 channel pages: each of 64 pages already
    # holds P - 1 tokens (written untimed), the step writes its last slot; a page's channel
    # range grows with most new tokens, so the step reads (and mostly re-encodes) the page's
    # earlier tokens; with the decode launch's chunk of rows / warps as variants
    pages = perm[:64]
    last = (pages * P + P - 1).contiguous()
    fill = (pages[:, None] * P + torch.arange(P - 1, device=DEV)).reshape(-1)
    xf = torch.randn(fill.numel(), H, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
    xl = x[:last.numel()].contiguous()
    for tag, knobs in [("", {}), (f", chunks of {P} rows", {"int.DECODE_ROWS": P}),
                       (f", chunks of {P} rows, 8 warps", {"int.DECODE_ROWS": P,
                                                           "int.DECODE_WARPS": 8})]:
        with set_knobs(knobs):
            row(f"decode step, 64 tokens into pages of {P - 1}, int4 channel{tag}",
                KVFormat("int4", "channel"), last, xl, True, not tag, before=(fill, xf))
    worst = {r["row"]: r["x_copy"] for r in res["rows"] if r["default"]}
    met = [k for k, v in worst.items() if v >= 0.70 and "decode" not in k]
    missed = [k for k, v in worst.items() if v < 0.70 and "decode" not in k]
    print(f"\nAPPEND: target >= 0.70 x copy bandwidth: met by {len(met)} row(s), missed by "
          f"{len(missed)}: {'; '.join(f'{k} {worst[k]:.2f}' for k in missed) or '-'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
