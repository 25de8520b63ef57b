"""The CUDA decode kernel (kernels/decode_sm90.py) on the H200: correctness, accuracy, speed.

    python benchmarks/gpu_decode_fast.py [--check] [--accuracy] [--bench] [--out DIR]

--check: the kernel against the fp32 reference (kernels/reference.py) on fresh random inputs,
    outputs poisoned with NaN, over formats x head_dim x GQA x page size x Sq x masks x splits,
    each case asserting that the CUDA kernel (not the Triton one) ran.
--accuracy: L = 131,072 with peaky attention (a few keys hold most of the mass) against an
    fp32 reference over the same dequantized pages.
--bench: decode time relative to torch SDPA over contiguous bf16 (same process), CUDA kernel
    and the Triton kernel side by side, medians of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.kernels import decode as dec  # noqa: E402
from kvcompile.kernels import decode_sm90 as fast  # noqa: E402
from kvcompile.kernels.reference import paged_decode_attention_ref  # noqa: E402
from kvcompile.testing import REL_ERR, poison_, rel_err  # noqa: E402
from tests.kernels.kernel_cases import make_format, make_paged_kv  # noqa: E402

DEV = "cuda"
FAST_FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
                ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("fp8_e5m2", "token")]


def _launch(q, kc, vc, bt, sl, out, backend, *, key_mask=None, window=0, sinks=0,
            softcap=0.0, splits=0):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return dec.launch_decode(
        q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl, key_mask, None,
        out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity, scale, window,
        sinks, softcap, splits, None, kz=kc.zero, vz=vc.zero, backend=backend)


def warm_builds() -> float:
    """Compile every variant the check and bench use, in parallel; returns seconds."""
    t0 = time.perf_counter()
    keys = set()
    for (kf, kg), d, rows, qt in itertools.product(FAST_FORMATS, (64, 128), (8, 16),
                                                    (torch.float32, torch.bfloat16)):
        kk = fast._KIND[kf]
        sm = fast._SCALE[kg] if kk < 2 else 0
        keys.add((kk, kk, sm, sm, d, d, rows, fast._QT[qt]))
    keys.add((0, 3, 1, 0, 128, 128, 8, 1))  # K fp8 / V bf16
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: fast._kernel(*k), sorted(keys)))
    return time.perf_counter() - t0


def check(gen) -> tuple[int, int, list]:
    cases = []
    for (kf, kg), D, G, P, Sq in itertools.product(FAST_FORMATS, (64, 128), (1, 4, 8),
                                                   (8, 16, 64, 128), (1, 2)):
        if G * Sq > 16 or (P == 8 and D == 64 and G == 1):
            continue
        cases.append(dict(k=(kf, kg), v=(kf, kg), D=D, G=G, P=P, Sq=Sq))
    extra = [  # masks, splits, mixed formats, q dtypes
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1, window=100,
             sinks=4),
        dict(k=("fp8_e4m3", "token"), v=("fp8_e4m3", "token"), D=128, G=4, P=16, Sq=2,
             window=37, sinks=3),
        dict(k=("bf16", "page"), v=("bf16", "page"), D=128, G=8, P=16, Sq=2, window=64, sinks=0),
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1, kmask=True),
        dict(k=("bf16", "page"), v=("bf16", "page"), D=64, G=4, P=32, Sq=4, kmask=True),
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1,
             softcap=30.0),
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1, splits=1),
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1, splits=7),
        dict(k=("bf16", "page"), v=("bf16", "page"), D=128, G=4, P=16, Sq=1, splits=1),
        dict(k=("fp8_e4m3", "page"), v=("bf16", "page"), D=128, G=4, P=16, Sq=1),
        dict(k=("fp8_e4m3", "page"), v=("fp8_e4m3", "page"), D=128, G=4, P=16, Sq=1,
             q=torch.bfloat16),
        dict(k=("bf16", "page"), v=("bf16", "page"), D=128, G=4, P=16, Sq=1, q=torch.bfloat16),
    ]
    cases += extra
    npass, fails = 0, []
    t0 = time.perf_counter()
    for i, c in enumerate(cases):
        print(f"case {i + 1}/{len(cases)} at {time.perf_counter() - t0:.1f} s: {c}", flush=True)
        lens = [1, 17, 300, 1033, 16, 15][: 3 if c["D"] == 64 else 6]
        kc, vc, bt, sl = make_paged_kv(make_format(*c["k"]), make_format(*c["v"]), lens, 2,
                                       c["D"], c["P"], gen=gen)
        B, Hq = len(lens), 2 * c["G"]
        qdt = c.get("q", torch.float32)
        q = torch.randn(B, Hq, c["Sq"], c["D"], generator=gen).to(DEV, qdt)
        km = None
        if c.get("kmask"):
            km = torch.rand(B, max(lens), generator=gen).to(DEV) > 0.3
            km[:, -1] = True
        out = poison_(torch.empty(B, Hq, c["Sq"], c["D"], dtype=qdt, device=DEV))
        tag = json.dumps({k: (str(v) if not isinstance(v, (int, float, str, tuple)) else v)
                          for k, v in c.items()})
        try:
            why = dec.fast_path_reason(q, *c["k"], *c["v"], c["D"], c["D"], c["P"],
                                       c["G"] * c["Sq"])
            if why:
                raise AssertionError(f"fast path refused: {why}")
            _launch(q, kc, vc, bt, sl, out, "cuda", key_mask=km, window=c.get("window", 0),
                    sinks=c.get("sinks", 0), softcap=c.get("softcap", 0.0),
                    splits=c.get("splits", 0))
            torch.cuda.synchronize()
            ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 1 / math.sqrt(c["D"]),
                                             key_mask=km, sliding_window=c.get("window", 0),
                                             sinks=c.get("sinks", 0),
                                             softcap=c.get("softcap", 0.0))
            cdt = torch.bfloat16 if "bf16" in (c["k"][0], c["v"][0]) else torch.float16
            if qdt == torch.bfloat16:
                cdt = torch.bfloat16
            err, bound = rel_err(out, ref), REL_ERR[cdt]
            if torch.isnan(out).any() or err > bound:
                raise AssertionError(f"rel err {err:.2e} > {bound:.1e} "
                                     f"(nan: {bool(torch.isnan(out).any())})")
            npass += 1
        except Exception as e:  # noqa: BLE001
            fails.append(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
    return npass, len(cases), fails


def accuracy(gen) -> list[dict]:
    """B=1, L=131072, Hkv 8, G 4: q aligned with 8 'needle' keys; the rest noise."""
    rows = []
    L, Hkv, G, D, P = 131072, 8, 4, 128, 16
    for kf, kg in (("fp8_e4m3", "page"), ("fp8_e4m3", "tensor"), ("bf16", "page")):
        f = make_format(kf, kg)
        npg = L // P
        kc, vc = f.allocate(npg, Hkv, P, D, DEV), f.allocate(npg, Hkv, P, D, DEV)
        q = torch.randn(1, Hkv * G, 1, D, generator=gen).to(DEV)
        k = torch.randn(L, Hkv, D, generator=gen).to(DEV)
        needles = torch.randint(0, L, (8,), generator=gen)
        qd = q[0, ::G, 0]  # [Hkv, D], the group's first head
        k[needles] = qd[None] * 1.5   # peaky: scores ~ |q|^2 * 1.5 / sqrt(D) above the noise
        v = torch.randn(L, Hkv, D, generator=gen).to(DEV)
        slots = torch.arange(L, device=DEV)
        for a in range(0, L, 16384):
            kc.write(slots[a:a + 16384], k[a:a + 16384])
            vc.write(slots[a:a + 16384], v[a:a + 16384])
        bt = torch.arange(npg, dtype=torch.int32, device=DEV)[None]
        sl = torch.tensor([L], dtype=torch.int32, device=DEV)
        out = poison_(torch.empty(1, Hkv * G, 1, D, device=DEV))
        ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 1 / math.sqrt(D))
        row = {"format": f"{kf}/{kg}"}
        for backend in ("cuda", "triton"):
            _launch(q, kc, vc, bt, sl, out, backend)
            torch.cuda.synchronize()
            row[backend] = rel_err(out, ref)
        row["bound"] = REL_ERR[torch.bfloat16 if kf == "bf16" else torch.float16]
        rows.append(row)
        del kc, vc, k, v
        torch.cuda.empty_cache()
    return rows


SHAPES = {"B64_L8k": (64, 8192, 32, 8, 128), "B16_L32k": (16, 32768, 32, 8, 128),
          "B1_L128k": (1, 131072, 32, 8, 128), "D64_B64_L8k": (64, 8192, 32, 8, 64)}
BENCH_FORMATS = [("bf16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
                 ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page")]


def _bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def _random_pages(f, N, Hkv, P, D, gen):
    c = f.allocate(N, Hkv, P, D, DEV)
    if c.data.dtype in (torch.bfloat16, torch.float16):
        c.data.normal_(generator=gen)
    else:
        for ch in c.data.split(max(1, N // 8)):
            ch.copy_((torch.randn(ch.shape, device=DEV, generator=gen) * 60).to(ch.dtype))
    if c.scale is not None:
        c.scale.copy_(torch.rand(c.scale.shape, device=DEV, generator=gen) * 0.01 + 0.01)
    return c


def bench(gen, waves_list) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    for name, (B, L, Hq, Hkv, D) in SHAPES.items():
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        t_sdpa = _bench(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True))
        del k, v
        kv_bf16 = 2 * B * L * Hkv * D * 2
        rows.append({"shape": name, "row": "sdpa bf16", "ms": t_sdpa, "x": 1.0,
                     "TB/s": kv_bf16 / t_sdpa / 1e9})
        npg = B * (L // 16)
        for kf, kg in BENCH_FORMATS:
            f = make_format(kf, kg)
            kc = _random_pages(f, npg, Hkv, 16, D, gen)
            vc = _random_pages(f, npg, Hkv, 16, D, gen)
            bt = torch.randperm(npg, device=DEV, generator=gen).to(torch.int32).view(B, -1)
            sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
            out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
            stored = 2 * B * L * f.bytes_per_token(Hkv, D, 16)
            for backend in ("triton", "cuda"):
                variants = [None] if backend == "triton" else [None] + waves_list
                for w in variants:
                    splits = 0  # the CUDA kernel's own choice (decode_sm90.choose_splits)
                    if w is not None:
                        splits = fast.choose_splits(B, Hkv, bt.shape[1] * 16,
                                                    dec._sm_count(q.device), waves=w)
                    t = _bench(functools.partial(_launch, q, kc, vc, bt, sl, out, backend,
                                                 splits=splits))
                    if backend == "cuda" and w is None:
                        splits = fast.choose_splits(
                            B, Hkv, bt.shape[1] * 16, dec._sm_count(q.device),
                            ctas_per_sm=fast.variant(fast._KIND[kf], fast._KIND[kf],
                                                     fast._SCALE[kg] if "fp8" in kf else 0,
                                                     fast._SCALE[kg] if "fp8" in kf else 0,
                                                     D, D, 8, fast._QT[q.dtype])[1])
                    label = ("" if backend == "triton" else
                             f" auto splits={splits}" if w is None else
                             f" waves={w} splits={splits}")
                    rows.append({"shape": name, "row": f"{kf}/{kg} {backend}{label}",
                                 "ms": t, "x": t / t_sdpa, "TB/s": stored / t / 1e9})
            del kc, vc
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--waves", default="2,4,8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if not (a.check or a.accuracy or a.bench):
        a.check = a.accuracy = a.bench = True
    gen = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["build_s"] = warm_builds()
    print(f"built variants in {res['build_s']:.1f} s", flush=True)
    if a.check:
        npass, n, fails = check(gen)
        res["check"] = {"pass": npass, "total": n, "fails": fails}
        print(f"CHECK {npass}/{n} passed", flush=True)
        for f in fails[:40]:
            print("  FAIL", f, flush=True)
    if a.accuracy:
        res["accuracy"] = accuracy(gen)
        for r in res["accuracy"]:
            print("ACCURACY", r, flush=True)
    if a.bench:
        gen_cuda = torch.Generator(device=DEV).manual_seed(1)
        res["bench"] = bench(gen_cuda, [float(w) for w in a.waves.split(",")])
        print(f"{'shape':12s} {'row':42s} {'ms':>8s} {'x sdpa':>7s} {'TB/s':>6s}")
        for r in res["bench"]:
            print(f"{r['shape']:12s} {r['row']:42s} {r['ms']:8.4f} {r['x']:7.3f} "
                  f"{r['TB/s']:6.2f}")
    with open(os.path.join(a.out, "gpu_decode_fast.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
