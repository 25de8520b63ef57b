"""Runs one engine step on the compiled model: a packed batch over the pool.

The scheduled tokens of every sequence are packed into one row, `input_ids [1, T]` with their
absolute `position_ids [1, T]`, and the model is called with `use_cache=False`: its attention
sites are then "none" caches, rewritten onto `kvcompile::attention` like any other. The forward
context carries a packed `StepPlan` (docs/architecture.md, "The engine drives the same graphs
with its own plan"): the op stores each sequence's new K/V at the reserved slots and attends
causally within each sequence (`cu_seqlens_q`), ignoring whatever mask the model built.

T and the number of sequences vary from step to step; they are marked dynamic, so Dynamo
compiles two graphs (any T, and T = 1), not one per length.
"""

from __future__ import annotations

import inspect

import torch

from kvcompile.cache.context import ForwardContext, StepPlan, forward_context
from kvcompile.engine.scheduler import SchedulerOutput
from kvcompile.errors import UnsupportedShapeError
from kvcompile.runtime import RuntimeHook


class ModelRunner:
    def __init__(self, model, state, max_batch: int = 128, cuda_graphs: bool = True):
        from kvcompile.engine.cudagraph import DecodeGraphs

        self.model = model
        self.state = state
        state.serve()   # KVConfig.reserve="auto": the whole pool up front (cache/sizing.py)
        self.device = next(model.parameters()).device
        fwd = inspect.signature(type(model).forward).parameters
        self.keep_arg = "logits_to_keep" in fwd
        if not any(isinstance(h, PackedDecodeHook) for h in state.hooks):
            state.hooks.append(PackedDecodeHook(state))
        # decode steps replayed from CUDA graphs (engine/cudagraph.py), where they can be
        self.graphs = DecodeGraphs(self, max_batch) if cuda_graphs else None

    @property
    def pool(self):
        return self.state.pool

    def warm_up(self) -> None:
        """One forward outside any context: Dynamo traces (T and the kept rows dynamic from the
        start), the passes register every attention layer, and the pool is built (the
        GraphRunner binds a throwaway sequence)."""
        ids = torch.zeros(1, 4, dtype=torch.long, device=self.device)
        pos = torch.arange(4, device=self.device)[None]
        keep = torch.tensor([1, 3], device=self.device)
        self._call(ids, pos, keep)
        self.state.ensure_pool(self.device)

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [B, V] at the last scheduled token of each sequence of the step."""
        if self.graphs is not None and self.graphs.usable(out):
            return self.graphs.run(out)
        seqs = out.seqs
        ids, pos, cu, q_lens, past, lens = [], [], [0], [], [], []
        for s in seqs:
            ids += s.req.tokens(s.start, s.start + s.n)
            pos += range(s.start, s.start + s.n)
            cu.append(cu[-1] + s.n)
            q_lens.append(s.n)
            past.append(s.start)
            lens.append(s.start + s.n)
        dev = self.device
        seq_ids = [s.req.seq_id for s in seqs]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        plan = StepPlan(
            seq_ids=seq_ids, batch=len(seqs), new_tokens=max(q_lens), past_lens=past,
            slots=torch.cat([s.slots for s in seqs]).to(dev),
            block_tables=self.pool.block_table(seq_ids, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), seq_lens_list=lens,
            kv_start=[0] * len(seqs), packed=True, cu_seqlens_q=cu_t.to(dev), q_lens=q_lens)
        ctx = ForwardContext(self.state, None, plan=plan)
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([pos], dtype=torch.long, device=dev)
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


class PackedDecodeHook(RuntimeHook):
    """A packed step in which every sequence adds one token is a decode step: send it to the
    split-K decode kernel (q [1, Hq, B, D] viewed as [B, Hq, 1, D]) rather than the varlen
    prefill kernel, which has one program per query block and no split over the keys."""

    def __init__(self, state):
        self.state = state

    def attend(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras):
        # q: [1, Hq, B, D] -> out [1, Hq, B, Dv], or None (the usual kernel / reference)
        if not plan.packed or not plan.q_lens or max(plan.q_lens) != 1:
            return None
        if min(plan.past_lens) == 0 or not self.state.kernels.use_triton(q.device):
            return None
        pool = self.state.pool
        kc, vc = pool.k[layer], pool.v[layer]
        readable = getattr(_runtime(), "kernel_readable", None)
        if readable is not None and not (readable(kc) and readable(vc)):
            return None
        try:
            from kvcompile.kernels.decode import paged_decode_attention
        except ImportError:
            return None
        qd = q[0].transpose(0, 1).unsqueeze(2).contiguous()        # [B, Hq, 1, D]
        try:
            out = paged_decode_attention(qd, kc, vc, plan.block_tables, plan.seq_lens, scale,
                                         sliding_window=window, softcap=softcap,
                                         direct=True, **extras)
        except UnsupportedShapeError:
            return None   # e.g. a head_dim the kernel does not take: the usual path
        self.state.count("engine_decode_kernel_calls")
        return out.squeeze(2).transpose(0, 1).unsqueeze(0)          # [1, Hq, B, Dv]


def _runtime():
    import kvcompile.runtime as rt

    return rt
