"""Run-time state of one compiled model: its layers, its pool, its kernels, its report.

One `ModelState` serves every graph Dynamo compiles for a model (prefill, decode, recompiles):
layers are keyed by the attention module's path, so all graphs agree on the layer index. The
pool is built at the first forward, when the weights are on their device, from the budget
(cache/sizing.py: grown on demand on the Hugging Face paths, reserved up front for the Engine).

Lifetime: the model owns its state (kvcompile.compile: the model's `__dict__`; the backend
route: its parameters, runtime/ownership.py). Nothing global holds a state strongly: compiled
graphs that Dynamo keeps on code objects reach it through a weak reference, so the pool and the
CUDA graphs go when the model does (or at `release()`).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref

import torch

from kvcompile.config import KVConfig
from kvcompile.errors import CacheStateError
from kvcompile.runtime.dispatch import KernelDispatch
from kvcompile.runtime.hooks import RuntimeHook

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
        # the parameter ids last laid out for merged projections, until the retrace that
        # follows finds them in place (backend.py `_lay_out_projections`)
        self.laid_out: frozenset | None = None
        self.kernels = KernelDispatch(self)
        self.eviction = None                   # eviction runtime (kvcompile.eviction), if any
        self.hooks: list[RuntimeHook] = []     # eviction / telemetry / calibration hooks
        self.kernel_notes: list[str] = []      # which kernels ran and why (kvcompile.report)
        # Forwards of one model run one at a time (GraphRunner, GraphedForward): they share
        # run-time state besides the pool (CUDA-graph buffers, eviction bookkeeping, counters).
        self.lock = threading.RLock()
        self.serving = False       # driven by the Engine: KVConfig.reserve="auto" is "upfront"
        self.graph_calls = 0       # calls of kvcompile graphs (a forward making none ran eagerly)
        self.release_hooks: list = []   # weak callables run by release() (CUDA graphs' owners)
        # the tensor-parallel group its heads are split over (integrations/tp.py), or None
        self.tp = None
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
            budget = functools.partial(sizing.budget_bytes, self.config, self.device)
            if self.tp is not None:   # every rank's pool the same size: the least of them
                budget = functools.partial(_least_of_ranks, self.tp, budget)
            if self.reserve_policy == "upfront":
                pool = PagePool.from_budget(self.layer_specs, P, budget(), self.device, **kw)
            else:   # the budget is evaluated again at each growth (memory free then)
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
        from kvcompile.runtime.binding import live_bindings

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


def _least_of_ranks(tp, budget, *args, **kw) -> int:
    """A pool budget every tensor-parallel rank agrees on (each measures its own free memory),
    so that the same schedule fits every rank's pool."""
    return tp.min_int(budget(*args, **kw))


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


