"""Building kvcompile's CUDA kernels at first use: nvcc -> cubin, cached on disk.

    cubin = build_cubin("paged_decode.cuh", "kvc_paged_decode", defines, arch="sm_90")

A variant is one set of compile-time constants (`defines`); its cubin is cached under
`$XDG_CACHE_HOME/kvcompile/cuda` (default `~/.cache/kvcompile/cuda`) keyed by the source, the
constants, the target and nvcc's version, so each variant compiles once per machine (about 2 s).
`available()` says whether a compiler is there; without one the portable Triton kernels run and
`kvcompile.report` says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_lock = threading.RLock()   # re-entrant: a build may build its parts (build_emu.py)

_WRAPPER = """#include "{header}"
extern "C" __global__ void __launch_bounds__({threads}, {min_blocks})
{name}(const __grid_constant__ {params} p) {{
  {call}(p);
}}
"""


class BuildError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return None


@lru_cache(maxsize=1)
def nvcc_version() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        return ""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.stdout else ""


def available() -> tuple[bool, str]:
    """(True, "") when nvcc can build kernels here, else (False, the reason)."""
    if nvcc_path() is None:
        return False, "nvcc not found (install the CUDA toolkit or put nvcc on PATH)"
    return True, ""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcompile" / "cuda"


def _source_with_includes(header: str) -> str:
    """The header's text and, after it, that of every local header it includes (recursively):
    the cache key changes when an included header does (latent_decode.cuh includes
    paged_decode.cuh's helpers)."""
    import re

    seen, order, todo = set(), [], [header]
    while todo:
        name = todo.pop()
        if name in seen or not (_HERE / name).exists():
            continue
        seen.add(name)
        text = (_HERE / name).read_text()
        order.append(text)
        todo.extend(re.findall(r'^#include "([^"]+)"', text, flags=re.M))
    return "\0".join(order)


def build_cubin(header: str, name: str, call: str, defines: dict[str, int], *, arch: str,
                threads: int, min_blocks: int, params: str = "DecodeParams") -> bytes:
    """The cubin of kernel `name` = `call<defines>(params)` from `header`, built once."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise BuildError(available()[1])
    src = _source_with_includes(header)
    wrapper = _WRAPPER.format(header=header, threads=threads, min_blocks=min_blocks, name=name,
                              params=params, call=call)
    flags = ["-cubin", f"-arch={arch}", "-O3", "--use_fast_math", "-std=c++17",
             f"-I{_HERE}"] + [f"-D{k}={v}" for k, v in sorted(defines.items())]

    def compile_into(out: Path) -> None:
        cu = out.with_name("kernel.cu")
        cu.write_text(wrapper)
        run_compiler([nvcc, *flags, "-o", str(out), str(cu)], f"nvcc failed for {name} {defines}",
                     timeout=600)

    return cached_build("cuda", name, ".cubin", [src, wrapper, nvcc_version(), *flags],
                        compile_into).read_bytes()


def run_compiler(argv: list[str], failed: str, timeout: int = 900) -> None:
    """Runs a compiler command line; BuildError(`failed` and the tail of its stderr) when it
    fails (the compile_into of every cached_build: nvcc here, g++ for the emulation, the C
    compiler for kernels/cpu_fp8.c)."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise BuildError(f"{failed}:\n{res.stderr[-4000:]}")


@cache
def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` (part of every cache key: a new compiler
    rebuilds)."""
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else ""


def cached_build(subdir: str, stem: str, suffix: str, key_parts: list[str],
                 compile_into: Callable[[Path], None]) -> Path:
    """The path of a build product cached under `cache_dir().parent / subdir` as
    `stem-<hash of key_parts>suffix` (the source, the compiler's version, the flags): made
    once per machine by compile_into(out), which writes it to `out` in a temporary directory
    (or raises BuildError), then moved into place atomically, so concurrent builders agree."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()
    path = cache_dir().parent / subdir / f"{stem}-{key[:24]}{suffix}"
    if path.exists():
        return path
    with _lock:
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, f"out{suffix}")
            compile_into(out)
            tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(out, tmp_path)
        os.replace(tmp_path, path)  # atomic: concurrent builders agree on the result
    return path
