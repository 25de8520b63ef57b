"""The Gluon FP8 prefill kernel (kernels/prefill_sm90.py) on a machine without a GPU: built for
sm_90 by the installed Triton (head_dim 64 and 128), with no spills and without ptxas
serializing its asynchronous wgmma (a non-wgmma instruction touching an in-flight
accumulator makes ptxas wait after every wgmma: the kernel's overlap gone, silently, warning
C7514); and which prefills it refuses, and why. Its numbers are checked on the GPU
(benchmarks/bench_prefill_fp8.py). Checked with the GPU image's triton 3.6 too (2026-12-07)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import pytest
import torch

from kvcompile.kernels import prefill_sm90 as P
from tests.kernels.sm90_compile import compile_rows, innermost_error


def _build(d: int, q_bf16: bool, variant: str = "serial") -> list:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    x = torch.zeros(1024, 8 * d, dtype=torch.float8_e4m3fn)
    xq = torch.zeros(1024, 8 * d, dtype=torch.bfloat16)

    def desc(block, t=x):   # as the launcher builds them: Q [16 * warps, d], K [128, d], V^T
        lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t is xq else
                                                   gl.float8e4nv)
        return mangle_type(TensorDescriptor(t, list(t.shape), list(t.stride()), block, lay))

    bm = 16 * P.NUM_WARPS
    bn = 64 if variant == "pipe" else P.BLOCK_N   # keys a tile
    types = dict(q_desc=desc([bm, d], xq if q_bf16 else x), k_desc=desc([bn, d]),
                 v_desc=desc([d, bn]),
                 Out="*bf16", cu_seqlens="*i32", cu_blocks="*i32", QD="*fp32", KD="*fp32",
                 VD="*fp32", sm_scale_log2="fp32", stride_ot="i32", stride_oh="i32",
                 stride_sb="i32", ratio="i32", HEAD_DIM="constexpr", SYNC="constexpr",
                 OVERLAP="constexpr", TREE="constexpr", Q_BF16="constexpr",
                 q8_layout="constexpr", LAZY="constexpr", TAU="constexpr",
                 PIPE="constexpr", BLOCK="constexpr", num_warps="constexpr")
    fn = P.prefill_fp8_sm90_kernel
    try:
        cx = {"HEAD_DIM": d, "SYNC": False, "OVERLAP": False, "TREE": False, "Q_BF16": q_bf16,
              "q8_layout": gl.NVMMASharedLayout.get_default_for([bm, d], gl.float8e4nv),
              "LAZY": variant == "lazy", "TAU": 3.0, "PIPE": variant == "pipe",
              "BLOCK": bn, "num_warps": P.NUM_WARPS}
        k = triton.compile(GluonASTSource(fn=fn, signature=types, constexprs=cx),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=P.NUM_WARPS))
    except Exception as e:  # reported to the test, which fails with the innermost cause
        return [d, q_bf16, variant, innermost_error(e), 0, -1, ""]
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path   # the ptxas this Triton builds sm_90 with
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    stack = re.search(r"(\d+) bytes stack frame", r.stderr)
    warn = " ".join(re.findall(r"\(C7514\)[^\n]*", r.stderr))
    return [d, q_bf16, variant, "ok" if r.returncode == 0 else r.stderr[-1500:],
            int(regs.group(1)) if regs else 0, int(stack.group(1)) if stack else -1, warn]


# (head_dim, Q in bf16 for the kernel to quantize, the loop: "serial" (the default), "lazy"
# (O rescaled lazily), "pipe" (64-key tiles, q.k a tile ahead)) of the builds checked
BUILDS = ([(d, b, "serial") for d in P.HEAD_DIMS for b in (False, True)]
          + [(128, b, v) for v in ("lazy", "pipe") for b in (False, True)])


def _main() -> None:
    for d, q_bf16, variant in BUILDS:
        print(json.dumps(_build(d, q_bf16, variant)), flush=True)


@pytest.mark.skipif(P.GLUON_ERROR is not None, reason=str(P.GLUON_ERROR))
def test_gluon_fp8_prefill_builds_for_sm90_without_serialized_wgmma():
    rows = compile_rows("tests.kernels.test_prefill_sm90")
    assert [tuple(r[:3]) for r in rows] == BUILDS
    for d, q_bf16, variant, status, regs, stack, warn in rows:
        what = f"head_dim {d}, q {'bf16' if q_bf16 else 'e4m3'}, {variant}"
        assert status == "ok", f"{what}: {status}"
        assert stack == 0, f"{what}: {stack} bytes of stack (spills), {regs} registers"
        assert not warn, f"{what}: ptxas serialized the wgmma: {warn}"


def _inputs(d=128, hq=4, hkv=2, T=300, dv=None):
    f8 = torch.float8_e4m3fn
    q8 = torch.zeros(T, hq, d, dtype=f8)
    k8 = torch.zeros(T, hkv, d, dtype=f8)
    vt8 = torch.zeros(hkv * (dv or d), 512, dtype=f8)
    out = torch.empty(T, hq, dv or d, dtype=torch.bfloat16)
    return q8, k8, vt8, out


@pytest.mark.parametrize("case, why", [
    (dict(causal=False), "causal self-attention only"),
    (dict(window=64), "causal self-attention only"),
    (dict(sinks=4), "causal self-attention only"),
    (dict(softcap=30.0), "causal self-attention only"),
    (dict(d=256), "head_dim 256"),
    (dict(dv=64), "head_dim 128 / 64"),
    (dict(out=torch.float32), "output torch.float32"),
    (dict(strided=True), "non-contiguous"),
    (dict(q=torch.float16), "q torch.float16"),
    (dict(), "not a Hopper"),    # everything else it takes: the CPU is the one refusal left
])
def test_gluon_fp8_prefill_says_what_it_does_not_take(case, why):
    q8, k8, vt8, out = _inputs(d=case.get("d", 128), dv=case.get("dv"))
    if "out" in case:
        out = out.to(case["out"])
    if "q" in case:
        q8 = q8.to(case["q"])
    if case.get("strided"):
        q8 = q8.transpose(0, 1).contiguous().transpose(0, 1)
    reason = P.unsupported(q8, k8, vt8, out, case.get("causal", True), case.get("window", 0),
                           case.get("sinks", 0), case.get("softcap", 0.0), None)
    if P.GLUON_ERROR is not None and why == "not a Hopper":
        why = "gluon"
    assert reason is not None and why in reason, reason
