"""Decode attention and quantize-and-append on the GPU: kvcompile's Triton kernels vs baselines.

    python benchmarks/bench_decode.py run [--out DIR]        # sweep, final table, append table
    python benchmarks/bench_decode.py warmup --part I --parts N   # compile kernels (parallel)
    python benchmarks/bench_decode.py flexwarm               # compile the FlexAttention baseline
    python benchmarks/bench_decode.py run --no-sweep --no-flex --no-append --waves 8 \
        --shapes B64_L8k,B16_L32k --formats 'int4/channel+int4/token@64'   # a few rows only

Shapes: Hq 32, Hkv 8, D 128 at B=64/L=8192, B=16/L=32768, B=1/L=131072, and D=64 at
B=64/L=8192; page size 16 (some rows at 64, and K / V in different formats). Baselines in the same process: torch SDPA over contiguous bf16 K/V
with enable_gqa=True, and compiled FlexAttention over the same paged bf16 pool (flex_paged.py).
Every timing is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph), so
Python launch overhead is excluded for every contender alike. TB/s counts the bytes actually
stored for the tokens read (codes, micro scales, scales and zero points). Inputs are random,
never zeros.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
if os.environ.get("KVC_BENCH_DRY") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.cache.registry import format_spec  # noqa: E402
from kvcompile.kernels import decode as dec  # noqa: E402
from kvcompile.kernels.append import quantize_append  # noqa: E402

P = 16
# KVC_BENCH_DRY=1: a CPU dry run of this script (TRITON_INTERPRET, tiny shapes, wall-clock timer)
DRY = os.environ.get("KVC_BENCH_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
SHAPES = {  # name: (B, L, Hq, Hkv, D)
    "B64_L8k": (64, 8192, 32, 8, 128),
    "B16_L32k": (16, 32768, 32, 8, 128),
    "B1_L128k": (1, 131072, 32, 8, 128),
    "D64_B64_L8k": (64, 8192, 32, 8, 64),
}
# A row's format: "name/granularity" for K and V, or "K+V" for different ones; "@64" sets the
# row's page size (default P).
FORMATS = ["bf16", "fp8_e4m3/page", "fp8_e4m3/token", "fp8_e5m2/page", "fp4_e2m1/page",
           "int4/channel+int4/token@64", "int4/channel+fp4_e2m1/page@64",
           "int2/channel+int2/token@64"]
TARGET = {"bf16": 1.10, "fp8": 0.55, "fp4": 0.33}
# Variants timed on B16_L32k; the best per format family becomes the config of the final table.
# ASM: 3 = keys and values widened by inline PTX, 2 = values only, 0 = plain Triton casts.
_W4 = dict(num_warps=4)
VARIANTS = {
    "bf16": [dict(BLOCK_T=128, num_stages=2, **_W4), dict(BLOCK_T=128, num_stages=1, SPLIT=1,
             **_W4), dict(BLOCK_T=64, num_stages=1, SPLIT=1, **_W4),
             dict(BLOCK_T=128, num_stages=1, SPLIT=1, maxnreg=128, **_W4)],
    "fp8": [dict(BLOCK_T=128, num_stages=1, ASM=3, SPLIT=1, **_W4),
            dict(BLOCK_T=128, num_stages=1, ASM=3, SPLIT=1, maxnreg=128, **_W4),
            dict(BLOCK_T=64, num_stages=1, ASM=3, SPLIT=1, **_W4),
            dict(BLOCK_T=128, num_warps=8, num_stages=1, ASM=3, SPLIT=1),
            dict(BLOCK_T=64, num_stages=1, ASM=3, SPLIT=1, maxnreg=96, **_W4)],
    "fp4": [dict(BLOCK_T=128, num_stages=1, ASM=3, **_W4),
            dict(BLOCK_T=128, num_stages=1, ASM=3, maxnreg=128, **_W4),
            dict(BLOCK_T=64, num_stages=1, ASM=3, **_W4),
            dict(BLOCK_T=128, num_warps=8, num_stages=1, ASM=3)],
    # int rows (channel keys: 128-token tiles = two 64-token pages, each query row held once
    # per page (PAIR), register cap PAIR_MAXNREG; BLOCK_T 64: one page per tile)
    "int": [dict(BLOCK_T=128, num_stages=1, PAIR_MAXNREG=168, **_W4),  # 3 programs / SM
            dict(BLOCK_T=128, num_stages=1, PAIR_MAXNREG=128, **_W4),
            dict(BLOCK_T=64, num_stages=1, maxnreg=128, **_W4)],
}
SWEEP_FORMAT = {"bf16": "bf16", "fp8": "fp8_e4m3/page", "fp4": "fp4_e2m1/page",
                "int": "int4/channel+int4/token@64"}
WAVES = (4, 8, 16)
CONFIG_OVERRIDE: dict = {}  # --config
SWEEP_SHAPE = "B16_L32k"
if DRY:
    SHAPES = {"B2_L100": (2, 100, 8, 2, 64), "B1_L300": (1, 300, 8, 2, 64)}
    VARIANTS = {k: v[:2] for k, v in VARIANTS.items()}
    WAVES = (8,)
    SWEEP_SHAPE = "B2_L100"


def family(fmt: str) -> str:
    return "bf16" if fmt == "bf16" else fmt[:3]


def make_format(fmt: str) -> KVFormat:
    name, _, gran = fmt.partition("/")
    return KVFormat(name) if name == "bf16" else KVFormat(name, gran)


def split_spec(spec: str) -> tuple[str, str, int]:
    """Row spec -> (K format, V format, page size)."""
    fmts, _, page = spec.partition("@")
    k, _, v = fmts.partition("+")
    return k, v or k, int(page) if page else P


def stored_bytes(spec: str, B: int, L: int, Hkv: int, D: int) -> float:
    k, v, page = split_spec(spec)
    return B * L * sum(make_format(f).bytes_per_token(Hkv, D, page) for f in (k, v))


def build_paged(spec: str, B: int, L: int, Hkv: int, D: int, gen):
    """Random K/V pages (random codes, scales and zero points, not zeros) and shuffled block
    tables, in the row's K and V formats and page size."""
    k, v, page = split_spec(spec)
    npg = (L + page - 1) // page
    N = B * npg
    caches = []
    for fmt in (k, v):
        f = make_format(fmt)
        c = f.allocate(N, Hkv, page, D, DEV)
        if f.name == "bf16":
            c.data.normal_(generator=gen)
        elif c.data.dtype == torch.uint8:  # fp4 and int codes: any byte is a code
            c.data.copy_(torch.randint(0, 256, c.data.shape, dtype=torch.uint8, device=DEV,
                                       generator=gen))
        else:
            for chunk in c.data.split(max(1, N // 8)):
                chunk.copy_((torch.randn(chunk.shape, device=DEV, generator=gen) * 60)
                            .to(chunk.dtype))
        if c.micro is not None:
            c.micro.copy_((torch.rand(c.micro.shape, device=DEV, generator=gen) * 4 + 0.5)
                          .to(torch.float8_e4m3fn))
        if c.scale is not None:
            c.scale.copy_(torch.rand(c.scale.shape, device=DEV, generator=gen) * 0.01 + 0.01)
        if c.zero is not None:
            c.zero.copy_(torch.randn(c.zero.shape, device=DEV, generator=gen) * 0.1)
        caches.append(c)
    perm = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    bt = perm.view(B, npg).contiguous()
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    return caches[0], caches[1], bt, sl


def decode_fn(q, kc, vc, bt, sl, out, cfg, waves=None, splits=0):
    cfg = dict(cfg)
    if waves is not None:
        cfg["waves"] = waves
    scale = 1.0 / math.sqrt(q.shape[-1])

    def fn():
        dec.launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl,
                          None, None, out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name,
                          vc.fmt.granularity, scale, 0, 0, 0.0, splits, cfg, kz=kc.zero,
                          vz=vc.zero)
    return fn


def bench(fn) -> float:
    import triton.testing

    fn()
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def base_config(fmt: str, D: int, best: dict) -> dict:
    fam = family(fmt)
    code = format_spec(make_format(split_spec(fmt)[0]).name).kernels.code
    cfg = dec.default_config(code, D, D, 16)
    if fam in best:
        cfg.update(best[fam])
        if D >= 256:  # keep the register tile of D=256 rows within bounds
            cfg["BLOCK_T"] = min(cfg["BLOCK_T"], 64)
    cfg.update(CONFIG_OVERRIDE)
    return cfg


# --- baselines -----------------------------------------------------------------------------

def sdpa_fn(B, L, Hq, Hkv, D, gen):
    import torch.nn.functional as F

    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


_FLEX = None


def flex_fn(B, L, Hq, Hkv, D, gen):
    from torch.nn.attention.flex_attention import flex_attention

    from benchmarks.flex_paged import paged_flex_inputs

    global _FLEX
    if _FLEX is None:
        _FLEX = flex_attention if DRY else torch.compile(flex_attention, dynamic=False)
    kc, vc, bt, sl = build_paged("bf16", B, L, Hkv, D, gen)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    qv, kf, vf, bm = paged_flex_inputs(kc.data, vc.data, bt, sl, Hq)
    q = qv(q)
    # KV blocks are pages of 16 rows: the kernel's BLOCK_N must divide them
    opts = {} if DRY else {"BLOCK_N": 16}
    return lambda: _FLEX(q, kf, vf, block_mask=bm, enable_gqa=True, kernel_options=opts)


# --- commands ------------------------------------------------------------------------------

def cmd_warmup(part: int, parts: int) -> None:
    """Compile every (format, head_dim, variant) binary and combine width the run may use, on
    tiny inputs (the kernels do not specialize on runtime ints, so the binaries are the same)."""
    gen = torch.Generator(device=DEV).manual_seed(part)
    items = [(fmt, D, cfg) for fmt in FORMATS for D in sorted({s[4] for s in SHAPES.values()})
             for cfg in VARIANTS.get(family(fmt), [base_config(fmt, D, {})])]
    for i, (fmt, D, cfg) in enumerate(items):
        if i % parts != part:
            continue
        kc, vc, bt, sl = build_paged(fmt, 1, 64, 8, D, gen)
        q = torch.randn(1, 32, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(1, 32, 1, D, device=DEV, dtype=torch.bfloat16)
        widths = set()
        for B, L, _hq, Hkv, _ in SHAPES.values():
            for w in WAVES:  # the combine kernel specializes on the padded split count
                tile = cfg.get("BLOCK_T", 128)
                if "channel" in fmt.replace("fp4_e2m1/channel", ""):  # one or two pages
                    tile = dec.channel_tile(tile, split_spec(fmt)[2], "int" in fmt and
                                            cfg.get("PAIR", True))
                s = dec.choose_splits(B, Hkv, L, tile, 132, w)
                if s > 1 and 1 << (s - 1).bit_length() in widths:
                    continue
                widths.add(1 << (s - 1).bit_length())
                decode_fn(q, kc, vc, bt, sl, out, cfg, splits=s)()
    if not DRY:
        torch.cuda.synchronize()
    print(f"warmup part {part}/{parts} done", flush=True)


def cmd_flexwarm(part: int, parts: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    for i, (shape, (B, L, Hq, Hkv, D)) in enumerate(SHAPES.items()):
        if i % parts != part:
            continue
        t = time.time()
        try:
            flex_fn(B, L, Hq, Hkv, D, gen)()
            if not DRY:
                torch.cuda.synchronize()
            print(f"flex {shape} compiled in {time.time() - t:.0f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"flex {shape} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def cmd_run(out_dir: str, sweep: bool, flex: bool = True, append: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)  # before the sweep, not after it
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "triton": __import__("triton").__version__, "page_size": P, "sweep": [],
           "final": [], "append": []}
    best = {}
    # 1. variant sweep on one shape
    if sweep:
        B, L, Hq, Hkv, D = SHAPES[SWEEP_SHAPE]
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        for fam, variants in VARIANTS.items():
            if fam not in {family(f) for f in FORMATS}:
                continue  # only the families of the rows asked for
            fmt = SWEEP_FORMAT[fam]
            kc, vc, bt, sl = build_paged(fmt, B, L, Hkv, D, gen)
            nbytes = stored_bytes(fmt, B, L, Hkv, D)
            for cfg in variants:
                try:
                    ms = bench(decode_fn(q, kc, vc, bt, sl, out, cfg))
                except Exception as e:  # noqa: BLE001
                    print(f"sweep {fam} {cfg} failed: {e}", flush=True)
                    continue
                res["sweep"].append({"fmt": fmt, "cfg": cfg, "ms": ms,
                                     "tbs": nbytes / ms / 1e9})
                print(f"sweep {fmt:16s} {cfg} {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s",
                      flush=True)
                if fam not in best or ms < best[fam][1]:
                    best[fam] = (cfg, ms)
            del kc, vc
        best = {f: dict(c) for f, (c, _) in best.items()}
        res["best"] = best
    # 2. waves sweep per shape for each format, then the final table
    for shape, (B, L, Hq, Hkv, D) in SHAPES.items():
        base_ms = bench(sdpa_fn(B, L, Hq, Hkv, D, gen))
        kv_bf16 = 2 * B * L * Hkv * D * 2
        row = {"shape": shape, "sdpa_ms": base_ms, "sdpa_tbs": kv_bf16 / base_ms / 1e9}
        row["flex_ms"] = None
        try:
            if flex:
                row["flex_ms"] = bench(flex_fn(B, L, Hq, Hkv, D, gen))
        except Exception as e:  # noqa: BLE001
            print(f"flex {shape} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.empty_cache() if not DRY else None
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        row["kernels"] = {}
        for fmt in FORMATS:
            kc, vc, bt, sl = build_paged(fmt, B, L, Hkv, D, gen)
            cfg = base_config(fmt, D, best)
            times = {}
            for w in WAVES:
                try:
                    times[w] = bench(decode_fn(q, kc, vc, bt, sl, out, cfg, waves=w))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} {fmt} waves={w} failed: {e}", flush=True)
            nbytes = stored_bytes(fmt, B, L, Hkv, D)
            default_w = cfg.get("waves", 8)
            ms = times.get(default_w, min(times.values()) if times else float("nan"))
            row["kernels"][fmt] = {"ms": ms, "ms_by_waves": times, "bytes": nbytes,
                                   "tbs": nbytes / ms / 1e9, "ratio": ms / base_ms, "cfg": cfg,
                                   "roofline_ms": nbytes / (row["sdpa_tbs"] * 1e9)}
            del kc, vc
            torch.cuda.empty_cache() if not DRY else None
        res["final"].append(row)
        print(json.dumps(row, default=str), flush=True)
    # 3. append bandwidth on a bulk prefill, vs a device copy
    res["append"] = bench_append(gen) if append else []
    with open(os.path.join(out_dir, "bench_decode.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print_tables(res)


def bench_append(gen, T: int = 65536, H: int = 8, D: int = 128):
    if DRY:
        T, H, D = 256, 2, 64
    x = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    dst = torch.empty_like(x)
    copy_ms = bench(lambda: dst.copy_(x))
    copy_tbs = 2 * x.numel() * 2 / copy_ms / 1e9
    rows = [{"fmt": "device copy (bf16)", "ms": copy_ms, "tbs": copy_tbs, "frac": 1.0}]
    N = T // P
    perm = torch.randperm(N, device=DEV, generator=gen)
    slots = (perm[:, None] * P + torch.arange(P, device=DEV)).reshape(-1)
    for fmt in ["bf16", "fp8_e4m3/page", "fp8_e4m3/token", "fp8_e5m2/tensor", "fp4_e2m1/page",
                "fp4_e2m1/token"]:
        f = make_format(fmt) if "tensor" not in fmt else KVFormat("fp8_e5m2", "tensor", 0.01)
        c = f.allocate(N, H, P, D, DEV)
        nbytes = x.numel() * 2 + T * f.bytes_per_token(H, D, P)
        try:
            ms = bench(lambda c=c: quantize_append(c, slots, x))
            rows.append({"fmt": fmt, "ms": ms, "tbs": nbytes / ms / 1e9,
                         "frac": nbytes / ms / 1e9 / copy_tbs})
        except Exception as e:  # noqa: BLE001
            print(f"append {fmt} failed: {e}", flush=True)
    dec_slots = slots[:: max(1, T // 64)][:64].contiguous()  # one token in each of 64 pages
    c = make_format("fp8_e4m3/page").allocate(N, H, P, D, DEV)
    xd = x[:dec_slots.numel()].contiguous()
    rows.append({"fmt": "decode step B=64, fp8_e4m3/page", "ms":
                 bench(lambda: quantize_append(c, dec_slots, xd)), "tbs": None, "frac": None})
    return rows


def print_tables(res) -> None:
    print(f"\n## Decode, {res['device']}, torch {res['torch']}, triton {res['triton']}, "
          f"page size {P} unless @; ms = median of CUDA-graph replays")
    print("| shape | SDPA bf16 ms (TB/s) | flex paged ms | format | kvcompile ms | TB/s "
          "| x SDPA | target |")
    print("|---|---|---|---|---|---|---|---|")
    for row in res["final"]:
        flex = f"{row['flex_ms']:.3f}" if row.get("flex_ms") else "n/a"
        for fmt, k in row["kernels"].items():
            target = TARGET.get(family(fmt))
            print(f"| {row['shape']} | {row['sdpa_ms']:.3f} ({row['sdpa_tbs']:.2f}) | {flex} | "
                  f"{fmt} | {k['ms']:.3f} | {k['tbs']:.2f} | {k['ratio']:.2f} | "
                  f"{'-' if target is None else f'{target:.2f}'} |")
    print("\n| append (T=65536, H=8, D=128, bf16 in) | ms | TB/s | x copy |")
    print("|---|---|---|---|")
    for r in res["append"]:
        tbs = f"{r['tbs']:.2f}" if r["tbs"] else "-"
        frac = f"{r['frac']:.2f}" if r["frac"] else "-"
        print(f"| {r['fmt']} | {r['ms']:.4f} | {tbs} | {frac} |")
    if res.get("best"):
        print("\nbest configs:", json.dumps(res["best"]))


def main() -> None:
    global FORMATS, SHAPES, WAVES
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run", "warmup", "flexwarm"])
    ap.add_argument("--part", type=int, default=0)
    ap.add_argument("--parts", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline")
    ap.add_argument("--no-append", action="store_true", help="skip the append table")
    ap.add_argument("--formats", help="comma-separated rows, e.g. 'fp4_e2m1/page,"
                    "int4/channel+int4/token@64' (default: all of FORMATS)")
    ap.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--waves", help="comma-separated waves per SM to try (default "
                    f"{','.join(map(str, WAVES))})")
    ap.add_argument("--config", help="JSON tile config applied to every row, e.g. "
                    "'{\"BLOCK_T\": 64, \"maxnreg\": null}'")
    a = ap.parse_args()
    if a.config:
        CONFIG_OVERRIDE.update(json.loads(a.config))
    if a.formats:
        FORMATS = a.formats.split(",")
    if a.shapes:
        SHAPES = {k: SHAPES[k] for k in a.shapes.split(",")}
    if a.waves:
        WAVES = tuple(int(w) for w in a.waves.split(","))
    if a.cmd == "warmup":
        cmd_warmup(a.part, a.parts)
    elif a.cmd == "flexwarm":
        cmd_flexwarm(a.part, a.parts)
    else:
        cmd_run(a.out, not a.no_sweep, not a.no_flex, not a.no_append)


if __name__ == "__main__":
    main()
