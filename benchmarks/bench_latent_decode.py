"""MLA decode attention on the GPU: kvcompile's absorbed attention over latent pages vs
Hugging Face's expanding path, one layer of a DeepSeek-V3-shaped model, in one process.

    python benchmarks/bench_latent_decode.py [--shapes B16_L8k,B64_L8k,B16_L32k,B64_L32k]
    python benchmarks/bench_latent_decode.py --quick   # the kernel alone, old vs new (< 3 min)
    python benchmarks/bench_latent_decode.py --quick --heads 16 --shapes B16_L8k,B64_L32k
    KVC_BENCH_DRY=1 python benchmarks/bench_latent_decode.py [--quick]   # CPU dry run, tiny

Shape: 128 query heads (--heads: 16 / 32 are DeepSeek-V3's shards a GPU at tensor-parallel 8
/ 4, the memory-bound setting), kv_lora_rank 512, rope 64, nope 128, v 128 (DeepSeek-V3), bf16, one
new token per sequence. Contenders, each from the same latent and rotary key of B x L tokens:
- `hf eager`: transformers 5.x `expand_kv` as it runs each step: kv_b_proj over the whole
  cached latent, the keys assembled, SDPA over the expanded heads;
- `hf inductor`: the same function under torch.compile (what StaticCache + inductor runs);
- `absorbed dense`: q_nope W_UK, SDPA of one kv head (MQA) over the contiguous latent, W_UV:
  the absorbed math with no paging, the plain-PyTorch bound of this design;
- `kvc <fmt>, reference`: kernels/latent.py absorption + kernels/dense.py paged reference over
  latent pages of 16 tokens (what `attend_latent` runs where no kernel applies), bf16 and fp8;
- `kvc <fmt>, Triton kernel`: the same absorption + kernels/latent_decode.py (what
  `attend_latent` runs for an unpadded decode step on CUDA).
Timings are medians of triton.testing.do_bench; GB/s counts the latent pages' bytes read
(codes and scales) over the step time. Rows whose HF expansion would need more than
--hf-max-gib are skipped and say so (B64 x 32k expands about 300 GiB per layer).

--quick times only the attention over the pages (the absorbed query given), for B16 / B64 x
8k / 32k and bf16 / fp8_e4m3 pages: the kernel before issue 22's rework
(benchmarks/latent_decode_before.py), the kernel with the tiles its rule picks, and every
candidate of kernels/latent_decode.py CANDIDATES and SWEEP_CANDIDATES of 32+ heads (at --heads
under 64: those whose head block the heads fill; or the --tiles given, each at
the rule's splits and at every --splits given). Per shape it prints the work: GFLOP of the two
GEMMs counting QK^T once (2 B H L (r + dr) + 2 B H L r), MB of latent pages read, and the
bound each gives (MB at 100% of the copy, GFLOP at --peak-tflops). Per row: GB/s of pages
read and its share of a device-to-device copy measured in the same run (bytes read + written
over time, as shared/REFERENCE.md), TFLOP/s useful (QK^T once) and issued (the "heads"
layout at 64 heads computes QK^T twice), and the relative error against the old kernel.

    python benchmarks/bench_latent_decode.py --quick --heads 16 --rule-only --cuda base,base:w8,alu,alu:s4
        # the CUDA latent kernel (kernels/latent_sm90.py, opt-in) beside the rule's tiles, at its
        # own splits and every --splits given; --rule-only: no candidate sweep
    python benchmarks/bench_latent_decode.py --quick --tiles once:64:128:8:1,once_t:32:64:4:3 \
        --splits 2,8   # tile spec: layout:heads:tokens:warps:stages[:v_split][:dot|tile|bits]
                       # [:bt|rope] (the prefetch variants, LatentTiles.ahead)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
if os.environ.get("KVC_BENCH_DRY") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET is set)

from kvcompile.cache.formats import KVFormat  # noqa: E402
from kvcompile.cache.pool import LayerSpec, PagePool  # noqa: E402
from kvcompile.engine.cudagraph import capture  # noqa: E402
from kvcompile.kernels.dense import paged_reference_attention  # noqa: E402
from kvcompile.kernels.latent import absorb_query, latent_output  # noqa: E402
from kvcompile.kernels.latent_decode import (  # noqa: E402
    AHEADS,
    CANDIDATES,
    SWEEP_CANDIDATES,
    WIDENS,
    LatentTiles,
    latent_decode_attention,
    pick_splits,
    pick_tiles,
    sm_count,
)
from kvcompile.testing import REL_ERR  # noqa: E402

DRY = os.environ.get("KVC_BENCH_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
H, R, DR, DN, DV = (128, 512, 64, 128, 128) if not DRY else (8, 32, 16, 16, 16)
P = 16
SHAPES = {"B16_L8k": (16, 8192), "B64_L8k": (64, 8192), "B16_L32k": (16, 32768),
          "B64_L32k": (64, 32768),
          # short contexts (--shapes only): a launch's fixed part by regression over the tiles
          # a CTA runs (mla22k)
          "B16_L2k": (16, 2048), "B16_L4k": (16, 4096)}
DEFAULT_SHAPES = "B16_L8k,B64_L8k,B16_L32k,B64_L32k"
DRY_SHAPES = {"B2_L64": (2, 64), "B3_L100": (3, 100)}
FORMATS = ["bf16", "fp8_e4m3"]
TP_NOTE = {16: " (DeepSeek-V3 at TP 8)", 32: " (DeepSeek-V3 at TP 4)"}


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of fn() (do_bench's warmup and rep in ms)."""
    if DRY:
        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


GRAPH_CALLS = 4


def bench_graph(fn, calls: int = GRAPH_CALLS) -> float:
    """Median ms of one fn() replayed from a CUDA graph of `calls` back-to-back calls (as the
    run time's decode graphs launch it): no Python launch cost, and do_bench's cache flush
    (which leaves L2 full of dirty lines) once per `calls` calls, not before every call."""
    if DRY:
        return bench(fn)

    def calls_in_a_row():
        for _ in range(calls):
            fn()

    g, _ = capture(calls_in_a_row, torch.device("cuda"), None)   # (warmed up first)
    return bench(g.replay, warmup=10, rep=50) / calls


def hf_expand_attend(q, c, rope, w, scale):
    """transformers 5.x DeepseekV3Attention after the cache update (expand_kv + SDPA).
    q [B, H, 1, dn + dr], c [B, 1, L, r], rope [B, 1, L, dr] -> [B, H, 1, dv]."""
    B, _, L, _ = c.shape
    kv = F.linear(c, w).view(B, L, -1, DN + DV).transpose(1, 2)
    k_nope, v = torch.split(kv, [DN, DV], dim=-1)
    k = kv.new_empty(B, H, L, DN + DR)
    k[..., :DN].copy_(k_nope)
    k[..., DN:].copy_(rope.expand(-1, H, -1, -1))
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def absorbed_dense(q, c, rope, w, scale):
    q_lat = absorb_query(q, w, DN)                                   # [B, H, 1, r + dr]
    kv = torch.cat([c, rope], dim=-1)                                # [B, 1, L, r + dr]
    o = F.scaled_dot_product_attention(q_lat, kv, c, scale=scale, enable_gqa=True)
    return latent_output(o, w, DN)


def latent_pool(c, rope, fmt: str):
    """A pool of one latent layer holding B sequences of L tokens: (pool, plan)."""
    B, _, L, _ = c.shape
    kf = KVFormat(fmt, "page")
    spec = LayerSpec(num_kv_heads=1, head_dim=R, v_head_dim=DR, k_format=kf, v_format=kf)
    pages = B * math.ceil(L / P)
    pool = PagePool([spec], pages, P, device=DEV)
    seqs = pool.allocate(B)
    for b, s in enumerate(seqs):
        slots = pool.reserve([s], L)
        pool.write(0, slots, c[b, 0, :, None].contiguous(), rope[b, 0, :, None].contiguous())
    plan = SimpleNamespace(
        packed=False, batch=B, seq_lens_list=[L] * B, kv_start=[0] * B, cache={},
        block_tables=pool.block_table(seqs, device=DEV), new_tokens=1, past_lens=[L - 1] * B)
    return pool, plan


def kvc_attend(pool, plan, q, w, scale):
    q_lat = absorb_query(q, w, DN)
    o = paged_reference_attention(pool.k[0], pool.v[0], q_lat, plan, None, True, 0, 0.0,
                                  scale, latent=True)
    return latent_output(o, w, DN)


def kvc_kernel(pool, plan, q, w, scale):
    q_lat = absorb_query(q, w, DN)[:, :, 0]                          # [B, H, r + dr]
    lens = torch.tensor(plan.seq_lens_list, dtype=torch.int32, device=q.device)
    o = latent_decode_attention(q_lat, pool.k[0], pool.v[0], plan.block_tables, lens, scale)
    return latent_output(o.to(q.dtype)[:, :, None], w, DN)


def run_shape(name, B, L, hf_max_gib: float, compiled) -> list[dict]:
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.float32 if DRY else torch.bfloat16   # (the interpreter's bf16 dots are wrong)
    q = torch.randn(B, H, 1, DN + DR, device=DEV, generator=g).to(dt)
    c = torch.randn(B, 1, L, R, device=DEV, generator=g).to(dt)
    rope = torch.randn(B, 1, L, DR, device=DEV, generator=g).to(dt)
    w = (torch.randn(H * (DN + DV), R, device=DEV, generator=g) / R ** 0.5).to(dt)
    scale = (DN + DR) ** -0.5
    latent_bytes = B * L * (R + DR) * 2
    rows = []
    # transient per step: kv_b_proj's output (dn + dv), the keys (dn + dr), SDPA's copy of v
    expanded_gib = B * L * H * ((DN + DV) + (DN + DR) + DV) * 2 / 2 ** 30
    ref = None
    if expanded_gib <= hf_max_gib:
        ref = hf_expand_attend(q, c, rope, w, scale).float()
        rows.append(dict(shape=name, row="hf eager", ms=bench(
            lambda: hf_expand_attend(q, c, rope, w, scale)), bytes=latent_bytes))
        if compiled is not None:
            rows.append(dict(shape=name, row="hf inductor", ms=bench(
                lambda: compiled(q, c, rope, w, scale)), bytes=latent_bytes))
    else:
        rows.append(dict(shape=name, row="hf eager", ms=None, note=f"skipped: expands "
                         f"{expanded_gib:.0f} GiB > --hf-max-gib {hf_max_gib:.0f}"))
    # SDPA has no kernel for a shared single-head latent with enable_gqa at these widths: its
    # math path expands keys and values to every head
    dense_gib = B * L * H * ((R + DR) + R) * 2 / 2 ** 30
    if dense_gib <= hf_max_gib:
        out = absorbed_dense(q, c, rope, w, scale)
        err = _rel(out, ref)
        rows.append(dict(shape=name, row="absorbed dense", ms=bench(
            lambda: absorbed_dense(q, c, rope, w, scale)), bytes=latent_bytes, err=err))
    else:
        rows.append(dict(shape=name, row="absorbed dense", ms=None, note=f"skipped: SDPA's "
                         f"math path expands {dense_gib:.0f} GiB > --hf-max-gib {hf_max_gib:.0f}"))
    for fmt in FORMATS:
        pool, plan = latent_pool(c, rope, fmt)
        out = kvc_attend(pool, plan, q, w, scale)
        stored = pool.bytes_per_token * B * L
        rows.append(dict(shape=name, row=f"kvc {fmt} pages, reference", ms=bench(
            lambda pool=pool, plan=plan: kvc_attend(pool, plan, q, w, scale)), bytes=stored,
            err=_rel(out, ref)))
        out = kvc_kernel(pool, plan, q, w, scale)
        rows.append(dict(shape=name, row=f"kvc {fmt} pages, Triton kernel", ms=bench(
            lambda pool=pool, plan=plan: kvc_kernel(pool, plan, q, w, scale)), bytes=stored,
            err=_rel(out, ref)))
    if not DRY:
        torch.cuda.empty_cache()
    return rows


def _rel(out, ref) -> float | None:
    if ref is None:
        return None
    return ((out.float() - ref).norm() / ref.norm()).item()


def copy_bandwidth(graph: bool = False) -> float:
    """Device-to-device copy, (bytes read + bytes written) / median time, in GB/s (graph:
    timed as bench_graph times the kernels)."""
    n = (1 << 20) if DRY else (1 << 30)
    x = torch.empty(n, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = (bench_graph if graph else bench)(lambda: y.copy_(x))
    return 2 * n / (ms * 1e-3) / 1e9


def profile_line(fn, ctas: int) -> str:
    """One launch of fn(pbuf=...) with the CUDA latent kernel's per-CTA timers
    (latent_sm90.PROF_NAMES; latent_decode.cuh LAT_VAR_PROF), after one plain launch, summarized
    over the CTAs as median / max (us from the earliest CTA's entry, global timer; cycles of
    warp 0 per tile, clock64). Where a launch's time goes: the CTAs' start skew, q's prologue,
    tile 0's wait, the loop (per tile), the partials' stores, the fused merge, the end skew."""
    from kvcompile.kernels import latent_sm90

    if DRY:
        return "dry run"
    pbuf = torch.zeros(ctas * latent_sm90.PROF_SLOTS, dtype=torch.int64, device=DEV)
    fn()
    torch.cuda.synchronize()
    fn(pbuf=pbuf)
    torch.cuda.synchronize()
    p = pbuf.view(ctas, latent_sm90.PROF_SLOTS).cpu().double()
    t0 = p[:, 0].min()
    end = torch.where(p[:, 5] > 0, p[:, 5], p[:, 4])
    tiles = p[:, 7].clamp_min(1)

    def mm(x, k=1e-3):
        x = x * k
        return f"{x.median().item():.1f}/{x.max().item():.1f}"

    sms = p[:, 6].long()
    per_sm = torch.bincount(sms).max().item()
    return (f"{ctas} CTAs on {len(sms.unique())} SMs (<= {per_sm} an SM); us median/max: "
            f"start {mm(p[:, 0] - t0)}, q {mm(p[:, 1] - p[:, 0])}, tile 0 wait "
            f"{mm(p[:, 2] - p[:, 1])}, loop {mm(p[:, 3] - p[:, 2])} "
            f"({mm((p[:, 3] - p[:, 2]) / (tiles - 1).clamp_min(1))} a tile after the first), "
            f"stores {mm(p[:, 4] - p[:, 3])}, merge {mm(torch.where(p[:, 5] > 0, p[:, 5] - p[:, 4], 0 * t0))}, "
            f"end {mm(end - t0)} (span {(end.max() - t0).item() * 1e-3:.1f}); warp 0 cycles a "
            f"tile median: wait {(p[:, 8] / tiles).median().item():.0f}, scores "
            f"{(p[:, 9] / tiles).median().item():.0f}, softmax "
            f"{(p[:, 10] / tiles).median().item():.0f}, P V issue "
            f"{(p[:, 11] / tiles).median().item():.0f}")


def parse_tiles(spec: str) -> list:
    """'once:64:128:8:1,heads:64:16:4:2:2,once:16:128:8:2:1:tile' -> [LatentTiles, ...]"""
    out = []
    for item in filter(None, spec.split(",")):
        layout, *nums = item.split(":")
        ahead = nums.pop() if nums and nums[-1] in AHEADS[1:] else ""
        widen = nums.pop() if nums and nums[-1] in WIDENS else "dot"
        if len(nums) not in (4, 5):
            raise SystemExit(f"--tiles {item!r}: layout:heads:tokens:warps:stages[:v_split"
                             f"][:dot|tile|bits][:bt|rope]")
        h, n, w, st, *v = (int(x) for x in nums)
        out.append(LatentTiles(h, n, w, st, v_split=v[0] if v else 1, layout=layout,
                               widen=widen, ahead=ahead))
    return out


def score_copies(t) -> int:
    """Times each QK^T score is computed (sm_90 layouts, tests/kernels/
    test_latent_decode_sm90.py): the "heads" layout at 64 heads computes it in both
    warpgroups (8 warps) or in both programs of a v_split pair."""
    return 2 if t is not None and t.layout == "heads" and t.block_h == 64 and (
        t.num_warps == 8 or t.v_split == 2) else 1


def parse_cuda(spec: str) -> list[tuple]:
    """'base,base:w8,alu:s4,base:nm' -> [(variant, stages or None, warps, merge, fm, prof),
    ...]
    (kernels/latent_sm90.py VARIANTS; stages None: as many half-tile stages as fit one CTA an
    SM, s4 lets fp8 pages run two CTAs an SM; warps 4 unless w8; nm: the kernel alone, the
    splits' partials left unmerged, to time the merge by difference; ml: merged by the loop
    merge kernel of before mla22j, merge "loop"; fm: the splits merged by the kernel's last
    CTA a head block, fused_merge=True (mla22k); prof: after its timing, one more launch with
    the per-CTA timers (profile=...), summarized on a '# prof' line: the launch's fixed part;
    rs: O rescaled in every tile, the kernel before mla22k, always_rescale=True; 16-bit pages
    time s<n> rows as the full ring, once)."""
    from kvcompile.kernels.latent_sm90 import VARIANTS, WARP_COUNTS

    out = []
    for item in filter(None, spec.split(",")):
        var, *opts = item.split(":")
        st, w, merge, fm, prof, rs = None, 4, True, False, False, False
        for o in opts:
            if o == "rs":
                rs = True
            elif o == "fm":
                fm = True
            elif o == "prof":
                prof = True
            elif o in ("nm", "ml"):
                merge = {"nm": False, "ml": "loop"}[o]
            elif o[:1] == "s" and o[1:].isdigit():
                st = int(o[1:])
            elif o[:1] == "w" and o[1:].isdigit() and int(o[1:]) in WARP_COUNTS:
                w = int(o[1:])
            else:
                var = ""
        if not all(v in VARIANTS for v in var.split("+")):
            raise SystemExit(f"--cuda {item!r}: variant[:s<stages>][:w<warps>][:nm|ml|fm]"
                             f"[:prof], variant one of {sorted(VARIANTS)}, warps one of "
                             f"{WARP_COUNTS}")
        out.append((var, st, w, merge, fm, prof, rs))
    return out


def prebuild_cuda(cuda: list) -> None:
    """Builds every --cuda variant's cubin (both page formats) in parallel processes before
    anything is timed (the launcher builds at first use, one at a time: on a fresh machine
    twenty variants took minutes). Before CUDA is initialized (the workers fork)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from kvcompile.kernels import latent_sm90

    keys = set()
    for var, st, w, _mg, fm, prof, rs in cuda:
        for fmt in FORMATS:
            ck = latent_sm90._KIND[fmt]
            bits = (latent_sm90.variant_bits(var, ck) | (latent_sm90.FMERGE if fm else 0)
                    | (latent_sm90.RESCALE if rs else 0))
            for extra in (0, latent_sm90.PROF) if prof else (0,):   # a :prof row times both
                keys.add((ck, ck, R, DR, P, 1, st if ck < 2 else None, bits | extra, w))
    t = time.perf_counter()
    with cf.ProcessPoolExecutor(min(len(keys), os.cpu_count() or 1),
                                mp.get_context("fork")) as ex:
        list(ex.map(latent_sm90.build_key, sorted(keys, key=str)))
    print(f"# built {len(keys)} CUDA variants in {time.perf_counter() - t:.0f} s", flush=True)


def quick(shape_names: list[str], tiles: list | None, splits: list[int],
          peak_tflops: float, cuda: list | None = None, rule_only: bool = False,
          graph: bool = False) -> None:
    """The kernel alone: old vs the rule's tiles vs each candidate (or --tiles), and the
    CUDA kernel's variants (--cuda) beside them."""
    from benchmarks.latent_decode_before import latent_decode_before

    if cuda and not DRY:
        prebuild_cuda(cuda)

    shapes = DRY_SHAPES if DRY else SHAPES
    copy = copy_bandwidth()
    # the graph column's 100% is the eager copy: a 1 GB copy_ is one cudaMemcpyAsync, which a
    # graph makes a memcpy node (2,715 GB/s on the H200 against 4,224 eager, mla22j's run)
    copy_g = copy_bandwidth(graph=True) if graph else None
    dt = torch.float32 if DRY else torch.bfloat16
    sms = sm_count(torch.device(DEV))
    print(f"# MLA latent decode kernel alone: H {H}{TP_NOTE.get(H, '')}, r {R}, rope {DR}, page {P}, q {dt}; "
          f"torch {torch.__version__}, triton {triton.__version__}"
          + ("" if DRY else f", {torch.cuda.get_device_name()}, {sms} SMs"))
    print(f"# device copy: {copy:.0f} GB/s (read + write); compute bound at {peak_tflops:.0f} "
          f"TFLOP/s (--peak-tflops)")
    gcols = ""
    if graph:
        print(f"# --graph: each row also timed as a CUDA graph of {GRAPH_CALLS} back-to-back "
              f"calls (ms a call; no Python launch cost, one cache flush per graph); % of the "
              f"eager copy above (the copy as a graph memcpy node: {copy_g:.0f} GB/s)")
        gcols = " ms graph | % of copy graph |"
    print("| shape | pages | kernel | tiles x splits | ms | GB/s | % of copy | TFLOP/s useful | "
          "TFLOP/s issued | vs old | rel err vs old |" + gcols)
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if graph else ""))
    bound = REL_ERR[dt]
    best, work, profs = [], [], []
    sweep = tiles or ([] if rule_only else [
        t for t in CANDIDATES + SWEEP_CANDIDATES
        if (t.block_h >= 32 if H >= 64 else t.block_h <= max(H, 16))])
    for name in shape_names:
        B, L = shapes[name]
        g = torch.Generator(device=DEV).manual_seed(0)
        c = torch.randn(B, 1, L, R, device=DEV, generator=g).to(dt)
        rope = torch.randn(B, 1, L, DR, device=DEV, generator=g).to(dt)
        q_lat = (torch.randn(B, H, R + DR, device=DEV, generator=g) / 8).to(dt)
        lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
        qk, pv = 2 * B * H * L * (R + DR), 2 * B * H * L * R
        max_len = math.ceil(L / P) * P
        for fmt in FORMATS:
            pool, plan = latent_pool(c, rope, fmt)
            args = (q_lat, pool.k[0], pool.v[0], plan.block_tables, lens, (DN + DR) ** -0.5)
            nbytes = pool.bytes_per_token * B * L
            t_mem = nbytes / (copy * 1e9) * 1e3      # ms at 100% of copy, as the % column
            t_mma = (qk + pv) / (peak_tflops * 1e12) * 1e3
            work.append(f"# {name} {fmt}: {(qk + pv) / 1e9:.1f} GFLOP (QK^T {qk / 1e9:.1f} + PV "
                        f"{pv / 1e9:.1f}), {nbytes / 1e6:.0f} MB of pages ({nbytes / (B * L):.0f}"
                        f" B a token, {(qk + pv) / nbytes:.0f} FLOP/B): {t_mem:.3f} ms at 100% "
                        f"of copy ({t_mem / 0.8:.3f} at the 80% target, which needs "
                        f"{(qk + pv) * 0.8 / (t_mem * 1e-3) / 1e12:.0f} TFLOP/s useful), "
                        f"{t_mma:.3f} ms at "
                        f"{peak_tflops:.0f} TFLOP/s")
            old = latent_decode_before(*args)
            rule = pick_tiles(H, R, fmt != "bf16", B, sms, q_fp32=dt == torch.float32)
            runs = [("old (before #22)", None, None)]
            # widen "tile" / "bits" tiles take fp8 pages only (the launcher refuses bf16)
            for t in [rule] + [t for t in sweep if t != rule and (
                    t.widen == "dot" or fmt != "bf16")]:
                own = pick_splits(B, H, max_len, t, sms, widened=fmt != "bf16")
                for sp in dict.fromkeys([own] + splits):
                    runs.append(("rule" if t == rule and sp == own else "sweep", t, sp))
            seen = set()   # variants that change nothing for these pages (bf16) time once
            for var, st, w, mg, fm, prof, rs in cuda or []:   # the CUDA kernel (latent_sm90.py)
                if DRY:
                    print(f"| {name} | {fmt} | cuda {var} | - | dry run: the CUDA kernel takes "
                          f"r 512 + rope 64 on sm_90 only | | | | | | |")
                    continue
                from kvcompile.kernels import latent_sm90

                ck = latent_sm90._KIND[fmt]
                vbits = latent_sm90.variant_bits(var, ck)
                if ck >= 2:   # 16-bit pages: s<n> rows time as the full ring (one CTA an SM
                    st = None  # either way; mla22j measured s4 = smax), once
                if (vbits, st, w, mg, fm, prof, rs) in seen:
                    continue
                seen.add((vbits, st, w, mg, fm, prof, rs))
                _, ctas, smem = latent_sm90.kernel_constants(ck, ck, R, DR, P, 1, st, vbits,
                                                             warps=w)
                own = latent_sm90.choose_splits(B, (H + 15) // 16, max_len, sms, ctas)
                for sp in dict.fromkeys([own] + splits):
                    runs.append(("cuda", (var, st, w, ctas, smem, mg, fm, prof, rs), sp))
            base, fastest = None, None
            for kernel, t, sp in runs:
                if kernel == "cuda":
                    var, st, w, ctas, smem, mg, fm, prof, rs = t
                    label = (f"cuda {var} w{w} s{st or 'max'} ({ctas} CTA/SM, {smem // 1024} "
                             f"KB) x {sp}"
                             f"{dict(loop=', loop merge').get(mg, '') if mg else ', no merge'}"
                             f"{', fused merge' if fm else ''}"
                             f"{', rescale every tile' if rs else ''}")

                    def fn(a=args, v=var, st=st, sp=sp, w=w, mg=mg, fm=fm, rs=rs, pbuf=None):
                        from kvcompile.kernels import latent_decode as ld

                        before = ld.MERGE
                        ld.MERGE = "loop" if mg == "loop" else "once"
                        try:
                            return latent_sm90.latent_decode_sm90(*a, num_splits=sp, stages=st,
                                                                  variant=v, warps=w,
                                                                  merge=bool(mg), fused_merge=fm,
                                                                  profile=pbuf,
                                                                  always_rescale=rs)
                        finally:
                            ld.MERGE = before
                    profiled = fn if prof else None
                    t = None
                else:
                    label = "16 heads, 1 page" if t is None else f"{t} x {sp}"
                    fn = (lambda a=args: latent_decode_before(*a)) if t is None else (
                        lambda a=args, t=t, sp=sp: latent_decode_attention(*a, num_splits=sp,
                                                                           tiles=t))
                    profiled = None
                try:
                    out = fn()
                    ms = bench(fn, warmup=10, rep=50)
                except Exception as e:   # a candidate over the SM's resources: say so, go on
                    print(f"| {name} | {fmt} | {kernel} | {label} | failed: "
                          f"{type(e).__name__}: {str(e)[:80]} | | | | | | |", flush=True)
                    continue
                gcell = ""
                if graph:
                    try:
                        ms_g = bench_graph(fn)
                        gcell = (f" {ms_g:.3f} | "
                                 f"{100 * nbytes / (ms_g * 1e-3) / 1e9 / copy:.1f}% |")
                    except Exception as e:   # capture refused: say so, keep the eager time
                        gcell = f" graph failed: {type(e).__name__}: {str(e)[:60]} | |"
                base = base or ms
                gbs = nbytes / (ms * 1e-3) / 1e9
                unmerged = kernel == "cuda" and not mg and sp > 1
                err = 0.0 if unmerged else _rel(out, old.float())   # no output to compare
                if kernel != "old (before #22)" and not unmerged and (
                        fastest is None or ms < fastest[0]):
                    fastest = (ms, label, 100 * gbs / copy, kernel == "rule")
                issued = qk * score_copies(t) + pv
                print(f"| {name} | {fmt} | {kernel} | {label} | {ms:.3f} | {gbs:.0f} | "
                      f"{100 * gbs / copy:.1f}% | {(qk + pv) / (ms * 1e-3) / 1e12:.0f} | "
                      f"{issued / (ms * 1e-3) / 1e12:.0f} | {base / ms:.2f}x | "
                      f"{err:.1e}{'' if err <= bound else f' > {bound:.1e}: WRONG'} |"
                      + gcell, flush=True)
                if profiled is not None:
                    try:
                        line = profile_line(profiled, B * ((H + 15) // 16) * sp)
                    except Exception as e:   # say so, keep the table
                        line = f"failed: {type(e).__name__}: {str(e)[:120]}"
                    profs.append(f"# prof {name} {fmt} {label}: {line}")
                    print(profs[-1], flush=True)   # now too: a cut run keeps it
            if fastest:
                best.append(f"# {name} {fmt}: fastest {fastest[1]} {fastest[0]:.3f} ms, "
                            f"{fastest[2]:.1f}% of copy (target 80%); the rule's pick "
                            f"{'is' if fastest[3] else 'is not'} it")
            del pool, plan
            if not DRY:
                torch.cuda.empty_cache()
    print("\n".join(work + best + profs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DRY_SHAPES) if DRY else DEFAULT_SHAPES)
    ap.add_argument("--heads", type=int, default=None,
                    help="query heads a GPU (default 128, DeepSeek-V3 unsharded; 16 / 32 are "
                    "its tensor-parallel 8 / 4 shards; dry run: 8)")
    ap.add_argument("--hf-max-gib", type=float, default=100.0)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="the decode kernel alone, old vs new and the tile candidates")
    ap.add_argument("--tiles", default="", help="--quick: time these tiles instead of the "
                    "candidates, layout:heads:tokens:warps:stages[:v_split][:dot|tile|bits][:bt|rope], "
                    "comma-separated (widen 'tile' / 'bits': fp8 pages only)")
    ap.add_argument("--splits", default="", help="--quick: split counts to time each tile "
                    "at, besides the rule's (comma-separated)")
    ap.add_argument("--cuda", default="", help="--quick: also time the CUDA latent kernel "
                    "(kernels/latent_sm90.py, opt-in), variant[:s<stages>][:w<warps>] comma-"
                    "separated, e.g. base,base:w8,alu:s4 (s4: fp8 pages two CTAs an SM; w8: 8 "
                    "warps a CTA)")
    ap.add_argument("--graph", action="store_true", help="--quick: also time every row as "
                    "a CUDA graph of back-to-back calls (the run time's decode graphs)")
    ap.add_argument("--rule-only", action="store_true", help="--quick: time the rule's "
                    "tiles (and --cuda) only, no candidate sweep")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 tensor-core peak for the compute bound (H100/H200 SXM "
                    "spec sheet: 989)")
    a = ap.parse_args()
    global H
    if a.heads is not None:
        if a.heads < 1:
            raise SystemExit(f"--heads {a.heads}: need >= 1")
        H = a.heads
    if a.quick:
        quick(a.shapes.split(","), parse_tiles(a.tiles) or None,
              [int(x) for x in a.splits.split(",") if x], a.peak_tflops,
              parse_cuda(a.cuda), a.rule_only, a.graph)
        return
    shapes = DRY_SHAPES if DRY else SHAPES
    compiled = None if a.no_inductor or DRY else torch.compile(hf_expand_attend, dynamic=False)
    print(f"# MLA decode, one layer: H {H}{TP_NOTE.get(H, '')}, r {R}, rope {DR}, nope {DN}, v {DV}, bf16, page "
          f"{P}; torch {torch.__version__}"
          + ("" if DRY else f", {torch.cuda.get_device_name()}"))
    print("| shape | row | ms | vs hf eager | vs hf inductor | latent GB/s | rel err vs hf |")
    print("|---|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        B, L = shapes[name]
        rows = run_shape(name, B, L, a.hf_max_gib, compiled)
        base = {r["row"]: r.get("ms") for r in rows}
        for r in rows:
            if r.get("ms") is None:
                print(f"| {name} | {r['row']} | - | | | | {r['note']} |")
                continue
            ratio = [f"{base[k] / r['ms']:.2f}x" if base.get(k) else "-"
                     for k in ("hf eager", "hf inductor")]
            gbs = r["bytes"] / (r["ms"] * 1e-3) / 1e9
            err = f"{r['err']:.1e}" if r.get("err") is not None else "-"
            print(f"| {name} | {r['row']} | {r['ms']:.3f} | {ratio[0]} | {ratio[1]} | "
                  f"{gbs:.0f} | {err} |", flush=True)


if __name__ == "__main__":
    main()
