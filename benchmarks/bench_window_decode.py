"""One decode attention layer as an Engine step runs it (eviction in the Engine): without
eviction at the full length, without eviction at half the length, and SinkWindow at half the length with its key mask
(sinks at their text positions: the zero-copy window path, eviction/runtime.py `_evict_window`),
through the packed decode path (runtime/dispatch.py `_packed_decode`: what a SinkWindow step runs
since branch sink19d) and through the previous aside path (eviction/aside.py before sink19d: the
key mask widened into uint8 by the sm_90 kernel on every layer, the output cast to fp32 and
back to bf16).

    python benchmarks/bench_window_decode.py                 # H200: B16, L4096, fp8 token
    TRITON_INTERPRET=1 python benchmarks/bench_window_decode.py --smoke   # CPU: the script runs

Llama-3-8B's layer (32 q / 8 kv heads, head_dim 128), bf16 q, fp8_e4m3 pages with token scales,
pages of 16, block tables as wide as the Engine's (`--width` tokens: the prompt plus the new
tokens). Each row's op sequence per layer: q [1, Hq, B, D] -> [B, Hq, 1, D] contiguous, the
decode kernel (backend "auto": the CUDA kernel for fp8 on sm_90), the output back to
[1, Hq, B, Dv] and made contiguous in q's dtype (attention_op `_as_promised`). Times in
microseconds, medians: `eager` triton.testing.do_bench (host launches included), `graph`
do_bench_cudagraph (the ops replayed in a CUDA graph, as the Engine's decode steps are). The
key mask's construction (once per step for all layers, aside.py `AsideInputs.key_mask`) is
timed apart.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_rot_decode import fp8_token_pages  # noqa: E402
from kvcompile.eviction.aside import AsideInputs, AsideSpec  # noqa: E402
from kvcompile.kernels.decode import paged_decode_attention  # noqa: E402


def _layer(q, kc, vc, bt, lens, scale, key_mask=None, aside=False):
    """One layer's attention ops (the module docstring); aside: the previous aside path's."""
    def run():
        qd = q[0].transpose(0, 1).unsqueeze(2).contiguous()
        out = paged_decode_attention(qd, kc, vc, bt, lens, scale, key_mask=key_mask,
                                     direct=True)
        if aside:
            out = out.float()
        out = out.squeeze(2).transpose(0, 1).unsqueeze(0)
        if out.dtype != q.dtype:
            out = out.to(q.dtype)
        return out.contiguous()
    return run


def _time(fn, smoke: bool, graph: bool) -> float:
    fn()
    if smoke:
        return float("nan")
    import triton.testing

    if graph:   # (on a side stream of its own)
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (full length)")
    p.add_argument("--width", type=int, default=4096 + 256, help="block-table capacity, tokens")
    p.add_argument("--sinks", type=int, default=4)
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    Hq, Hkv, D, P = (32, 8, 128, 16) if not args.smoke else (4, 2, 64, 16)
    B, L, Wt = (args.batch, args.length, args.width) if not args.smoke else (2, 96, 128)
    W = -(-Wt // P)
    gen = torch.Generator(device=dev).manual_seed(0)
    kc, vc, bt = fp8_token_pages(B, W, Hkv, D, P, dev, gen)
    q = torch.randn(1, Hq, B, D, device=dev, generator=gen).to(torch.bfloat16)
    scale = D ** -0.5
    half = L // 2
    # SinkWindow at half: the sinks' page, its hidden tail [sinks, P) and the window (half - P
    # tokens after it, in the pages that follow: the pages in between left the table)
    lo, hi = args.sinks, P
    stored = half + (hi - lo)
    full = torch.full((B,), L, dtype=torch.int32, device=dev)
    halfl = torch.full((B,), half, dtype=torch.int32, device=dev)
    winl = torch.full((B,), stored, dtype=torch.int32, device=dev)
    lo_t = torch.full((B,), lo, dtype=torch.int64, device=dev)
    hi_t = torch.full((B,), hi, dtype=torch.int64, device=dev)
    width = -(-(-(-lo // P) * P + P) // 16) * 16   # aside_inputs' mask width
    inputs = AsideInputs(AsideSpec(hidden=width), lo_t, lo_t, lo_t, lo_t, hi_t)
    mask = inputs.key_mask()
    # the previous aside path: a mask the sm_90 kernel widens on every layer (before sink19d
    # `_padded_mask` copied every mask; a non-contiguous one still takes that copy)
    wide = torch.ones(B, width + 16, dtype=torch.bool, device=dev)
    wide[:, :width] = mask
    old_mask = wide[:, :width]
    half_bt = bt[:, :-(-stored // P)].contiguous()
    rows = [
        ("no eviction, full length", _layer(q, kc, vc, bt, full, scale)),
        ("no eviction, half length", _layer(q, kc, vc, bt, halfl, scale)),
        ("SinkWindow half, packed path + key mask (sink19d)",
         _layer(q, kc, vc, bt, winl, scale, mask)),
        ("SinkWindow half, previous aside path", _layer(q, kc, vc, bt, winl, scale, old_mask,
                                                        aside=True)),
        ("no eviction, half length, table of half width",
         _layer(q, kc, vc, half_bt, halfl, scale)),
        ("key mask build (once per step)", inputs.key_mask),
    ]
    # the two SinkWindow paths give the same output (the same kernel, the same mask)
    new, old = rows[2][1](), rows[3][1]()
    if not torch.equal(new, old):
        raise SystemExit(f"the SinkWindow paths differ: max {(new - old).abs().max().item()}")
    if not args.smoke:
        import triton

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}; B{B}, L {L}, table {W * P} tokens, fp8_e4m3 "
              f"token scales, 32/8 heads, D 128, page {P}")
    print("| row | eager us | graph us | graph vs full length |")
    print("|---|---|---|---|")
    base = None
    for name, fn in rows:
        te, tg = _time(fn, args.smoke, False), _time(fn, args.smoke, True)
        base = tg if base is None else base
        print(f"| {name} | {te:.1f} | {tg:.1f} | {tg / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
