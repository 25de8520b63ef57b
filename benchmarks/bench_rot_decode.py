"""One decode attention layer with re-rotated sinks scored inside the kernel (kernels/decode.py
`rot`, eviction/aside.py) against the same kernel without them and the CUDA kernel that decode
steps without eviction take for fp8 pages.

    python benchmarks/bench_rot_decode.py              # H200
    TRITON_INTERPRET=1 python benchmarks/bench_rot_decode.py --smoke   # CPU: the script runs

Shapes: bench_generate's Llama-3-8B layer (32 q / 8 kv heads, head_dim 128) and SmolLM2's
(9 / 3, head_dim 64), B=16, kept tokens L (2048: half of bench_generate's 4096-token prompt,
as SinkWindow at 50% keeps; and 4096), pages of 16, fp8_e4m3 with token scales, 4 sinks in
every row. Rows: `cuda` the sm_90 CUDA kernel (backend "auto", what a step without eviction
runs), `triton` the Triton kernel, `triton+rot` the Triton kernel with the rotated sinks
(what a re-rotated SinkWindow step runs), `rot masked` the same with the kernel's ROT_PEEL
off (one loop masks the rotated keys instead of a loop of their own: fewer registers, more
instructions per tile), `rot prep` the per-step torch work beside it
(sink_rotation: cos / sin from the shifts, once per step for all layers). Times: the median of
triton.testing.do_bench, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.eviction.aside import sink_rotation  # noqa: E402
from kvcompile.kernels.decode import launch_decode, paged_decode_attention  # noqa: E402

SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}   # Hq, Hkv, head_dim


def fp8_token_pages(B: int, W: int, Hkv: int, D: int, P: int, dev, gen):
    """Random fp8 e4m3 K and V pages with token scales, W pages per row in shuffled order
    (also bench_window_decode.py's) -> (k_cache, v_cache, block_tables [B, W] int32)."""
    fmt = KVFormat("fp8_e4m3", "token")
    caches = []
    for _ in range(2):
        c = fmt.allocate(B * W, Hkv, P, D, dev)
        c.data.copy_((torch.randn(c.data.shape, device=dev, generator=gen) * 60)
                     .to(c.data.dtype))
        c.scale.copy_(torch.rand(c.scale.shape, device=dev, generator=gen) * 0.01 + 1e-3)
        caches.append(c)
    bt = torch.randperm(B * W, device=dev, generator=gen).view(B, W).int()
    return caches[0], caches[1], bt


def _time(fn, smoke: bool) -> float:
    fn()
    if smoke:
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def _row(Hq: int, Hkv: int, D: int, L: int, B: int, sinks: int, dev, smoke: bool) -> list:
    """Times (us) of one layer's decode: cuda, triton, triton+rot, the same with ROT_PEEL off,
    rot prep."""
    gen = torch.Generator(device=dev).manual_seed(0)
    kc, vc, bt = fp8_token_pages(B, -(-L // 16), Hkv, D, 16, dev, gen)
    sl = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, 1, D, device=dev, generator=gen).to(torch.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    shift = torch.full((B,), L, dtype=torch.int64, device=dev)
    cos, sin = sink_rotation(inv_freq, shift)
    rot = (torch.full((B,), sinks, dtype=torch.int64, device=dev), cos, sin)

    def run(backend, rot=None):
        return lambda: paged_decode_attention(q, kc, vc, bt, sl, D ** -0.5, direct=True,
                                              backend=backend, rot=rot)

    out = torch.empty_like(q)

    def masked():   # rot with ROT_PEEL off: one loop that masks the rotated keys
        launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, sl, None,
                      None, out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name,
                      vc.fmt.granularity, D ** -0.5, 0, 0, 0.0, 0, {"ROT_PEEL": 0},
                      backend="triton", rot=rot)

    return [float("nan") if smoke else _time(run("auto"), smoke),
            _time(run("triton"), smoke), _time(run("triton", rot), smoke), _time(masked, smoke),
            _time(lambda: sink_rotation(inv_freq, shift), smoke)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--lens", default="2048,4096")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sinks", type=int, default=4)
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    lens = [40] if args.smoke else [int(x) for x in args.lens.split(",")]
    B = 2 if args.smoke else args.batch
    if not args.smoke:
        import triton

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}")
    print("| shape | L | cuda us | triton us | triton+rot us | rot masked us | rot prep us "
          "| triton+rot / cuda | triton+rot / triton |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (Hq, Hkv, D) in SHAPES.items():
        for L in lens:
            t_cuda, t_tri, t_rot, t_mask, t_prep = _row(Hq, Hkv, D, L, B, args.sinks, dev,
                                                        args.smoke)
            print(f"| {name} B{B} | {L} | {t_cuda:.1f} | {t_tri:.1f} | {t_rot:.1f} | "
                  f"{t_mask:.1f} | {t_prep:.1f} | {t_rot / t_cuda:.2f} | {t_rot / t_tri:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
