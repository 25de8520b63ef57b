"""Runs one engine step on the compiled model: a packed batch over the pool.

The scheduled tokens of every sequence are packed into one row, `input_ids [1, T]` with their
absolute `position_ids [1, T]`, and the model is called with `use_cache=False`: its attention
sites are then "none" caches, rewritten onto `kvcompile::attention` like any other. The forward
context carries a packed `StepPlan` (docs/architecture.md, "The engine drives the same graphs
with its own plan"): the op stores each sequence's new K/V at the reserved slots and attends
causally within each sequence (`cu_seqlens_q`), ignoring whatever mask the model built; a step
in which every sequence adds one token goes to the split-K decode kernel (runtime/dispatch.py).

T and the number of sequences vary from step to step; they are marked dynamic, so Dynamo
compiles two graphs (any T, and T = 1), not one per length.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from kvcompile.engine.scheduler import SchedulerOutput
from kvcompile.eviction.aside import AsideInputs
from kvcompile.runtime.context import ForwardContext, StepPlan, forward_context

# tokens of a step from which its ids and positions are built as arrays (runner._eager)
LARGE_STEP_TOKENS = 512


class ModelRunner:
    def __init__(self, model, state, max_batch: int = 128, cuda_graphs: bool = True):
        from kvcompile.engine.cudagraph import DecodeGraphs

        self.model = model
        self.state = state
        state.serve()   # KVConfig.reserve="auto": the whole pool up front (cache/sizing.py)
        self.device = next(model.parameters()).device
        fwd = inspect.signature(type(model).forward).parameters
        self.keep_arg = "logits_to_keep" in fwd
        # decode steps replayed from CUDA graphs (engine/cudagraph.py), where they can be
        self.graphs = DecodeGraphs(self, max_batch) if cuda_graphs else None

    @property
    def pool(self):
        return self.state.pool

    def warm_up(self) -> None:
        """One forward in the engine's warm-up context: Dynamo traces (T and the kept rows
        dynamic from the start) a graph for the engine's steps, whose attention ops take no
        mask (passes/mask_inputs.py drop_masks: the model's own mask over a packed step is
        [1, 1, T, T]), and the passes register every attention layer; then the pool is
        built. The ops attend over the 4 given tokens alone and store nothing."""
        ids = torch.zeros(1, 4, dtype=torch.long, device=self.device)
        pos = torch.arange(4, device=self.device)[None]
        keep = torch.tensor([1, 3], device=self.device)
        with forward_context(ForwardContext(self.state, None, engine_warm_up=True)):
            self._call(ids, pos, keep)
        self.state.ensure_pool(self.device)

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [B, V] at the last scheduled token of each sequence of the step. `out.feed`:
        input ids still on the device (engine/overlap.py `TokenFeed`), over placeholders."""
        ev = self.state.eviction
        # a decode step eviction needs nothing inside of: the decode kernel attends over the
        # stored slots (a CUDA graph where one applies); eviction runs after it, on the device
        sids = [s.req.seq_id for s in out.seqs]
        aside = (ev is not None and all(s.n == 1 and s.start > 0 for s in out.seqs)
                 and ev.decode_aside(sids))
        # what the step does for eviction inside it (H2O mass, re-rotated sinks: aside.py)
        inputs = ev.aside_inputs(sids, self.device) if aside else None
        if self.graphs is not None and self.graphs.usable(out, eviction_aside=aside):
            logits = self.graphs.run(out, inputs)
        else:
            logits = self._eager(out, aside, inputs)
        if aside:
            ev.after_decode_step([s.req.seq_id for s in out.seqs])
        return logits

    def _eager(self, out: SchedulerOutput, aside: bool, inputs=None) -> torch.Tensor:
        seqs = out.seqs
        pool = self.pool
        ids, pos, cu, q_lens, past, lens = [], [], [0], [], [], []
        # a large step (prompts): ids and positions as arrays, joined once (16 prompts of
        # 4,096 tokens: 8.9 ms of Python lists and list-to-tensor copies, host time before
        # the step's launch, CPU-timed)
        big = sum(s.n for s in seqs) >= LARGE_STEP_TOKENS
        for s in seqs:
            if big:
                ids.append(s.req.token_array(s.start, s.start + s.n))
                pos.append(np.arange(s.start, s.start + s.n, dtype=np.int64))
            else:
                ids += s.req.tokens(s.start, s.start + s.n)
                pos += range(s.start, s.start + s.n)   # logical positions
            cu.append(cu[-1] + s.n)
            q_lens.append(s.n)
            stored = pool.seq_len(s.req.seq_id)   # after reserve; < start once evicted
            past.append(stored - s.n)
            lens.append(stored)
        ev = self.state.eviction
        if ev is not None and not aside:   # a chunk before a prompt's end: no eviction after it
            # (Engine.prefill_eviction_chunk: evicted at every multiple of req.evict_every)
            ev.hold([s.req.seq_id for s in seqs if s.start + s.n < len(s.req.prompt_ids)
                     and not (s.req.evict_every and (s.start + s.n) % s.req.evict_every == 0)])
            # decode steps (past the prompt) evict every eviction_interval steps
            ev.decoding = {s.req.seq_id for s in seqs
                           if s.n == 1 and s.start >= len(s.req.prompt_ids)}
        dev = self.device
        seq_ids = [s.req.seq_id for s in seqs]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        plan = StepPlan(
            seq_ids=seq_ids, batch=len(seqs), new_tokens=max(q_lens), past_lens=past,
            slots=torch.cat([s.slots for s in seqs]).to(dev),
            block_tables=pool.block_table(seq_ids, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), seq_lens_list=lens,
            kv_start=[0] * len(seqs), packed=True, cu_seqlens_q=cu_t.to(dev), q_lens=q_lens,
            eviction_aside=aside,
            slots_grouped=True)   # each sequence's slots in order, in pages it alone writes
        if inputs is not None and inputs[0]:
            spec, *rows = inputs
            t = torch.tensor(rows, dtype=torch.int64).to(dev)
            plan.aside = AsideInputs(spec, *t)
        ctx = ForwardContext(self.state, None, plan=plan)
        ids_t = (torch.from_numpy(np.concatenate(ids))[None].to(dev) if big else
                 torch.tensor([ids], dtype=torch.long, device=dev))
        if out.feed is not None:
            out.feed.apply(ids_t[0])
        pos_t = (torch.from_numpy(np.concatenate(pos))[None].to(dev) if big else
                 torch.tensor([pos], dtype=torch.long, device=dev))
        keep = (cu_t[1:] - 1).to(dev, torch.long)
        with forward_context(ctx):
            logits = self._call(ids_t, pos_t, keep)
        for hook in self.state.hooks:  # the GraphRunner leaves an engine's context alone
            hook.after_forward(ctx)
        return logits

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # ids, pos: [1, T]  keep: [B] indices of the rows whose logits are needed -> [B, V]
        B = keep.shape[0]
        if B == 1:  # a size-1 dim would be specialized (one more graph): ask for a row twice
            keep = keep.repeat(2)
        torch._dynamo.maybe_mark_dynamic(keep, 0)
        if ids.shape[1] > 1:  # T == 1 (one decode alone) is its own graph
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            torch._dynamo.maybe_mark_dynamic(pos, 1)
        kw = dict(input_ids=ids, position_ids=pos, use_cache=False)
        with torch.no_grad():
            if self.keep_arg:
                logits = self.model(**kw, logits_to_keep=keep).logits[0]
            else:
                logits = self.model(**kw).logits[0].index_select(0, keep)
        return logits[:B]
