"""The absorbed MLA decode kernel compiled for sm_90 (Hopper) on a machine without a GPU:
every candidate tile at DeepSeek-V3 shape (r 512, rope 64, page 16), bf16 and fp8 pages,
split and unsplit, must compile through the installed Triton's NVIDIA backend, fit the SM's
shared memory, and put both GEMMs of the 64-head tiles on wgmma (Hopper tensor cores). The
"once" layouts must compute each score once: the warps of the QK^T layout Triton chose
(warpsPerCTA x instrShape) must not cover the score tile more than once, which the first
rebuild's 64-head, 8-warp tile does (twice: the negative case). The interpreter cannot tell
any of that; this does not replace the CUDA run (tests/gpu/), and its
Triton may differ from the GPU image's."""

from __future__ import annotations

import inspect
import json
import os
import re

import pytest

from kvcompile.kernels.latent_decode import (
    CANDIDATES,
    PREFETCH_VARIANTS,
    SWEEP_CANDIDATES,
    LatentTiles,
    programs_per_sm,
)
from tests.kernels.sm90_compile import compile_rows

# the rule's tiles; with KVCOMPILE_TEST_FULL=1 also the benchmark's only (sweep and prefetch
# tiles: ~16 s of cold compiles on the 2-core CI machine, which no run-time launch takes)
ALL = CANDIDATES + (SWEEP_CANDIDATES + PREFETCH_VARIANTS
                    if os.environ.get("KVCOMPILE_TEST_FULL") else ())
SMEM_LIMIT = 232448   # bytes of shared memory one block may use on sm_90 (227 KiB)
SMEM_PER_SM = 233472  # bytes of shared memory an SM has (228 KiB), 1 KiB reserved a block
REGS_PER_SM = 65536
TYPES = dict(QL="*bf16", CS="*fp32", RS="*fp32", BT="*i32", SL="*i32", OUT="*fp32",
             ACC="*fp32", ML="*fp32", stride_qb="i32", stride_qh="i32", stride_bt="i32",
             H="i32", num_splits="i32", tiles_per_split="i32", qk_scale="fp32")
DIV16 = ("stride_qb", "stride_qh", "H")   # as a launch at 128 heads specializes them
pytestmark = pytest.mark.slow   # 36 compiles (81 full): ~1.5 min on the 2-core machine
PAGES = ("bf16", "fp8e4nv")
# the one-split launch (DIRECT: the kernel normalizes and writes out itself) of each tile with
# KVCOMPILE_TEST_FULL=1 (an epilogue apart, the same kernel: ~30 s of cold compiles on CI)
DIRECTS = (False, True) if os.environ.get("KVCOMPILE_TEST_FULL") else (False,)


def _compile(tiles, page: str, direct: bool) -> dict:
    """One compile for sm_90 -> {shared, wgmma, pipelined} or {error}. Runs in a process
    without TRITON_INTERPRET (the interpreter patches triton.language for the process)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcompile.kernels import latent_decode as ld

    scaled = page != "bf16"
    consts = dict(R=512, DR=64, P=16, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
                  C_SCALED=scaled, R_SCALED=scaled, DT=tl.bfloat16, DIRECT=direct)
    if tiles.layout == "heads":
        fn, consts["V_SPLIT"] = ld._latent_tile_kernel, tiles.v_split
    else:
        fn, consts["OUT_T"] = ld._latent_once_kernel, tiles.layout == "once_t"
        consts.update(BT_AHEAD=tiles.ahead != "", ROPE_AHEAD=tiles.ahead == "rope")
        # as the launcher runs fp8 pages under bf16 queries (latent_decode._fp8_dots)
        dot = tl.float16 if scaled else tl.bfloat16
        consts.update(DT=dot, DT_R=dot, Q_SHIFT=ld._Q_SHIFT if scaled else 1.0,
                      WIDEN_ASM=ld._CVT["fp8_e4m3"] if tiles.widen == "tile" and scaled
                      else "", WIDEN_BITS="", C_MUL=1.0)
        if tiles.widen == "bits" and scaled:
            consts.update(WIDEN_ASM=ld._BITS["fp8_e4m3"], WIDEN_BITS="asm",
                          C_MUL=ld._BITS_MUL["fp8_e4m3"])
    for name, prm in inspect.signature(fn.fn).parameters.items():   # constexpr defaults
        if name not in consts and prm.default is not inspect.Parameter.empty:
            consts[name] = prm.default   # (the key mask's: no mask, as the rule's launches)
    types = dict(TYPES, CD=f"*{page}", RD=f"*{page}")
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    except Exception as e:  # reported to the test, which fails with it
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    ttgir = k.asm["ttgir"]
    # the latent tile itself in the cp.async ring (not only the rotary key or the scales)
    width = 256 if tiles.layout != "heads" else 512 // tiles.v_split
    ring = re.search(rf"async_copy_global_to_local .* -> <{tiles.block_n}x{width}x", ttgir)
    body = ttgir[ttgir.find("scf.for"):]
    wait = re.search(r"ttg\.async_wait .*\{num = (\d+)", body[:body.find("scf.yield")])
    return {"loop_wait": int(wait.group(1)) if wait else -1, "shared": k.metadata.shared, "wgmma": ttgir.count("ttng.warp_group_dot "),
            "pipelined": "async_copy_global_to_local" in ttgir, "latent_ring": bool(ring),
            "score_copies": _score_copies(ttgir, tiles), "usage": _usage(k.asm["cubin"])}


def _usage(cubin: bytes) -> str:
    """Registers and stack (spills) of the cubin, from the cuobjdump Triton ships; '' where
    there is none. Reported, not asserted (the GPU timing judges a spill)."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                           text=True)
    return " ".join(re.findall(r"(?:REG|STACK):\d+", r.stdout))


def _score_copies(ttgir: str, tiles) -> float:
    """How many times the warps compute each score: the wgmma layout (warpsPerCTA x
    instrShape, 16 rows a warp) of the dots whose result is the score tile, over its shape.
    0 where no such dot is on wgmma."""
    mma = {m[0]: ([int(x) for x in m[1].split(",")], [int(x) for x in m[2].split(",")])
           for m in re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3.*?"
                               r"warpsPerCTA = \[([\d, ]+)\], instrShape = \[([\d, ]+)\]",
                               ttgir, re.M)}
    rows, cols = ((tiles.block_n, tiles.block_h) if tiles.layout != "heads"
                  else (tiles.block_h, tiles.block_n))
    copies = 0.0
    for m, n, enc in re.findall(r"ttng\.warp_group_dot .*-> tensor<(\d+)x(\d+)xf32, (#mma\d*)>",
                                ttgir):
        if (int(m), int(n)) == (rows, cols) and enc in mma:
            warps, instr = mma[enc]
            copies = max(copies, max(1.0, warps[0] * 16 / rows) * max(1.0, warps[1] * instr[1]
                                                                         / cols))
    return copies


def _pages(tiles) -> tuple:
    """The pages a candidate takes: widen "tile" / "bits" only fp8 (the launcher refuses
    bf16)."""
    return PAGES[1:] if tiles.widen != "dot" else PAGES


PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "fp8_e4m3": "*fp8e4nv",
       "fp8_e5m2": "*fp8e5"}


def rule_launches() -> list:
    """Every distinct launch the rule (pick_launch) makes at DeepSeek-V3's r 512 / rope 64 /
    page 16 over head counts, batches, contexts, query dtypes (bf16 / fp16 / fp32) and page
    formats (bf16, fp8 e4m3 / e5m2 with page scales; the rotary key in the latent's format
    or bf16): (tiles index in ALL, query dtype, latent format, rotary format), sorted."""
    from kvcompile.kernels.latent_decode import pick_launch

    # fp16 queries and e5m2 pages take the same tiles as bf16 / e4m3 (only an element type
    # differs): compiled with KVCOMPILE_TEST_FULL=1, left out of the default run (36 launches
    # against 9: about a minute of cold compiles on the 2-core CI machine), as are fp32
    # queries on a tile that a bf16 launch compiles
    full = bool(os.environ.get("KVCOMPILE_TEST_FULL"))
    out = set()
    for heads in (1, 8, 16, 20, 32, 48, 64, 128):
        for batch in (1, 16, 64, 256):
            for ctx in (1000, 8192, 131072):
                for q in ("bf16", "fp16", "fp32") if full else ("bf16", "fp32"):
                    for c in ("bf16", "fp8_e4m3", "fp8_e5m2") if full else ("bf16", "fp8_e4m3"):
                        for r in {c, "bf16"}:
                            t, _ = pick_launch(heads, 512, batch, ctx, 132, c != "bf16",
                                               q_fp32=q == "fp32")
                            out.add((ALL.index(t), q, c, r))
    if not full:  # fp32 queries only for the tiles no bf16 launch compiles (6 compiles less)
        bf16 = {i for i, q, _, _ in out if q == "bf16"}
        out = {x for x in out if x[1] == "bf16" or x[0] not in bf16}
    return sorted(out)


def mass_launches() -> list:
    """The launches H2O's stepped-aside steps make (attn_mass: the scores written too), at 16
    and 128 heads over bf16 and fp8 latent pages (bf16 rotary key), bf16 queries."""
    from kvcompile.kernels.latent_decode import pick_launch

    return sorted({(ALL.index(pick_launch(h, 512, 16, 8192, 132, c != "bf16")[0]), "bf16",
                    c, "bf16") for h in (16, 128) for c in ("bf16", "fp8_e4m3")})


def _compile_launch(tiles, q: str, c: str, r: str, mass: bool = False) -> dict:
    """One launch configuration as the launcher makes it (latent_decode.launch_constexprs),
    split version, compiled for sm_90 -> {shared, usage} or {error}; mass: with H2O's
    scores output (WRITE_SCORES, as latent_decode_attention's attn_mass launches)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcompile.kernels import latent_decode as ld

    qdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[q]
    fn, consts = ld.launch_constexprs(tiles, qdt, c, r, 512, 64, 16, False)
    opts = dict(num_warps=consts.pop("num_warps"), num_stages=consts.pop("num_stages"))
    if mass:
        consts["WRITE_SCORES"] = True
    for name, prm in inspect.signature(fn.fn).parameters.items():   # constexpr defaults
        if name not in consts and prm.default is not inspect.Parameter.empty and not (
                mass and name in ("SCORES", "scores_len")):
            consts[name] = prm.default
    types = dict(TYPES, QL=PTR[q], CD=PTR[c], RD=PTR[r], SCORES="*fp32", scores_len="i32")
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:  # reported to the test, which fails with it
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    return {"shared": k.metadata.shared, "usage": _usage(k.asm["cubin"])}


def _main() -> None:
    for i, tiles in enumerate(ALL):
        for page in _pages(tiles):
            for direct in DIRECTS:
                print(json.dumps([i, page, direct, _compile(tiles, page, direct)]), flush=True)
    for i, q, c, r in rule_launches():
        print(json.dumps([i, f"rule:{q}:{c}:{r}", False, _compile_launch(ALL[i], q, c, r)]),
              flush=True)
    for i, q, c, r in mass_launches():
        print(json.dumps([i, f"mass:{q}:{c}:{r}", False,
                          _compile_launch(ALL[i], q, c, r, mass=True)]), flush=True)


@pytest.fixture(scope="module")
def compiled():
    rows = compile_rows("tests.kernels.test_latent_decode_sm90")
    if all("ptxas" in row[3].get("error", "") for row in rows):
        pytest.skip(f"no working ptxas for sm_90 here: {rows[0][3]['error'][:300]}")
    return {(i, page, direct): res for i, page, direct, res in rows}


@pytest.mark.parametrize("i,page", [(i, p) for i, t in enumerate(ALL)
                                    for p in _pages(t)])
def test_candidate_compiles_for_sm90(compiled, i, page):
    tiles = ALL[i]
    for direct in DIRECTS:
        res = compiled[(i, page, direct)]
        assert "error" not in res, f"{tiles} {page} direct={direct}: {res.get('error')}"
        assert res["shared"] <= SMEM_LIMIT, f"{tiles}: {res['shared']} B of shared memory"
        if tiles.block_h == 64:
            assert res["wgmma"] >= 3, f"{tiles}: the GEMMs are not on wgmma"
        if tiles.layout != "heads":
            assert res["score_copies"] == 1, f"{tiles}: scores computed " \
                                             f"{res['score_copies']} times"
        elif tiles.block_h == 64 and tiles.num_warps == 8:   # what "once" exists to avoid
            assert res["score_copies"] == 2, f"{tiles}: {res['score_copies']} score copies"
        assert res["pipelined"] or tiles.num_stages == 1, f"{tiles}: page loads not pipelined"



@pytest.mark.parametrize("i,page", [(i, p) for i, t in enumerate(ALL)
                                    if t.layout != "heads" for p in _pages(t)])
def test_programs_per_sm_as_compiled(compiled, i, page):
    """pick_splits sizes split-K by programs_per_sm: that many programs of the compiled
    kernel must fit an SM's shared memory and registers, and (4-warp tiles over pages read as
    stored) one more must not, or the rule under-fills the SMs. The 4-warp tiles of the
    memory-bound setting (16-32 heads) keep bf16 latent tiles in the cp.async ring; widen
    "tile" keeps the fp8 ones there, without a register spill; the sweep's 4-warp widen
    "tile" / "bits" tiles without a ring (two programs an SM) spill nothing either."""
    tiles = ALL[i]
    widened = page != "bf16"
    n = programs_per_sm(tiles, widened)
    for direct in DIRECTS:
        res = compiled[(i, page, direct)]
        assert "error" not in res, res.get("error")
        regs = int(re.search(r"REG:(\d+)", res["usage"]).group(1)) if res["usage"] else 0
        threads = 32 * tiles.num_warps
        assert n * (res["shared"] + 1024) <= SMEM_PER_SM, f"{tiles} {page}: {n} x " \
                                                         f"{res['shared']} B of shared memory"
        assert n * regs * threads <= REGS_PER_SM, f"{tiles} {page}: {n} x {regs} registers"
        if tiles.num_warps == 4 and not widened:
            assert (n + 1) * (res["shared"] + 1024) > SMEM_PER_SM, \
                f"{tiles} {page}: {n + 1} programs fit ({res['shared']} B): raise " \
                f"programs_per_sm"
            assert res["latent_ring"], f"{tiles}: bf16 latent tiles not in the cp.async ring"
        if tiles.widen != "dot":
            assert res["latent_ring"] or tiles.num_stages == 1, \
                f"{tiles}: fp8 latent tiles not in the cp.async ring"
            assert "STACK:0" in res["usage"] or not res["usage"] or tiles.ahead, \
                f"{tiles} {page}: register spills ({res['usage']})"
        if tiles.num_stages == 1 and tiles.widen != "dot":   # their point: two an SM
            assert n == 2, f"{tiles}: programs_per_sm {n}"


def test_fp8_dot_widening_stays_out_of_the_ring(compiled):
    """Negative control for the widen "tile" check above: the same fp8 pages widened by
    Triton per dot operand (widen "dot", the memory-bound 4-warp tiles) are loaded outside
    the cp.async ring, so the check can fail."""
    for i, t in enumerate(CANDIDATES):
        if t.layout != "heads" and t.num_warps == 4 and t.widen == "dot":
            assert not compiled[(i, "fp8e4nv", False)]["latent_ring"], str(t)


@pytest.mark.parametrize("i", [i for i, t in enumerate(ALL) if t.ahead and t.num_stages > 1])
def test_prefetch_variants_keep_the_next_tile_in_flight(compiled, i):
    """The ahead variants exist for this: in the loop, the wait for this tile's cp.async
    groups leaves the next tile's in flight (async_wait num > 0), so its load overlaps this
    tile's dots. Negative control: the rule's bf16 tile (once_t h16 n64 w4 s3, the block-table
    entries a pipeline stage of their own) waits for everything (num 0): its next tile is
    issued after the dots and waited for at the top of the next iteration (RESULTS.md,
    mla22h)."""
    tiles = ALL[i]
    page = "fp8e4nv" if tiles.widen != "dot" else "bf16"
    assert compiled[(i, page, False)]["loop_wait"] > 0, f"{tiles}: no tile in flight"
    rule = CANDIDATES.index(LatentTiles(16, 64, 4, 3, layout="once_t"))
    assert compiled[(rule, "bf16", False)]["loop_wait"] == 0


@pytest.mark.parametrize("launch", rule_launches(), ids=lambda x: f"{ALL[x[0]]}-{x[1]}-{x[2]}-{x[3]}")
def test_every_launch_of_the_rule_compiles_for_sm90(compiled, launch):
    """Every tile the rule returns, under every query dtype and page format it meets, with
    the constexprs the launcher passes (launch_constexprs), compiles for sm_90 and fits the
    shared memory its programs_per_sm promises."""
    i, q, c, r = launch
    res = compiled[(i, f"rule:{q}:{c}:{r}", False)]
    assert "error" not in res, f"{ALL[i]} q {q} pages {c}/{r}: {res.get('error')}"
    n = programs_per_sm(ALL[i], c != "bf16")
    assert n * (res["shared"] + 1024) <= SMEM_PER_SM, f"{ALL[i]} q {q} pages {c}/{r}: " \
                                                     f"{n} x {res['shared']} B"


@pytest.mark.parametrize("launch", mass_launches(), ids=lambda x: f"{ALL[x[0]]}-{x[2]}")
def test_mass_launches_compile_for_sm90(compiled, launch):
    """H2O's launches (the scores written beside the attention, kernels/latent_decode.py
    attn_mass) compile for sm_90 and fit the shared memory and registers of the programs an
    SM the rule's splits assume (programs_per_sm). Spills are reported, not asserted: at 128
    heads the 8-warp tile already runs at 255 registers a thread (sm_90, triton 3.9: stack
    8 -> 520 B over bf16 pages)."""
    i, q, c, r = launch
    res = compiled[(i, f"mass:{q}:{c}:{r}", False)]
    assert "error" not in res, f"{ALL[i]} pages {c}: {res.get('error')}"
    n = programs_per_sm(ALL[i], c != "bf16")
    regs = int(re.search(r"REG:(\d+)", res["usage"]).group(1)) if res["usage"] else 0
    assert n * (res["shared"] + 1024) <= SMEM_PER_SM, f"{ALL[i]}: {n} x {res['shared']} B"
    assert n * regs * 32 * ALL[i].num_warps <= REGS_PER_SM, f"{ALL[i]}: {n} x {regs} regs"
