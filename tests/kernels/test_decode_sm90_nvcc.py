"""paged_decode.cuh through nvcc for sm_90 on the CPU machine (no GPU needed): the default
variant and the opt-in qk_fp8 variant (q.k on e4m3 tensor cores, mma.sync m16n8k32) both build,
for ROWS 8 / 16, head_dim 64 / 128, and the int4 variants, each into a fresh cache (so the compile really runs).
Skipped where nvcc is absent. Their numbers: test_decode_sm90_emu.py (CPU emulation) and
tests/gpu/test_decode_sm90_gpu.py (H200)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcompile.kernels import decode_sm90 as fast
from kvcompile.kernels.cuda import build

pytestmark = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not found")

# (kk, vk, ksm, vsm, D, DV, ROWS, QT, q8)
VARIANTS = [
    (0, 0, 1, 1, 128, 128, 8, 1, 0),
    (0, 0, 1, 1, 128, 128, 8, 1, 1),
    (0, 0, 2, 2, 64, 64, 16, 2, 1),
    (0, 3, 3, 0, 128, 128, 16, 0, 1),  # e4m3 keys (tensor scale), bf16 values
    (4, 4, 4, 5, 128, 128, 8, 1, 0),   # int4 keys (channel scale + zero), int4 values (token)
    (4, 4, 4, 5, 128, 128, 16, 0, 0),
    (4, 0, 4, 2, 128, 128, 8, 2, 0),   # int4 keys, e4m3 values with token scales
    (4, 4, 4, 5, 64, 64, 16, 1, 0),    # int4, head_dim 64
]


def _cubin(key, arch="sm_90") -> bytes:
    defines, ctas, _ = fast.kernel_constants(*key)
    return build.build_cubin("paged_decode.cuh", "kvc_paged_decode", fast.KERNEL_CALL, defines,
                             arch=arch, threads=fast.WARPS * 32, min_blocks=ctas)


@pytest.mark.parametrize("key", VARIANTS, ids=lambda k: "q8-" + "-".join(map(str, k)))
def test_builds_for_sm90(key, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cubin = _cubin(key)
    assert cubin[:4] == b"\x7fELF"
    assert list((tmp_path / "kvcompile" / "cuda").glob("kvc_paged_decode-*.cubin"))


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.exists() else None


@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump not found")
def test_qk8_is_the_fp8_tensor_core_instruction(tmp_path, monkeypatch):
    """The qk_fp8 variant's PTX is the FP8 MMA: built for sm_89 (Ada, where mma.sync takes e4m3
    natively) its SASS holds QMMA.16832 e4m3 and the default variant's none. (For sm_90 ptxas
    lowers the same PTX to F2FP unpacks + HMMA.16816: Hopper's FP8 tensor cores are reached
    through wgmma only; benchmarks/RESULTS.md, "qk_fp8".)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def sass(key):
        path = tmp_path / f"k{key[-1]}.cubin"
        path.write_bytes(_cubin(key, arch="sm_89"))
        return subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True,
                              text=True, timeout=120).stdout

    assert "QMMA.16832.F32.E4M3.E4M3" in sass(VARIANTS[1])
    assert "QMMA" not in sass(VARIANTS[0])


@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump not found")
@pytest.mark.parametrize("name", [v for v in fast.VARIANTS if os.environ.get("KVCOMPILE_TEST_FULL")
                                  or v in ("base", "nocap", "alu", "pvt4h")])
def test_variants_build_without_spills(name, tmp_path, monkeypatch):
    """The issue-14 variants (decode_sm90.VARIANTS) build for sm_90 at 16 rows, fp32 q, without
    spills (no local-memory loads / stores in the SASS), and the SASS lacks what each removes:
    tanh (all but base, no softcap), F2FP unpacks of keys and / or values (the alu ones).
    cta4 (the plain kernel held to 128 registers for 4 CTAs a SM) is the one that spills: it is
    the control that pvt4 (the same occupancy from P.V's smaller accumulators) is timed against."""
    import re

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    var = fast.variant_bits(name, 0, 0, 0.0, rows=16)
    key = (0, 0, 2, 2, 128, 128, 16, 2, 0) + ((var,) if var else ())
    path = tmp_path / "k.cubin"
    path.write_bytes(_cubin(key))
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          timeout=120).stdout
    spills = bool(re.search(r"\b(LDL|STL)(\.|\s)", sass))
    assert spills == (name == "cta4"), "local memory: registers spilled"
    assert ("MUFU.TANH" in sass) == (name == "base")
    unpack = len(re.findall(r"F2FP\.F16\.E4M3\.UNPACK_B", sass))
    assert unpack == {"base": 64, "nocap": 64, "aluk": 32, "aluv": 32, "alu": 0}.get(name, 64), unpack


@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump not found")
def test_pvt4h_at_eight_rows(tmp_path, monkeypatch):
    """The bench's shape (e4m3 pages, D 128, G 4 x Sq 1 = 8 rows, bf16 q): pvt4h builds for 4
    CTAs a SM (__launch_bounds__(128, 4): <= 128 registers) without spills, and P.V transposed
    takes 8 MMAs a step instead of 16 (24 HMMA in the kernel, base's 32)."""
    import re

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    var = fast.variant_bits("pvt4h", 0, 0, 0.0)
    key = (0, 0, 1, 1, 128, 128, 8, 1, 0, var)
    assert fast.kernel_constants(*key)[1] == 4
    path = tmp_path / "k.cubin"
    path.write_bytes(_cubin(key))
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          timeout=120).stdout
    assert not re.search(r"\b(LDL|STL)(\.|\s)", sass), "local memory: registers spilled"
    assert len(re.findall(r"HMMA\.16816", sass)) == 24


# cuda14h: q.k with the tokens as M (SWQ) at 8 rows, bf16 q, D 128: (name, kk, vk, ksm, vsm,
# CTAs a SM, HMMA in the kernel). int4 (pvt4sz, the proposed int4 default): q.k 8 + the page's
# zero-point term 8 + P.V 8 (base: 40); 16-bit pages: 8 + 8 (base 32); fp8: 8 + 8 (pvt4h 24)
SWQ_BUILDS = [("pvt4sz", 4, 4, 4, 5, 4, 24)] + ([
    ("pvt4s", 3, 3, 0, 0, 3, 16), ("pvt4s", 0, 0, 1, 1, 4, 16)]
    if os.environ.get("KVCOMPILE_TEST_FULL") else [])


@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump not found")
@pytest.mark.parametrize("name,kk,vk,ksm,vsm,ctas,hmma", SWQ_BUILDS)
def test_swq_at_eight_rows(name, kk, vk, ksm, vsm, ctas, hmma, tmp_path, monkeypatch):
    """cuda14h's SWQ variants build for sm_90 without spills at their CTAs a SM, with the
    MMA count of tokens as M (no padded rows) and P^T's blocks transposed by MOVM."""
    import re

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    var = fast.variant_bits(name, kk, vk, 0.0)
    assert var & fast.VAR_SWQ
    key = (kk, vk, ksm, vsm, 128, 128, 8, 1, 0, var)
    assert fast.kernel_constants(*key)[1] == ctas
    path = tmp_path / "k.cubin"
    path.write_bytes(_cubin(key))
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          timeout=120).stdout
    assert not re.search(r"\b(LDL|STL)(\.|\s)", sass), "local memory: registers spilled"
    assert len(re.findall(r"HMMA\.16816", sass)) == hmma
    assert len(re.findall(r"\bMOVM\b", sass)) == 2
