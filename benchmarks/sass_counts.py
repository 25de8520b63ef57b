"""The CUDA decode kernel's main loop in SASS: instructions per 16-token step and warp, by kind.

    python benchmarks/sass_counts.py [--variants base,nocap,aluk,alu] [--cases e4m3_page_d128,...]
                                     [--json FILE] [--dump DIR]

Needs nvcc (CUDA 12.4+) and nvdisasm (on PATH, or the copy Triton ships); no GPU. Each case is
built with build.py's flags (plus -Xptxas -v for registers / spills), disassembled, and the
loop over a warp's steps (the backward branch whose body holds the HMMAs) counted. "hot" leaves
out the blocks a step skips in steady state: forward-branched regions of more than 12
instructions without a cp.async (the O rescale, the value-scale rescale, the edge masks); "all"
is the whole body. Bytes per step: 16 tokens of K and V as stored (+ their scales).
benchmarks/RESULTS.md, "The CUDA decode kernel's limiter, from its SASS", reads these numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.kernels import decode_sm90 as fast  # noqa: E402
from kvcompile.kernels.cuda import build  # noqa: E402

# name -> (k kind, k scale mode, D, rows, q dtype code); V like K
CASES = {
    "e4m3_page_d128": (0, 1, 128, 8, 1),
    "e4m3_token_d128": (0, 2, 128, 8, 1),
    "e4m3_tensor_d128": (0, 3, 128, 8, 1),
    "e5m2_page_d128": (1, 1, 128, 8, 1),
    "e4m3_page_d64": (0, 1, 64, 8, 1),
    "e4m3_page_d128_r16": (0, 1, 128, 16, 1),  # 16 query rows (G 8 x Sq 2, G 16)
    "bf16_d128": (3, 0, 128, 8, 1),
    "bf16_d64": (3, 0, 64, 8, 1),
    # int4 pages, K channel scale + zero / V token scale + zero (the chosen 4-bit format)
    "int4_chan_d128": (4, 4, 128, 8, 1),
    "int4_chan_d64": (4, 4, 64, 8, 1),
}
# SASS opcode (first word, predicate dropped) -> column
GROUPS = [
    ("LDGSTS", r"^LDGSTS"), ("LDG", r"^LDG\b|^LDG\."), ("LDS", r"^LDS"),
    ("F2FP unpack", r"^F2FP\..*UNPACK"), ("F2FP pack", r"^F2FP\..*PACK_AB"),
    ("PRMT", r"^PRMT"), ("LOP3/SHF", r"^(LOP3|SHF)(\.|$)"), ("HMMA", r"^HMMA"),
    ("FMNMX", r"^FMNMX"), ("SHFL", r"^SHFL"), ("MUFU.EX2", r"^MUFU\.EX2"),
    ("MUFU.TANH", r"^MUFU\.TANH"), ("MUFU other", r"^MUFU"),
    ("FMUL/FADD/FFMA", r"^(FMUL|FADD|FFMA)"), ("IMAD", r"^IMAD"),
    ("IADD3/ISETP/LEA/SEL", r"^(IADD3|VIADD|ISETP|LEA|SEL)"),
    ("wait/sync", r"^(DEPBAR|LDGDEPBAR|WARPSYNC|BAR|VOTE|BSSY|BSYNC|NOP)"),
]


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import triton

    cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if cand.exists():
        return str(cand)
    raise SystemExit("nvdisasm not found (CUDA toolkit, or Triton's bundled copy)")


def compile_case(key: tuple, arch: str = "sm_90") -> tuple[str, str]:
    """(SASS text, ptxas -v output) of the variant `key` (decode_sm90._kernel's key)."""
    defines, ctas, _ = fast.kernel_constants(*key)
    nvcc = build.nvcc_path()
    if nvcc is None:
        raise SystemExit("nvcc not found")
    wrapper = build._WRAPPER.format(header="paged_decode.cuh", threads=fast.WARPS * 32,
                                    min_blocks=ctas, name="kvc_paged_decode",
                                    params="DecodeParams", call=fast.KERNEL_CALL)
    flags = ["-cubin", f"-arch={arch}", "-O3", "--use_fast_math", "-std=c++17",
             f"-I{build._HERE}", "-Xptxas", "-v"] + [f"-D{k}={v}" for k, v in
                                                     sorted(defines.items())]
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = Path(tmp, "k.cu"), Path(tmp, "k.cubin")
        cu.write_text(wrapper)
        res = subprocess.run([nvcc, *flags, "-o", str(out), str(cu)], capture_output=True,
                             text=True, timeout=600)
        if res.returncode != 0:
            raise SystemExit(f"nvcc failed for {key}:\n{res.stderr[-3000:]}")
        sass = subprocess.run([nvdisasm(), "-c", str(out)], capture_output=True, text=True,
                              timeout=300, check=True).stdout
    return sass, res.stderr


_INSN = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def parse(sass: str) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """[(opcode, operands)] of the kernel body and {label: index of the next instruction}."""
    insns, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if m:
            insns.append((m.group(3), (m.group(2) or "") + m.group(4)))
    return insns, labels


def main_loop(insns, labels) -> tuple[int, int]:
    """[start, end] of the backward branch's body holding the most HMMAs."""
    best = None
    for i, (op, rest) in enumerate(insns):
        m = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and m and labels.get(m.group(1), i + 1) <= i:
            lo = labels[m.group(1)]
            n = sum(1 for o, _ in insns[lo:i + 1] if o.startswith("HMMA"))
            if best is None or n > best[0]:
                best = (n, lo, i)
    if best is None or best[0] == 0:
        raise SystemExit("no loop with HMMA found")
    return best[1], best[2]


def cold_ranges(insns, labels, lo, hi) -> list[tuple[int, int]]:
    """Forward-branched regions inside [lo, hi] skipped in steady state (see the docstring)."""
    out = []
    for i in range(lo, hi + 1):
        op, rest = insns[i]
        m = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and m and rest.lstrip().startswith("@"):
            tgt = labels.get(m.group(1), -1)
            if i < tgt <= hi + 1:
                body = insns[i + 1:tgt]
                if len(body) > 12 and not any(o.startswith("LDGSTS") for o, _ in body):
                    out.append((i + 1, tgt))
    return out


def count(insns, lo, hi, cold) -> dict[str, dict[str, int]]:
    skip = set()
    for a, b in cold:
        skip.update(range(a, b))
    res = {}
    for name, idx in (("all", range(lo, hi + 1)),
                      ("hot", [i for i in range(lo, hi + 1) if i not in skip])):
        c = Counter()
        for i in idx:
            op = insns[i][0]
            for g, pat in GROUPS:
                if re.match(pat, op):
                    c[g] += 1
                    break
            else:
                c["other"] += 1
        c["total"] = sum(v for k, v in c.items())
        res[name] = dict(c)
    return res


def step_bytes(kk: int, ksm: int, d: int, page: int = 64) -> int:
    if kk == 4:  # int4 K channel (fp16 scale + zero per channel and page) / V token
        return int(16 * (d / 2 + 4 * d / page) + 16 * (d / 2 + 4))
    eb = 2 if kk >= 2 else 1  # (bf16: ksm 0, no scales)
    sc = {0: 0, 1: 2 * 4 / 16, 2: 4, 3: 0}[ksm]  # per-token share of page / token scales
    return int(2 * 16 * (d * eb + sc))


def run(variants, cases) -> list[dict]:
    rows = []
    for case in cases:
        kk, ksm, d, rows_, qt = CASES[case]
        for v in variants:
            var = fast.variant_bits(v, kk, kk, 0.0, rows=rows_)
            vsm = 5 if kk == 4 else ksm  # int4 values: token scale + zero point
            key = (kk, kk, ksm, vsm, d, d, rows_, qt, 0) + ((var,) if var else ())
            sass, info = compile_case(key)
            regs = re.search(r"Used (\d+) registers", info)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
            insns, labels = parse(sass)
            lo, hi = main_loop(insns, labels)
            cold = cold_ranges(insns, labels, lo, hi)
            c = count(insns, lo, hi, cold)
            rows.append({"case": case, "variant": v, "var_bits": var,
                         "registers": int(regs.group(1)) if regs else None,
                         "spill_bytes": (int(spill.group(1)) + int(spill.group(2))
                                         if spill else None),
                         "ctas_per_sm": fast.kernel_constants(*key)[1],
                         "stages": fast.kernel_constants(*key)[0]["KVC_NS"],
                         "smem_per_cta": fast.kernel_constants(*key)[2],
                         "step_bytes": step_bytes(kk, ksm, d), "counts": c,
                         "cold_blocks": [b - a for a, b in cold]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(fast.VARIANTS))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = run([v for v in a.variants.split(",") if v], [c for c in a.cases.split(",") if c])
    cols = [g for g, _ in GROUPS] + ["other", "total"]
    print("case variant regs spill B/step CTAs/SM stages | hot counts per step and warp: "
          + ", ".join(cols))
    for r in rows:
        h = r["counts"]["hot"]
        print(f"{r['case']} {r['variant']} {r['registers']} {r['spill_bytes']} "
              f"{r['step_bytes']} {r['ctas_per_sm']} {r['stages']} | " + " ".join(f"{g}={h.get(g, 0)}" for g in cols)
              + f" | all={r['counts']['all']['total']} cold={r['cold_blocks']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
