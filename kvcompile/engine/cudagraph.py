"""CUDA graphs of the engine's decode steps.

A decode step of B sequences launches a few hundred kernels (the compiled model's, plus per
layer the append and the split-K decode attention); its host time, not the GPU's, sets the
step time at small and medium batches (benchmarks/RESULTS.md, "Generation"). A step in which
every scheduled sequence adds one token is replayed from a CUDA graph captured once per padded
batch size ("bucket"), as vLLM does:

- every input of the step lives in static device buffers the graph was captured with: token
  ids, positions, the slots the new K/V go to, the block tables and the sequence lengths. A
  step writes them (two host-to-device copies from pinned memory, one gather of the block
  table rows) and replays;
- the kernels read lengths and pages from those buffers, never from the host: the split-K
  decode kernel's grid depends only on the block table's width, fixed at the pool's
  `max_seq_len`, and splits past a sequence's end exit at once;
- rows past B (the bucket's padding) run a scratch sequence of the pool: each writes its own
  slot of the scratch pages and attends to one key there. Their logits are never read;
- the pool lives outside the graph, as before: its pages and scales are fixed addresses, the
  block tables change between steps only, never a shape inside the graph. A pool that grows
  (KVConfig.reserve="grow", cache/sizing.py) moves its storage: the graphs are dropped and
  captured again (`pool.generation`); `kvcompile.release` drops them too (`close`).

Graphs are used only where nothing in the step needs the host: CUDA, the Triton kernels for
both K and V formats, no runtime hook but an eviction runtime that steps aside for the step
(eviction/runtime.py `decode_aside`: it evicts after the replay, on the device, every
`eviction_interval` steps; what it needs inside the step, H2O's mass and re-rotated sinks, is an
`AsideSpec` that keys the graphs with the bucket, captured at its first step), no
`check_finite`. Anything else runs eagerly, as before. `KVConfig.cuda_graphs=False`
(or KVCOMPILE_CUDA_GRAPHS=0, its default) turns graphs off.
"""

from __future__ import annotations

import logging
import weakref

import torch

from kvcompile.eviction.aside import AsideInputs, AsideSpec
from kvcompile.runtime.context import ForwardContext, StepPlan, forward_context
from kvcompile.runtime.kernel_formats import graph_refusal

log = logging.getLogger("kvcompile.engine")

PLAIN = AsideSpec()   # a decode step with nothing of eviction inside it

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes up to max_batch (which is always one of them)."""
    out = [b for b in BUCKETS if b < max_batch]
    return out + [max_batch]


def check_inputs(g, pool, generation, seq_ids) -> None:
    """Raise CacheStateError naming the first input of a replay that would read or write
    outside the pool: the storage generation, each row's slot, length and block-table
    entries (pages below its length valid, the new token's slot in its last page)."""
    from kvcompile.errors import CacheStateError

    bp, P, N = g.bp, pool.page_size, pool.num_pages
    if g.dev64.is_cuda:
        torch.cuda.synchronize()
    if generation != pool.generation:
        raise CacheStateError(f"graph check: pool generation {pool.generation}, graphs of "
                              f"{generation}")
    slots = g.dev64[2 * bp:3 * bp].tolist()
    lens = g.seq_lens.tolist()
    table = g.block_tables.cpu()
    W = table.shape[1]
    for r in range(bp):
        who = f"row {r} (seq {seq_ids[r] if r < len(seq_ids) else 'pad'})"
        L, slot = lens[r], slots[r]
        if not 1 <= L <= W * P:
            raise CacheStateError(f"graph check: {who} length {L}, table width {W} x {P}")
        pages = table[r, :(L + P - 1) // P]
        if int(pages.min()) < 0 or int(pages.max()) >= N:
            raise CacheStateError(f"graph check: {who} length {L}: block-table entries "
                                  f"{pages.min()}..{pages.max()} outside [0, {N})")
        if not 0 <= slot < N * P or slot // P != int(pages[-1]):
            raise CacheStateError(f"graph check: {who} slot {slot} (page {slot // P}) is not "
                                  f"in its last page {int(pages[-1])}")


def upload_plan(g, pool, non_blocking: bool = True, rows_key=None) -> None:
    """Fill a graph's static plan buffers: `g.dev64` / `g.seq_lens` from its pinned host buffers
    (one copy: both are views of `g.dev_plan`, Staged), then `g.block_tables` as the pool's
    table rows `g.rows`.
    rows_key: the rows as host ints (hashable); with it the rows' copy is skipped while the
    rows and the pool's table stand as at the last copy (`generate`'s steps: a sequence takes
    a new page once in page_size steps). Shared by the engine's and `generate`'s graphs
    (integrations/hf_graphs.py)."""
    g.dev_plan.copy_(g.host_plan, non_blocking=non_blocking)
    table = pool.table()                     # flushed; its width may have grown
    key = None if rows_key is None else (id(pool), pool.generation, pool.table_version,
                                         rows_key)
    if key is not None and key == getattr(g, "table_key", None):
        return
    w = min(table.shape[1], g.block_tables.shape[1])
    g.block_tables[:, :w] = table[:, :w].index_select(0, g.rows)
    g.table_key = key


# One warm-up stream per device for every capture of the process. cuBLAS keeps a workspace
# for each (handle, stream) it has run on (32 MiB on Hopper), never freed: a new stream per
# capture made every capture (and every re-capture after a pool growth) keep 32 MiB more.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The warm-up stream of `device` (created at its first capture, then reused)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def capture(step, device: torch.device, mempool):
    """Run `step` twice on the device's warm-up stream (Dynamo / inductor / Triton compile and
    autotune there), then capture it into a new CUDA graph drawing on `mempool`. Returns
    (graph, what the captured call returned: static outputs, valid after each replay)."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = step()
    return graph, out


class Staged:
    """A graph's plan staged on the host for `upload_plan`: two buffers (`host_plan`, pinned on
    CUDA; `h64` / `h32` numpy views of its int64 and int32 parts), used in turn, since
    a step's host-to-device copy may still be queued when the next step writes its inputs.
    With events, a buffer is rewritten only after the event of its last upload (`uploaded`):
    `generate`'s graphs, whose host runs a step ahead under a deferred stop check. Without,
    the caller keeps at most one step in flight (the engine's overlapped steps)."""

    def _stage(self, n64: int, n32: int, device, events: bool) -> None:
        """The staging buffers and the device buffer they fill: one int64 buffer each,
        `n64` int64 values then `n32` int32 values (`h64` / `h32` numpy views of a staging
        buffer's parts, `dev64` / `seq_lens` of the device's; the int32 part 16-byte
        aligned), so that a step's upload is one copy, not one a dtype."""
        pin = torch.device(device).type == "cuda"   # (unpinned: the tests' CPU emulation)
        a64 = -(-n64 // 2) * 2                       # the int32 part at a 16-byte boundary
        total = a64 + -(-n32 // 2)

        def views(buf):
            b32 = buf[a64:].view(torch.int32)[:n32]
            b32.fill_(1)
            return buf[:n64], b32

        self._stages = []
        for _ in range(2):
            buf = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
            h64, h32 = views(buf)
            self._stages.append((buf, h64.numpy(), h32.numpy(),
                                 torch.cuda.Event() if pin and events else None))
        self.dev_plan = torch.zeros(total, dtype=torch.int64, device=device)
        self.dev64, self.seq_lens = views(self.dev_plan)
        self._recorded = [False, False]
        self._turn = 0
        self.host_plan, self.h64, self.h32, self._uploaded = self._stages[0]

    def next_stage(self) -> None:
        """Switch to the other staging buffer, once its last upload has left it."""
        self._turn ^= 1
        self.host_plan, self.h64, self.h32, self._uploaded = self._stages[self._turn]
        if self._uploaded is not None and self._recorded[self._turn]:
            self._uploaded.synchronize()

    def uploaded(self) -> None:
        """Mark the current staging buffer's upload as queued (upload_plan just ran)."""
        if self._uploaded is not None:
            self._uploaded.record()
            self._recorded[self._turn] = True


class _Graph(Staged):
    """One captured decode step of `bp` rows and its static buffers; `spec`: what it does for
    eviction inside the step (eviction/aside.py)."""

    def __init__(self, bp: int, width: int, device: torch.device, spec: AsideSpec = PLAIN):
        self.bp = bp
        self.spec = spec
        # int64 inputs in one buffer (one copy per step): ids | positions | slots | table rows
        # | eviction's mass rows | sink shifts | re-rotated sink counts | hidden slots [lo, hi),
        # staged in turn (Staged: overlapped steps, engine/overlap.py, keep one in flight)
        self._stage(9 * bp, bp, device, events=False)   # dev64 [9 bp], seq_lens [bp]
        self.ids = self.dev64[:bp].view(1, bp)
        self.pos = self.dev64[bp:2 * bp].view(1, bp)
        self.slots = self.dev64[2 * bp:3 * bp]
        self.rows = self.dev64[3 * bp:4 * bp]
        self.mass_rows = self.dev64[4 * bp:5 * bp]
        self.shift = self.dev64[5 * bp:6 * bp]
        self.n_rot = self.dev64[6 * bp:7 * bp]
        self.hide_lo = self.dev64[7 * bp:8 * bp]
        self.hide_hi = self.dev64[8 * bp:]
        self.block_tables = torch.zeros(bp, width, dtype=torch.int32, device=device)
        self.keep = torch.arange(bp, dtype=torch.int64, device=device)
        self.cu = torch.arange(bp + 1, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def plan(self) -> StepPlan:
        bp = self.bp
        return StepPlan(
            seq_ids=[-1] * bp, batch=bp, new_tokens=1, past_lens=[1] * bp, slots=self.slots,
            block_tables=self.block_tables, seq_lens=self.seq_lens, seq_lens_list=[1] * bp,
            kv_start=[0] * bp, packed=True, cu_seqlens_q=self.cu, q_lens=[1] * bp,
            eviction_aside=True,   # captured only for steps eviction steps aside for
            slots_grouped=True,    # one slot per sequence; padding rows: adjacent scratch slots
            aside=AsideInputs(self.spec, self.mass_rows, self.shift, self.n_rot, self.hide_lo,
                              self.hide_hi) if self.spec else None)


class DecodeGraphs:
    """Captures and replays the engine's decode steps (see the module docstring)."""

    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.state = runner.state
        self.max_batch = max(1, int(max_batch))
        self.buckets = bucket_sizes(self.max_batch)
        self.graphs: dict[tuple[int, AsideSpec], _Graph] = {}
        self.mempool = None
        self.scratch: tuple[int, list[int], int] | None = None   # (seq id, slots, table row)
        self.max_len: int | None = None   # block-table capacity (the engine's max_model_len)
        self.replays = 0
        self.captures = 0
        self._why_not: str | None = None
        self._generation: int | None = None   # the pool storage the graphs captured
        self._store = None   # the eviction mass store the graphs with mass captured
        self.state.release_hooks.append(weakref.WeakMethod(self.close))

    # -- when ---------------------------------------------------------------------------------
    def why_not(self) -> str | None:
        """None if decode steps can be graphed here, else the reason (fixed for the engine's
        life, except the hooks, checked at every step)."""
        if self._why_not is not None:
            return self._why_not
        st = self.state
        reason = None
        if not st.config.cuda_graphs:
            reason = "KVConfig.cuda_graphs is False (KVCOMPILE_CUDA_GRAPHS=0)"
        elif self.runner.device.type != "cuda":
            reason = "not on CUDA"
        elif not st.kernels.use_triton(self.runner.device):
            reason = "the reference kernels are selected"
        elif st.config.check_finite:
            reason = "check_finite syncs with the host"
        elif st.pool is None or not (self.max_len or st.pool.max_seq_len):
            reason = "no maximum sequence length (the block tables' width)"
        else:
            for k, v, meta in zip(st.pool.k, st.pool.v, st.layer_meta):
                reason = graph_refusal(k, v, latent=bool(meta.get("latent"))) or None
                if reason:
                    break
        self._why_not = reason
        if reason:
            log.info("kvcompile engine: decode steps run without CUDA graphs (%s)", reason)
        return reason

    def usable(self, out, eviction_aside: bool = False) -> bool:
        """eviction_aside: the eviction runtime needs nothing inside this step (its
        `decode_aside`); it evicts after the replay (runner.py)."""
        seqs = out.seqs
        if not seqs or len(seqs) > self.max_batch or self.why_not() is not None:
            return False
        ev = self.state.eviction
        if any(h is not ev or not eviction_aside for h in self.state.hooks):
            return False   # a hook may read or change K/V, or attend, on the host
        return all(s.n == 1 and s.start > 0 for s in seqs)

    # -- run ----------------------------------------------------------------------------------
    def run(self, out, inputs=None) -> torch.Tensor:
        """Logits [B, V] of a decode step (every sequence adds one token). inputs: eviction's
        (spec, mass rows, shifts, sink counts, hidden slots' lo, hi) of the step
        (EvictionRuntime.aside_inputs). out.feed: ids still on the device (overlap.py)."""
        seqs = out.seqs
        n = len(seqs)
        bp = next(b for b in self.buckets if b >= n)
        pool = self.runner.pool
        if self._generation != pool.generation:
            self.graphs.clear()   # the pool grew (or is new): the graphs read the old storage
            self._generation = pool.generation
        spec = inputs[0] if inputs is not None else PLAIN
        store = self.state.eviction.store if self.state.eviction is not None else None
        if spec.mass_len and store is not self._store:
            # the mass store is new or grew: graphs with mass read the old one
            self.graphs = {k: g for k, g in self.graphs.items() if not k[1].mass_len}
            self._store = store
        g = self._graph_for(bp, spec)
        g.next_stage()
        sids = [s.req.seq_id for s in seqs]
        slots, rows, lens = pool.decode_slots(sids)
        h64, h32 = g.h64, g.h32
        h64[:n] = [s.req.token_at(s.start) for s in seqs]
        h64[bp:bp + n] = [s.start for s in seqs]
        h64[2 * bp:2 * bp + n] = slots
        h64[3 * bp:3 * bp + n] = rows
        h32[:n] = lens
        if spec:
            h64[4 * bp:4 * bp + n] = inputs[1]
            h64[5 * bp:5 * bp + n] = inputs[2]
            h64[6 * bp:6 * bp + n] = inputs[3]
            h64[7 * bp:7 * bp + n] = inputs[4]
            h64[8 * bp:8 * bp + n] = inputs[5]
        if n < bp:  # padding rows: the scratch sequence, one slot each, one key seen
            self._pad(g, n)
        upload_plan(g, pool)
        if out.feed is not None:   # after the host ids' copy: the device's tokens win
            out.feed.apply(g.dev64[:n])
        if self.state.config.graph_check:   # (KVCOMPILE_GRAPH_CHECK=1: one sync a step)
            check_inputs(g, pool, self._generation, [s.req.seq_id for s in seqs])
        g.graph.replay()
        self.replays += 1
        self.state.count("engine_cuda_graph_replays")
        return g.logits[:n]

    def _graph_for(self, bp: int, spec: AsideSpec) -> _Graph:
        """The graph of bucket `bp` and eviction spec `spec`, captured if needed. The first
        step of a spec not seen before captures every bucket of it (largest first, as
        `capture_all` does for the plain step): the batch shrinks bucket by bucket as
        requests finish, and each capture in the middle of a run costs as much as tens of
        decode steps (on the H200 the eviction rows of bench_generate captured three buckets
        inside their timed call, while the plain step's were captured up front)."""
        g = self.graphs.get((bp, spec))
        if g is not None:
            return g
        if spec and not any(k[1] == spec for k in self.graphs):
            for b in reversed(self.buckets):
                if (b, spec) not in self.graphs:
                    self._capture(b, spec)
        g = self.graphs.get((bp, spec))   # (a capture that grew the pool dropped the others)
        return g if g is not None else self._capture(bp, spec)

    def _pad(self, g: _Graph, n: int) -> None:
        sid, slots, row = self._scratch(g.bp)
        bp = g.bp
        pad = bp - n
        g.h64[n:bp] = 0
        g.h64[bp + n:2 * bp] = 0
        g.h64[2 * bp + n:3 * bp] = slots[:pad]
        g.h64[3 * bp + n:4 * bp] = row
        ev = self.state.eviction
        store = ev.store if ev is not None else None
        g.h64[4 * bp + n:5 * bp] = store.scratch if store is not None else 0   # mass: scratch
        g.h64[5 * bp + n:6 * bp] = 0                                          # no rotation
        g.h64[6 * bp + n:7 * bp] = 0
        g.h64[7 * bp + n:8 * bp] = 0                                          # nothing hidden
        g.h64[8 * bp + n:] = 0
        g.h32[n:bp] = 1

    def _scratch(self, rows: int):
        """A pool sequence holding one slot per padding row (never read by a real row)."""
        pool = self.runner.pool
        if self.scratch is None or len(self.scratch[1]) < rows:
            if self.scratch is not None:
                pool.free([self.scratch[0]])
            sid = pool.allocate(1)[0]
            pool.reserve([sid], rows)
            slots, row = pool.sequence_slots(sid)
            self.scratch = (sid, slots, row)
        return self.scratch

    # -- capture ------------------------------------------------------------------------------
    def capture_all(self) -> int:
        """Capture every bucket now (largest first, so the smaller graphs reuse its memory), so
        that no step pays a capture; the engine calls it at construction. Returns the count."""
        if self.why_not() is not None:
            return 0
        self._generation = self.runner.pool.generation
        for bp in reversed(self.buckets):
            if (bp, PLAIN) not in self.graphs:
                self._capture(bp)
        return len(self.graphs)

    def _capture(self, bp: int, spec: AsideSpec = PLAIN) -> _Graph:
        pool = self.runner.pool
        dev = self.runner.device
        width = -(-(self.max_len or pool.max_seq_len) // pool.page_size)
        g = _Graph(bp, width, dev, spec)
        # every row is padding while capturing: the warm-up runs write the scratch pages only
        self._pad(g, 0)
        if self._generation != pool.generation:   # (the scratch sequence grew the pool)
            self.graphs.clear()
            self._generation = pool.generation
        upload_plan(g, pool, non_blocking=False)
        ctx = ForwardContext(self.state, None, plan=g.plan())

        def step():
            ctx.plan.cache.clear()   # a per-forward memo: captured ops must not be memoized
            with forward_context(ctx):
                return self.runner._call(g.ids, g.pos, g.keep[:bp])

        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        g.graph, g.logits = capture(step, dev, self.mempool)
        self.graphs[(bp, spec)] = g
        self.captures += 1
        self.state.count("engine_cuda_graph_captures")
        log.info("kvcompile engine: captured the decode step for %d rows%s", bp,
                 f" ({spec})" if spec else "")
        return g

    def close(self) -> None:
        """Drop the graphs and return the scratch pages."""
        self.graphs.clear()
        if self.scratch is not None and self.runner.pool is not None:
            if self.runner.pool.has(self.scratch[0]):
                self.runner.pool.free([self.scratch[0]])
            self.scratch = None
