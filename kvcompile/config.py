"""KVConfig: the one config of kvcompile, and `configure`, its per-module overrides.

    kvcompile.compile(model, KVConfig(kv_dtype="fp8_e4m3", page_size=16))
    torch.compile(model, backend="kvcompile", options={"kv_dtype": "fp8_e4m3"})

Both take the same fields. Every bad value raises `KVConfigError` naming the field and the values
it allows. The KVCOMPILE_* environment variables set the defaults of the run-time switches
(`cuda_graphs`, `deferred_stop`, `prefill`, `prefill_*`, ...); they are read here, when a
KVConfig is made, and nowhere else in the package.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import weakref
from dataclasses import dataclass, fields
from typing import Any

from kvcompile.cache.registry import (
    ADD_FORMAT_HINT,
    BUILTIN_NAMES,
    format_names,
    format_spec,
    is_quantized,
)
from kvcompile.errors import KVConfigError

# Storage formats of the cache: the registry's (cache/registry.py), built-ins here for the CLI's
# choices. "auto" keeps the model's own dtype (bf16/fp16/fp32).
KV_DTYPES = ("auto",) + BUILTIN_NAMES
PAGE_SIZES = (8, 16, 32, 64, 128)
# page: one fp32 scale per (page, kv-head); token: per (token, kv-head); tensor: one static scale
# per layer; channel: per (page, kv-head, channel), KIVI-style, for keys.
SCALE_GRANULARITIES = ("page", "token", "tensor", "channel")
ROTATIONS = (None, "hadamard")
INNER_BACKENDS = ("auto", "inductor", "aot_eager", "eager")
KERNEL_CHOICES = ("auto", "triton", "cuda", "reference")
# When the pool takes its memory (cache/sizing.py): "grow" on demand up to the budget,
# "upfront" all of it at the first forward; "auto": grow for HF generate, upfront for the Engine.
RESERVE_POLICIES = ("auto", "grow", "upfront")
# Prefill attention over the pages: "triton" (the chunked-prefill kernel), "sdpa" (gather the
# pages, torch SDPA: exact for every format); "auto": triton on CUDA, sdpa elsewhere.
PREFILL_CHOICES = ("auto", "triton", "sdpa")
# What a fresh prompt's prefill attends to: "fresh" (its K/V as computed, torch SDPA; the pages
# are written for the decode steps) or "stored" (the pages, as every later step does).
PREFILL_ATTENDS = ("fresh", "stored", "fresh_fp8")
# How a chunk attends over its sequence's pages (prefill="triton"): "gather" (dequantize the
# pages into a transient contiguous workspace, then the dense varlen kernel), "paged" (the
# kernel reads the pages in its tile loop), "auto": kernels/prefill_gather.py choose_route.
PREFILL_CHUNK_ROUTES = ("auto", "gather", "paged")
# fp8 pages' CPU decode step (kernels/cpu_fp8.py): C where it builds, C or an error, numpy
CPU_FP8_ROUTES = ("auto", "c", "numpy")
DECODE_GEMMS = ("torch", "triton", "auto")

# Fields that `configure` may override per module; the rest are global to the pool.
PER_MODULE_FIELDS = (
    "kv_dtype", "k_dtype", "v_dtype", "scale_granularity", "v_scale_granularity", "static_scale",
    "eviction", "rotate", "enabled",
)


# Policy types by the name a dict form gives (`{"policy": "h2o", ...}`), filled by
# EvictionPolicy.__init_subclass__.
_POLICIES: dict[str, type] = {}


class EvictionPolicy:
    """Base type of eviction policies (`kvcompile.SinkWindow`, `H2O`, `SnapKV`).

    A policy is a frozen dataclass; the eviction runtime maps each policy type to its
    implementation. `KVConfig.eviction` accepts an instance, None, or a dict
    `{"policy": "sink_window", "sinks": 4, "window": 1020}`.
    """

    name: str = "base"

    def __init_subclass__(cls, **kw):
        # a subclass with its own `name` is accepted by that name in dict form
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:
            _POLICIES[cls.name] = cls

    def tokens_kept(self, seq_len: int) -> int:
        """How many tokens a sequence of `seq_len` tokens keeps in the cache under this policy."""
        raise NotImplementedError


def _quantized(kv_dtype: str) -> bool:
    return is_quantized(kv_dtype)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"{lo}..{hi}"
        raise KVConfigError(name, value, f"an int {rng}")


@dataclass(frozen=True)
class SinkWindow(EvictionPolicy):
    """StreamingLLM: keep the first `sinks` tokens and the last `window` tokens."""

    sinks: int = 4
    window: int = 1020
    granularity: str = "token"  # "token" (compact slots) or "page" (free whole pages only)
    name = "sink_window"

    def __post_init__(self):
        _check_int("eviction.sinks", self.sinks, 0)
        _check_int("eviction.window", self.window, 1)
        if self.granularity not in ("token", "page"):
            raise KVConfigError("eviction.granularity", self.granularity, "'token', 'page'")

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.sinks + self.window)


@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Heavy hitters: keep `sinks` first tokens, the `recent` last, and the keys with the most
    attention mass accumulated during decode, up to `budget` tokens in all."""

    budget: int = 1024
    recent: int = 256
    sinks: int = 4
    granularity: str = "token"
    name = "h2o"

    def __post_init__(self):
        _check_int("eviction.budget", self.budget, 1)
        _check_int("eviction.recent", self.recent, 0)
        _check_int("eviction.sinks", self.sinks, 0)
        if self.recent + self.sinks > self.budget:
            raise KVConfigError("eviction.budget", self.budget,
                                f"at least recent + sinks = {self.recent + self.sinks}")
        if self.granularity not in ("token", "page"):
            raise KVConfigError("eviction.granularity", self.granularity, "'token', 'page'")

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.budget)


@dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """SnapKV: at the end of prefill, keep the `budget` keys most attended by the last `window`
    queries (scores average-pooled with `kernel`), plus the window itself.

    Defaults are measured (benchmarks/RESULTS.md, "Quality: eviction"): a short observation
    window (8 queries) and one selection shared by the kv heads of a layer. On SmolLM2-135M at
    50% compression it retrieved the passkey in 15/15 prompts (1k-4k tokens) where the
    published setting, `SnapKV(budget, window=32, kernel=5, per_head=True)`, retrieved 0/15
    (it kept only some digits of the key); perplexity after a compressed 1k-token context was
    26.77 against 26.60 (one 128-token window: within noise).
    `SnapKV(budget, window=1, kernel=1, per_head=False)` is TOVA at prefill (the last query's
    attention summed over the heads of a layer).

    hold: what decode steps do once the prompt is chosen. False (the published SnapKV): the
    cache grows by every decoded token (budget + generated tokens). True: the budget holds
    while decoding: the choice's scores are kept per slot, and each decoded token past the
    budget pushes out the lowest-ranked prompt token (decoded tokens rank above every prompt
    token, newer above older), so a sequence never stores more than `budget` tokens (+ the
    engine's `eviction_interval` - 1 between evictions) and an engine admits by the budget.
    No second pass and no attention mass: the scores are those of the prompt's choice."""

    budget: int = 1024
    window: int = 8
    kernel: int = 5
    per_head: bool = False
    hold: bool = False
    name = "snapkv"

    def __post_init__(self):
        _check_int("eviction.budget", self.budget, 1)
        _check_int("eviction.window", self.window, 1)
        _check_int("eviction.kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise KVConfigError("eviction.kernel", self.kernel, "an odd int (pooling is centered)")
        for name in ("per_head", "hold"):
            if not isinstance(getattr(self, name), bool):
                raise KVConfigError(f"eviction.{name}", getattr(self, name), "True or False")

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.budget)


_POLICIES["streaming"] = SinkWindow


def _coerce_eviction(value) -> EvictionPolicy | None:
    if value is None or isinstance(value, EvictionPolicy):
        return value
    if isinstance(value, dict):
        kw = dict(value)
        kind = kw.pop("policy", None)
        if kind not in _POLICIES:
            raise KVConfigError("eviction", value, f"a dict with 'policy' in {sorted(_POLICIES)}")
        cls = _POLICIES[kind]
        names = [f.name for f in fields(cls)]
        for key in kw:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                raise KVConfigError(f"eviction.{key}", kw[key], f"a field of {cls.__name__}: "
                                    + ", ".join(names),
                                    hint=f"Did you mean {close[0]!r}?" if close else "")
        return cls(**kw)
    raise KVConfigError("eviction", value, "None, SinkWindow(...), H2O(...), SnapKV(...) or a dict")


# --- defaults set by the environment (read here only) -----------------------------------------

def _env_on(var: str, default: bool) -> bool:
    """Unset or empty: the default; "0", "false", "False": off; anything else: on."""
    v = os.environ.get(var)
    return default if v is None or v == "" else v not in ("0", "false", "False")


def _cuda_graphs_default() -> bool:
    return os.environ.get("KVCOMPILE_CUDA_GRAPHS", "1") not in ("0", "false", "False", "")


def _prefill_default() -> str:
    v = os.environ.get("KVCOMPILE_PREFILL")
    return "auto" if not v else "triton" if v == "triton" else "sdpa"   # any other value: sdpa


def _merge_default():
    v = os.environ.get("KVCOMPILE_MERGE_PROJECTIONS")
    return "auto" if v in (None, "", "auto") else v not in ("0", "false", "False")


def _env_field(default):
    return dataclasses.field(default_factory=default)


@dataclass(frozen=True)
class KVConfig:
    """How the KV cache of a compiled model is stored, bounded and evicted.

    kv_dtype: storage format of K and V ("auto" keeps the model's dtype). k_dtype / v_dtype
        override it for keys or values alone (e.g. keys fp8, values fp4).
    page_size: tokens per page of the paged pool.
    scale_granularity: "page" (one fp32 scale per page and kv-head), "token", "tensor" (one
        static scale per layer: `static_scale`, or calibrated on the first write), or "channel"
        (per page, kv-head and channel; keys only, KIVI-style).
    v_scale_granularity: the values' own granularity ("page", "token", "tensor"; not
        "channel"), e.g. keys "page" with values "token". None: the same as
        scale_granularity, except that under "channel" values take "token" (int) or "page".
    max_kv_bytes / memory_fraction: the pool's budget; bytes, or a fraction of the device
        memory free when the pool is built or grows (on the CPU: of available RAM, at most
        4 GiB). The rest stays free for activations.
    reserve: when the pool takes its budget: "grow" (start with one chunk, grow on demand,
        as Hugging Face caches do), "upfront" (all of it at the first forward, as vLLM does),
        or "auto": grow for `generate` / the torch.compile backend, upfront for the Engine.
    max_seq_len: longest sequence allowed; longer raises SequenceTooLongError.
    eviction: None or a policy (SinkWindow, H2O, SnapKV).
    rotate: None or "hadamard": rotate q and k over head_dim before quantizing keys.
    check_finite: raise NonFiniteKVError when NaN/Inf enters the cache (costs a sync).
    inner: the backend the rest of the graph goes to. "auto" (the default): inductor on CUDA,
        "eager" on the CPU, where inductor's C++ compile is slow and buys the CPU path nothing
        (SmolLM2-135M on 2 cores: compile + the first generate took 280 s with inductor
        against about 28 s eager, and decode ran no faster; benchmarks/RESULTS.md, "CPU
        generate"). "aot_eager" functionalizes the graph as inductor would (debugging).
    kernels: "auto" (on CUDA: the CUDA C++ decode kernel on Hopper (sm_90) for fp8 pages,
        Triton for the rest; the PyTorch reference on the CPU), "triton" (the portable
        kernels only), "reference", or "cuda": the CUDA C++ decode kernel wherever it takes
        the pages (bf16 / fp16 / fp8; kernels/decode_sm90.py), Triton for the rest, with the
        reason said once. On the H200 the CUDA kernel measured 0.65-0.77x torch SDPA for fp8
        pages against Triton's 0.76-0.96x, and slower than Triton for bf16 pages
        (benchmarks/RESULTS.md, "The CUDA decode kernel runs").
    residual: keep a sequence's last, partly filled page in bf16 until it fills (int4/int2).
    enabled: False leaves attention sites untouched (useful per module through `configure`).
    prefill_attends: what a fresh prompt's prefill (nothing of any row cached yet) attends to:
        "fresh" (the default) its K/V as the model computed them, through torch SDPA (flash /
        cuDNN on CUDA), as the model's own path and vLLM do; "stored": the pages just written
        (quantized), as every later step does; "fresh_fp8": its K/V as computed, attended on FP8
        tensor cores (`prefill_attention(fp8=True)`: q, k, v in E4M3 with block scales, on
        Hopper the Gluon kernel with each query row quantized by the kernel, elsewhere the
        Triton FP8 kernel, on the CPU the reference over the same values; layers or batches
        it cannot take attend as "fresh" does, said once in kvcompile.report). The pages are
        written either way; windows shorter than the prompt, softcaps and eviction take the
        paged path.
    prefill_chunk_route: how a prefill over pages (a later chunk of a chunked prefill, or
        prefill_attends="stored") reads them with the Triton kernels: "gather" dequantizes the
        sequences' pages, one layer at a time, into a transient contiguous workspace and runs
        the dense varlen kernel over it; "paged" reads the pages inside the attention loop;
        "auto" (the default) gathers for long chunks (kernels/prefill_gather.py
        `choose_route`: at least GATHER_MIN_ROWS query rows per kv head, weighted by keys).
        Attention-sink logits and left padding inside a chunk stay paged. The report counts
        each (prefill_gather, prefill_triton) and says why the rule chose, once per reason.
    prefill_gather_bytes: bound of the gather's workspace (bytes, K and V of the sequences
        gathered together); a batch over it is gathered in groups of sequences, a sequence
        over it in pieces of keys merged by their log-sum-exp (a windowed one, or one whose
        chunk alone exceeds it, stays paged). The prefill chunker
        (integrations/hf_prefill.py) keeps it free beside the activations.

    Run-time switches, whose defaults the environment sets:
    cuda_graphs: replay decode steps from CUDA graphs where they can be (the Engine's,
        engine/cudagraph.py, and `generate`'s, integrations/hf_graphs.py). Default True;
        KVCOMPILE_CUDA_GRAPHS=0 sets False.
    merge_projections: run the linears that read one activation with parameters of one
        dtype and width (q / k / v, gate / up) as one GEMM on their weights laid out as one
        tensor (passes/merge_projections.py; no copy of the weights survives). "auto" (the
        default): in graphs on CUDA (a decode step's GEMMs 5-7% faster there; on the CPU,
        where the eager inner compiler runs the narrowed views as they are, it measured no
        gain); True: everywhere; False: never. KVCOMPILE_MERGE_PROJECTIONS=0 / 1 / auto.
    decode_gemms: who runs a rewritten CUDA graph's linears whose input has at most 16 rows
        (a decode step's weight GEMMs): "torch" (the default: the inner compiler, cuBLAS),
        "triton" (kernels/skinny.py through passes/skinny_linears.py; on the H100 it matched
        cuBLAS, 0.97-0.99x over a step's shapes; the H200 is unmeasured) or "auto" (each
        shape on whichever of the two ran it faster on this GPU, measured once a shape at its
        first call: runtime/skinny_op.py; the report lists the choices).
        KVCOMPILE_DECODE_GEMMS=torch / triton / auto.
    deferred_stop: in Hugging Face `generate` on CUDA, read each step's stop decision one step
        late (transformers' own DeferredStopCheck, which it uses on "mps" only), so the host
        queues step n + 1 while the GPU runs step n instead of waiting for it every step;
        streamers get each token one step late, and a call whose rows all stop early (EOS)
        runs one more step, undone. Not where the cache outlives the call (returned, or
        passed in): `kvcompile.report` says so. Default True; KVCOMPILE_DEFERRED_STOP=0 sets
        False.
    device_loop: Hugging Face `generate`'s greedy decoding over CUDA-graphed decode steps
        runs its steps on the device (integrations/hf_loop.py): each step a forward replay and
        a captured tail (argmax, the finished rows' padding, the next step's inputs, the stop
        flag, read a step late), with none of transformers' per-step Python or small kernels.
        Greedy tokens are transformers' own; sampling through the temperature / top-k /
        top-p / min-p warpers draws from the same distribution with a graph-safe draw (not
        transformers' random numbers); with an eviction policy each step goes through the
        forward (a graph where eviction steps aside). Other logits processors, stop strings
        and the other features that need the host keep transformers' loop
        (`kvcompile.report` says which). Default True; KVCOMPILE_DEVICE_LOOP=0 sets False.
    prefill: "auto", "triton" or "sdpa" (PREFILL_CHOICES). Default from KVCOMPILE_PREFILL
        ("triton"; any other value set means "sdpa").
    prefill_tma / prefill_q_tma / prefill_scale_tma / prefill_warp_spec: diagnostic switches
        of the packed varlen prefill kernel (kernels/prefill_launch.py `PrefillSwitches`:
        K/V and Q through TMA descriptors, FP8 scales through TMA, warp-specialized tiles),
        used by benchmarks/prefill_diag.py; the compiled model's paged prefill does not read
        them. Defaults True / True / False / False, from KVCOMPILE_PREFILL_TMA,
        KVCOMPILE_PREFILL_Q_TMA, KVCOMPILE_PREFILL_SCALE_TMA ("0" / "false" off, other
        values on) and KVCOMPILE_PREFILL_WARP_SPEC (on only for "1").
    rerotated_sinks_graphs: let SinkWindow decode steps with re-rotated sinks
        (sink_positions="cache") replay CUDA graphs on CUDA (eviction/runtime.py
        `decode_aside`). Default True; KVCOMPILE_REROT_ASIDE=0 sets False: those steps take
        the host path (attend_kept), which says so once. (Off from 2026-12-03 to 12-04
        while fp8 pages parted from the eager steps in 2 of 4 H200 cases: the graph path's
        logic equals the eager path's on the CPU, tests/engine/test_rerotated_graph_parity.py;
        the partings are near ties after other rounding, see benchmarks/RESULTS.md.)
    eviction_interval: a decoding sequence evicts once it holds budget + interval - 1 tokens,
        back to its budget, instead of after every step (1, the default): Hugging Face
        `generate`'s decode steps evict on the host, so an interval of 8-32 divides that cost
        (benchmarks/RESULTS.md, "Fourteenth session"); the sequence holds up to interval - 1
        tokens more. Per model (the model-level config's); `Engine(eviction_interval=...)`
        overrides it for the engine's steps.
    window_eviction: SinkWindow with its sinks at their text positions evicts without moving
        a token (pages between sinks and window freed, the rest hidden by a key mask:
        eviction/runtime.py `_evict_window`); False compacts as other policies do (moves the
        kept tokens), to time both. Default True; KVCOMPILE_WINDOW_EVICTION=0 sets False.
    cpu_fp8: fp8 pages' CPU decode step (kernels/cpu_fp8.py): "auto" (its C library, built
        at first use by the system C compiler, where it builds; else the numpy route with one
        warning), "c" (the C library or an error), "numpy" (CPU_FP8_ROUTES). The same bytes
        and values either way. Default from KVCOMPILE_CPU_FP8 ("auto" when unset or empty).
    graph_check: before every replay of the engine's CUDA-graph decode steps, check its inputs
        against the pool (engine/cudagraph.py `check_inputs`: each row's slot, length and
        block-table entries; the storage generation) and raise CacheStateError naming the
        first bad one. One host sync a step: a debugging aid for a fault inside a replay.
        Default False; KVCOMPILE_GRAPH_CHECK=1 sets True.
    """

    kv_dtype: str = "auto"
    k_dtype: str | None = None
    v_dtype: str | None = None
    page_size: int = 16
    scale_granularity: str = "page"
    v_scale_granularity: str | None = None
    static_scale: float | None = None
    max_kv_bytes: int | None = None
    memory_fraction: float = 0.9
    reserve: str = "auto"
    max_seq_len: int | None = None
    eviction: EvictionPolicy | None = None
    rotate: str | None = None
    check_finite: bool = False
    inner: str = "auto"
    kernels: str = "auto"
    residual: bool = False
    enabled: bool = True
    prefill_attends: str = "fresh"
    prefill_chunk_route: str = "auto"
    prefill_gather_bytes: int = 1 << 30
    # run-time switches: their defaults come from the environment (see the docstring)
    cuda_graphs: bool = _env_field(_cuda_graphs_default)
    deferred_stop: bool = _env_field(lambda: _env_on("KVCOMPILE_DEFERRED_STOP", True))
    device_loop: bool = _env_field(lambda: _env_on("KVCOMPILE_DEVICE_LOOP", True))
    merge_projections: bool | str = _env_field(_merge_default)
    decode_gemms: str = _env_field(lambda: os.environ.get("KVCOMPILE_DECODE_GEMMS") or "torch")
    prefill: str = _env_field(_prefill_default)
    prefill_tma: bool = _env_field(lambda: _env_on("KVCOMPILE_PREFILL_TMA", True))
    prefill_q_tma: bool = _env_field(lambda: _env_on("KVCOMPILE_PREFILL_Q_TMA", True))
    prefill_scale_tma: bool = _env_field(lambda: _env_on("KVCOMPILE_PREFILL_SCALE_TMA", False))
    prefill_warp_spec: bool = _env_field(
        lambda: os.environ.get("KVCOMPILE_PREFILL_WARP_SPEC", "0") == "1")
    rerotated_sinks_graphs: bool = _env_field(lambda: _env_on("KVCOMPILE_REROT_ASIDE", True))
    window_eviction: bool = _env_field(lambda: _env_on("KVCOMPILE_WINDOW_EVICTION", True))
    eviction_interval: int = 1
    cpu_fp8: str = _env_field(lambda: os.environ.get("KVCOMPILE_CPU_FP8") or "auto")
    graph_check: bool = _env_field(lambda: _env_on("KVCOMPILE_GRAPH_CHECK", False))

    def __post_init__(self):
        for name in ("kv_dtype", "k_dtype", "v_dtype"):
            v = getattr(self, name)
            if v is None and name != "kv_dtype":
                continue
            if v != "auto" and v not in format_names():
                raise KVConfigError(name, v, ", ".join(repr(d) for d in ("auto",) +
                                                       format_names()), hint=ADD_FORMAT_HINT)
        if self.page_size not in PAGE_SIZES:
            raise KVConfigError("page_size", self.page_size, ", ".join(map(str, PAGE_SIZES)))
        if self.scale_granularity not in SCALE_GRANULARITIES:
            raise KVConfigError("scale_granularity", self.scale_granularity,
                                ", ".join(repr(g) for g in SCALE_GRANULARITIES))
        if self.v_scale_granularity is not None and (
                self.v_scale_granularity not in SCALE_GRANULARITIES
                or self.v_scale_granularity == "channel"):
            raise KVConfigError("v_scale_granularity", self.v_scale_granularity,
                                "None, 'page', 'token', 'tensor'",
                                hint="Channel scales are for keys.")
        if self.static_scale is not None and not (
                isinstance(self.static_scale, (int, float))
                and not isinstance(self.static_scale, bool)
                and 0 < self.static_scale < math.inf):
            raise KVConfigError("static_scale", self.static_scale, "None or a finite float > 0")
        if self.max_kv_bytes is not None:
            _check_int("max_kv_bytes", self.max_kv_bytes, 1)
        if not (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1):
            raise KVConfigError("memory_fraction", self.memory_fraction, "a float in (0, 1]")
        if self.reserve not in RESERVE_POLICIES:
            raise KVConfigError("reserve", self.reserve, ", ".join(map(repr, RESERVE_POLICIES)))
        if self.max_seq_len is not None:
            _check_int("max_seq_len", self.max_seq_len, 1)
        object.__setattr__(self, "eviction", _coerce_eviction(self.eviction))
        if self.rotate not in ROTATIONS:
            raise KVConfigError("rotate", self.rotate, "None, 'hadamard'")
        if self.inner not in INNER_BACKENDS:
            raise KVConfigError("inner", self.inner, ", ".join(repr(b) for b in INNER_BACKENDS))
        if self.kernels not in KERNEL_CHOICES:
            raise KVConfigError("kernels", self.kernels, ", ".join(repr(k) for k in KERNEL_CHOICES))
        if self.prefill_attends not in PREFILL_ATTENDS:
            raise KVConfigError("prefill_attends", self.prefill_attends,
                                ", ".join(map(repr, PREFILL_ATTENDS)))
        if self.prefill_chunk_route not in PREFILL_CHUNK_ROUTES:
            raise KVConfigError("prefill_chunk_route", self.prefill_chunk_route,
                                ", ".join(map(repr, PREFILL_CHUNK_ROUTES)))
        _check_int("prefill_gather_bytes", self.prefill_gather_bytes, 1)
        _check_int("eviction_interval", self.eviction_interval, 1)
        if self.cpu_fp8 not in CPU_FP8_ROUTES:
            raise KVConfigError("cpu_fp8", self.cpu_fp8, ", ".join(map(repr, CPU_FP8_ROUTES)))
        if self.prefill not in PREFILL_CHOICES:
            raise KVConfigError("prefill", self.prefill, ", ".join(map(repr, PREFILL_CHOICES)))
        if self.decode_gemms not in DECODE_GEMMS:
            raise KVConfigError("decode_gemms", self.decode_gemms,
                                ", ".join(map(repr, DECODE_GEMMS)))
        if not (isinstance(self.merge_projections, bool) or self.merge_projections == "auto"):
            raise KVConfigError("merge_projections", self.merge_projections,
                                "'auto', True, False")
        for name in ("check_finite", "residual", "enabled", "cuda_graphs", "deferred_stop",
                     "device_loop",
                     "prefill_tma", "prefill_q_tma", "prefill_scale_tma", "prefill_warp_spec",
                     "graph_check"):
            if not isinstance(getattr(self, name), bool):
                raise KVConfigError(name, getattr(self, name), "True, False")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Field combinations that no storage format can honour: refused here, by name, rather
        than leaving every attention site alone at compile time."""
        kq, vq = _quantized(self.key_dtype), _quantized(self.value_dtype)
        v_field = "v_scale_granularity" if self.v_scale_granularity else "scale_granularity"
        for dtype, gran, field in ((self.key_dtype, self.scale_granularity, "scale_granularity"),
                                   (self.value_dtype, self.value_granularity, v_field)):
            takes = format_spec(dtype).granularities if dtype != "auto" else ()
            if takes and gran not in takes:
                int_hint = ("The asymmetric int formats calibrate a scale and a zero point per "
                            "block, never one per layer.")
                raise KVConfigError(field, gran, ", ".join(map(repr, takes)) + " with " + dtype,
                                    hint=int_hint if format_spec(dtype).family == "int" else "")
        if self.static_scale is not None:
            # one fixed scale per layer is what "tensor" granularity means; unquantized pages
            # have no scale at all
            if self.scale_granularity != "tensor" or (vq and self.value_granularity != "tensor"):
                gran = (self.scale_granularity if self.scale_granularity != "tensor"
                        else self.value_granularity)
                raise KVConfigError("static_scale", self.static_scale,
                                    f"None with scale granularity {gran!r}",
                                    hint="A static scale is one scale per layer: set "
                                         "scale_granularity='tensor' (fp8 / fp4 formats), or "
                                         "drop static_scale.")
        if (kq and self.key_dtype == "fp4_e2m1" and self.scale_granularity == "channel"
                and self.page_size % 16):
            raise KVConfigError("page_size", self.page_size,
                                "16, 32, 64, 128 with fp4_e2m1 channel-scaled keys",
                                hint="fp4_e2m1 with channel scales keeps one micro scale per 16 "
                                     "tokens of a channel; or use scale_granularity='page'.")

    # The storage formats of keys and values, with `kv_dtype` as the default of both.
    @property
    def key_dtype(self) -> str:
        return self.k_dtype or self.kv_dtype

    @property
    def value_dtype(self) -> str:
        return self.v_dtype or self.kv_dtype

    @property
    def value_granularity(self) -> str:
        """The values' scale granularity: v_scale_granularity, else scale_granularity, with
        "channel" (keys only) turned into per-token int scales (KIVI) or page fp ones."""
        if self.v_scale_granularity is not None:
            return self.v_scale_granularity
        if self.scale_granularity != "channel":
            return self.scale_granularity
        v = self.value_dtype
        return format_spec(v).default_value_granularity if v != "auto" else "page"

    @classmethod
    def from_options(cls, options: KVConfig | dict[str, Any] | None) -> KVConfig:
        """Build a config from `torch.compile(..., options={...})` (a dict), or pass one through."""
        if options is None:
            return cls()
        if isinstance(options, KVConfig):
            return options
        if not isinstance(options, dict):
            raise KVConfigError("options", options, "a dict of KVConfig fields or a KVConfig")
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"Unknown option; did you mean {close[0]!r}?" if close else \
                    "Unknown option."
                raise KVConfigError(key, options[key], "a KVConfig field: " + ", ".join(sorted(known)),
                                    hint=hint)
        return cls(**options)

    def replace(self, **changes) -> KVConfig:
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """A stable string of every field, for inductor's cache key and the report."""
        return repr(sorted((f.name, repr(getattr(self, f.name))) for f in fields(self)))


# --- configurations known to cost quality ---------------------------------------------------

# Perplexity through the pool against fp32, SmolLM2-135M, 4,096 tokens each of the Lee corpus
# and of stdlib pydoc topics (benchmarks/quality/pareto.py, README "Key-aware 4-bit caches").
# A key format below this table's rows loses more than a few percent; the key-aware 4-bit layout
# (int4 keys with per-channel scales, int4 values per token, page 64, values rotated) costs
# +1.7% on both texts at 4.5 bits.
KEY_AWARE_4BIT = ('KVConfig(kv_dtype="int4", scale_granularity="channel", page_size=64, '
                  'rotate="hadamard")')
_LOSSY_KEYS = {
    # key format: (perplexity cost as measured, what it was measured with)
    "fp4_e2m1": ("+9.6% (Lee) / +15.0% (pydoc); +5.4% / +8.8% with rotate='hadamard'",
                 "without per-channel scales; measured with page scales"),
    "int3": ("+10.7% / +13.6% even with channel-scaled keys", "3-bit keys"),
    "int2": ("more than 3-bit keys' +10.7% / +13.6%", "2-bit keys"),
}


def quality_warning(cfg: KVConfig) -> str | None:
    """A one-paragraph warning when `cfg` stores keys in a format measured to raise perplexity
    by more than a few percent (fp4 keys without channel scales, 2- or 3-bit keys), naming the
    measured cost and the key-aware layout that keeps it near +2%; else None."""
    k = cfg.k_dtype or cfg.kv_dtype
    if k not in _LOSSY_KEYS:
        return None
    if k == "fp4_e2m1" and cfg.scale_granularity == "channel":
        return None   # channel-scaled fp4 keys: the key-aware treatment (Pareto table)
    cost, what = _LOSSY_KEYS[k]
    return (f"kvcompile: keys stored as {k} ({what}) raised perplexity by {cost} on "
            f"SmolLM2-135M (README, 'Key-aware 4-bit caches'). For a 4-bit cache at about +2%, "
            f"use {KEY_AWARE_4BIT}; for near-lossless, kv_dtype='fp8_e4m3' with "
            f"rotate='hadamard'.")


# --- per-module overrides --------------------------------------------------------------------

_OVERRIDE_ATTR = "_kvcompile_overrides"
# Instances configured with `configure(module, ...)`; weak so that configuring never leaks a model.
_configured_instances: weakref.WeakSet = weakref.WeakSet()


def _validate_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    for key in overrides:
        if key not in PER_MODULE_FIELDS:
            raise KVConfigError(key, overrides[key], "a per-module field: " +
                                ", ".join(PER_MODULE_FIELDS),
                                hint="Global fields (page_size, budgets) belong in KVConfig.")
    KVConfig().replace(**overrides)  # validates values with the same messages as KVConfig
    return dict(overrides)


def configure(target=None, /, **overrides):
    """Override config fields for one module class or one module instance.

        @kvcompile.configure(kv_dtype="bf16")          # every instance of the class
        class MyAttention(nn.Module): ...

        kvcompile.configure(model.model.layers[0], kv_dtype="bf16")   # one instance

    The passes apply overrides through each attention site's `nn_module_stack`: instance
    overrides beat class overrides, and inner modules beat outer ones.
    """
    import torch.nn as nn

    checked = _validate_overrides(overrides)

    def apply(obj):
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            merged = dict(obj.__dict__.get(_OVERRIDE_ATTR, {}))
            merged.update(checked)
            setattr(obj, _OVERRIDE_ATTR, merged)
            return obj
        if isinstance(obj, nn.Module):
            merged = dict(obj.__dict__.get(_OVERRIDE_ATTR, {}))
            merged.update(checked)
            obj.__dict__[_OVERRIDE_ATTR] = merged  # instance dict: not inherited by the class
            _configured_instances.add(obj)
            return obj
        raise KVConfigError("configure target", obj, "an nn.Module subclass or instance")

    if target is None:
        return apply
    return apply(target)


def class_overrides(cls: type) -> dict[str, Any]:
    """Overrides set on `cls` or its bases by `@configure` (nearest class wins)."""
    merged: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        merged.update(klass.__dict__.get(_OVERRIDE_ATTR, {}))
    return merged


def instance_overrides(module) -> dict[str, Any]:
    return dict(module.__dict__.get(_OVERRIDE_ATTR, {}))


def configured_instances() -> list:
    return list(_configured_instances)
