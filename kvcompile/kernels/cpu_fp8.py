"""fp8 and bf16 pages' CPU decode step in C: the one-token write (fp8: with its scale
decisions) and the gather + decode of K and V, one ctypes call per layer (cpu_fp8.c).

    lib = library(config.cpu_fp8)     # None: the numpy route (forced, or no C compiler)
    write_tokens(lib, (kt, vt), p, o, (k, v), scratch)     # as PagedTensor.write_tokens_fp8
    write_tokens(..., gather=(pages, n, out))               # and the gather, by the same call
    gather(lib, (kt, vt), pages, out)                       # as dense._fp8_rows_host, times sc
    bf16_step(lib, kt, vt, p, o, k, v, (pages, n, out))     # bf16: write_token x 2 + _gather x 2

The numpy route (`PagedTensor.write_tokens_fp8`, `dense._fp8_rows_host`) costs ~40 numpy /
torch calls per scale decision and ~12 per gather, each a few microseconds cold between a
model's matmuls; here each is one call, with the same fp32 operations in the same order: the
bytes written and the values gathered are those of the numpy route, bit for bit
(tests/kernels/test_cpu_fp8_c.py). The library is built at first use by the system C compiler
(`$CC`, else cc / gcc / clang; ~0.2 s of gcc at -O3) and cached on disk like the CUDA kernels
(cuda/build.py `cached_build`: keyed by the source, the compiler's version, the flags and the
machine). No -march: the cached library runs on any CPU of the architecture.

`KVConfig.cpu_fp8` (KVCOMPILE_CPU_FP8) picks the route: "auto" (C where it builds, else numpy
with one warning naming the reason), "c" (C or an error), "numpy". bf16 pages (of an fp32
model) take the same library on the same switch; without it, their torch ops (`write_token`,
`dense._gather`: two index_copy_, two index_select and two casts a layer).
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import torch

from kvcompile.cache.fp4 import MIN_SCALE
from kvcompile.errors import KVCompileWarning
from kvcompile.kernels.cuda import build

_SOURCE = Path(__file__).with_name("cpu_fp8.c")
_FLAGS = ["-std=c11", "-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing",
          "-Wall"]
_p, _i, _f, _d = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_double


def c_compiler() -> str | None:
    return os.environ.get("CC") or next(
        (found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def build_library(source: Path = _SOURCE) -> Path:
    """The shared library of `source` (cpu_fp8.c; a test passes a broken copy), built once per
    source / compiler / flags / machine; where the compiler refuses the gather's multiversioned
    clones (an old clang), without them. Raises build.BuildError naming the reason."""
    cc = c_compiler()
    if cc is None:
        raise build.BuildError("no C compiler found (install gcc or clang, or set CC)")
    text = source.read_text()
    for extra in ([], ["-DKVC_NO_CLONES"]):
        flags = _FLAGS + extra

        def compile_into(out: Path, flags=flags) -> None:
            build.run_compiler([cc, *flags, str(source), "-o", str(out), "-lm"],
                               f"{cc} failed on {source.name}", timeout=300)

        try:
            return build.cached_build("cpu", "kvc_cpu_fp8", ".so", [
                text, build.compiler_version(cc), platform.machine(), *flags], compile_into)
        except build.BuildError:
            if extra:
                raise
    raise AssertionError("unreachable")


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.kvc_fp8_gather.restype = None
    lib.kvc_fp8_gather.argtypes = [_i, _i, _p, _p, _p, _p, _p, _i, _i, _i, _p]
    lib.kvc_fp8_write.restype = _i
    lib.kvc_fp8_write.argtypes = [_i, _i, _i, _i, _i, ctypes.c_int64, _i, _p, _p, _p, _p, _p,
                                  _p, _d, _f, _f, _f, _i, _p, _p]
    lib.kvc_fp8_step.restype = _i
    lib.kvc_fp8_step.argtypes = lib.kvc_fp8_write.argtypes + [_p, _i, _p]
    lib.kvc_bf16_step.restype = _i
    lib.kvc_bf16_step.argtypes = [_i, _i, _i, ctypes.c_int64, _i, _p, _p, _p, _p, _p, _i, _p]
    for name in ("kvc_fp8_values", "kvc_fp8_encode"):   # (the tests')
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [_i, _p, ctypes.c_int64, _p]
    return lib


@cache
def library(route: str = "auto") -> ctypes.CDLL | None:
    """The C library for `route` (config.CPU_FP8_ROUTES), or None for the numpy route. "auto"
    without a working build warns once (the reason and the fix) and returns None; "c"
    raises."""
    if route == "numpy":
        return None
    try:
        return load(build_library())
    except (build.BuildError, OSError, subprocess.SubprocessError) as e:
        if route == "c":
            raise
        warnings.warn(
            "kvcompile: fp8 / bf16 pages' CPU decode runs its numpy / torch route (about "
            f"5-10% slower), the C route did not build: {e}. Install a C compiler (gcc or "
            "clang) or set CC; "
            "KVCOMPILE_CPU_FP8=numpy chooses the numpy route without this warning.",
            KVCompileWarning, stacklevel=2)
        return None


def _pointers(t) -> tuple[int, int]:
    """(codes, page scales) base addresses of a CPU fp8 PagedTensor, kept with its views
    (a growth forgets them)."""
    views = t.__dict__.setdefault("_views", {})
    ptrs = views.get("c_ptrs")
    if ptrs is None or ptrs[0] is not t.data or ptrs[1] is not t.scale:
        ptrs = views["c_ptrs"] = (t.data, t.scale, t.data.data_ptr(), t.scale.data_ptr())
    return ptrs[2], ptrs[3]


def gather(lib, parts, pages: np.ndarray, out: torch.Tensor) -> None:
    """out [k, 1, H, n, P, D] fp32 (contiguous) = the decoded values of the pages `pages`
    [n] int64 (contiguous numpy) of parts (k = 1 or 2 fp8 PagedTensors of one format and
    shape, page scales), heads first: `dense._fp8_rows_host`'s x * sc."""
    first = parts[0]
    c0, s0 = _pointers(first)
    c1, s1 = _pointers(parts[-1])
    lib.kvc_fp8_gather(first.fmt.storage_dtype == torch.float8_e5m2, len(parts), c0, s0, c1,
                       s1, pages.ctypes.data, len(pages), first.num_heads,
                       first.page_size * first.data.shape[-1], out.data_ptr())


def bf16_step(lib, kt, vt, p: int, o: int, k, v, gather) -> None:
    """A bf16 pages' decode step of one layer by one C call: k / v [1, H, 1, D] fp32
    (contiguous CPU tensors) written at offset o of page p, as `PagedTensor.write_token`
    stores them (torch's .to(bfloat16)), then the K and V pages widened, heads first
    (`dense._gather`'s values) into out [2, 1, H, n, P, D] fp32; gather: (the address of the
    pages [n] int64, n, out's address). A token with a NaN is written by `write_token`
    (torch's NaN bits), then the gather alone."""
    ptrs = kt.__dict__.setdefault("_views", {}).get("c_bf16")
    if ptrs is None or ptrs[0] is not kt.data or ptrs[1] is not vt.data:
        ptrs = kt.__dict__["_views"]["c_bf16"] = (kt.data, vt.data, kt.data.data_ptr(),
                                                  vt.data.data_ptr())
    H, D, P = kt.num_heads, kt.head_dim, kt.page_size
    if lib.kvc_bf16_step(H, D, P, p, o, ptrs[2], ptrs[3], k.data_ptr(), v.data_ptr(),
                         *gather) < 0:
        token = (p * H + torch.arange(H)) * P + o
        kt.write_token(p, o, token, k)
        vt.write_token(p, o, token, v)
        lib.kvc_bf16_step(H, D, P, p, o, ptrs[2], ptrs[3], None, None, *gather)


def write_tokens(lib, tensors, p: int, o: int, xs, scratch: dict, gather=None) -> bool:
    """`PagedTensor.write_tokens_fp8` (decide=True) by one C call: xs, the k tokens [H, Ds]
    fp32 as contiguous CPU tensors. The same bytes, scales and kept facts. False (nothing
    written) where a fact is missing or stale at o > 0, a token holds NaN / Inf or a scale
    would leave fp32: then each tensor's own write. gather: (address of the pages [n] int64,
    n, address of out [k, 1, H, n, P, Ds] fp32): where the write is done, `gather` of the
    same tensors by the same C call (kvc_fp8_step)."""
    facts = [t._fp8_fact(p, o) for t in tensors] if o else None
    if o and None in facts:
        return False
    first = tensors[0]
    k = len(tensors)
    key = ("c_write", k, first.num_heads, first.data.shape[-1], first.page_size)
    args = scratch.get(key)
    if args is None:   # what every call of the step passes alike, and its scratch buffers
        H, Ds, P = key[2:]
        divisor, fmax, _, screen = first._fp8_numbers()
        work = torch.empty(k * H * P * Ds, dtype=torch.float32)
        s_new = np.empty((k, H, 1), np.float32)
        args = scratch[key] = (work, s_new, (
            first.fmt.storage_dtype == torch.float8_e5m2, k, H, Ds, P), (
            divisor, fmax, screen, MIN_SCALE, 1, s_new.ctypes.data, work.data_ptr()))
    c0, sc0 = _pointers(first)
    c1, sc1 = _pointers(tensors[-1])
    if gather is None:
        rc = lib.kvc_fp8_write(*args[2], p, o, c0, sc0, c1, sc1, xs[0].data_ptr(),
                               xs[-1].data_ptr(), *args[3])
    else:
        rc = lib.kvc_fp8_step(*args[2], p, o, c0, sc0, c1, sc1, xs[0].data_ptr(),
                              xs[-1].data_ptr(), *args[3], *gather)
    if rc < 0:
        return False
    if rc == 0:   # by the kept facts: they move to o + 1 (the C writes bump no version)
        last = o + 1 == first.page_size
        for t, f in zip(tensors, facts):
            if last:
                del t.__dict__["_views"]["fp8_fact"]
            else:
                t.__dict__["_views"]["fp8_fact"] = (p, o + 1, *f[2:])
        return True
    s_new = args[1].copy() if rc == 1 else None   # (a kept fact holds its own rows)
    for i, t in enumerate(tensors):
        views = t.__dict__["_views"]
        if rc == 2:
            views.pop("fp8_fact", None)
        elif o:
            views["fp8_fact"] = (p, o + 1, *facts[i][2:5], s_new[i], *facts[i][6:])
        else:
            t._keep_fp8_fact(p, o + 1, s_new[i])
    return True
