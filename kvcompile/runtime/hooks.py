"""`RuntimeHook`: what code outside the graph may observe or change around each attention op.

Hooks live in `ModelState.hooks` (eviction bookkeeping, `kvcompile inspect` / `verify`,
telemetry, tests). Which code attends is not decided by their order: runtime/dispatch.py
`attend` asks a hook's `attend` at one fixed step of its list.
"""

from __future__ import annotations

import weakref


class RuntimeHook:
    """Extension point for run-time policies (eviction, telemetry). All methods optional.

    before_write(ctx, layer, k, v) -> (k, v)   new tokens [T, Hkv, D] before they are stored
    attention_extras(ctx, layer) -> dict        extra kernel kwargs (e.g. attn_mass buffer)
    after_attention(ctx, layer, q, out, extras) after a layer attended (q [B, Hq, S, D])
    after_forward(ctx)                          after the whole graph ran (evict here)
    attend(ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras)
        -> out [B, Hq, S, Dv] or None           replaces the kernel / reference attention of
                                                a layer (runtime/dispatch.py says when)
    """

    # A hook's `state` is held weakly: the state holds its hooks, and a cycle would keep the
    # pool alive until a second garbage collection after the model is gone.
    @property
    def state(self):
        ref = self.__dict__.get("_state_ref")
        return ref() if ref is not None else None

    @state.setter
    def state(self, st) -> None:
        self.__dict__["_state_ref"] = weakref.ref(st) if st is not None else None

    def attend(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras):
        return None

    def before_write(self, ctx, layer, k, v):
        return k, v

    def attention_extras(self, ctx, layer) -> dict:
        return {}

    def after_attention(self, ctx, layer, q, out, extras) -> None:
        pass

    def after_forward(self, ctx) -> None:
        pass
