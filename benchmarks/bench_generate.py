"""Generation speed and capacity: Hugging Face generate on kvcompile's pool vs HF's own caches,
and the continuous-batching engine.

    python benchmarks/bench_generate.py                  # H200: the setup below
    python benchmarks/bench_generate.py --smoke          # CPU: a tiny model through every path

Setup: an 8-layer Llama-3-8B-shaped model (hidden 4096, 32 q / 8 kv heads, head_dim
128, MLP 14336, vocab 128256), random bf16 weights, B=16, prompt 4096, 128 new tokens, greedy.
Sections, each in its own try/except, within one deadline (`--budget-s`), printed as tables:

  capacity   concurrent 32k-token sequences a 40 GiB KV budget holds, per format (pool layout)
  hf_eager   HF generate, DynamicCache, eager                 (baseline; reference tokens)
  hf_static  HF generate, StaticCache + torch.compile         (baseline; compiled run excluded)
  kvc_fp8    kvcompile.compile(model, kv_dtype="fp8_e4m3") + HF generate
  kvc_bf16   same with bf16 pages: tokens vs hf_eager (free run, and teacher-forced)
  kvc_int4   same with K int4 per-channel / V int4 per-token pages of 64 (the 4-bit format)
  kvc_fp8_pf8  kvc_fp8 with KVConfig(prefill_attends="fresh_fp8"): the fresh prompt attended on
             FP8 tensor cores (on Hopper the Gluon kernel); compare its first token with kvc_fp8
  kvc_fp8_evict_sink / kvc_fp8_evict_snapkv / kvc_fp8_evict_snapkv_hold   kvc_fp8 with
             eviction at 50% of the prompt (the engine_evict_* policies; SinkWindow's sinks
             at their text positions): decode steps replay CUDA graphs with the eviction
             runtime stepped aside, evicting every --evict-interval steps; compare with kvc_fp8
  kvc_int4_evict_sink / kvc_int4_evict_snapkv_hold   the same over kvc_int4's pages (channel-
             scaled keys: moved tokens re-encoded on the device); compare with kvc_int4
  engine_b   the same B prompts through kvcompile.Engine (fp8 pages, one prefill step, decode
             steps replayed from CUDA graphs); engine_b_nograph: the same without graphs;
             engine_b_sync: the same with async_steps=False (each step reads its tokens
             before the next is queued; engine_b overlaps them, engine/overlap.py)
  engine     Engine throughput / latency against concurrency (closed loop) -> PNG
  engine_evict_sink / engine_evict_snapkv   engine_b's setup with eviction at 50% of the
             prompt: SinkWindow(4, prompt/2 - 4) (original sink positions, so decode steps
             replay graphs and evict on the device every --evict-interval steps) and
             SnapKV(budget=prompt/2) (chooses at the prompt's end); compare with engine_b
  engine_evict_snapkv_hold   the same SnapKV holding its budget while decoding (hold=True:
             each step past the budget drops the lowest-ranked prompt token, on the device)
  engine_evict_sink_rot / engine_evict_h2o   the same with SinkWindow's sinks re-rotated (the
             default positions) and H2O(budget=prompt/2, recent=prompt/8, sinks=4), whose
             rotation and mass run inside the replayed steps (eviction/aside.py)

tok/s = B * new tokens / wall time of the whole generate call (prefill included); decode tok/s
= B * (N - 1) / (t_N - t_1), t_k the time the k-th new token reached the host in the same call
(a streamer that reads the clock: step_profile.StepClock). --step-profile adds a table of one
decode step by part (GEMM, attention, KV append, ...) for every generate row. Timings are wall
clock around synchronized calls (a generate call is not a kernel: do_bench does not apply), the
median of `--repeats` runs after a warm-up run that compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from step_profile import StepClock, decode_step_profile, profile_table  # noqa: E402

import kvcompile  # noqa: E402
from kvcompile import Engine, KVConfig, SamplingParams  # noqa: E402
from kvcompile.api import state_of  # noqa: E402

GIB = 1 << 30


# --- setup -------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, every path")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pad", type=float, default=0.0,
                   help="left-pad row b by PAD * prompt * b / (batch - 1) tokens (0: none)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=330.0, help="skip sections past this")
    p.add_argument("--sections", default="capacity,hf_eager,hf_static,kvc_fp8,kvc_bf16,"
                                         "engine_b,engine_b_nograph,engine")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--engine-prompt", type=int, default=1024)
    p.add_argument("--kvc-scale", default="page", choices=("page", "token", "tensor"),
                   help="kvc_fp8 / kvc_fp8_evict_*: fp8 scale granularity (token: decode-step "
                        "evictions move tokens on the device; page re-encodes them on the host)")
    p.add_argument("--engine-scale", default="page", choices=("page", "token", "tensor"),
                   help="engine_b / engine_evict_*: fp8 scale granularity (token: eviction "
                        "moves tokens on the device, page: on the host between replays)")
    p.add_argument("--evict-interval", type=int, default=64,
                   help="engine_evict_*: decode steps between evictions (Engine "
                        "eviction_interval)")
    p.add_argument("--kv-gib", type=float, default=8.0,
                   help="the pool's budget (KVConfig.max_kv_bytes) for the kvc_* sections")
    p.add_argument("--static", action="store_true",
                   help="compile the kvc_* sections with static shapes "
                        "(assume_static_by_default=True); by default they compile with "
                        "dynamic shapes (False), as every kvc row since 2026-12-03 ran")
    p.add_argument("--no-move-kernel", action="store_true",
                   help="evictions over fp8 page scales move through compaction's PyTorch "
                        "path instead of kernels/move_cells.py (compaction.CELL_KERNEL['cuda'] "
                        "off; the kernel is on by default since it passed its GPU test)")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "cuda"),
                   help="KVConfig.kernels for the kvc_* sections (decode kernel choice)")
    p.add_argument("--step-profile", action="store_true",
                   help="each generate row: one more call, profiled over its decode steps "
                        "(device time by part: GEMM, attention, append, ...; step_profile.py), "
                        "printed as a table after the rows")
    p.add_argument("--peak-tbs", type=float, default=None,
                   help="memory bandwidth in TB/s for the roofline column; default: the "
                        "GPU's by name (peak_tbs(): H200 4.8, H100 SXM 3.35, H100 PCIe 2.0), "
                        "else 4.8")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks"))
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.prompt, a.new, a.layers = 3, 40, 12, 2
        a.concurrency, a.engine_prompt = "1,2,4", 24
    if a.peak_tbs is None:  # the roofline's bandwidth: this GPU's, by name (else the H200's)
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        a.peak_tbs = peak_tbs(name) or 4.8
    return a


def model_config(args):
    from transformers import LlamaConfig

    if args.smoke:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=args.layers, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=2048)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=args.layers, num_attention_heads=32,
                          num_key_value_heads=8,
                          # (the engine's max_model_len: long enough for --prompt 32768)
                          max_position_embeddings=max(8192, args.prompt + args.new + 64),
                          rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
    cfg._attn_implementation = "sdpa"
    return cfg


def make_model(args, device, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(args), dtype=dtype)
    return model.eval()


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    @property
    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def uncompile(model):
    """Undo kvcompile.compile on an HF model (instance attributes), so another config can be
    compiled on the same weights."""
    for name in ("forward", "generate", "_prefill", "_expand_inputs_for_generation",
                 "_kvcompile_state"):
        model.__dict__.pop(name, None)
    torch._dynamo.reset()


# --- sections ----------------------------------------------------------------------------------

CAPACITY_FORMATS = (("bf16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "tensor"),
                    ("fp8_e5m2", "page"), ("fp4_e2m1", "page"), ("fp4_e2m1", "tensor"))


def capacity(args, device, ctx):
    """Concurrent 32k-token sequences that fit a 40 GiB KV budget, from the pool's own layout
    (pages of 16 tokens, K + V, scales included), for Llama-3-8B (32 layers) and for the bench
    model (--layers). On CUDA the pool is allocated to check the page count."""
    from kvcompile.cache.formats import resolve_format
    from kvcompile.cache.pool import LayerSpec, PagePool

    cfg = model_config(argparse.Namespace(smoke=False, layers=32, prompt=32768, new=0))
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    P, per_seq = 16, math.ceil(32768 / 16)
    rows = []
    for fmt_name, gran in CAPACITY_FORMATS:
        fmt = resolve_format(fmt_name, torch.bfloat16, gran)
        spec = LayerSpec(hkv, d, d, fmt, fmt)
        row = dict(format=f"{fmt_name} ({gran} scale)" if fmt.is_quantized else fmt_name)
        for layers in (32, args.layers):
            per_page = round(layers * spec.bytes_per_page(P))
            pages = int(40 * GIB // per_page)
            if layers == args.layers and device.type == "cuda" and not args.smoke:
                pool = PagePool.from_budget([spec] * layers, P, 40 * GIB, device)
                assert pool.num_pages == pages, (pool.num_pages, pages)
                del pool
                torch.cuda.empty_cache()
            row[f"bytes_per_token_{layers}L"] = per_page / P
            row[f"seqs_32k_{layers}L"] = pages // per_seq
        rows.append(row)
    b = rows[0]
    for r in rows:
        r["x_bf16_bytes"] = b["bytes_per_token_32L"] / r["bytes_per_token_32L"]
        r["x_bf16_seqs_32L"] = r["seqs_32k_32L"] / b["seqs_32k_32L"]
        r[f"x_bf16_seqs_{args.layers}L"] = (r[f"seqs_32k_{args.layers}L"]
                                            / b[f"seqs_32k_{args.layers}L"])
    return rows


def _inputs(args, device, vocab):
    """(ids, attention_mask) [batch, prompt]; with --pad F, row b is left-padded by
    F * prompt * b / (batch - 1) tokens (HF generate's batch of prompts of different lengths:
    the last row is (1 - F) * prompt tokens long)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, vocab, (args.batch, args.prompt), generator=g)
    am = torch.ones_like(ids)
    pad = getattr(args, "pad", 0.0)
    for b in range(args.batch):
        n = int(pad * args.prompt * b / max(args.batch - 1, 1))
        ids[b, :n], am[b, :n] = 0, 0
    return ids.to(device), am.to(device)


def _gen_kwargs(args, **kw):
    return dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                pad_token_id=0, eos_token_id=None, **kw)


def run_generate(model, args, device, ids, am, label, extra=None, warm=True):
    """(row, tokens [B, new]); row: tok/s, decode tok/s = B * (N - 1) / (t_N - t_1) and
    first-token seconds from the StepClock of each timed call (medians of --repeats)."""
    extra = extra or {}
    if warm:  # compiles (excluded)
        model.generate(ids, attention_mask=am, **_gen_kwargs(args, **extra))
    times, firsts, decodes, out = [], [], [], None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    B, N = ids.shape[0], args.new
    for _ in range(args.repeats):
        clock = StepClock()
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=am, streamer=clock, **_gen_kwargs(args, **extra))
        sync(device)
        t = time.perf_counter() - t0
        if len(clock.t) != N + 1:
            raise RuntimeError(f"{label}: the step clock saw {len(clock.t)} puts, expected "
                               f"{N + 1} (the prompt and {N} tokens)")
        times.append(t)
        firsts.append(clock.t[1] - t0)
        decodes.append(clock.t[N] - clock.t[1])
    t, t1, td = (statistics.median(x) for x in (times, firsts, decodes))
    toks = out[:, ids.shape[1]:].cpu() if isinstance(out, torch.Tensor) else None
    row = dict(label=label, tok_s=B * N / t, decode_tok_s=B * (N - 1) / max(td, 1e-9),
               first_token_s=t1, total_s=t)
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    if getattr(args, "step_profile", False):   # one more call, profiled over its decode steps
        row["step_profile"] = decode_step_profile(
            lambda s: model.generate(ids, attention_mask=am, streamer=s,
                                     **_gen_kwargs(args, **extra)), device, N)
    return row, toks


def bf16_kv_bytes_per_token(model) -> int:
    """K + V bytes per token over all layers in bf16 (HF's caches; the roofline of its rows)."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * d * 2


# datasheet HBM bandwidth by device name (the roofline's denominator), most specific first
PEAK_TBS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
            ("A100-SXM4-80GB", 2.04), ("A100", 1.56))


def peak_tbs(name: str) -> float | None:
    """The memory bandwidth (TB/s) of a GPU by its name, or None when the table lacks it."""
    return next((tbs for key, tbs in PEAK_TBS if key in name), None)


def add_roofline(row, model, args, kv_bytes_per_token):
    """The decode step's bytes (every weight but the embedding table, which a step reads B rows
    of, plus the stored KV bytes of the average context during decode) over --peak-tbs, as a
    share of the measured step (B / decode tok/s)."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    w = sum(p.numel() * p.element_size() for p in model.parameters()
            if p is not emb or tied)
    ctx_len = args.prompt + args.new / 2
    kv = kv_bytes_per_token * args.batch * ctx_len
    step_s = args.batch / row["decode_tok_s"]
    ideal_s = (w + kv) / (args.peak_tbs * 1e12)
    row.update(step_ms=1e3 * step_s, roofline_ms=1e3 * ideal_s,
               pct_roofline=100 * ideal_s / step_s, weight_gb=w / 1e9, kv_gb_per_step=kv / 1e9)
    return row


def hf_eager(model, args, device, ctx):
    ids, am = ctx["inputs"]
    row, toks = run_generate(model, args, device, ids, am, "HF eager, DynamicCache", warm=False)
    add_roofline(row, model, args, bf16_kv_bytes_per_token(model))
    ctx["ref_tokens"] = toks
    # logits of eager's own path, for the bf16 identity check (teacher forcing)
    out = model.generate(ids, attention_mask=am, output_logits=True,
                         return_dict_in_generate=True, **_gen_kwargs(args))
    ctx["ref_logits"] = [x.float().cpu() for x in out.logits]
    return row


def hf_static(model, args, device, ctx):
    ids, am = ctx["inputs"]
    extra = dict(cache_implementation="static")
    if args.smoke:  # no inductor C++ compile on the CPU
        row, toks = run_generate(model, args, device, ids, am, "HF StaticCache (eager, smoke)",
                                 extra)
    else:
        row, toks = run_generate(model, args, device, ids, am,
                                 "HF StaticCache + torch.compile (inductor)", extra)
    add_roofline(row, model, args, bf16_kv_bytes_per_token(model))
    row["same_tokens_as_eager"] = _match(toks, ctx.get("ref_tokens"))
    model.__dict__.pop("_cache", None)
    torch._dynamo.reset()
    return row


def _kvc_config(args, kv_dtype):
    # "int4": the recommended 4-bit format (K int4 per channel / V int4 per token, pages of 64)
    extra = dict(scale_granularity="channel", page_size=64) if kv_dtype == "int4" else {}
    if kv_dtype.startswith("fp8"):
        extra = dict(scale_granularity=args.kvc_scale)
    return KVConfig(kv_dtype=kv_dtype, **extra,
                    max_kv_bytes=(64 << 20) if args.smoke else int(args.kv_gib * GIB),
                    inner="aot_eager" if args.smoke else "inductor",
                    kernels="reference" if args.smoke else args.kernels)


def kvc(model, args, device, ctx, kv_dtype, eviction=None, sinks=None, name="",
        prefill_attends=None):
    """HF generate on kvcompile pages; eviction: a policy for every layer (kvc_fp8_evict_*:
    decode steps replay CUDA graphs with the runtime stepped aside, evicting every
    --evict-interval steps); sinks: SinkWindow's sink positions ("original" / "cache")."""
    ids, am = ctx["inputs"]
    uncompile(model)
    cfg = _kvc_config(args, kv_dtype)
    if prefill_attends is not None:
        cfg = dataclasses.replace(cfg, prefill_attends=prefill_attends)
    if eviction is not None:
        cfg = dataclasses.replace(cfg, eviction=eviction,
                                  eviction_interval=args.evict_interval)
    kvcompile.compile(model, cfg)
    if sinks is not None:   # the runtime exists after a first call
        with torch.no_grad():
            model.generate(ids[:1, :8], attention_mask=am[:1, :8], max_new_tokens=1,
                           pad_token_id=0)
        state_of(model).eviction.sink_positions = sinks
    dyn = torch._dynamo.config.assume_static_by_default
    # dynamic shapes save a graph (prefill + decode: 2 graphs, not 3). On 2026-12-03 this
    # line was meant to make static shapes the default (torch 2.11's symbolic `self.scaling`
    # had failed in the backend) but set the flag inverted: every kvc row since ran with
    # dynamic shapes, and passed. Kept as measured; --static compiles static.
    torch._dynamo.config.assume_static_by_default = args.static
    try:
        row, toks = run_generate(model, args, device, ids, am,
                                 f"kvcompile {kv_dtype} pages + HF generate{name}")
        st = kvcompile.stats(model)
        if eviction is not None:
            counters = st.get("counters", {})
            row.update({k: counters.get(k, 0) for k in (
                "eviction_aside_steps", "eviction_device_runs", "evicted_tokens",
                "generate_cuda_graph_replays")})
        row["graphs"] = st.get("graphs")
        row["reference_fallbacks"] = st.get("reference_fallback", 0)
        row["projections_merged"] = st.get("projections_merged", 0)   # GEMMs over the graphs
        row["decode_gemms_triton"] = st.get("decode_gemms_triton", 0)   # kernels/skinny.py
        # decode_gemms="auto": linears routed, and the shapes it put on each (runtime/skinny_op)
        row["decode_gemms_auto"] = [st.get(f"decode_gemms_auto{k}", 0)
                                    for k in ("", "_triton", "_torch", "_unmeasured")]
        # decode steps run by the device loop (integrations/hf_loop.py; 0: transformers' loop)
        row["device_loop_steps"] = st.get("generate_device_loop_steps", 0)
        # which kernels ran and why (the reasons of reference fallbacks among them), once each
        row["kernel_notes"] = list(kvcompile.report(model).kernel_notes)
        for note in row["kernel_notes"]:
            print(f"  {row['label']}: {note}", flush=True)
        row["decode_kernel_calls"] = {k: st.get(k, 0) for k in ("decode_cuda", "decode_triton")}
        row["same_tokens_as_eager"] = _match(toks, ctx.get("ref_tokens"))
        row["bytes_per_token"] = st.get("bytes_per_token")
        if row["bytes_per_token"]:
            add_roofline(row, model, args, row["bytes_per_token"])
        row["pages_after_generate"] = st.get("pages_used")
        fwd = model.__dict__.get("forward")
        row["graph_replays"] = getattr(fwd, "replays", None)
        row["graph_captures"] = getattr(fwd, "captures", None)
        if kv_dtype == "bf16" and ctx.get("ref_logits") is not None:
            row.update(_teacher_forced(model, args, ids, am, ctx))
    finally:
        torch._dynamo.config.assume_static_by_default = dyn
    return row


def _match(toks, ref) -> float | None:
    if toks is None or ref is None:
        return None
    return float((toks == ref).float().mean())


class _Force:
    def __init__(self, seq):
        self.seq = seq

    def __call__(self, input_ids, scores):
        nxt = self.seq[:, input_ids.shape[1]].to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(scores.shape[0], device=scores.device), nxt] = 0.0
        return forced


def forced_agreement(ref_logits, logits) -> tuple[int, int, float]:
    """Per step logits [B, V] of a reference and of a model forced along the reference's
    tokens -> (steps where the model's top token is the reference's, among the decisive ones:
    the reference's top two more than 2 bf16 ulps apart; the decisive steps; the largest
    logit difference relative to the row's largest logit)."""
    agree = decisive = 0
    max_rel = 0.0
    for lr, lo in zip(ref_logits, logits):
        lo = lo.float().cpu()
        top2 = lr.topk(2, dim=-1).values
        ulp = torch.finfo(torch.bfloat16).eps * top2[:, 0].abs().clamp_min(1e-3)
        dec = (top2[:, 0] - top2[:, 1]) > 2 * ulp
        decisive += int(dec.sum())
        agree += int((lo.argmax(-1) == lr.argmax(-1))[dec].sum())
        max_rel = max(max_rel, float(((lo - lr).abs().amax(-1)
                                      / lr.abs().amax(-1).clamp_min(1e-6)).max()))
    return agree, decisive, max_rel


def _teacher_forced(model, args, ids, am, ctx) -> dict:
    """Along eager's own greedy path: how often the compiled model picks eager's token, at the
    steps where eager's top-two logits are more than 2 bf16 ulps apart (not a rounding tie)."""
    ref = torch.cat([ids.cpu(), ctx["ref_tokens"]], dim=1)
    out = model.generate(ids, attention_mask=am, logits_processor=[_Force(ref)],
                         output_logits=True, return_dict_in_generate=True, **_gen_kwargs(args))
    agree, decisive, max_rel = forced_agreement(ctx["ref_logits"], out.logits)
    n = args.batch * args.new
    return dict(forced_decisive_steps=f"{decisive}/{n}",
                forced_agree_at_decisive=agree / max(decisive, 1),
                forced_max_rel_logit_diff=max_rel)


def engine_curve(model, args, device, ctx, clock):
    """Closed loop: c requests (prompt --engine-prompt, --new tokens) submitted at once, for
    each concurrency c; generated tok/s, time to first token and time per output token."""
    uncompile(model)
    cfg = _kvc_config(args, "fp8_e4m3")
    if not args.smoke:
        cfg = KVConfig(**{**cfg.__dict__, "max_kv_bytes": 20 * GIB})
    eng = Engine(model, None, cfg, max_num_batched_tokens=8192 if not args.smoke else 64,
                 max_num_seqs=256, enable_prefix_caching=False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    warm = [torch.randint(10, vocab, (args.engine_prompt,), generator=g).tolist()
            for _ in range(2)]
    for batch in (warm, warm[:1]):  # compiles both graphs: any T, and T = 1
        eng.generate(batch, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    # the step shapes of the timed runs (full token budgets, mixed prefill + decode steps):
    # Triton autotunes the prefill kernel at each new shape key, which must not be timed
    for c in [int(x) for x in args.concurrency.split(",")]:
        if c > 1:
            eng.generate([warm[0]] * min(c, 16), SamplingParams(temperature=0, max_tokens=2,
                                                                ignore_eos=True))
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        if clock.left < 20:
            print(f"engine: out of time before concurrency {c}", flush=True)
            break
        prompts = [torch.randint(10, vocab, (args.engine_prompt,), generator=g).tolist()
                   for _ in range(c)]
        steps0 = eng.stats.steps
        outs, t = timed(lambda p=prompts: eng.generate(p, params), device)
        ttft = [o.first_token_time - o.arrival_time for o in outs]
        tpot = [(o.finish_time - o.first_token_time) / max(len(o.token_ids) - 1, 1)
                for o in outs]
        rows.append(dict(concurrency=c, tok_s=sum(len(o.token_ids) for o in outs) / t,
                         ttft_p50_ms=1e3 * _pct(ttft, 50), ttft_p99_ms=1e3 * _pct(ttft, 99),
                         tpot_p50_ms=1e3 * _pct(tpot, 50), tpot_p99_ms=1e3 * _pct(tpot, 99),
                         steps=eng.stats.steps - steps0, preemptions=eng.stats.preemptions))
        print(f"engine c={c}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    eng.close()
    return rows


def engine_batch(model, args, device, ctx, graphs: bool = True, eviction=None,
                 sinks: str = "original", async_steps: bool = True):
    """The HF rows' setup through the Engine: the same B prompts at once, prefill steps of at
    most 128k tokens (one step up to B x prompt 4096), then decode steps (CUDA graphs unless
    `graphs` is False). tok/s = B x new / wall time of the whole `generate` (prefill
    included), after a warm-up call that compiles and captures. The pool holds B x (prompt +
    new) tokens (at least --kv-gib). `eviction`: a policy for every layer (engine_evict_*)."""
    ids, _ = ctx["inputs"]
    uncompile(model)
    B, N = ids.shape[0], args.new
    cfg = _kvc_config(args, "fp8_e4m3")
    cfg = KVConfig(**{**cfg.__dict__, "scale_granularity": args.engine_scale})
    if not args.smoke:
        per_token = model.config.num_hidden_layers * model.config.num_key_value_heads * (
            model.config.hidden_size // model.config.num_attention_heads) * 2 * 1.05
        need = int(1.25 * B * (ids.shape[1] + N + 64) * per_token)
        cfg = KVConfig(**{**cfg.__dict__, "max_kv_bytes": max(cfg.max_kv_bytes, need)})
    if eviction is not None:
        cfg = KVConfig(**{**cfg.__dict__, "eviction": eviction})
    eng = Engine(model, None, cfg, max_num_batched_tokens=min(B * ids.shape[1], 131072),
                 max_num_seqs=B, enable_prefix_caching=False, cuda_graphs=graphs,
                 eviction_interval=args.evict_interval, async_steps=async_steps)
    if eviction is not None and eng.eviction is not None:
        eng.eviction.sink_positions = sinks   # "cache": the sinks rotated inside the step
    prompts = [row.tolist() for row in ids.cpu()]
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    times, outs = [], None
    captures0 = eng.runner.graphs.captures if eng.runner.graphs is not None else 0
    eng.history.clear()   # the warm-up's steps (graph captures among them) left out
    if device.type == "cuda":   # the peak of the timed calls, as run_generate's rows (the
        torch.cuda.synchronize()   # warm-up's compile and autotuning left out)
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        outs, t = timed(lambda: eng.generate(prompts, params), device)
        times.append(t)
    t = statistics.median(times)
    first = max(o.first_token_time - o.arrival_time for o in outs)
    # the step itself, apart from the prefill and the TTFT-based formula: host wall time of
    # the steps in which all B requests decoded (graph replays; eviction after them included)
    full = [s.duration_s for s in eng.history if not s.prefill_tokens and s.decode_tokens == B]
    g = eng.runner.graphs
    toks = torch.tensor([o.token_ids for o in outs])
    counters = kvcompile.stats(model)
    row = dict(label=f"kvcompile Engine, fp8 pages ({args.engine_scale} scale)"
               + (", CUDA-graph decode" if graphs else
                                                      ", no CUDA graphs")
               + ("" if async_steps else ", synchronous steps")
               + (f", {type(eviction).__name__} 50%" if eviction is not None else "")
               + (" holding its budget" if getattr(eviction, "hold", False) else "")
               + (" (sinks re-rotated)" if eviction is not None and sinks == "cache"
                  and type(eviction).__name__ == "SinkWindow" else ""),
               tok_s=B * N / t, decode_tok_s=B * (N - 1) / max(t - first, 1e-9),
               first_token_s=first, total_s=t,
               decode_step_ms_p50=1e3 * statistics.median(full) if full else None,
               # the mean carries the eviction events (one step in eviction_interval) that the
               # median leaves out: the decode speed a user sees once every request decodes
               decode_step_ms_mean=1e3 * statistics.fmean(full) if full else None,
               decode_steps_full_batch=len(full),
               graph_replays=g.replays if g is not None else 0,
               graph_captures=g.captures if g is not None else 0,
               captures_in_timed=(g.captures - captures0) if g is not None else 0,
               graphs_off_because=g.why_not() if g is not None else "cuda_graphs=False",
               launched_steps=eng.stats.launched_steps,
               overlapped_steps=eng.stats.overlapped_steps,
               sync_reasons=dict(eng.stats.sync_reasons))
    if device.type == "cuda":   # weights, the pool and the largest step of the timed calls
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    if eviction is not None:
        row.update(eviction_aside_steps=counters.get("eviction_aside_steps", 0),
                   eviction_device_runs=counters.get("eviction_device_runs", 0),
                   evicted_tokens=counters.get("evicted_tokens", 0),
                   # H2O prompt rows whose mass the extra pass added up (kernel / torch), and
                   # rows attended over kept slots in fp32 (0 prompt chunks expected)
                   prompt_mass_rows=(counters.get("eviction_prompt_mass_kernel", 0),
                                     counters.get("eviction_prompt_mass_torch", 0)),
                   fp32_rows=counters.get("eviction_reference_rows", 0),
                   min_pages_free=min(s.pages_free for s in eng.history),
                   # which kernels the steps took (CUDA / Triton / per-row paths), for the
                   # step's cost against the no-eviction row
                   kernel_counters={k: v for k, v in counters.items()
                                    if isinstance(v, int) and v and k.startswith(
                                        ("decode", "aside", "eviction", "engine_decode"))},
                   x_engine_b_decode=(row["decode_tok_s"] / ctx["engine_b_decode"]
                                      if ctx.get("engine_b_decode") else None),
                   x_engine_b_step_mean=(ctx["engine_b_step_mean"] / row["decode_step_ms_mean"]
                                         if ctx.get("engine_b_step_mean")
                                         and row["decode_step_ms_mean"] else None))
        eng.close()
        return row
    if counters.get("bytes_per_token"):
        add_roofline(row, model, args, counters["bytes_per_token"])
    if not async_steps:   # against engine_b (overlapped steps), which runs first
        row["same_tokens_as_engine_b"] = _match(toks, ctx.get("engine_tokens"))
        row["x_engine_b_decode"] = (ctx["engine_b_decode"] / row["decode_tok_s"]
                                    if ctx.get("engine_b_decode") else None)
        eng.close()
        return row
    ctx["engine_tokens" + ("" if graphs else "_nograph")] = toks
    if graphs:
        ctx["engine_b_decode"] = row["decode_tok_s"]
        ctx["engine_b_step_mean"] = row["decode_step_ms_mean"]
    other = ctx.get("engine_tokens_nograph" if graphs else "engine_tokens")
    row["same_tokens_as_other_engine_row"] = _match(toks, other)
    eng.close()
    return row


def _half(args):
    """Eviction policies at 50% of the prompt (the issue's speed target)."""
    from kvcompile.config import H2O, SinkWindow, SnapKV

    half = max(8, args.prompt // 2)
    return dict(sink=SinkWindow(4, half - 4), snapkv=SnapKV(budget=half),
                snapkv_hold=SnapKV(budget=half, hold=True),
                h2o=H2O(budget=half, recent=max(1, half // 4), sinks=4))


def _pct(xs, q):
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def plot_curve(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(c, [r["tok_s"] for r in rows], "o-")
    a.set(xscale="log", xlabel="concurrent requests (offered load)", ylabel="generated tok/s",
          title="throughput")
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"),
                       ("tpot_p99_ms", "s--")):
        b.plot(c, [r[key] for r in rows], style, label=key.replace("_ms", ""))
    b.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms",
          title="latency percentiles")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xticks(c, [str(x) for x in c])
        ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- report ------------------------------------------------------------------------------------

def table(rows, cols) -> str:
    if not rows:
        return "(no rows)"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    import transformers
    import triton

    env = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name()
               if device.type == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__, transformers=transformers.__version__,
               setup=f"{args.layers} layers, B={args.batch}, prompt {args.prompt}, "
                     f"{args.new} new tokens, greedy")
    env["roofline_tbs"] = args.peak_tbs
    if args.no_move_kernel:
        from kvcompile.cache import compaction

        compaction.CELL_KERNEL["cuda"] = False
        env["move_kernel"] = False
    print(env, flush=True)
    sections = args.sections.split(",")
    # rough minimum seconds each needs on the H200 (compiles included)
    need = dict(capacity=1, hf_eager=25, hf_static=90, kvc_fp8=80, kvc_bf16=70, kvc_int4=80,
                kvc_fp8_pf8=80, engine=60,
                kvc_fp8_evict_sink=80, kvc_fp8_evict_snapkv=80, kvc_fp8_evict_snapkv_hold=80,
                kvc_int4_evict_sink=80, kvc_int4_evict_snapkv_hold=80,
                engine_b=40, engine_b_nograph=30, engine_b_sync=40, engine_evict_sink=60, engine_evict_snapkv=60,
                engine_evict_snapkv_hold=60, engine_evict_sink_rot=60, engine_evict_h2o=60)
    results, errors, ctx = {"env": env}, {}, {}
    model = None
    try:
        model = make_model(args, device, dtype)
        ctx["inputs"] = _inputs(args, device, model.config.vocab_size)
    except Exception as e:  # noqa: BLE001
        errors["setup"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    steps = dict(
        capacity=lambda: capacity(args, device, ctx),
        hf_eager=lambda: hf_eager(model, args, device, ctx),
        hf_static=lambda: hf_static(model, args, device, ctx),
        kvc_fp8=lambda: kvc(model, args, device, ctx, "fp8_e4m3"),
        kvc_bf16=lambda: kvc(model, args, device, ctx, "bf16"),
        kvc_int4=lambda: kvc(model, args, device, ctx, "int4"),
        kvc_fp8_pf8=lambda: kvc(model, args, device, ctx, "fp8_e4m3", name=", FP8 prefill",
                                prefill_attends="fresh_fp8"),
        kvc_fp8_evict_sink=lambda: kvc(model, args, device, ctx, "fp8_e4m3",
                                       _half(args)["sink"], "original", ", SinkWindow 50%"),
        kvc_fp8_evict_snapkv=lambda: kvc(model, args, device, ctx, "fp8_e4m3",
                                         _half(args)["snapkv"], None, ", SnapKV 50%"),
        kvc_fp8_evict_snapkv_hold=lambda: kvc(model, args, device, ctx, "fp8_e4m3",
                                              _half(args)["snapkv_hold"], None,
                                              ", SnapKV 50% hold"),
        kvc_int4_evict_sink=lambda: kvc(model, args, device, ctx, "int4",
                                        _half(args)["sink"], "original", ", SinkWindow 50%"),
        kvc_int4_evict_snapkv_hold=lambda: kvc(model, args, device, ctx, "int4",
                                               _half(args)["snapkv_hold"], None,
                                               ", SnapKV 50% hold"),
        engine_b=lambda: engine_batch(model, args, device, ctx),
        engine_b_nograph=lambda: engine_batch(model, args, device, ctx, graphs=False),
        engine_b_sync=lambda: engine_batch(model, args, device, ctx, async_steps=False),
        engine_evict_sink=lambda: engine_batch(model, args, device, ctx,
                                               eviction=_half(args)["sink"]),
        engine_evict_snapkv=lambda: engine_batch(model, args, device, ctx,
                                                 eviction=_half(args)["snapkv"]),
        engine_evict_snapkv_hold=lambda: engine_batch(model, args, device, ctx,
                                                      eviction=_half(args)["snapkv_hold"]),
        engine_evict_sink_rot=lambda: engine_batch(model, args, device, ctx,
                                                   eviction=_half(args)["sink"], sinks="cache"),
        engine_evict_h2o=lambda: engine_batch(model, args, device, ctx,
                                              eviction=_half(args)["h2o"]),
        engine=lambda: engine_curve(model, args, device, ctx, clock))
    for name in sections:
        if name != "capacity" and model is None:
            continue
        if clock.left < (0 if args.smoke else need.get(name, 30)):
            errors[name] = f"skipped: {clock.left:.0f} s left"
            print(f"== {name}: skipped ({clock.left:.0f} s left)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            results[name] = steps[name]()
            print(f"== {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001  (one section failing must not sink the rest)
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"== {name}: FAILED {errors[name]}", flush=True)
            traceback.print_exc()
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(results, errors, args)
    return 0


def report(results, errors, args):
    gen = [results[k] for k in ("hf_eager", "hf_static", "kvc_fp8", "kvc_bf16", "kvc_int4",
                                "kvc_fp8_pf8",
                                "kvc_fp8_evict_sink", "kvc_fp8_evict_snapkv",
                                "kvc_fp8_evict_snapkv_hold", "kvc_int4_evict_sink",
                                "kvc_int4_evict_snapkv_hold", "engine_b",
                                "engine_b_sync", "engine_b_nograph") if k in results]
    base = results.get("hf_static", {}).get("tok_s")
    fp8 = results.get("kvc_fp8", {}).get("decode_tok_s")
    for r in gen:
        r["x_static"] = r["tok_s"] / base if base else None
        r["x_kvc_fp8_decode"] = r["decode_tok_s"] / fp8 if fp8 else None
    for k in ("kvc_int4_evict_sink", "kvc_int4_evict_snapkv_hold"):
        if k in results and "kvc_int4" in results:   # against the same format
            results[k]["x_kvc_int4_decode"] = (results[k]["decode_tok_s"]
                                               / results["kvc_int4"]["decode_tok_s"])
    print("\n### HF generate, " + results["env"]["setup"])
    for r in gen:
        r["ttft_x_static"] = (r["first_token_s"] / results["hf_static"]["first_token_s"]
                              if "hf_static" in results else None)
    print(table(gen, ["label", "tok_s", "decode_tok_s", "first_token_s", "total_s", "x_static",
                      "ttft_x_static", "step_ms", "roofline_ms", "pct_roofline", "peak_gib",
                      "same_tokens_as_eager", "graphs", "reference_fallbacks", "graph_captures",
                      "graph_replays", "x_kvc_fp8_decode", "x_kvc_int4_decode",
                      "eviction_aside_steps",
                      "eviction_device_runs", "evicted_tokens"]))
    prof = {r["label"]: r["step_profile"] for r in gen if r.get("step_profile")}
    if prof:
        print("\n### One decode step by part (--step-profile: steps 2..N of one more call; "
              + ("each op's own CPU time" if results["env"]["device"] == "cpu" else
                 "device time of each kernel") + ")")
        print(profile_table(prof))
    eng = [results[k] for k in ("engine_b", "engine_b_sync", "engine_b_nograph") if k in results]
    if eng:
        print(table(eng, ["label", "decode_step_ms_p50", "captures_in_timed", "graph_captures",
                          "graph_replays", "graphs_off_because", "launched_steps",
                          "overlapped_steps", "same_tokens_as_other_engine_row",
                          "same_tokens_as_engine_b", "x_engine_b_decode"]))
    ev = [results[k] for k in ("engine_b", "engine_evict_sink", "engine_evict_snapkv",
                               "engine_evict_snapkv_hold", "engine_evict_sink_rot",
                               "engine_evict_h2o") if k in results]
    if len(ev) > 1:
        print(f"\n### Engine with eviction at 50% of the prompt (fp8 pages, eviction every "
              f"{args.evict_interval} decode steps), " + results["env"]["setup"])
        print(table(ev, ["label", "tok_s", "decode_tok_s", "x_engine_b_decode", "first_token_s",
                         "decode_step_ms_p50", "decode_step_ms_mean", "x_engine_b_step_mean",
                         "decode_steps_full_batch", "captures_in_timed",
                         "graph_replays", "eviction_aside_steps", "eviction_device_runs",
                         "evicted_tokens", "min_pages_free"]))
        for r in ev:
            if r.get("kernel_counters"):
                print(f"- {r['label']}: {r['kernel_counters']}")
    bf = results.get("kvc_bf16")
    if bf and "forced_decisive_steps" in bf:
        print(f"\nbf16 pages vs eager, teacher-forced: decisive steps {bf['forced_decisive_steps']}"
              f", same token at {100 * bf['forced_agree_at_decisive']:.2f}% of them, max "
              f"relative logit difference {bf['forced_max_rel_logit_diff']:.4f}")
    if "capacity" in results:
        L = args.layers
        print("\n### Engine capacity: concurrent 32k-token sequences in a 40 GiB KV budget "
              f"(8 kv heads, head_dim 128, page 16; Llama-3-8B 32 layers, bench model {L})")
        print(table(results["capacity"], [
            "format", "bytes_per_token_32L", "x_bf16_bytes", "seqs_32k_32L", "x_bf16_seqs_32L",
            f"seqs_32k_{L}L", f"x_bf16_seqs_{L}L"]))
    if results.get("engine"):
        print(f"\n### Engine (fp8 pages), closed loop: prompt {args.engine_prompt}, "
              f"{args.new} new tokens")
        print(table(results["engine"], ["concurrency", "tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                        "tpot_p50_ms", "tpot_p99_ms", "steps", "preemptions"]))
        name = "generate_concurrency_smoke.png" if args.smoke else "generate_concurrency.png"
        try:
            shape = "tiny Llama (smoke)" if args.smoke else f"{args.layers}-layer Llama-3-8B"
            plot_curve(results["engine"], os.path.join(args.out, name),
                       f"kvcompile Engine, fp8 pages, {results['env']['device']}, {shape}, "
                       f"prompt {args.engine_prompt}, {args.new} new tokens, random weights")
            print(f"plot: {os.path.join(args.out, name)}")
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e}")
    if errors:
        print("\nerrors / skipped:", json.dumps(errors, indent=1))
    path = os.path.join(args.out, "bench_generate_smoke.json" if args.smoke
                        else "bench_generate.json")
    with open(path, "w") as f:
        json.dump({"results": results, "errors": errors}, f, indent=1, default=str)
    print(f"json: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
