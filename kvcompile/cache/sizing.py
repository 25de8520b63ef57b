"""How big the page pool is: its budget, how it grows, and the storage copy of a growth.

Two reservation policies (KVConfig.reserve):
- "upfront" (vLLM-style, the Engine's default): the whole budget is allocated when the pool is
  built, at the first forward. The scheduler then plans against a fixed page count.
- "grow" (the Hugging Face paths' default, as HF's own caches grow): the pool starts with one
  small chunk and grows when `reserve` runs out of pages, geometrically (x GROWTH, at least one
  chunk), never above the budget. Page ids stay valid; the storage tensors are replaced.

The budget is `max_kv_bytes`, else `memory_fraction` of the memory free *when the pool needs
it* (built, or grown) plus what the pool already holds, so the other (1 - memory_fraction) stays
free for activations (prefill's included). On the CPU the free memory is the available RAM,
at most 4 GiB.
"""

from __future__ import annotations

import math
import os

import torch

CPU_BUDGET_CAP = 4 << 30   # bytes: a CPU pool never takes more than this by default
GROWTH = 1.5               # a growth multiplies the page count by at least this
CHUNK_BYTES = 2 << 20      # and adds at least this much (the first chunk's size, too)


def free_bytes(device) -> int:
    """Bytes a new allocation may take on `device` now. CUDA: the device's free memory plus the
    blocks PyTorch's caching allocator holds unused; CPU: available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0))
    return _available_ram()


def budget_bytes(config, device, held: int = 0) -> int:
    """The most bytes the pool may hold now: `config.max_kv_bytes`, else `memory_fraction` of
    (free memory + `held`, the bytes the pool already holds); on the CPU at most 4 GiB."""
    if config.max_kv_bytes is not None:
        return int(config.max_kv_bytes)
    avail = free_bytes(device) + int(held)
    if torch.device(device).type != "cuda":
        avail = min(avail, CPU_BUDGET_CAP)
    return int(config.memory_fraction * avail)


def chunk_pages(bytes_per_page: int) -> int:
    return max(1, CHUNK_BYTES // max(1, bytes_per_page))


def grow_target(num_pages: int, short: int, limit: int, chunk: int) -> int:
    """Page count after a growth that must add `short` pages: the larger of what is needed,
    x GROWTH and one more chunk, capped at `limit` (which may leave it short)."""
    want = max(num_pages + short, math.ceil(num_pages * GROWTH), num_pages + chunk)
    return int(min(want, limit))


# Per-page tensors of a PagedTensor (paged.py) and the value new pages start with (None: left
# uninitialized, as the pool's storage always is). Tensor-granular scales are per layer, kept.
_PER_PAGE = (("data", None), ("micro", None), ("scale", 1.0), ("zero", 0.0), ("res_slot", -1))


def grow_paged(paged, num_pages: int) -> None:
    """Give a PagedTensor `num_pages` pages, keeping its first pages bit for bit. One tensor at
    a time: the old one is freed before the next is allocated, so a growth's transient memory
    is one tensor, not the whole old pool."""
    old = paged.num_pages
    if num_pages <= old:
        return
    paged.forget_views()   # (a cached view would keep its old tensor alive)
    for name, fill in _PER_PAGE:
        t = getattr(paged, name, None)
        if t is None or (name in ("scale", "zero") and paged.fmt.granularity == "tensor"):
            continue
        shape = (num_pages, *t.shape[1:])
        new = (torch.empty(shape, dtype=t.dtype, device=t.device) if fill is None
               else torch.full(shape, fill, dtype=t.dtype, device=t.device))
        new[:old] = t[:old]   # (a growth that ran out of memory may have left more rows)
        setattr(paged, name, new)
        del t, new
    paged.num_pages = num_pages


def _available_ram() -> int:
    if os.path.exists("/proc/meminfo"):  # MemAvailable counts reclaimable cache; AVPHYS doesn't
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
