"""Every ```python block of README.md runs as written, each in a fresh interpreter.

A block that needs a GPU says so on its first line (`# needs CUDA`) and is skipped without one.
A block that fails only because the offline SmolLM2 wheel is missing (kvcompile.models raises
ModelNotFoundError) is skipped, as tests/test_realmodel.py skips. The blocks' interpreters
load SmolLM2's GGUF from the test run's one parse (tests/gguf_cache.py): the same model,
without a 30 s parse in each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from tests.gguf_cache import share_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 600          # one block: load SmolLM2 + compile + generate takes ~1 min on 2 cores
NEEDS_CUDA = re.compile(r"^#\s*needs\s+cuda\b", re.IGNORECASE)
_FENCE = re.compile(r"^```\s*([\w+-]*)")  # ```python, ```python title="x", ```


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i + 1, m.group(1).lower(), []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"README.md:{start}: code block never closed")
        i += 1  # the closing fence
        if lang in ("python", "py", "python3"):
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


def _readme_blocks() -> list[tuple[int, str]]:
    with open(README, encoding="utf-8") as f:
        return python_blocks(f.read())


BLOCKS = _readme_blocks()


def test_extractor_finds_the_quickstart():
    """The block test below cannot pass by finding nothing."""
    assert len(BLOCKS) >= 2, BLOCKS
    assert any("kvcompile.compile(model" in code and "model.generate(" in code
               for _, code in BLOCKS), "the Quickstart block was not extracted"
    assert any('backend="kvcompile"' in code for _, code in BLOCKS)
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```py\n# needs CUDA\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n"), (8, "# needs CUDA\nb = 2\n")]
    with pytest.raises(ValueError):
        python_blocks("```python\nunclosed\n")


def _skip_reason(line: int, code: str) -> str | None:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if NEEDS_CUDA.match(first) and not torch.cuda.is_available():
        return f"README.md:{line} needs CUDA"
    return None


class _Run:
    """One block running in its own interpreter (cwd = the repository root)."""

    def __init__(self, line: int, code: str, threads: int):
        self.line, self.code = line, code
        env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        share_with(env)   # SmolLM2's GGUF parsed once per test run (tests/gguf_cache.py)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> tuple[int, str, str, float]:
        """(exit status, stdout, stderr, seconds); fails the test past TIMEOUT_S from start."""
        left = max(1.0, TIMEOUT_S - (time.perf_counter() - self.t0))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"README.md:{self.line}: still running after {TIMEOUT_S} s\n"
                        f"--- stderr (tail) ---\n{err[-4000:]}")
        return self.proc.returncode, out, err, time.perf_counter() - self.t0


@pytest.fixture(scope="module")
def runs(request):
    """Every selected block starts at once: each is mostly single-threaded Python (Dynamo
    tracing, GGUF parsing), so on 2 cores two blocks take little more than one."""
    lines = {item.callspec.params["line"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_readme_block_runs"
             and hasattr(item, "callspec")}
    todo = [(n, c) for n, c in BLOCKS if n in lines and _skip_reason(n, c) is None]
    # this process's share of the cores (all of them, or one xdist worker's: tests/conftest.py)
    threads = max(1, torch.get_num_threads() // max(1, len(todo)))
    started = {n: _Run(n, c, threads) for n, c in todo}
    yield started
    for r in started.values():
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.communicate()


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs(line, code, runs):
    reason = _skip_reason(line, code)
    if reason:
        pytest.skip(reason)
    rc, out, err, secs = runs[line].result()
    if rc != 0 and "ModelNotFoundError" in err:
        pytest.skip(f"README.md:{line}: offline model missing: {err.strip().splitlines()[-1]}")
    assert rc == 0, (f"README.md:{line}: exit status {rc} after {secs:.0f} s\n"
                     f"--- code ---\n{code}--- stderr ---\n{err[-8000:]}\n"
                     f"--- stdout (tail) ---\n{out[-2000:]}")
