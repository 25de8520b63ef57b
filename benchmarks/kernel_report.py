"""What the compiler made of the decode and prefill kernels: registers, spills, shared memory,
warps / stages, occupancy, and the SASS instruction mix of the whole kernel and of its main
loop, so that a missed speed target (decode at the HBM limit of its bytes, prefill against
cuDNN SDPA) is explained from the compiled kernel, not a guess.

    python benchmarks/kernel_report.py [--out DIR] [--decode bf16,fp8_e4m3/page,fp4_e2m1/page]
                                       [--prefill varlen_bf16,varlen_fp8,paged_fp8,paged_bf16]
    python benchmarks/kernel_report.py --stand-in    # no GPU: compile for sm_90 only (see below)

Each kernel is built the way the benchmarks build it, by launching it once on small inputs
(the binaries depend on the constexprs, which small inputs share with the benchmark shapes):
decode as bench_decode.py's rows (Hq 32, Hkv 8, D 128, page 16, bf16 q, default tile config,
split-K with a combine: DIRECT off, as at the benchmark shapes); prefill as the warm cases
of tests/gpu/prefill_cases.py, i.e. bench_prefill.py's specializations (H 32, D 128, causal,
G 1 and 4; FP8 E4M3; chunked prefill over fp8 / bf16 pages of 16), on every candidate tile.
`kernel[grid](...)` returns triton's CompiledKernel (triton 3.x: JITFunction.run returns it;
n_regs / n_spills are filled when the binary is loaded, metadata.shared / num_warps /
num_stages come from the compile, asm holds 'ptx', 'cubin', 'ttgir' ...). SASS comes from
`cuobjdump -sass` on the cubin (triton's bundled one, else PATH; asm['sass'] as a fallback);
without any, the mix is counted on the PTX.

Output: a table of resources and one of the instruction mix (whole kernel and main loop = the
largest backward-branch range in the SASS, i.e. one tile per warp), plus for decode an issue
bound: the loop's instructions x warps / 4 schedulers = SM issue cycles per tile, against the
bytes a tile reads, at 1.98 GHz x 132 SMs (if that is below HBM speed, the kernel cannot reach
HBM speed even with perfect latency hiding). DIR/kernel_asm.tar.gz holds every kernel's SASS,
PTX, TTGIR and a JSON of the counts.

--stand-in (a CPU machine with triton's nvidia backend): a fake driver reports an sm_90 target
and the kernels are compiled (JITFunction.warmup), not run; registers come from
`cuobjdump -res-usage`. For checking this script and looking at SASS without the GPU; the GPU's
triton version may compile differently.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback

STAND_IN = "--stand-in" in sys.argv
if STAND_IN:
    os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (as on the GPU)

import torch  # noqa: E402
import triton  # noqa: E402

ROOT = __file__.rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, ROOT)

SMS, CLOCK_GHZ, REGS_SM, SMEM_SM, WARPS_SM, BLOCKS_SM = 132, 1.98, 65536, 228 * 1024, 64, 32
HBM_TBS, PEAK_TFLOPS = 4.5, 989.0  # SDPA's measured decode bandwidth; H200 dense bf16 peak
HBM_B_CYC = HBM_TBS * 1e12 / SMS / (CLOCK_GHZ * 1e9)  # bytes per SM cycle
MMA_F_CYC = PEAK_TFLOPS * 1e12 / SMS / (CLOCK_GHZ * 1e9)  # FLOP per SM cycle
MUFU_LANES_CYC = 16  # MUFU results per SM cycle (sm_90: 16 / clk / SM)
DEV = "cpu" if STAND_IN else "cuda"


# --- stand-in driver (CPU) ---------------------------------------------------------------------

def install_stand_in():
    from kvcompile.testing import install_sm90_stand_in

    install_sm90_stand_in()


class StopAfterCompile(Exception):
    pass


# --- capture the compiled kernel of a launch ---------------------------------------------------

def newest_compiled(fn):
    """The last CompiledKernel in a JITFunction's cache (when a launch returned None)."""
    for attr in ("device_caches", "cache"):
        caches = getattr(fn, attr, None)
        if not caches:
            continue
        for entry in list(caches.values())[::-1]:
            table = entry[0] if isinstance(entry, tuple) else entry
            if isinstance(table, dict) and table:
                return list(table.values())[-1]
    return None


class Capture:
    """Stands in for a @triton.jit function: launches it (or only compiles it, --stand-in)
    and keeps (CompiledKernel, constexpr kwargs) of every launch."""

    def __init__(self, fn, stop=False):
        self.fn, self.stop, self.got = fn, stop, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if STAND_IN:
                ck = self.fn.warmup(*args, grid=grid, **kw)
            else:
                ck = self.fn[grid](*args, **kw)
            if ck is None or not hasattr(ck, "asm"):
                ck = newest_compiled(self.fn)
            self.got.append((ck, {k: v for k, v in kw.items()}))
            if self.stop and STAND_IN:
                raise StopAfterCompile()
            return ck
        return launch

    def __getattr__(self, name):
        return getattr(self.fn, name)


# --- SASS -----------------------------------------------------------------------------------

def tool(name: str) -> str | None:
    try:
        from triton import knobs

        p = getattr(getattr(knobs.nvidia, name), "path", None)
        if p and os.path.exists(p):
            return p
    except Exception:  # noqa: BLE001 - older triton: no knobs
        pass
    cands = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name),
             shutil.which(name) or "", f"/usr/local/cuda/bin/{name}"]
    return next((c for c in cands if c and os.path.exists(c)), None)


def cuobjdump(cubin: bytes, flag: str) -> str | None:
    exe = tool("cuobjdump")
    if exe is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([exe, flag, f.name], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


RAW_RE = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;")
PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")
BRA_RE = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-fA-F]+|\.?L\w+|LBB\d+)")


def parse_sass(text: str):
    """-> [(opcode with modifiers, full text)], [(start index, end index)] of backward
    branches. Takes cuobjdump's raw listing (/*addr*/ lines, BRA 0xaddr) or triton's
    asm['sass'] form (ctrl<TAB>instruction; labels 'LBBn:')."""
    ins, labels, targets = [], {}, []
    for line in text.splitlines():
        m = RAW_RE.match(line)
        if m:
            body = m.group(2)
        else:
            s = line.strip()
            if re.match(r"^(LBB\d+|\.L\w+):$", s):
                labels[s[:-1]] = len(ins)
                continue
            if "\t" not in line or not s.endswith(";"):
                continue
            body = line.split("\t", 1)[1].strip().rstrip(";").strip()
        body = PRED_RE.sub("", body.strip())
        if not body:
            continue
        op = body.split()[0]
        bm = BRA_RE.search(body) if op.startswith("BRA") else None
        tgt = None
        if bm:
            t = bm.group(1)
            tgt = int(t, 16) // 16 if t.startswith("0x") else t
        targets.append((len(ins), tgt))
        ins.append((op, body))
    exits = [i for i, (op, _) in enumerate(ins) if op == "EXIT"]
    loops = []
    for i, t in targets:
        if t is None:
            continue
        j = labels.get(t, t) if isinstance(t, str) else t
        # a backward branch over an EXIT is a retry stub placed after the kernel's end (e.g.
        # an mbarrier try-wait jumping back into the loop), not a loop
        if isinstance(j, int) and j < i and not any(j <= e <= i for e in exits):
            loops.append((j, i))
    return ins, loops


CATS = [  # (column, base opcodes); the first match wins
    ("LDG", ("LDG",)), ("LDGSTS", ("LDGSTS",)), ("TMA", ("UTMALDG", "UBLKCP", "UTMASTG")),
    ("LDS", ("LDS", "LDSM")), ("STS", ("STS",)), ("STG", ("STG",)), ("LDL/STL", ("LDL", "STL")),
    ("MMA", ("HMMA", "HGMMA", "QGMMA", "IMMA")),
    ("CVT", ("F2F", "F2FP", "I2F", "I2FP", "F2I", "F2IP", "I2I")), ("PRMT", ("PRMT",)),
    ("FP32", ("FMUL", "FFMA", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK")),
    ("FP16x2", ("HMUL2", "HFMA2", "HADD2", "HMNMX2", "HSETP2")),
    ("INT", ("IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "SEL", "IABS", "IMNMX", "SGXT",
             "BMSK", "VIADD", "VIMNMX", "IDP")),
    ("MOV", ("MOV", "UMOV", "S2R", "S2UR", "CS2R", "R2UR", "LDC", "ULDC")),
    ("MUFU", ("MUFU",)), ("BAR", ("BAR",)),
    ("MBAR", ("SYNCS", "DEPBAR", "LDGDEPBAR", "ARRIVES", "WARPGROUP")),  # mbarrier, wgmma sync
    ("SHFL", ("SHFL",)), ("BRANCH", ("BRA", "BSSY", "BSYNC", "EXIT", "WARPSYNC", "CALL", "RET")),
]
COLS = [c for c, _ in CATS]


def mix(ins) -> dict:
    out = {c: 0 for c in COLS}
    out["other"] = 0
    out["total"] = sum(1 for op, _ in ins if op != "NOP")
    mufu: dict[str, int] = {}
    for op, _ in ins:
        if op == "NOP":
            continue
        base = op.split(".")[0]
        for col, names in CATS:
            if base in names:
                out[col] += 1
                break
        else:
            out["other"] += 1
        if base == "MUFU":
            sub = op.split(".")[1] if "." in op else "?"
            mufu[sub] = mufu.get(sub, 0) + 1
    out["mufu_kinds"] = mufu
    out["mma_kinds"] = sorted({op.split(".")[0] for op, _ in ins
                               if op.split(".")[0] in dict(CATS)["MMA"]})
    return out


PTX_CATS = [("LDG", r"\bld\.global"), ("LDGSTS", r"\bcp\.async\.(?:ca|cg)"),
            ("TMA", r"\bcp\.async\.bulk"), ("LDS", r"\b(?:ld\.shared|ldmatrix)"),
            ("STS", r"\bst\.shared"), ("STG", r"\bst\.global"), ("LDL/STL", r"\b(?:ld|st)\.local"),
            ("MMA", r"\b(?:mma\.sync|wgmma\.mma_async)"), ("CVT", r"\bcvt\."),
            ("PRMT", r"\bprmt\."), ("FP32", r"\b(?:mul|fma|add|max|min)(?:\.rn|\.ftz)*\.f32"),
            ("FP16x2", r"\b(?:mul|fma|add)(?:\.rn)?\.(?:f16x2|bf16x2)"),
            ("MUFU", r"\b(?:ex2|rcp|lg2|tanh|sqrt|rsqrt)\.approx"),
            ("BAR", r"\b(?:bar\.sync|barrier\.sync)"),
            ("MBAR", r"\b(?:mbarrier|cp\.async\.wait|wgmma\.wait)"),
            ("SHFL", r"\bshfl\.")]


def ptx_mix(ptx: str) -> dict:
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith(
        ("//", ".", "{", "}", "$")) and ln.strip().endswith(";")]
    out = {c: 0 for c in COLS}
    out["total"] = len(lines)
    for col, pat in PTX_CATS:
        out[col] = sum(1 for ln in lines if re.search(pat, ln))
    out["other"] = 0
    return out


# --- one compiled kernel -----------------------------------------------------------------------

def meta(ck, key):
    md = getattr(ck, "metadata", None)
    if isinstance(md, dict):
        return md.get(key)
    return getattr(md, key, None)


def analyse(label: str, ck, kw: dict, tile_bytes: float | None, tile_keys: int | None,
            tile_flops: float | None) -> dict:
    r = {"kernel": label, "name": getattr(ck, "name", None) or meta(ck, "name")}
    if not STAND_IN and getattr(ck, "n_regs", None) is None:
        try:
            ck._init_handles()  # older triton: loaded on first run only
        except Exception:  # noqa: BLE001
            pass
    r["regs"] = getattr(ck, "n_regs", None)
    r["spills"] = getattr(ck, "n_spills", None)
    r["shared"] = meta(ck, "shared")
    r["num_warps"] = meta(ck, "num_warps") or kw.get("num_warps")
    r["num_stages"] = meta(ck, "num_stages") or kw.get("num_stages")
    r["maxnreg"] = meta(ck, "maxnreg") or kw.get("maxnreg")
    r["constexprs"] = {k: str(v) for k, v in kw.items()}
    asm = getattr(ck, "asm", {}) or {}
    cubin = asm.get("cubin") if hasattr(asm, "get") else None
    sass, source = None, None
    raw = cuobjdump(cubin, "-sass") if cubin else None
    if raw:
        sass, source = raw, "cuobjdump -sass"
    else:
        try:
            sass, source = asm["sass"], "asm['sass']"
        except Exception:  # noqa: BLE001 - no cuobjdump: PTX counts below
            sass = None
    res = cuobjdump(cubin, "-res-usage") if cubin else None
    if res:
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", res)
        if m:
            r["res_usage"] = dict(zip(("REG", "STACK", "SHARED_static", "LOCAL"),
                                      map(int, m.groups())))
            if r["regs"] is None:
                r["regs"] = int(m.group(1))
    r["files"] = {"sass": sass, "ptx": asm.get("ptx") if hasattr(asm, "get") else None,
                  "ttgir": asm.get("ttgir") if hasattr(asm, "get") else None}
    if sass:
        ins, loops = parse_sass(sass)
        r["mix_source"] = source
        r["mix"] = mix(ins)
        loops = sorted(loops, key=lambda ab: ab[0] - ab[1])  # largest first
        loops = [ab for ab in loops if ab[1] - ab[0] + 1 >= 16]  # not try-wait spin loops
        r["loops"] = [(a, b, b - a + 1) for a, b in loops[:4]]
        if loops:
            a, b = loops[0]
            r["loop_mix"] = mix(ins[a:b + 1])
            # the other loops of the kernel (prefill: the masked diagonal tiles and the
            # unmasked ones run in separate loops)
            r["other_loop_mixes"] = [((a, b), mix(ins[a:b + 1])) for a, b in loops[1:3]
                                     if b - a + 1 >= 64]
    elif r["files"]["ptx"]:
        r["mix_source"] = "PTX (no cuobjdump)"
        r["mix"] = ptx_mix(r["files"]["ptx"])
    # occupancy: programs per SM from registers, shared memory, warps
    w, regs, sh = r["num_warps"], r["regs"], r["shared"]
    if w and regs:
        per_prog = -(-regs // 8) * 8 * 32 * w
        lim = [REGS_SM // per_prog, WARPS_SM // w, BLOCKS_SM]
        if sh is not None:
            lim.append(SMEM_SM // (sh + 1024))
        r["programs_per_sm"] = min(lim)
        r["limiter"] = ["registers", "warps", "blocks", "shared memory"][lim.index(min(lim))]
    r["tile_bytes"], r["tile_keys"], r["tile_flops"] = tile_bytes, tile_keys, tile_flops
    lm = r.get("loop_mix")
    if lm and tile_bytes and w:
        cycles = lm["total"] * w / 4  # 4 warp schedulers per SM, one instruction each / cycle
        r["issue_cycles_per_tile"] = cycles
        r["issue_bound_tbs"] = tile_bytes / cycles * CLOCK_GHZ * 1e9 * SMS / 1e12
    # SM cycles one tile (one iteration of a loop) needs from each resource, at full rate:
    # the largest is the bound at perfect overlap; measured time far above it = latency
    r["budget"] = []
    if w:
        loops = [((r["loops"][0][0], r["loops"][0][1]), lm)] if lm else []
        loops += r.get("other_loop_mixes", [])
        for (a, b), m in loops:
            c = {"loop": f"{a}-{b}", "issue": m["total"] * w / 4,
                 "mufu": m["MUFU"] * w * 32 / MUFU_LANES_CYC,
                 # fp8 wgmma (QGMMA) runs at twice the bf16 rate
                 "mma": (tile_flops / MMA_F_CYC / (2 if "QGMMA" in m.get("mma_kinds", []) else 1)
                         if tile_flops else None),
                 "hbm": tile_bytes / HBM_B_CYC if tile_bytes else None,
                 "bar": m["BAR"], "mbar": m["MBAR"]}
            vals = {k: v for k, v in c.items() if k in ("issue", "mufu", "mma", "hbm") and v}
            c["bound"] = max(vals, key=vals.get) if vals else "-"
            r["budget"].append(c)
    return r


# --- the kernels -------------------------------------------------------------------------------

def decode_kernels(formats: list[str]) -> list[dict]:
    import kvcompile.kernels.decode as dec
    from benchmarks import bench_decode as bd

    bd.DEV = DEV
    rows = []
    if STAND_IN:  # launch_decode's contract check wants CUDA tensors: let it pass on the CPU
        orig_check = dec._check

        def check(*a):
            dec.interpreting = lambda: True
            try:
                return orig_check(*a)
            finally:
                dec.interpreting = lambda: False

        dec._check, dec.interpreting, dec._sm_count = check, (lambda: False), (lambda d: SMS)
    real = dec.decode_split_kernel, dec.combine_splits_kernel
    for fmt in formats:
        cap = Capture(real[0])
        dec.decode_split_kernel, dec.combine_splits_kernel = cap, Capture(real[1])
        try:
            gen = torch.Generator(device=DEV).manual_seed(0)
            B, L, Hq, Hkv, D = 1, 2048, 32, 8, 128
            kc, vc, bt, sl = bd.build_paged(fmt, B, L, Hkv, D, gen)
            q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            out = torch.empty_like(q)
            cfg = bd.base_config(fmt, D, {})
            # explicit splits: split-K + combine (DIRECT off), as at the benchmark shapes
            bd.decode_fn(q, kc, vc, bt, sl, out, cfg, splits=4)()
            if not STAND_IN:
                torch.cuda.synchronize()
            ck, kw = cap.got[-1]
            k_spec, v_spec, page = bd.split_spec(fmt)
            per_tok = sum(bd.make_format(f).bytes_per_token(1, D, page) for f in (k_spec, v_spec))
            bt_ = kw.get("BLOCK_T")
            flops = 2 * kw.get("M", 16) * bt_ * (kw.get("D", D) + kw.get("DV", D)) if bt_ else None
            r = analyse(f"decode {fmt}", ck, kw, per_tok * bt_ if bt_ else None, bt_, flops)
            r["config"] = cfg
            rows.append(r)
        except Exception as e:  # noqa: BLE001 - report the others
            print(f"decode {fmt}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=4)
        finally:
            dec.decode_split_kernel, dec.combine_splits_kernel = real
    return rows


def prefill_kernels(sets: list[str]) -> list[dict]:
    from kvcompile.kernels import prefill_paged, prefill_varlen
    from tests.gpu import prefill_cases as gp

    if STAND_IN:  # no GPU: build the sm_90 binaries with the GPU's dtypes, run nothing
        gp.BF = {"bf16": torch.bfloat16, "fp16": torch.float16}
        gp.DEV = "cpu"
        gp.L.device_has_tma = lambda device: True  # the sm_90 binaries load K/V through TMA
    want = {  # set name -> predicate on a warm case (bench_prefill.py's specializations)
        "varlen_bf16": lambda c: c["kind"] == "varlen" and c["hkv"] == 32,
        "varlen_gqa_bf16": lambda c: c["kind"] == "varlen" and c["hkv"] == 8
        and not c.get("k_lens"),
        "varlen_chunk_bf16": lambda c: c["kind"] == "varlen" and bool(c.get("k_lens")),
        "varlen_fp8": lambda c: c["kind"] == "fp8" and c["hkv"] == 32,
        "paged_fp8": lambda c: c["kind"] == "paged" and c["fmt"] == "fp8_e4m3",
        "paged_bf16": lambda c: c["kind"] == "paged" and c["fmt"] == "bf16",
    }
    rows = []
    real = prefill_varlen.prefill_varlen_kernel, prefill_paged.paged_prefill_kernel
    for name in sets:
        if name not in want:
            print(f"prefill set {name!r} unknown; known: {', '.join(want)}")
            continue
        for c in [c for c in gp.warm_cases() if want[name](c)]:
            caps = Capture(real[0], stop=True), Capture(real[1], stop=True)
            prefill_varlen.prefill_varlen_kernel, prefill_paged.paged_prefill_kernel = caps
            label = f"prefill {name} {c['cfg']}"
            try:
                if STAND_IN:
                    fn = {"varlen": gp.run_varlen, "fp8": gp.run_fp8, "paged": gp.run_paged}
                    try:
                        fn[c["kind"]](c, torch.Generator().manual_seed(0))
                    except StopAfterCompile:
                        pass
                    check = "not run (stand-in)"
                else:
                    res = gp.run_case(c)
                    check = (f"{res['status']} err {res['err']:.2e} <= {res['bound']:.2e}"
                             if res["ok"] else f"{res['status']} err {res['err']}")
                got = [g for cap in caps for g in cap.got]
                if not got:
                    raise RuntimeError("no launch captured")
                ck, kw = got[-1]
                flops = (2 * kw.get("BLOCK_M", 0) * kw.get("BLOCK_N", 0)
                         * (kw.get("HEAD_DIM", 0) + kw.get("HEAD_DIM_V", kw.get("HEAD_DIM", 0))))
                r = analyse(label, ck, kw, None, None, flops or None)
                r["check"] = check
                rows.append(r)
            except Exception as e:  # noqa: BLE001
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=4)
            finally:
                prefill_varlen.prefill_varlen_kernel, prefill_paged.paged_prefill_kernel = real
    return rows


# --- report --------------------------------------------------------------------------------------

def fmt_num(x, spec="d"):
    return "-" if x is None else format(x, spec)


def print_report(rows: list[dict]) -> None:
    print("\n## Resources (per program)\n")
    print("| kernel | regs | spills | smem KB | warps | stages | maxnreg | programs/SM (limit) "
          "| warps/SM | SASS from |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sh = f"{r['shared'] / 1024:.1f}" if r.get("shared") is not None else "-"
        occ = (f"{r['programs_per_sm']} ({r['limiter']})" if r.get("programs_per_sm") else "-")
        wsm = (r["programs_per_sm"] * r["num_warps"]) if r.get("programs_per_sm") else None
        print(f"| {r['kernel']} | {fmt_num(r['regs'])} | {fmt_num(r['spills'])} | {sh} | "
              f"{fmt_num(r['num_warps'])} | {fmt_num(r['num_stages'])} | "
              f"{fmt_num(r['maxnreg'])} | {occ} | {fmt_num(wsm)} | {r.get('mix_source', '-')} |")
    cols = ["total"] + COLS
    for part, title in (("mix", "whole kernel"),
                        ("loop_mix", "largest loop = one tile, per warp (other loops below it)")):
        print(f"\n## Instruction mix, {title}\n")
        print("| kernel | " + " | ".join(cols) + " | MUFU kinds | MMA op |")
        print("|---|" + "---|" * (len(cols) + 2))
        for r in rows:
            mixes = [(r["kernel"], r.get(part))]
            if part == "loop_mix":
                (a, b, _), = r.get("loops", [(0, 0, 0)])[:1] or [(0, 0, 0)]
                mixes = [(f"{r['kernel']} [{a}-{b}]", r.get(part))] + [
                    (f"{r['kernel']} [{x}-{y}]", m) for (x, y), m in
                    r.get("other_loop_mixes", [])]
            for label, m in mixes:
                if not m:
                    print(f"| {label} | " + " | ".join("-" for _ in cols) + " | - | - |")
                    continue
                mk = ",".join(f"{k}:{v}" for k, v in sorted(m.get("mufu_kinds", {}).items()))
                print(f"| {label} | " + " | ".join(str(m.get(c, 0)) for c in cols)
                      + f" | {mk or '-'} | {','.join(m.get('mma_kinds', [])) or '-'} |")
    dec = [r for r in rows if r.get("issue_bound_tbs")]
    if dec:
        print("\n## Decode: issue bound of the main loop\n")
        print("| kernel | keys / tile | bytes / tile | loop instr / warp | SM issue cycles / tile"
              " | issue-bound TB/s (132 SMs, 1.98 GHz) |")
        print("|---|---|---|---|---|---|")
        for r in dec:
            print(f"| {r['kernel']} | {r['tile_keys']} | {r['tile_bytes']:.0f} | "
                  f"{r['loop_mix']['total']} | {r['issue_cycles_per_tile']:.0f} | "
                  f"{r['issue_bound_tbs']:.2f} |")
    print("\n## Cycle budget of one tile (one loop iteration of one program), SM cycles at "
          "full rate\n")
    print(f"issue = loop instructions x warps / 4 schedulers; MUFU = MUFU ops x 32 lanes x warps "
          f"/ {MUFU_LANES_CYC} per cycle; MMA = the tile's FLOPs at {PEAK_TFLOPS:.0f} TFLOP/s "
          f"(fp8 QGMMA: twice; decode's mma.sync HMMA: a lower bound); "
          f"HBM = the tile's stored bytes at {HBM_TBS} TB/s (decode). The largest is the bound "
          f"with perfect overlap; a measured time well above it means latency (dependency "
          f"chains, barriers: BAR / MBAR per tile, and warps/SM to hide them).\n")
    print("| kernel | loop (SASS index) | issue | MUFU | MMA | HBM | BAR | MBAR | bound at full "
          "overlap | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    def f(v):
        return "-" if v is None else f"{v:.0f}"

    for r in rows:
        for c in r.get("budget", []):
            print(f"| {r['kernel']} | {c['loop']} | {f(c['issue'])} | {f(c['mufu'])} | "
                  f"{f(c['mma'])} | {f(c['hbm'])} | {c['bar']} | {c['mbar']} | {c['bound']} | "
                  f"{r.get('check', '-')} |")


def save(rows: list[dict], path: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))

        summary = []
        for r in rows:
            stem = re.sub(r"[^A-Za-z0-9._-]+", "_", r["kernel"]).strip("_")
            for ext, text in r["files"].items():
                if text:
                    add(f"kernel_asm/{stem}.{ext}", text)
            summary.append({k: v for k, v in r.items() if k != "files"})
        add("kernel_asm/summary.json", json.dumps(summary, indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode", default="bf16,fp8_e4m3/page,fp4_e2m1/page",
                    help="bench_decode.py row specs ('' for none)")
    ap.add_argument("--prefill", default="varlen_bf16,varlen_fp8,paged_fp8,paged_bf16",
                    help="sets of tests/gpu/prefill_cases.py warm cases ('' for none); also: "
                         "varlen_gqa_bf16, varlen_chunk_bf16")
    ap.add_argument("--stand-in", action="store_true",
                    help="no GPU: compile for sm_90 through a fake driver, do not run")
    a = ap.parse_args()
    if STAND_IN:
        install_stand_in()
    elif not torch.cuda.is_available():
        print("kernel_report: no CUDA device (use --stand-in on a CPU machine)")
        return 2
    t0 = time.time()
    dev = "stand-in sm_90 (compile only)" if STAND_IN else torch.cuda.get_device_name()
    print(f"kernel report: {dev}, torch {torch.__version__}, triton {triton.__version__}, "
          f"cuobjdump {tool('cuobjdump') or 'not found'}", flush=True)
    rows = decode_kernels([f for f in a.decode.split(",") if f])
    rows += prefill_kernels([s for s in a.prefill.split(",") if s])
    print_report(rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "kernel_asm.tar.gz")
    save(rows, path)
    print(f"\nkernel report: {len(rows)} kernels in {time.time() - t0:.0f} s; SASS / PTX / TTGIR "
          f"and summary.json in {path}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
