"""Prefill speed on the GPU: kvcompile's Triton kernels vs torch SDPA (cuDNN and flash backends)
and compiled FlexAttention, timed in the same process. TFLOP/s count causal FLOPs as half
(only the (query, key) pairs the mask allows).

    python benchmarks/bench_prefill.py [--quick] [--json out.json]
    python benchmarks/bench_prefill.py --warm-flex     # compile FlexAttention only (cache)
    python benchmarks/bench_prefill.py --chunk-only    # the chunked-prefill rows alone
                                                       # (+ 64 / 256-token chunks, the rule)

Shapes: H=32, D=128 causal at B=4/L=8192 and B=1/L=32768; GQA 32/8 at B=4/L=8192;
chunked prefill of a 2,048-token chunk over a 30,720-token paged FP8 prefix (GQA 32/8, page 16)
against the same varlen kernel over contiguous bf16 K/V, each page format (bf16, fp8 page
scales, fp4) by the in-kernel paged route and the gathered route (kernels/prefill_gather.py).
Targets: bf16 >= 0.90x cuDNN SDPA;
FP8 >= 1.3x cuDNN SDPA bf16; chunked over FP8 pages >= 0.8x the same kernel over contiguous bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.kernels import prefill_launch as L  # noqa: E402
from kvcompile.kernels.prefill import (  # noqa: E402
    prefill_attention,
    quantize_fp8_prefill,
)
from kvcompile.testing import rel_err  # noqa: E402

D = 128
SHAPES = [
    dict(name="causal B=4 L=8192 H=32", B=4, L=8192, hq=32, hkv=32),
    dict(name="causal B=1 L=32768 H=32", B=1, L=32768, hq=32, hkv=32),
    dict(name="causal GQA 32/8 B=4 L=8192", B=4, L=8192, hq=32, hkv=8),
]
CHUNK = dict(prefix=30720, chunk=2048, hq=32, hkv=8, page=16)


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def packed_inputs(B, L, hq, hkv, d=D):
    """B sequences of L tokens, packed: random bf16 q [B * L, hq, d], k / v [B * L, hkv, d]
    (seed 0) and cu_seqlens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B * L, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (hq, hkv, hkv))
    return q, k, v, torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L


def causal_flops(B, L, H, d=D) -> float:
    return 4.0 * B * H * d * (L * (L + 1) / 2)


def flex_fn(L_, hq, hkv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, L_, L_, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=hq != hkv)


def sdpa_backend(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(q, k, v, **kw):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return run


def try_time(fn, rows, name, flops, check=None):
    print(f"START {name}", flush=True)  # a hang shows which variant it was
    try:
        fn()
        torch.cuda.synchronize()
        ms = bench_ms(fn)
        row = dict(name=name, ms=ms, tflops=flops / ms / 1e9)
        if check is not None:
            row["diff_vs_cudnn"] = check()
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        row = dict(name=name, ms=float("nan"), tflops=float("nan"),
                   error=f"{type(e).__name__}: {str(e)[:160]}")
    rows.append(row)
    print(json.dumps(row), flush=True)
    return row


def bench_shape(s, quick: bool):
    B, Lq, hq, hkv = s["B"], s["L"], s["hq"], s["hkv"]
    q, k, v, cu = packed_inputs(B, Lq, hq, hkv)
    scale = D ** -0.5
    flops = causal_flops(B, Lq, hq)
    qb, kb, vb = (x.view(B, Lq, x.shape[1], D).transpose(1, 2) for x in (q, k, v))
    gqa = hq != hkv
    rows = []
    cudnn = sdpa_backend("cudnn")
    ref = {}

    def cudnn_run():
        ref["o"] = cudnn(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        return ref["o"]

    if gqa:  # cuDNN may not take enable_gqa: then time it on K/V repeated to Hq heads
        try:
            cudnn_run()
        except RuntimeError:
            kr, vr = (x.repeat_interleave(hq // hkv, 1) for x in (kb, vb))

            def cudnn_run():
                ref["o"] = cudnn(qb, kr, vr, is_causal=True, scale=scale)
                return ref["o"]

    def diff(out):
        def f():
            if "o" not in ref:
                return None
            return rel_err(out().view(B, Lq, hq, D).float(), ref["o"].transpose(1, 2).float())
        return f

    try_time(cudnn_run, rows, "sdpa cudnn (bf16)", flops)

    def ours():
        return prefill_attention(q, k, v, cu, scale, max_seqlen=Lq)
    try_time(ours, rows, "kvcompile prefill (bf16)", flops, check=diff(ours))
    q8, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
    torch.cuda.synchronize()

    def ours8():
        return prefill_attention(q8, k8, vt8, cu, scale, fp8=sc, max_seqlen=Lq)
    try_time(ours8, rows, "kvcompile prefill (fp8 e4m3, block scales)", flops,
             check=diff(ours8))
    t = time.time()
    quantize_fp8_prefill(q, k, v, cu)
    torch.cuda.synchronize()
    rows[-1]["quantize_ms_torch"] = (time.time() - t) * 1e3
    flash = sdpa_backend("flash")
    try_time(lambda: flash(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa), rows,
             "sdpa flash (bf16)", flops)
    if not quick:
        flex = flex_fn(Lq, hq, hkv)
        try_time(lambda: flex(qb, kb, vb), rows, "flex_attention compiled (bf16)", flops)
    return rows


def _paged_pair(k, v, fmt: KVFormat, hkv: int, P: int, total: int):
    """K/V [total, hkv, D] written into shuffled pages of `fmt` (8k-token appends, as a
    prefill would): (k_cache, v_cache, block_tables [1, n] int32)."""
    n_pages = (total + P - 1) // P
    perm = torch.randperm(n_pages + 8, device="cuda")[:n_pages]
    slots = (perm[:, None] * P + torch.arange(P, device="cuda")[None]).reshape(-1)[:total]
    kc = fmt.allocate(n_pages + 8, hkv, P, D, "cuda")
    vc = fmt.allocate(n_pages + 8, hkv, P, D, "cuda")
    for a in range(0, total, 8192):
        kc.write(slots[a:a + 8192], k[a:a + 8192])
        vc.write(slots[a:a + 8192], v[a:a + 8192])
    torch.cuda.synchronize()
    return kc, vc, perm.to(torch.int32)[None]


CHUNK_FORMATS = [("bf16", "page"), ("fp8_e4m3", "page"), ("fp4_e2m1", "page")]


def bench_chunk(quick: bool, chunk: int | None = None, formats=CHUNK_FORMATS, sdpa=True):
    """One chunk over a paged prefix: the varlen kernel over contiguous bf16 (the baseline),
    then per page format the in-kernel paged route and the gathered route
    (kernels/prefill_gather.py: gather + varlen), the gather alone (GB/s of codes read +
    workspace written), and which route the rule ("auto") picks."""
    from kvcompile.kernels import prefill_gather as G

    c = dict(CHUNK, chunk=chunk or CHUNK["chunk"])
    total = c["prefix"] + c["chunk"]
    hq, hkv, P = c["hq"], c["hkv"], c["page"]
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(c["chunk"], hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = torch.tensor([0, c["chunk"]], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, total], device="cuda", dtype=torch.int32)
    scale = D ** -0.5
    pairs = c["chunk"] * c["prefix"] + c["chunk"] * (c["chunk"] + 1) / 2
    flops = 4.0 * hq * D * pairs
    rows = []

    def contiguous():
        return prefill_attention(q, k, v, cu_q, scale, cu_seqlens_k=cu_k, max_seqlen=c["chunk"])
    base = try_time(contiguous, rows, "kvcompile varlen, contiguous bf16 K/V", flops)
    ref = contiguous().float()
    seq_lens = torch.tensor([total], device="cuda", dtype=torch.int32)
    host = G.HostLens([c["chunk"]], [total], [0])
    starts = torch.zeros(1, device="cuda", dtype=torch.int32)
    per_key = hkv * 2 * D * 2
    for name, gran in formats:
        fmt = KVFormat(name, gran) if name != "bf16" else KVFormat(name)
        kc, vc, bt = _paged_pair(k, v, fmt, hkv, P, total)
        pick = G.choose_route("auto", host, hq // hkv, per_key, G.DEFAULT_WORKSPACE_BYTES)
        for route in ("paged", "gather"):
            def run(kc=kc, vc=vc, bt=bt, route=route):
                return G.chunk_prefill_attention(q, kc, vc, bt, cu_q, seq_lens, scale,
                                                 route=route, host=host)[0]
            label = "in-kernel paged" if route == "paged" else "gather + varlen"
            row = try_time(run, rows, f"chunk {label}, {name} pages (P={P})", flops,
                           check=lambda run=run: rel_err(run().float(), ref))
            row["vs_contiguous_bf16"] = base["ms"] / row["ms"]
            row["auto_picks"] = pick.route
        if name == "fp8_e4m3":   # a workspace bound below the prefix: pieces merged by LSE
            def pieces(kc=kc, vc=vc, bt=bt):
                return G.chunk_prefill_attention(q, kc, vc, bt, cu_q, seq_lens, scale,
                                                 route="gather", host=host,
                                                 workspace_bytes=48 << 20)[0]
            row = try_time(pieces, rows, f"chunk gather in 48 MiB pieces + LSE merge, {name} "
                           f"pages", flops, check=lambda: rel_err(pieces().float(), ref))
            row["vs_contiguous_bf16"] = base["ms"] / row["ms"]
        page_bytes = sum(t[0].numel() * t.element_size() for t in (kc.data, kc.scale, kc.micro)
                         if t is not None and t.dim() > 1)
        moved = 2 * (total // P * page_bytes + total * hkv * D * 2)  # K, V: pages in, bf16 out

        def gather(kc=kc, vc=vc, bt=bt):
            G.gather_pages(kc, bt, starts, cu_k, total, total, torch.bfloat16)
            G.gather_pages(vc, bt, starts, cu_k, total, total, torch.bfloat16)
        row = try_time(gather, rows, f"gather alone (K+V -> bf16), {name} pages", 0.0)
        row["gbps"] = moved / row["ms"] / 1e6
        del kc, vc
    if not sdpa:
        return rows
    from torch.nn.attention.bias import causal_lower_right

    qb = q[None].transpose(1, 2)
    kb, vb = (x[None].transpose(1, 2).repeat_interleave(hq // hkv, 1) for x in (k, v))
    bias = causal_lower_right(c["chunk"], total)
    for be in ("cudnn", "flash"):
        run = sdpa_backend(be)
        try_time(lambda run=run: run(qb, kb, vb, attn_mask=bias, scale=scale), rows,
                 f"sdpa {be} (bf16, causal_lower_right, K/V repeated)", flops)
    return rows


def env_info() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return dict(date=time.strftime("%Y-%m-%d"), gpu=p.name, sms=p.multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), python=platform.python_version())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm-flex", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chunk-only", action="store_true",
                    help="only the chunked prefill rows (bf16 / fp8 / fp4 pages, paged and "
                         "gathered routes; with short chunks unless --quick)")
    ap.add_argument("--budget", type=float, default=170.0,
                    help="seconds; past it, print every thread's stack (a hung kernel) and exit")
    args = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(args.budget, exit=True)
    if args.warm_flex:
        for s in SHAPES:
            x = torch.randn(s["B"], s["hq"], s["L"], D, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(s["B"], s["hkv"], s["L"], D, device="cuda", dtype=torch.bfloat16)
            flex_fn(s["L"], s["hq"], s["hkv"])(x, kv, kv)
        torch.cuda.synchronize()
        return 0
    info = env_info()
    print(json.dumps(info), flush=True)
    results = {}
    for s in ([] if args.chunk_only else SHAPES):
        results[s["name"]] = bench_shape(s, args.quick)
    results["chunk 2048 over 30720 paged, GQA 32/8"] = bench_chunk(args.quick)
    if args.chunk_only and not args.quick:   # the route rule's threshold: short chunks
        for n in (64, 256):
            results[f"chunk {n} over 30720 paged, GQA 32/8"] = bench_chunk(
                True, chunk=n, formats=[("fp8_e4m3", "page")], sdpa=False)
    tuned = {str(k): v for k, v in {**L.VARLEN_TUNER.timings, **L.PAGED_TUNER.timings}.items()}
    report(info, results, tuned)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, results=results, tuner=tuned), f, indent=1, default=str)
    return 0


def report(info, results, tuned):
    print(f"\n## Prefill, {info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
          f"{info['date']}")
    print("| shape | variant | ms | TFLOP/s | x cuDNN | note |")
    print("|---|---|---|---|---|---|")
    for shape, rows in results.items():
        cud = next((r for r in rows if r["name"].startswith("sdpa cudnn")), None)
        for r in rows:
            ratio = cud["ms"] / r["ms"] if cud and cud["ms"] == cud["ms"] else float("nan")
            note = r.get("error", "")
            for key in ("diff_vs_cudnn", "vs_contiguous_bf16", "quantize_ms_torch", "gbps"):
                if isinstance(r.get(key), float):
                    note += f" {key}={r[key]:.3g}"
            if r.get("auto_picks"):
                note += f" auto_picks={r['auto_picks']}"
            print(f"| {shape} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                  f"{ratio:.2f} | {note.strip()} |")
    print("\nTuner timings (ms per config, per key):")
    for key, t in tuned.items():
        print(" ", key[:150], {c: round(ms, 3) for c, ms in t.items()})


if __name__ == "__main__":
    sys.exit(main())
