"""`torch.ops.kvcompile.skinny_linear`: F.linear on kernels/skinny.py's Triton kernel.

    torch.ops.kvcompile.skinny_linear(x, w, b)         # = F.linear(x, w, b), the Triton kernel
    torch.ops.kvcompile.skinny_linear(x, w, b, True)   # = F.linear(x, w, b), the faster one

passes/skinny_linears.py puts it in place of a decode graph's linears whose input has at most
16 rows (KVConfig.decode_gemms="triton" or "auto"). It is F.linear by definition: the kernel
takes x of at most 16 rows and w with contiguous rows in one dtype with x, on CUDA (or under the
Triton interpreter); anything else (which the pass does not insert, but a graph's input could
change under it) runs F.linear.

With `auto` the op measures, once per shape (device, rows, N, K, dtype, bias), the Triton kernel
against F.linear (cuBLAS) on this GPU at the shape's first call outside a CUDA graph capture
(the capture's warm-up runs are such calls): each candidate's median of `REPS` runs, the L2
flushed before each run as the weights stream from memory in a real step. The kernel is kept
where it takes at most `MARGIN` of cuBLAS's time, else F.linear. A shape first met inside a
capture runs F.linear there, said once, and is measured at its next call outside one. The choices and their times are in `CHOICES` and
`kvcompile.report`. The sums' order differs between the two (both accumulate in fp32), so a
choice that flips between processes changes outputs by the dtype's rounding only.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F

from kvcompile.kernels import skinny

REPS = 7        # timed runs a candidate (interleaved, each after an L2 flush)
MARGIN = 0.97   # the Triton kernel is chosen at most this fraction of cuBLAS's median time
# shape key -> (choice "triton" / "torch", cuBLAS ms, Triton ms), process-wide (the counts
# and notes go to the model whose call measured the shape)
CHOICES: dict[tuple, tuple[str, float, float]] = {}
_UNMEASURED: set[tuple] = set()   # shapes met inside a capture before any timing (said once)


def takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands (else F.linear runs them)."""
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    return (k > 0 and w.dim() == 2 and w.shape[1] == k and rows <= skinny.MAX_M
            and w.stride(1) == 1 and x.dtype == w.dtype and (b is None or b.dtype == x.dtype)
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and x.device == w.device
            and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def shape_key(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple:
    """What a choice is made for: device, rows, N, K, dtype, bias, w's row stride (read at
    every call of an eager step: no strings made)."""
    k = x.shape[-1]
    return (x.device, x.numel() // k, w.shape[0], k, x.dtype, b is not None, w.stride(0))


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """Twice the device's L2 (at least 64 MiB), zeroed before each timed run; made for one
    shape's timing and dropped after it (kept, it held 0.1 GiB of the H100 for the process's
    life: the first GPU run's peak)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=device)


SLEEP_CYCLES = 2_000_000   # ~1 ms of GPU spin before each timed run (see time_candidates)


def time_candidates(fns, device: torch.device) -> list[float]:
    """Each fn's median ms over REPS runs on CUDA, the candidates interleaved, the L2 flushed
    before each run. Each run is queued behind a ~1 ms GPU spin, so that the host has queued
    the run before the GPU reaches its start event: the times are the kernels' GPU time, as
    in a replayed CUDA graph, not the host's launch cost (a Python-launched Triton kernel's
    is tens of microseconds, which the first version's timings held: on the H100 it made the
    kernel look 3-4x slower than cuBLAS at 4096 x 4096). (Replaced by the tests: no CUDA.)"""
    flush = _flush_buffer(device)
    for fn in fns:   # warm-up (the Triton kernel's compile, cuBLAS's heuristics)
        fn()
    spin = getattr(torch.cuda, "_sleep", None)
    times = [[] for _ in fns]
    events = []
    for _ in range(REPS):
        for i, fn in enumerate(fns):
            if spin is not None:
                spin(SLEEP_CYCLES)
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((i, s, e))
    torch.cuda.synchronize(device)
    del flush
    for i, s, e in events:
        times[i].append(s.elapsed_time(e))
    return [statistics.median(t) for t in times]


def capturing(x: torch.Tensor) -> bool:
    """Whether x's device stream is being captured into a CUDA graph (no timing there)."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _say(text: str, counter: str | None = None) -> None:
    """A note in the current model's kernel notes (kvcompile.report) and a count."""
    from kvcompile.runtime import context

    ctx = context.current()
    state = getattr(ctx, "state", None)
    kernels = getattr(state, "kernels", None)
    if kernels is not None:
        kernels.note(text)
    if state is not None and counter:
        state.count(counter)


def choose(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> str:
    """"triton" or "torch" for this shape: measured at its first call outside a capture."""
    key = shape_key(x, w, b)
    got = CHOICES.get(key)
    if got is not None:
        return got[0]
    _, m, n, k, dtype, _, _ = key
    what = (f"{m} x {k} @ {n} x {k}^T ({str(dtype).removeprefix('torch.')}"
            f"{', bias' if b is not None else ''})")
    if capturing(x):
        # no timing inside a capture: cuBLAS in this graph; the shape's next call outside a
        # capture (a recapture's warm-up, an eager step) measures it
        if key not in _UNMEASURED:
            _UNMEASURED.add(key)
            _say(f"decode GEMMs (auto): {what} first met inside a CUDA graph capture: "
                 f"cuBLAS there, not measured", "decode_gemms_auto_unmeasured")
        return "torch"
    xc = x.contiguous()
    t_torch, t_triton = time_candidates(
        [lambda: F.linear(xc, w, b), lambda: skinny.skinny_linear(xc, w, b)], x.device)
    pick = "triton" if t_triton <= MARGIN * t_torch else "torch"
    CHOICES[key] = (pick, t_torch, t_triton)
    _say(f"decode GEMMs (auto): {what}: {'Triton' if pick == 'triton' else 'cuBLAS'} "
         f"(cuBLAS {t_torch:.4f} ms, Triton {t_triton:.4f} ms)",
         f"decode_gemms_auto_{pick}")
    return pick


@torch.library.custom_op("kvcompile::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  auto: bool = False) -> torch.Tensor:
    if takes(x, w, b) and (not auto or choose(x, w, b) == "triton"):
        return skinny.skinny_linear(x.contiguous(), w, b)
    return F.linear(x, w, b)


@skinny_linear.register_fake
def _(x, w, b, auto=False):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
