"""Full correctness matrix of the decode and append kernels, on the GPU (H200).

    python benchmarks/gpu_check_decode.py [--shard I --shards N] [--quick]
    python benchmarks/gpu_check_decode.py --only decode-only-formats --quick   # int / mixed K-V
    python benchmarks/gpu_check_decode.py --half H --halves 2 --shard I --shards 16 --budget 330
    python benchmarks/gpu_check_decode.py --plan [--halves 2 --shards 16]   # print the split only
    bash benchmarks/run_decode_check_gpu.sh          # SHARDSET=0 / 1 / all: the runner

Decode: every storage format and scale granularity (int4 / int3 / int2 and channel scales
included) x head_dim {64, 128, 256} x GQA ratio {1, 4, 8} x page size {16, 32, 64, 128} x Sq
{1, 3, 8}, odd and mixed lengths in each batch, against the fp32 reference
(kernels/reference.py) on fresh random inputs, outputs poisoned with NaN before each launch;
plus masks (window + sinks, key_mask, softcap), the attention mass, one split (direct write)
and many splits, K / V in different formats, and bf16 residual pages. Append: bit-exact with
PagedTensor.write for every format it writes, granularity and head_dim, bulk and decode-style
appends. Exit status 1 if any case fails or is skipped.

Sharding: Triton compiles dominate the wall time (almost every case is its own kernel
specialization: 175 decode binaries for the 180 decode cases of the full matrix, and 125
append binaries for its 67 append cases). Cases are grouped by
everything that selects a binary (spec_key: every field but the lengths), each group gets an
estimated cost (est_seconds), and the groups are dealt largest first to the least loaded half,
then within the half to the least loaded shard (plan()). So the halves and the shards compile
disjoint sets of the main kernel's specializations, and every process computes the same plan.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import traceback

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import os  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.kernel_cases import (  # noqa: E402
    append_slot_steps,
    assert_same_storage,
    make_format,
    run_case,
    storage_pair,
)

FORMATS = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
           ("fp8_e4m3", "tensor"), ("fp8_e5m2", "page"), ("fp8_e5m2", "token"),
           ("fp4_e2m1", "page"), ("fp4_e2m1", "token"), ("fp4_e2m1", "tensor")]
# Read by the decode kernel only (the append kernel leaves them to PagedTensor.write).
DECODE_ONLY = [("int4", "page"), ("int4", "token"), ("int4", "channel"), ("int3", "page"),
               ("int3", "token"), ("int3", "channel"), ("int2", "page"), ("int2", "token"),
               ("int2", "channel"), ("fp8_e4m3", "channel"), ("fp8_e5m2", "channel"),
               ("fp4_e2m1", "channel")]


def decode_cases(quick: bool):
    geo = [(1, 16, 1), (4, 32, 3), (8, 128, 1), (4, 16, 8), (8, 64, 1), (1, 128, 3)]
    cases = []
    for i, ((name, gran), D) in enumerate(itertools.product(FORMATS + DECODE_ONLY,
                                                            (64, 128, 256))):
        for j in range(1 if quick else 2):
            G, P, Sq = geo[(i + 3 * j) % len(geo)]
            if name.startswith("int") and gran == "channel":
                P = max(P, 32)  # the kernel refuses smaller pages (decode.channel_min_page)
            lens = [1 + (37 * i + 11 * j) % 300, 777 + 13 * i, 2 * P + 5, 4000 + 97 * j]
            cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq, lens=lens))
    extra = [
        dict(kf="fp8_e4m3", vf="fp4_e2m1", gran="page", D=128, G=4, P=16, Sq=1, lens=[900, 33]),
        dict(kf="bf16", vf="fp8_e5m2", gran="token", D=64, G=8, P=32, Sq=2, lens=[513, 7000]),
        dict(kf="fp4_e2m1", vf="fp4_e2m1", gran="page", D=128, G=4, P=16, Sq=4, lens=[3000, 61],
             window=500, sinks=4, softcap=30.0, with_mass=True),
        dict(kf="fp8_e4m3", vf="fp8_e4m3", gran="page", D=128, G=4, P=16, Sq=1,
             lens=[2048, 999], key_mask=True, with_mass=True),
        dict(kf="bf16", vf="bf16", gran="page", D=128, G=4, P=16, Sq=1, lens=[4096, 100],
             splits=1),
        dict(kf="fp8_e5m2", vf="fp8_e5m2", gran="tensor", D=256, G=8, P=16, Sq=1,
             lens=[20000], splits=300),
        dict(kf="bf16", vf="bf16", gran="page", D=128, G=4, P=16, Sq=1, lens=[5000, 70],
             q_dtype=torch.bfloat16, window=1000, sinks=1),
        # issue 9: K / V in different formats and granularities, residual pages
        dict(kf="int4", vf="int4", gran="channel", vgran="token", D=128, G=4, P=64, Sq=1,
             lens=[4001, 77, 64]),
        dict(kf="int4", vf="int4", gran="channel", vgran="token", D=64, G=1, P=64, Sq=3,
             lens=[1000, 5], residual=True),
        dict(kf="int4", vf="fp4_e2m1", gran="channel", vgran="page", D=128, G=4, P=64, Sq=1,
             lens=[3000, 130], residual=True),
        dict(kf="int2", vf="int2", gran="channel", vgran="token", D=128, G=8, P=64, Sq=1,
             lens=[2500, 63], window=700, sinks=4, with_mass=True),
        dict(kf="int3", vf="int3", gran="channel", vgran="token", D=128, G=4, P=32, Sq=2,
             lens=[1800, 17], key_mask=True, residual=True),
        dict(kf="int4", vf="int4", gran="token", vgran="page", D=64, G=1, P=16, Sq=1,
             lens=[1000, 21], config=dict(BLOCK_T=16)),  # bumped to 32-token tiles
        dict(kf="fp8_e4m3", vf="fp8_e4m3", gran="channel", vgran="token", D=128, G=4, P=64,
             Sq=1, lens=[6000, 300], residual=True, q_dtype=torch.bfloat16),
        dict(kf="fp4_e2m1", vf="fp4_e2m1", gran="channel", vgran="page", D=128, G=4, P=32,
             Sq=1, lens=[2222, 31], softcap=30.0),
        dict(kf="int4", vf="int2", gran="token", vgran="page", D=128, G=4, P=16, Sq=1,
             lens=[3000, 41], config=dict(BLOCK_T=128, num_stages=1, SPLIT=1, num_warps=4)),
    ]
    return cases + extra


DEV = "cuda"


def config_cases():
    """Every tile variant bench_decode.py may pick, checked before its timing is trusted."""
    from benchmarks.bench_decode import VARIANTS

    fmts = {"bf16": [("bf16", "page")], "fp8": [("fp8_e4m3", "page"), ("fp8_e5m2", "token")],
            "fp4": [("fp4_e2m1", "page")]}
    cases = []
    for fam, variants in VARIANTS.items():
        if fam == "int":  # the bench's int rows: K channel, V token or fp4 page, pages of 64
            for cfg in variants:
                cases += [dict(kf="int4", vf="int4", gran="channel", vgran="token", D=128, G=4,
                               P=64, Sq=1, lens=[1500, 37, 640], config=dict(cfg)),
                          dict(kf="int2", vf="fp4_e2m1", gran="channel", vgran="page", D=64,
                               G=8, P=64, Sq=3, lens=[900, 5], config=dict(cfg))]
            continue
        for cfg in variants:
            for k, (name, gran) in enumerate(fmts[fam]):
                D, G, P, Sq = ((128, 4, 16, 1), (64, 8, 32, 3))[k % 2]
                cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq,
                                  lens=[1500, 37, 640], config=dict(cfg)))
                if fam != "fp8":
                    D, G, P, Sq = 64, 8, 32, 3
                    cases.append(dict(kf=name, vf=name, gran=gran, D=D, G=G, P=P, Sq=Sq,
                                      lens=[900, 5], config=dict(cfg)))
    return cases


def check_decode(c, gen) -> str:
    c = dict(c)
    km = None
    if c.pop("key_mask", False):
        km = torch.rand(len(c["lens"]), max(c["lens"]) - 3, generator=gen) > 0.2
        km = km.to(DEV)
    kf, vf, gran = c.pop("kf"), c.pop("vf"), c.pop("gran")
    vgran, res = c.pop("vgran", gran), c.pop("residual", False)
    lens, D, G, P = c.pop("lens"), c.pop("D"), c.pop("G"), c.pop("P")
    err, bound, _, (mass, mass_ref) = run_case(make_format(kf, gran, res),
                                                make_format(vf, vgran, res), lens, 2, G, D, P,
                                                key_mask=km, device=DEV, gen=gen, **c)
    ok = err <= bound
    msg = f"err {err:.2e} <= {bound:.1e}"
    if mass is not None:
        merr = float((mass - mass_ref).norm() / mass_ref.norm())
        ok = ok and merr <= 1e-3
        msg += f", mass err {merr:.1e}"
    if not ok:
        raise AssertionError(msg)
    return msg


def append_cases(quick: bool):
    cases = [dict(name=n, gran=g, D=D, P=P) for (n, g), D, P in itertools.product(
        FORMATS, (64, 128, 256), (16,) if quick else (16, 64))]
    bulk = [dict(name=n, gran=g, D=128, P=16, bulk=True) for n, g in FORMATS if g != "token"]
    return cases + bulk


def check_append(c, gen) -> str:
    from kvcompile.kernels.append import quantize_append

    H, P = 4, c["P"]
    steps = [1700, 1, 5, 300] if c.get("bulk") else [2 * P + 3, 1, 1, 5, 1, P + 1]
    per_seq = -(-sum(steps) // P)
    N = 3 * per_seq + 4
    ref, got = storage_pair(make_format(c["name"], c["gran"]), N, H, P, c["D"], DEV)
    perm = torch.randperm(N, generator=gen).tolist()
    pages = [perm[k * per_seq:(k + 1) * per_seq] for k in range(3)]
    for i, slots in enumerate(append_slot_steps(steps, P, pages, gen)):
        x = torch.randn(slots.numel(), H, c["D"], generator=gen) * (1.0 + 2.0 * i)
        x = x.to(torch.bfloat16 if i % 2 else torch.float32).to(DEV)
        ref.write(slots.to(DEV), x)
        quantize_append(got, slots.to(DEV), x)
        assert_same_storage(ref, got, f"write {i}")
    return "bit-exact"


def spec_key(kind: str, c: dict) -> tuple:
    """Everything of a case that selects a kernel binary (all fields but the lengths): cases
    with the same key reuse one compile, so they go to the same shard."""
    return (kind,) + tuple(sorted((k, repr(v)) for k, v in c.items() if k != "lens"))


def est_seconds(kind: str, c: dict) -> float:
    """Rough seconds of a case: the compile of its kernels dominates. Means per kind of case from
    compiling this whole matrix for sm_90 on a CPU (triton 3.9 + ptxas, one loaded core,
    2026-12: 1100 s in all, decode 1.5-25 s per case): plain pages 2.5 s; fp8 / fp4 3.3 s; channel
    scales 5 s (head_dim 256: 10 s); int codes 6-11 s; an append case 3.4 s (2-3 small kernels)."""
    if kind == "append":
        return 1.5 if c.get("bulk") else 3.4
    fmts = (c["kf"], c["vf"])
    channel = "channel" in (c["gran"], c.get("vgran"))
    if any(f.startswith("int") for f in fmts):
        t = 7.0 if channel else 6.0 + {256: 5.0, 128: 2.0}.get(c["D"], 0.0)
    elif channel:
        t = 5.0 + (4.0 if c["D"] == 256 else 0.0)
    elif any(f not in ("bf16", "fp16") for f in fmts):
        t = 3.3 + (0.7 if c["D"] == 256 else 0.0)
    else:
        t = 2.5
    return t + 0.5  # the run: inputs, reference, checks


def _deal(groups, bins: int):
    """Largest first onto the least loaded bin (LPT). groups: [(cost, first index, items)]."""
    load = [0.0] * bins
    out = [[] for _ in range(bins)]
    for cost, _, items in sorted(groups, key=lambda g: (-g[0], g[1])):
        b = min(range(bins), key=lambda i: (load[i], i))
        load[b] += cost
        out[b].append((cost, _, items))
    return out, load


def plan(work, halves: int, shards: int):
    """-> [half][shard] = list of (index, kind, case) in matrix order, and the estimated seconds
    [half][shard]. Same-key cases stay together; halves and shards are balanced by cost."""
    groups: dict[tuple, list] = {}
    for i, (kind, c) in enumerate(work):
        groups.setdefault(spec_key(kind, c), []).append((i, kind, c))
    glist = [(sum(est_seconds(k, c) for _, k, c in g), g[0][0], g) for g in groups.values()]
    by_half, _ = _deal(glist, halves)
    out, loads = [], []
    for hg in by_half:
        by_shard, load = _deal(hg, shards)
        out.append([sorted(x for _, _, g in sg for x in g) for sg in by_shard])
        loads.append(load)
    return out, loads


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--half", type=int, default=0,
                    help="which part of the matrix (0 .. halves-1): one device call each")
    ap.add_argument("--halves", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: start no case after this (the rest print SKIP and count as "
                         "not passed); 0 = no limit")
    ap.add_argument("--plan", action="store_true",
                    help="print the split (cases and estimated seconds per half and shard) "
                         "and exit")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["decode-only-formats"],
                    help="decode-only-formats: just the cases of the int / channel / residual "
                         "formats (K and V in different formats and scale granularities)")
    ap.add_argument("--cpu-smoke", type=int, default=0,
                    help="run the first N cases on the CPU interpreter with short sequences")
    a = ap.parse_args()
    t0 = time.time()
    work = ([("decode", c) for c in decode_cases(a.quick)]
            + [("decode", c) for c in config_cases()]
            + [("append", c) for c in append_cases(a.quick)])
    if a.only == "decode-only-formats":
        work = [(k, c) for k, c in work if k == "decode" and (
            (c["kf"], c["gran"]) in DECODE_ONLY or c.get("residual")
            or (c["vf"], c.get("vgran", c["gran"])) in DECODE_ONLY)]
    parts, loads = plan(work, a.halves, a.shards)
    if a.plan:
        keys = {spec_key(k, c) for k, c in work}
        print(f"{len(work)} cases ({sum(k == 'decode' for k, _ in work)} decode, "
              f"{sum(k == 'append' for k, _ in work)} append), {len(keys)} distinct case keys, "
              f"{a.halves} half(s) x {a.shards} shard(s)")
        for h, (hp, hl) in enumerate(zip(parts, loads)):
            n = sum(len(x) for x in hp)
            print(f"half {h}: {n} cases, est. {sum(hl):.0f} s of compile + run in all, "
                  f"per shard {min(hl):.0f}-{max(hl):.0f} s")
            for i, (sp, sl) in enumerate(zip(hp, hl)):
                print(f"  shard {h}.{i}: {len(sp)} cases, est. {sl:.0f} s: "
                      + " ".join(str(j) for j, _, _ in sp))
        return 0
    mine = parts[a.half][a.shard]
    work = [(k, c) for _, k, c in mine]
    if a.cpu_smoke:
        global DEV
        DEV = "cpu"
        work = work[:a.cpu_smoke]
        for _, c in work:
            if "lens" in c:
                c["lens"] = [max(1, n // 100) for n in c["lens"]]
            c.pop("splits", None)
    name = f"{a.half}.{a.shard}" if a.halves > 1 else f"{a.shard}"
    print(f"plan of shard {name}: {len(work)} cases, est. {loads[a.half][a.shard]:.0f} s",
          flush=True)
    fails = skips = 0
    for idx, kind, c in mine[:len(work)]:
        label = " ".join(f"{k}={v}" for k, v in c.items() if k != "lens")
        if a.budget and time.time() - t0 > a.budget:
            skips += 1
            print(f"SKIP (budget) {kind} #{idx} {label}", flush=True)
            continue
        gen = torch.Generator().manual_seed(1000 + idx)  # per case, not per shard
        t = time.time()
        try:
            msg = (check_decode if kind == "decode" else check_append)(c, gen)
            print(f"PASS {kind} #{idx} {label}: {msg} ({time.time() - t:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing case, keep going
            fails += 1
            print(f"FAIL {kind} #{idx} {label}: {type(e).__name__}: {e} "
                  f"({time.time() - t:.1f}s)", flush=True)
            traceback.print_exc(limit=3)
    n = len(work)
    print(f"shard {name}/{a.shards}: {n - fails - skips}/{n} passed, {fails} failed, "
          f"{skips} skipped in {time.time() - t0:.0f}s", flush=True)
    return 1 if fails or skips else 0


if __name__ == "__main__":
    sys.exit(main())
