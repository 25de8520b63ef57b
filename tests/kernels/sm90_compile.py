"""Compiling Triton kernels for sm_90 (Hopper) on a machine without a GPU, for the tests that
check what the interpreter cannot (test_append_sm90.py, test_latent_decode_sm90.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def compile_rows(module: str) -> list:
    """Run `module._main()` in a process without TRITON_INTERPRET (the interpreter patches
    triton.language for its whole process) and return the JSON lists it printed, one per
    compile. Skips where Triton has no AOT compile for NVIDIA; fails if the process printed
    none."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Triton without the NVIDIA backend's AOT compile: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", f"import {module} as t; t._main()"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=1200)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    if not rows:
        pytest.fail(f"the sm_90 compile process gave nothing: {r.stderr[-3000:]}")
    return rows


def innermost_error(e: BaseException) -> str:
    """The innermost cause of a failed compile, as a test reports it (the last 1,500 chars)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"[-1500:]


def compile_sm90(fn, signature: dict, constexprs: dict, **options) -> str:
    """Compile a @triton.jit kernel ahead of time for sm_90: "ok", or the innermost error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # reported to the test, which fails with the innermost cause
        return innermost_error(e)
    return "ok"
