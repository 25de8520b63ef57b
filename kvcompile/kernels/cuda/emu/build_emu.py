"""paged_decode.cuh on the CPU: g++ builds a variant (the kernel's own source, KVC_EMU) into a
shared library, cached like build.py's cubins; ctypes runs a decode_sm90 launch with it.

    lp = decode_sm90.plan_decode_sm90(q, kd, ks, vd, vs, bt, sl, key_mask, out, ...)  # CPU
    run(lp, seed=0)            # the grid, lane by lane (cuda_emu.h); raises EmuError on a fault
    out = finish(lp)           # splits merged as combine_splits_kernel merges them

Needs only g++ (no CUDA toolkit). `available()` says whether it is there.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch

from kvcompile.kernels.cuda import build

_HERE = Path(__file__).resolve().parent
_SOURCES = ("emu_decode.cpp", "lanes.cpp", "collectives.cpp", "memory.cpp", "selftest.cpp")
# sources[0] is the entry (it includes the kernel); the rest are the run time (_runtime_object)
_RUNTIME_HEADERS = ("cuda_emu.h", "runtime.h", "state.h")
_HEADERS = _RUNTIME_HEADERS + ("../paged_decode.cuh",)
# the latent kernel (latent_decode.cuh, latent_sm90.py): its own entry, the same runtime
_LATENT_SOURCES = ("emu_latent.cpp", "lanes.cpp", "collectives.cpp", "memory.cpp")
_LATENT_HEADERS = _HEADERS + ("../latent_decode.cuh",)
_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE",
          "-Wall", "-Wno-unknown-pragmas", "-DKVC_EMU"]
_WRITABLE = ("out", "acc", "lse")
_libs: dict[Path, ctypes.CDLL] = {}


class EmuError(RuntimeError):
    """The emulated kernel did something a GPU would fault on or race at (the message says
    which block, thread and instruction)."""


class _Buffer(ctypes.Structure):  # runtime.h kvc_emu::Buffer
    _fields_ = [("ptr", ctypes.c_void_p), ("nbytes", ctypes.c_longlong),
                ("writable", ctypes.c_int), ("name", ctypes.c_char_p)]


@lru_cache(maxsize=1)
def gxx_path() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def _gxx_version() -> str:
    return build.compiler_version(gxx_path())


def available() -> tuple[bool, str]:
    """(True, "") when g++ can build the emulation here, else (False, the reason)."""
    if gxx_path() is None:
        return False, "g++ not found (set CXX or install g++)"
    return True, ""


def _gxx(cmd: list[str], what: str):
    """compile_into for build.cached_build: g++ `cmd` -o out."""
    return lambda out: build.run_compiler([gxx_path(), *cmd, "-o", str(out)],
                                          f"g++ failed for {what}")


def _runtime_object(here: Path, source: str) -> Path:
    """One of the emulation's run-time sources (lanes, collectives, memory, selftest) compiled
    once per machine: they do not read the kernel's constants, so every variant links the same
    object and only its entry file (emu_decode.cpp / emu_latent.cpp, which includes the kernel)
    is compiled per variant (about 2.5x less g++ time a variant)."""
    flags = [f for f in _FLAGS if f != "-shared"] + ["-c"]
    src = "\0".join((here / f).read_text() for f in (source,) + _RUNTIME_HEADERS)
    return build.cached_build("cuda_emu", Path(source).stem, ".o",
                              [src, _gxx_version(), *flags],
                              _gxx([*flags, str(here / source)], source))


def build_so(defines: dict[str, int], root: Path | None = None, latent: bool = False) -> Path:
    """The shared library of one kernel variant (decode_sm90.kernel_constants), built once
    per source / constants / compiler: the entry file at -O2 (about 1-2 s of g++; -O1 builds
    faster but runs 2x slower), linked with the run-time objects (_runtime_object, built once).
    root: another directory laid out as kernels/cuda (paged_decode.cuh, emu/), e.g. a
    deliberately broken kernel in a test."""
    if gxx_path() is None:
        raise build.BuildError(available()[1])
    here = _HERE if root is None else Path(root) / "emu"
    sources = _LATENT_SOURCES if latent else _SOURCES
    src = "\0".join((here / f).read_text()
                    for f in sources + (_LATENT_HEADERS if latent else _HEADERS))
    flags = _FLAGS + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    stem = "kvc_emu_latent" if latent else "kvc_emu_decode"
    key = [src, _gxx_version(), *flags]

    def compile_into(out: Path) -> None:   # (the run-time objects only when the .so is new)
        objects = [str(_runtime_object(here, f)) for f in sources[1:]]
        _gxx([*flags, str(here / sources[0]), *objects], str(defines))(out)

    return build.cached_build("cuda_emu", stem, ".so", key, compile_into)


def load(defines: dict[str, int], root: Path | None = None) -> ctypes.CDLL:
    path = build_so(defines, root)
    lib = _libs.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.kvc_emu_decode.restype = ctypes.c_int
        lib.kvc_emu_decode.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.POINTER(_Buffer), ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p,
            ctypes.c_int]
        lib.kvc_emu_convert.restype = None
        lib.kvc_emu_convert.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_longlong]
        lib.kvc_emu_selftest.restype = ctypes.c_int
        lib.kvc_emu_selftest.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.kvc_emu_byte_perm.restype = ctypes.c_uint
        lib.kvc_emu_byte_perm.argtypes = [ctypes.c_uint] * 3
        _libs[path] = lib
    return lib


def run(lp, seed: int = 0, root: Path | None = None) -> None:
    """Runs the kernel launch `lp` (decode_sm90.Launch over CPU tensors) in the emulation.
    seed 0: lanes resume in lane order at each meeting point; others: a random order."""
    from kvcompile.kernels import decode_sm90

    defines, _, smem = decode_sm90.kernel_constants(*lp.key)
    lib = load(defines, root)
    names, bufs = [], []
    for name, t in lp.tensors.items():
        if t is None:
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"emulated decode: '{name}' must be a contiguous CPU tensor")
        names.append(name.encode())
        bufs.append(_Buffer(t.data_ptr(), t.numel() * t.element_size(), name in _WRITABLE,
                            names[-1]))
    arr = (_Buffer * len(bufs))(*bufs)
    err = ctypes.create_string_buffer(4096)
    gx, gy, _ = lp.grid
    rc = lib.kvc_emu_decode(ctypes.addressof(lp.prm), gx, gy, smem, arr, len(bufs), seed, err,
                            len(err))
    if rc != 0:
        raise EmuError(f"emulated paged_decode {defines}: {err.value.decode()}")


def selftest(lib: ctypes.CDLL, which: int) -> str:
    """'' or what the emulation reported for selftest.cpp's kernel `which`."""
    err = ctypes.create_string_buffer(2048)
    rc = lib.kvc_emu_selftest(which, err, len(err))
    return err.value.decode() if rc else ""


def combine_splits(acc: torch.Tensor, plse: torch.Tensor) -> torch.Tensor:
    """acc [R, S, DV] normalized partial outputs, plse [R, S] their log2-sum-exp -> [R, DV]
    fp32, as decode_kernels.combine_splits_kernel: out = sum_s 2^(lse_s - lse) acc_s."""
    m = plse.max(1, keepdim=True).values
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(plse - m_safe)                                # [R, S]
    total = w.sum(1, keepdim=True)
    out = (acc * w[:, :, None]).sum(1)
    t_safe = torch.where(total == 0, torch.ones_like(total), total)
    return torch.where(total == 0, torch.zeros_like(out), out / t_safe)   # NaN total stays NaN


def finish(lp) -> torch.Tensor:
    """lp.out after run(lp): the splits merged into it unless the launch wrote it directly."""
    if not lp.direct:
        lp.out.copy_(combine_splits(lp.acc, lp.plse).view(lp.out.shape))
    return lp.out


_LATENT_WRITABLE = ("out", "acc", "ml", "prof", "cnt", "scores")


def run_latent(lp, seed: int = 0) -> torch.Tensor:
    """Runs the latent kernel's launch `lp` (latent_sm90.Launch over CPU tensors) in the
    emulation and returns its output [B, H, R] fp32 (splits merged by latent_sm90.merge_splits,
    as the merge kernel merges them on the GPU)."""
    from kvcompile.kernels import latent_sm90

    defines, _, smem = latent_sm90.kernel_constants(*lp.key)
    path = build_so(defines, latent=True)
    lib = _libs.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.kvc_emu_latent.restype = ctypes.c_int
        lib.kvc_emu_latent.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.POINTER(_Buffer), ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p,
            ctypes.c_int]
        _libs[path] = lib
    names, bufs, seen = [], [], set()
    for name, t in lp.tensors.items():
        if t is None or t.data_ptr() in seen:
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"emulated latent decode: '{name}' must be a contiguous CPU tensor")
        seen.add(t.data_ptr())
        names.append(name.encode())
        bufs.append(_Buffer(t.data_ptr(), t.numel() * t.element_size(),
                            name in _LATENT_WRITABLE, names[-1]))
    arr = (_Buffer * len(bufs))(*bufs)
    err = ctypes.create_string_buffer(4096)
    gx, gy, _ = lp.grid
    rc = lib.kvc_emu_latent(ctypes.addressof(lp.prm), gx, gy, smem, arr, len(bufs), seed, err,
                            len(err))
    if rc != 0:
        raise EmuError(f"emulated latent_decode {defines}: {err.value.decode()}")
    if lp.merged:
        return lp.out
    return latent_sm90.merge_splits(lp.acc, lp.ml)
