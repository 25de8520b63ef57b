"""The CUDA decode kernel (kernels/decode_sm90.py) on the H200: speed.

    python benchmarks/gpu_decode_fast.py [--waves 2,4,8] [--variants base,qk8] [--out DIR]
                                                                     # gpu_jobs.sh decode_fast

Decode time relative to torch SDPA over contiguous bf16 (same process), the CUDA kernel and the
Triton kernel side by side, medians of CUDA-graph replays; results in DIR/gpu_decode_fast.json.
Its correctness and long-context accuracy checks (formerly --check / --accuracy) are
tests/gpu/test_decode_sm90_gpu.py.

--variants: the CUDA kernel variants timed, comma-separated: base (the default launch, rows
"cuda" or, where decode_sm90.default_variant is not base, "cuda[pvt4h]" beside a "cuda base"
row of the base kernel by name), qk8 (the
opt-in qk_fp8 variant: q.k on e4m3 tensor cores; e4m3-key formats only, rows labelled
"cuda qk8"), and the issue-14 compile-time variants decode_sm90.VARIANTS (nocap, aluk, aluv,
alu; rows labelled "cuda <name>"; launched through launch_decode_sm90(variant=...), the same
kernel and split rule as base). Default: base. --formats / --shapes narrow the rows (comma-separated names of
BENCH_FORMATS as fmt/gran, of SHAPES); --no-triton drops the Triton rows; --key-mask makes
every launch read an all-True key mask [B, L + 1], as a decode step of HF generate does (the
mask's cost: compare with a run without it).
int4/channel rows: the Pareto table's K int4/V int4 (keys' scale + zero point per page and
channel, values' per token) in pages of --int4-pages tokens (default 64, the table's P64; no
Triton row under 32, which that kernel refuses for int channel scales).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.kernels import decode as dec  # noqa: E402
from kvcompile.kernels import decode_sm90 as fast  # noqa: E402
from tests.kernels.kernel_cases import FAST_FORMATS, make_format  # noqa: E402
from tests.kernels.kernel_cases import launch_backend as _launch  # noqa: E402

DEV = "cuda"


def warm_builds(qk8: bool = False, variants=(), formats=()) -> float:
    """Compile every variant the bench uses, in parallel (only those of `formats`, names
    "fmt/gran", where given); returns seconds."""
    t0 = time.perf_counter()
    keys = set()

    def asked(kf, kg):
        return not formats or f"{kf}/{kg}" in formats

    for (kf, kg), d, rows, qt in itertools.product(FAST_FORMATS, (64, 128), (8, 16),
                                                    (torch.float32, torch.bfloat16)):
        if not asked(kf, kg):
            continue
        kk = fast._KIND[kf]
        sm = fast._SCALE[kg] if kk < 2 else 0
        keys.add((kk, kk, sm, sm, d, d, rows, fast._QT[qt]))
        if qk8 and kf == "fp8_e4m3":
            keys.add((kk, kk, sm, sm, d, d, rows, fast._QT[qt], 1))
        for v in variants:  # only what bench() times: G 4 x Sq 1 (8 rows), bf16 q
            var = fast.variant_bits(v, kk, kk, 0.0, rows=rows)
            if var and rows == 8 and qt == torch.bfloat16:
                keys.add((kk, kk, sm, sm, d, d, rows, fast._QT[qt], 0, var))
    if not formats:
        keys.add((0, 3, 1, 0, 128, 128, 8, 1))  # K fp8 / V bf16
    for d, rows, qt in itertools.product((64, 128), (8, 16), (torch.float32, torch.bfloat16)):
        if not asked("int4", "channel"):
            break
        keys.add((*_kinds("int4", "channel"), d, d, rows, fast._QT[qt]))
        for v in variants:  # int4 K channel / V token rows of the variants (cuda14h)
            var = fast.variant_bits(v, fast.INT4, fast.INT4, 0.0, rows=rows)
            if var and rows == 8 and qt == torch.bfloat16:
                keys.add((*_kinds("int4", "channel"), d, d, rows, fast._QT[qt], 0, var))
    keys = fast.with_default_variants(keys)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: fast._kernel(*k), sorted(keys)))
    return time.perf_counter() - t0


SHAPES = {"B64_L8k": (64, 8192, 32, 8, 128), "B16_L32k": (16, 32768, 32, 8, 128),
          "B1_L128k": (1, 131072, 32, 8, 128), "D64_B64_L8k": (64, 8192, 32, 8, 64)}
BENCH_FORMATS = [("bf16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
                 ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("int4", "channel")]
# keys' format -> the values' (default: the same)
VALUE_FORMAT = {("int4", "channel"): ("int4", "token")}


def _kinds(kf: str, kg: str) -> tuple[int, int, int, int]:
    """(kk, vk, ksm, vsm) of the variant a BENCH_FORMATS row runs."""
    vf, vg = VALUE_FORMAT.get((kf, kg), (kf, kg))

    def mode(f, g, side):
        if f == "int4":
            return fast._SC_CHANZP if side == "k" else fast._SC_TOKZP
        return fast._SCALE[g] if f.startswith("fp8") else 0

    return fast._KIND[kf], fast._KIND[vf], mode(kf, kg, "k"), mode(vf, vg, "v")


def _bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def _launch_variant(q, kc, vc, bt, sl, out, variant, splits=0, key_mask=None):
    """One launch of an issue-14 variant (decode_sm90.VARIANTS) straight through the launcher."""
    return fast.launch_decode_sm90(
        q, kc.data, kc.scale, vc.data, vc.scale, bt, sl, key_mask, out, kc.fmt.name,
        kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity, 1.0 / q.shape[-1] ** 0.5, 0, 0,
        0.0, splits, dec._sm_count(q.device), dec._combine, kz=kc.zero, vz=vc.zero,
        variant=variant)


def _random_pages(f, N, Hkv, P, D, gen):
    c = f.allocate(N, Hkv, P, D, DEV)
    if c.data.dtype in (torch.bfloat16, torch.float16):
        c.data.normal_(generator=gen)
    elif c.fmt.is_int:
        c.data.copy_(torch.randint(0, 256, c.data.shape, device=DEV, generator=gen))
        c.zero.copy_(torch.randn(c.zero.shape, device=DEV, generator=gen) * 0.1)
    else:
        for ch in c.data.split(max(1, N // 8)):
            ch.copy_((torch.randn(ch.shape, device=DEV, generator=gen) * 60).to(ch.dtype))
    if c.scale is not None:
        c.scale.copy_(torch.rand(c.scale.shape, device=DEV, generator=gen) * 0.01 + 0.01)
    return c


def random_case(kf: str, kg: str, B: int, L: int, Hkv: int, D: int, P: int, gen):
    """A row's pages: keys' and values' formats (VALUE_FORMAT), random pages for B full
    sequences of L tokens, block tables a random permutation -> (f, vf, kc, vc, bt, sl)."""
    npg = B * (L // P)
    f, vf = make_format(kf, kg), make_format(*VALUE_FORMAT.get((kf, kg), (kf, kg)))
    kc = _random_pages(f, npg, Hkv, P, D, gen)
    vc = _random_pages(vf, npg, Hkv, P, D, gen)
    bt = torch.randperm(npg, device=DEV, generator=gen).to(torch.int32).view(B, -1)
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    return f, vf, kc, vc, bt, sl


def sdpa_baseline(B: int, L: int, Hq: int, Hkv: int, D: int, gen) -> tuple[torch.Tensor, float]:
    """The ratios' baseline at a shape: q [B, Hq, 1, D] and the ms of torch SDPA over
    contiguous bf16 keys / values of L tokens (GQA), which are freed after."""
    import torch.nn.functional as F

    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    return q, _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def bench(gen, waves_list, variants=("base",), formats=None, shapes=None,
          triton=True, int4_pages=(64,), key_mask=False) -> list[dict]:
    rows = []
    for name, (B, L, Hq, Hkv, D) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        q, t_sdpa = sdpa_baseline(B, L, Hq, Hkv, D, gen)
        kv_bf16 = 2 * B * L * Hkv * D * 2
        rows.append({"shape": name, "row": "sdpa bf16", "ms": t_sdpa, "x": 1.0,
                     "TB/s": kv_bf16 / t_sdpa / 1e9})
        rows_of = [(f0, g0, p0) for f0, g0 in BENCH_FORMATS
                   for p0 in (int4_pages if f0 == "int4" else (16,))]
        for kf, kg, P in rows_of:
            if formats and f"{kf}/{kg}" not in formats:
                continue
            f, vf, kc, vc, bt, sl = random_case(kf, kg, B, L, Hkv, D, P, gen)
            # --key-mask: every launch also reads an all-True key row [B, L + 1] (what a
            # decode step of HF generate passes: the step's 2-D mask, one column past the
            # cached keys), to time the mask's cost against the same launch without it
            km = torch.ones(B, L + 1, dtype=torch.bool, device=DEV) if key_mask else None
            out = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
            stored = B * L * (f.bytes_per_token(Hkv, D, P) + vf.bytes_per_token(Hkv, D, P))
            fname = f"{kf}/{kg}" + (f" P{P}" if P != 16 else "")
            # the Triton kernel refuses int channel scales in pages under 32 (channel_min_page)
            tri_ok = kg != "channel" or P >= dec.channel_min_page(kf)
            runs = [("triton", False)] if triton and tri_ok else []
            runs += [("cuda", False)] if "base" in variants else []
            runs += [("cuda", True)] if "qk8" in variants and kf == "fp8_e4m3" else []
            # "base" also times the base kernel by name where the default launch runs another
            # variant (decode_sm90.default_variant: pvt4h for fp8 page / tensor scales)
            dflt = fast.default_variant(*_kinds(kf, kg))
            runs += [("cuda", v) for v in variants if v in fast.VARIANTS and v != dflt
                     and (v != "base" or dflt != "base")]
            for backend, qk8 in runs:
                ws = [None] if backend == "triton" else [None] + waves_list
                if isinstance(qk8, str):  # an issue-14 variant: its own split choice only
                    t = _bench(functools.partial(_launch_variant, q, kc, vc, bt, sl, out, qk8,
                                                 key_mask=km))
                    rows.append({"shape": name, "row": f"{kf}/{kg} cuda {qk8} auto",
                                 "ms": t, "x": t / t_sdpa, "TB/s": stored / t / 1e9})
                    continue
                for w in ws:
                    splits = 0  # the CUDA kernel's own choice (decode_sm90.choose_splits)
                    if w is not None:
                        splits = fast.choose_splits(B, Hkv, bt.shape[1] * P,
                                                    dec._sm_count(q.device), waves=w)
                    t = _bench(functools.partial(_launch, q, kc, vc, bt, sl, out, backend,
                                                 splits=splits, qk_fp8=qk8, key_mask=km))
                    if backend == "cuda" and w is None:
                        splits = fast.choose_splits(
                            B, Hkv, bt.shape[1] * P, dec._sm_count(q.device),
                            ctas_per_sm=fast.kernel_constants(*_kinds(kf, kg), D, D, 8,
                                                     fast._QT[q.dtype])[1])
                    label = ("" if backend == "triton" else
                             f" auto splits={splits}" if w is None else
                             f" waves={w} splits={splits}")
                    tag = f"{backend} qk8" if qk8 else backend if backend == "triton" else (
                        f"cuda[{dflt}]" if dflt != "base" else "cuda")
                    rows.append({"shape": name, "row": f"{fname} {tag}{label}",
                                 "ms": t, "x": t / t_sdpa, "TB/s": stored / t / 1e9})
            del kc, vc
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", default="2,4,8", help="'' for none")
    ap.add_argument("--variants", default="base",
                    help="base,qk8 and/or " + ",".join(v for v in fast.VARIANTS if v != "base"))
    ap.add_argument("--formats", default="", help="e.g. fp8_e4m3/page,fp8_e4m3/tensor")
    ap.add_argument("--shapes", default="", help="e.g. B64_L8k,B1_L128k")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--int4-pages", default="64", help="page sizes of the int4 rows, e.g. 16,64")
    ap.add_argument("--key-mask", action="store_true",
                    help="every launch reads an all-True key mask (generate's decode steps)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    known = {"qk8"} | set(fast.VARIANTS)
    bad = set(variants) - known
    if bad:
        ap.error(f"--variants: unknown {sorted(bad)}; take some of {sorted(known)}")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    formats = [f for f in a.formats.split(",") if f]
    res["build_s"] = warm_builds(qk8="qk8" in variants,
                                 variants=[v for v in variants if v in fast.VARIANTS],
                                 formats=formats)
    print(f"built variants in {res['build_s']:.1f} s", flush=True)
    gen_cuda = torch.Generator(device=DEV).manual_seed(1)
    waves = [float(w) for w in a.waves.split(",") if w]
    res["bench"] = bench(gen_cuda, waves, variants, formats,
                         [s for s in a.shapes.split(",") if s], not a.no_triton,
                         [int(p) for p in a.int4_pages.split(",") if p], a.key_mask)
    if a.key_mask:
        print("every launch read an all-True key mask [B, L + 1]")
    print(f"{'shape':12s} {'row':46s} {'ms':>8s} {'x sdpa':>7s} {'TB/s':>6s}")
    for r in res["bench"]:
        print(f"{r['shape']:12s} {r['row']:46s} {r['ms']:8.4f} {r['x']:7.3f} "
              f"{r['TB/s']:6.2f}")
    with open(os.path.join(a.out, "gpu_decode_fast.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
