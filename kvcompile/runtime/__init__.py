"""Everything that runs per forward outside the graph.

    state.py           ModelState (one per compiled model: layers, pool, counters) and the
                       registry of live states
    ownership.py       who keeps a state alive; which state a compiled graph's caller runs on
    binding.py         a model's own cache object (HF DynamicCache, ...) bound to pool sequences
    context.py         the forward context and its StepPlan (slots, block tables, lengths)
    attention_op.py    torch.ops.kvcompile.attention and its fake: write K/V, then attend
    dispatch.py        who attends (one ordered function), the kernels' choice, the prefill switch
    kernel_formats.py  which storage formats the Triton kernels read or write
    hooks.py           RuntimeHook: eviction bookkeeping, inspection, telemetry around each op

Kernels (kvcompile/kernels) get tensors, block tables and constants from here: they never see
the pool or the forward context.
"""

from kvcompile.runtime.hooks import RuntimeHook
from kvcompile.runtime.state import ModelState, all_states

__all__ = ["ModelState", "RuntimeHook", "all_states"]
