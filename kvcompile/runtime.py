"""Run-time state of one compiled model: its layers, its pool, its kernels, its report.

One `ModelState` serves every graph Dynamo compiles for a model (prefill, decode, recompiles):
layers are keyed by the attention module's path, so all graphs agree on the layer index. The
pool is built at the first forward, when the weights are on their device, from the budget
(cache/sizing.py: grown on demand on the Hugging Face paths, reserved up front for the Engine).

Lifetime: the model owns its state (kvcompile.compile: the model's `__dict__`; the backend
route: its parameters, kvcompile/ownership.py). Nothing global holds a state strongly: compiled
graphs that Dynamo keeps on code objects reach it through a weak reference, so the pool and the
CUDA graphs go when the model does (or at `release()`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref

import torch

from kvcompile.config import KVConfig
from kvcompile.errors import CacheStateError, UnsupportedShapeError

log = logging.getLogger("kvcompile")

_states: list[weakref.ref] = []


class ModelState:
    def __init__(self, config: KVConfig):
        self.config = config
        self.layer_names: dict[str, int] = {}
        self.layer_specs: list = []
        self.layer_meta: list[dict] = []       # per layer: site name, formats, policy
        self.pool = None
        self.device: torch.device | None = None
        self.records: list = []                # SiteRecord of every site of every graph
        self.graphs = 0
        self.compile_seconds = 0.0
        self.counters: dict[str, int] = {}
        self.param_ids: set[int] = set()
        self.kernels = KernelDispatch(self)
        self.eviction = None                   # eviction runtime (kvcompile.eviction), if any
        self.eviction_pass = _eviction_pass    # (gm, plan, state) -> summary (kvcompile.eviction)
        self.hooks: list[RuntimeHook] = []     # eviction / telemetry / calibration hooks
        self.kernel_notes: list[str] = []      # which kernels ran and why (kvcompile.report)
        # Forwards of one model run one at a time (GraphRunner, GraphedForward): they share
        # run-time state besides the pool (CUDA-graph buffers, eviction bookkeeping, counters).
        self.lock = threading.RLock()
        self.serving = False       # driven by the Engine: KVConfig.reserve="auto" is "upfront"
        self.graph_calls = 0       # calls of kvcompile graphs (a forward making none ran eagerly)
        self.release_hooks: list = []   # weak callables run by release() (CUDA graphs' owners)
        _states.append(weakref.ref(self))

    def __deepcopy__(self, memo):
        # a deep copy of a compiled model shares its state (pool, lock) with the original
        return self

    # -- layers -------------------------------------------------------------------------------
    def register_layer(self, site, layer_spec, meta: dict) -> int:
        return self.add_layer(site.name, layer_spec, meta)

    def add_layer(self, name: str, layer_spec, meta: dict) -> int:
        if name in self.layer_names:
            idx = self.layer_names[name]
            if self.layer_specs[idx] != layer_spec:
                raise CacheStateError(
                    f"attention site {name} was compiled twice with different shapes or "
                    f"formats ({self.layer_specs[idx]} vs {layer_spec})")
            return idx
        if self.pool is not None:
            if self.pool.stats().sequences:
                raise CacheStateError(
                    f"a new attention site {name} appeared in a later graph while sequences "
                    f"are cached; compile the whole model in one graph (fullgraph=True)")
            self.pool = None  # rebuilt with the new layer at the next forward
        idx = len(self.layer_specs)
        self.layer_names[name] = idx
        self.layer_specs.append(layer_spec)
        self.layer_meta.append(meta)
        return idx

    def layer_index(self, name: str) -> int:
        try:
            return self.layer_names[name]
        except KeyError:
            raise CacheStateError(f"unknown attention site {name!r}") from None

    # -- pool ---------------------------------------------------------------------------------
    @property
    def reserve_policy(self) -> str:
        """"upfront" or "grow": KVConfig.reserve, where "auto" means upfront for the Engine and
        grow for the Hugging Face paths."""
        policy = getattr(self.config, "reserve", "auto")
        if policy == "auto":
            return "upfront" if self.serving else "grow"
        return policy

    def ensure_pool(self, device: torch.device):
        if self.pool is not None:
            return self.pool
        from kvcompile.cache import sizing
        from kvcompile.cache.pool import PagePool

        with self.lock:
            if self.pool is not None:
                return self.pool
            self.device = torch.device(device)
            kw = dict(max_seq_len=self.config.max_seq_len,
                      writer=self.kernels.writer(self.device))
            P = self.config.page_size
            if self.reserve_policy == "upfront":
                budget = sizing.budget_bytes(self.config, self.device)
                pool = PagePool.from_budget(self.layer_specs, P, budget, self.device, **kw)
            else:   # the budget is evaluated again at each growth (memory free then)
                budget = functools.partial(sizing.budget_bytes, self.config, self.device)
                pool = PagePool.growing(self.layer_specs, P, budget, self.device, **kw)
            self.pool = pool
            log.info("kvcompile pool (%s): %d pages of %d tokens allocated, at most %d "
                     "(%.1f MiB), %.1f B/token", self.reserve_policy, pool.num_pages, P,
                     pool.max_pages, pool.max_pages * pool.bytes_per_page / 2**20,
                     pool.bytes_per_token)
            return pool

    def serve(self) -> None:
        """The Engine takes this model: under reserve="auto" its pool is reserved up front (a
        pool that grew for `generate` allocates the rest of its budget now)."""
        with self.lock:
            self.serving = True
            if self.pool is not None and self.pool.growable and self.reserve_policy == "upfront":
                self.pool.reserve_all()

    def release(self) -> None:
        """Give back the pool (every sequence's pages), the CUDA graphs and their buffers. The
        model stays compiled: its next forward builds a new pool. Cache objects that still
        hold stubs of the old pool are detached (using one again raises CacheStateError)."""
        from kvcompile.cache.binding import live_bindings

        with self.lock:
            for b in live_bindings():
                if b.state is self:
                    b.detach()
            for ref in list(self.release_hooks):
                fn = ref()
                if fn is not None:
                    fn()
            for hook in self.hooks:
                fn = getattr(hook, "release", None)
                if fn is not None:
                    fn()
            self.pool = None
            self.count("releases")

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n


class RuntimeHook:
    """Extension point for run-time policies (eviction, telemetry). All methods optional.

    before_write(ctx, layer, k, v) -> (k, v)   new tokens [T, Hkv, D] before they are stored
    attention_extras(ctx, layer) -> dict        extra kernel kwargs (e.g. attn_mass buffer)
    after_attention(ctx, layer, q, out, extras) after a layer attended (q [B, Hq, S, D])
    after_forward(ctx)                          after the whole graph ran (evict here)
    attend(ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras)
        -> out [B, Hq, S, Dv] or None           replaces the kernel / reference attention of
                                                a layer (eviction: attention over kept slots)
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


def _eviction_pass(gm, plan, state):
    # the eviction pass lives in kvcompile/eviction; imported here lazily (import cycle)
    from kvcompile.eviction.insert import eviction_pass

    return eviction_pass(gm, plan, state)


def find_state(example_inputs, config: KVConfig) -> ModelState:
    """The state of the model whose parameters these graph inputs are (or a new one)."""
    from kvcompile.ownership import find_state as find

    return find(example_inputs, config)


def all_states() -> list[ModelState]:
    live = []
    for ref in list(_states):
        st = ref()
        if st is None:
            try:
                _states.remove(ref)
            except ValueError:   # (another thread removed it)
                pass
        else:
            live.append(st)
    return live


# Storage the Triton kernels read or write (kernels/decode.py, prefill*.py, append.py).
# The decode kernel reads every storage format: also int4 / int3 / int2 (page, token and channel
# scale + zero point), channel-granular fp8 / fp4, and bf16 residual pages, dequantized in
# registers. The append kernel and the prefill kernels know only TRITON_FORMATS with
# TRITON_GRANULARITIES and no residual: the other formats are written by the reference
# PagedTensor.write (it defines the same bytes) and prefilled by gathered SDPA / the reference.
TRITON_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
TRITON_GRANULARITIES = ("page", "token", "tensor")
DECODE_FORMATS = TRITON_FORMATS + ("int4", "int3", "int2")
DECODE_GRANULARITIES = TRITON_GRANULARITIES + ("channel",)


def kernel_readable(paged, op: str = "decode") -> bool:
    """Whether the Triton kernel of `op` ("decode", "prefill", "append") takes these pages."""
    f = paged.fmt
    if op != "decode":
        if f.name not in TRITON_FORMATS or getattr(f, "residual", False):
            return False
        return not f.is_quantized or f.granularity in TRITON_GRANULARITIES
    if f.name not in DECODE_FORMATS:
        return False
    if not f.is_quantized:
        return True
    if f.granularity == "channel" and f.name != "fp4_e2m1":
        # a channel-scaled tile is one page: >= 16 keys, >= 32 for int codes
        # (kernels/decode.py channel_min_page)
        if paged.page_size < (32 if f.is_int else 16):
            return False
    return f.granularity in DECODE_GRANULARITIES


class KernelDispatch:
    """Chooses the Triton kernels (CUDA, or KVConfig.kernels="triton") or the reference."""

    def __init__(self, state: ModelState):
        self._state = weakref.ref(state)   # (the state holds this: no cycle, see RuntimeHook)
        self._warned: set[str] = set()

    @property
    def state(self) -> ModelState:
        return self._state()

    def use_triton(self, device: torch.device) -> bool:
        choice = self.state.config.kernels
        if choice == "reference":
            return False
        if choice in ("triton", "cuda"):
            return choice == "triton" or device.type == "cuda"
        return device.type == "cuda"

    def writer(self, device: torch.device):
        if not self.use_triton(device):
            return None
        try:
            from kvcompile.kernels.append import quantize_append
        except ImportError:
            return None

        def write(paged, slots, x, grouped=False):
            # formats the append kernel does not know (int, channel scales, residual pages)
            # are written by the reference, which defines the same bytes
            if not kernel_readable(paged, "append"):
                return paged.write(slots, x)
            return quantize_append(paged, slots, x, grouped, direct=True)

        return write

    def _decode_backend(self, q, kc, vc, extras: dict) -> str:
        """Which decode kernel runs ("cuda" on sm_90 where it applies, else "triton"); counted
        for the report, with the reason a requested CUDA kernel did not run said once."""
        from kvcompile.kernels.decode import CUDA_DECODE_DEFAULT, fast_path_reason

        choice = self.state.config.kernels
        if choice == "triton" or choice == "auto" and not CUDA_DECODE_DEFAULT:
            self.state.count("decode_triton")
            return "triton"
        why = fast_path_reason(
            q, kc.fmt.name, kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity, kc.head_dim,
            vc.head_dim, kc.page_size, q.shape[1] // kc.num_heads * q.shape[2],
            extras.get("attn_mass"), bool(kc.fmt.residual or vc.fmt.residual))
        if not why:
            self.state.count("decode_cuda")
            return "cuda"
        self.state.count("decode_triton")
        key = f"decode: Triton kernel, not the CUDA one ({why})"
        if key not in self._warned:
            self._warned.add(key)
            self.state.kernel_notes.append(key)
            log.warning("kvcompile: %s", key)
        return "triton"

    def _fallback(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            log.info("kvcompile: reference attention used (%s)", why)
        self.state.count("reference_fallback")

    def attend(self, layer: int, q, plan, mask_info, attn_mask, is_causal, window, softcap,
               scale, extras: dict | None = None):
        """Output [B, Hq, S, Dv] from a kernel, or None to use the reference."""
        if not self.use_triton(q.device):
            return None
        extras = extras or {}
        if plan.packed:
            attn_mask = None  # the engine's plan defines the structure (causal per sequence)
        pool = self.state.pool
        kc, vc = pool.k[layer], pool.v[layer]
        op = "decode" if plan.is_decode else "prefill"
        if not (kernel_readable(kc, op) and kernel_readable(vc, op)):
            return self._fallback(f"{kc.fmt.name}/{vc.fmt.name} pages "
                                  f"({kc.fmt.granularity} scales, residual "
                                  f"{kc.fmt.residual or vc.fmt.residual}) have no Triton {op} kernel")
        key_mask, kv_start = None, None
        if attn_mask is not None:
            if mask_info is None or mask_info.key_mask is None:
                return self._fallback(getattr(mask_info, "reason", "")
                                      or "mask with per-head or per-row structure")
            if plan.new_tokens == 1 and plan.is_decode:
                key_mask = mask_info.key_mask
            elif mask_info.exact:
                kv_start = mask_info.kv_start
                window = window or mask_info.window
            else:
                return self._fallback("mask that is not causal + padding + window")
        elif not is_causal and plan.new_tokens > 1 and not plan.packed:
            # (a packed plan is causal within each sequence whatever mask the model built: the
            # engine calls the model with use_cache=False, so HF passes a mask, not is_causal)
            return self._fallback("non-causal attention over several new tokens")
        try:
            if plan.is_decode:
                from kvcompile.kernels.decode import paged_decode_attention

                if kv_start is not None and any(kv_start):
                    return self._fallback("padded speculative decode")
                backend = self._decode_backend(q, kc, vc, extras)
                return paged_decode_attention(
                    q, kc, vc, plan.block_tables, plan.seq_lens, scale, key_mask=key_mask,
                    sliding_window=window, softcap=softcap, direct=True, backend=backend,
                    **extras)
            # CUDA prefill runs the Triton chunked-prefill kernel over the pages (checked on the
            # H200, benchmarks/prefill_diag.py and gpu_check_prefill.py, 2026-11-30). Escape
            # hatch: KVCOMPILE_PREFILL=sdpa gathers the pages and runs torch SDPA
            # (kernels/dense.py), exact for any stored format; that stays the default off CUDA
            # (KVConfig(kernels="triton") on the CPU), where KVCOMPILE_PREFILL=triton opts in.
            mode = os.environ.get("KVCOMPILE_PREFILL") or ("triton" if q.is_cuda else "sdpa")
            if mode != "triton":
                self.state.count("prefill_gathered_sdpa")
                return None
            from kvcompile.kernels.prefill import paged_prefill_attention

            B, Hq, S, D = q.shape
            if plan.packed:
                qp = q[0].transpose(0, 1)
                cu = plan.cu_seqlens_q
            else:
                qp = q.transpose(1, 2).reshape(B * S, Hq, D)
                cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
            start = None
            if kv_start is not None or any(plan.kv_start):
                start = torch.tensor(kv_start or plan.kv_start, dtype=torch.int32,
                                     device=q.device)
            out = paged_prefill_attention(
                qp.contiguous(), kc, vc, plan.block_tables, cu, plan.seq_lens, scale,
                sliding_window=window, softcap=softcap, kv_start=start)
            self.state.count("prefill_triton")
            if plan.packed:
                return out.transpose(0, 1).unsqueeze(0)
            return out.reshape(B, S, Hq, -1).transpose(1, 2)
        except (ImportError, UnsupportedShapeError) as e:
            self._fallback(f"{type(e).__name__}: {e}")
            return None
