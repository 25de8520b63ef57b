"""MLA end to end: Hugging Face generate on a DeepSeek-V3-shaped stack, HF's own caches vs
kvcompile's latent pages, in one process.

    python benchmarks/bench_latent_generate.py [--batch 16] [--prompt 8192] [--new 64]
    python benchmarks/bench_latent_generate.py --smoke      # CPU: a tiny stack, every row
    python benchmarks/bench_latent_generate.py --capacity 40   # bytes/token, 32k seqs in 40 GiB

Model: DeepSeek-V3 attention (128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128,
hidden 7168) with a dense MLP in every layer (`first_k_dense_replace` = layers), `--layers`
layers, vocab 32000, random bf16 weights, SDPA. Rows: HF eager (DynamicCache), HF StaticCache
with generate's own auto-compile of the decode step (CUDA only), kvcompile with bf16 and
fp8_e4m3 latent pages, and "engine_<format>": the same prompts through kvcompile.Engine in
chunked prefill steps of --engine-tokens tokens (2,048: a long prompt's chunks over its own
latent pages, packed with other rows; decode tok/s = B * (N - 1) / (total - first token),
its first-token time printed to stderr); "kvc_<format>+sink" / "+snapkv" / "+h2o" add an
eviction policy keeping
half the prompt (SinkWindow, SnapKV(hold), H2O; their tokens differ from eager's by design;
--evict-interval, 64 by default). Each row: how many of its rows' new tokens equal HF eager's
(and their mean common start; kvcompile rows without eviction also along eager's tokens: how
often their top token is eager's where eager's is not a rounding tie, and the largest logit
difference), the sites rewritten (kvcompile rows: MLA sites must say "mla"),
KV bytes per token, and decode tok/s = B * (N - 1) / (t_N - t_1), t_k the time the k-th new
token reached the host within one call (step_profile.StepClock: no prefill in it), the median
of --repeats after a warm-up that compiles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench_generate

from step_profile import StepClock  # noqa: E402

import kvcompile  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="hf_eager,hf_static,kvc_bf16,kvc_fp8_e4m3")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timing, one N-token generate under torch.profiler: the top "
                        "host ops and device kernels and the host-sync events of each row")
    p.add_argument("--capacity", type=float, default=0, metavar="GIB",
                   help="instead of generating: KV bytes per token and concurrent 32k-token "
                        "sequences in a GIB budget, kvcompile's latent pages (each format's "
                        "pool layout, read from a compiled 2-layer model of these attention "
                        "widths) against HF's caches, for --capacity-layers layers")
    p.add_argument("--capacity-layers", type=int, default=61,
                   help="layers of the model the capacity rows count (DeepSeek-V3: 61)")
    p.add_argument("--evict-interval", type=int, default=64,
                   help="KVConfig.eviction_interval of the +sink / +snapkv / +h2o rows (1: "
                        "evict at every step once over budget)")
    p.add_argument("--engine-tokens", type=int, default=2048,
                   help="max_num_batched_tokens of the engine_* rows (their prefill chunks)")
    p.add_argument("--ref", default="", help="a file for hf_eager's tokens and tok/s: the "
                   "hf_eager row writes it, the others compare with it (one process a row)")
    p.add_argument("--expand-min", type=int, default=0, metavar="N",
                   help="set both of dispatch's expansion thresholds (queries a row from which "
                        "an MLA prompt chunk expands) to N for this process: a large N keeps "
                        "every chunk folded; 0: the defaults")
    p.add_argument("--packed-split", action="store_true",
                   help="engine steps split their long chunks off to be expanded "
                        "(dispatch.LATENT_SPLIT_PACKED, off by default: measured slower), "
                        "for an A/B of the engine_* rows")
    a = p.parse_args()
    if a.packed_split:
        from kvcompile.runtime import dispatch

        dispatch.LATENT_SPLIT_PACKED = True
    if a.smoke:
        a.batch, a.prompt, a.new, a.layers, a.repeats = 2, 24, 6, 2, 1
    if a.expand_min:
        from kvcompile.runtime import dispatch

        dispatch.LATENT_EXPAND_MIN_QUERIES = dispatch.LATENT_EXPAND_MIN_QUERIES_FP8 = a.expand_min
    return a


def make_model(a):
    import transformers

    dims = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=32000)
    if a.smoke:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=16, vocab_size=256)
    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=a.layers, first_k_dense_replace=a.layers,
        max_position_embeddings=a.prompt + a.new + 16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **dims)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dev, dt = ("cpu", torch.float32) if a.smoke else ("cuda", torch.bfloat16)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dt).eval()
    return model, dev


def policy(name: str, prompt: int):
    """A row's eviction policy ("kvc_<format>+<policy>"): half the prompt kept."""
    keep = max(8, prompt // 2)
    make = {"sink": lambda: kvcompile.SinkWindow(4, keep),
            "snapkv": lambda: kvcompile.SnapKV(budget=keep, window=min(32, prompt // 4),
                                               hold=True),
            "h2o": lambda: kvcompile.H2O(budget=keep, recent=min(64, prompt // 4), sinks=4)}
    if name and name not in make:
        raise SystemExit(f"unknown eviction suffix +{name}: one of +sink, +snapkv, +h2o")
    return make[name]() if name else None


_COMPILED = []   # the row's compiled model, for its route counters when the row fails


def _routes(model) -> str:
    """The prefill / attention route counters of a compiled model (kvcompile.stats)."""
    c = kvcompile.stats(model).get("counters", {})
    keys = ("prefill_", "latent_", "decode_")
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k.startswith(keys))


def run_row(row, a, ids, ref_logits=None):
    """One row's timing (and for hf_eager its logits; for a kvcompile row without eviction,
    given HF eager's logits, the teacher-forced comparison)."""
    if torch.cuda.is_available():   # the row's own peak (the previous row's model is freed)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, _ = make_model(a)
    if row.startswith("engine_"):
        return _engine_row(row, model, a, ids)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if row == "hf_static":
        # HF's own auto-compile of the decode step (generate's compile_config: fullgraph,
        # CUDA graphs), as bench_generate.py's hf_static. Compiling the whole forward with
        # mode="reduce-overhead" here skipped CUDA graphs (the cache's mutated
        # cumulative_length) and then crashed (SIGSEGV, H200, torch 2.11, 2026-12-05).
        kw["cache_implementation"] = "static"
    elif row.startswith("kvc_"):
        fmt, _, pol = row[4:].partition("+")
        kvcompile.compile(model, kvcompile.KVConfig(
            kv_dtype=fmt, max_kv_bytes=(1 << 26 if a.smoke else 40 << 30),
            eviction=policy(pol, a.prompt), eviction_interval=a.evict_interval))
        _COMPILED[:] = [model]
    info = {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.new, output_logits=True,
                             return_dict_in_generate=True, **kw)   # warm-up, compiles
        logits = [x.float().cpu() for x in out.logits]
        out = out.sequences
        if row == "hf_eager":
            info["logits"] = logits
        elif ref_logits is not None and row.startswith("kvc_") and "+" not in row:
            info["forced"] = _teacher_forced(model, a, ids, ref_logits, kw)
        steps = []
        for _ in range(a.repeats):
            clock = StepClock()
            model.generate(ids, max_new_tokens=a.new, streamer=clock, **kw)
            steps.append(clock.step_s(a.new))
        if a.profile:
            from profile_generate import profile_call

            profile_call(lambda: model.generate(ids, max_new_tokens=a.profile, **kw), row,
                         a.profile)
    info.update(row=row, tokens=out, tok_s=a.batch / max(statistics.median(steps), 1e-9),
                peak=(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                      else None))
    if row.startswith("kvc_"):
        rep = kvcompile.report(model)
        info["sites"] = f"{len(rep.rewritten)}/{len(rep.sites)} " + ",".join(
            sorted({s.gqa for s in rep.rewritten})) + (
            f", {getattr(model.forward, 'replays', 0)} graph replays")
        st = kvcompile.stats(model)
        info["bytes"] = st["bytes_per_token"]
        print(f"# {row} routes: {_routes(model)}", file=sys.stderr, flush=True)
        if pol:
            c = st.get("counters", {})
            info["sites"] += (f", {c.get('eviction_device_runs', 0)} device evictions, "
                              f"{c.get('evicted_tokens', 0)} tokens evicted")
    else:
        if row == "hf_static":
            info["sites"] = ("HF auto-compile" if getattr(model, "_compiled_call", None)
                             is not None else "HF did not compile")
        c = model.config   # transformers 5.x caches the latent and the rotary key, as the pool
        info["bytes"] = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * (
            2 if not a.smoke else 4)
        info.setdefault("sites", "-")
    model = None   # the next row's model takes its memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def _engine_row(row, model, a, ids) -> dict:
    """The prompts through kvcompile.Engine (latent pages of the row's format, chunked
    prefill of --engine-tokens a step, CUDA-graph decode on CUDA): a warm-up call, then
    --repeats timed calls; decode tok/s over the time after the last first token."""
    import time

    fmt = row[len("engine_"):]
    cfg = kvcompile.KVConfig(kv_dtype=fmt, max_kv_bytes=(1 << 26 if a.smoke else 40 << 30))
    eng = kvcompile.Engine(model, None, cfg, max_num_batched_tokens=a.engine_tokens,
                           max_num_seqs=a.batch, enable_prefix_caching=False)
    _COMPILED[:] = [model]
    prompts = [r.tolist() for r in ids.cpu()]
    sp = kvcompile.SamplingParams
    eng.generate(prompts, sp(temperature=0, max_tokens=3, ignore_eos=True))   # compiles
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp(temperature=0, max_tokens=a.new, ignore_eos=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        runs.append((total, max(o.first_token_time - o.arrival_time for o in outs)))
    total, first = sorted(runs)[len(runs) // 2]
    new = torch.tensor([o.token_ids for o in outs], device=ids.device)
    rep = kvcompile.report(model)
    print(f"# {row}: first token {first:.3f} s, total {total:.3f} s (median of "
          f"{a.repeats}); routes: {_routes(model)}", file=sys.stderr, flush=True)
    info = dict(row=row, tokens=torch.cat([ids, new], dim=1),
                tok_s=a.batch * (a.new - 1) / max(total - first, 1e-9),
                peak=(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                      else None),
                sites=f"{len(rep.rewritten)}/{len(rep.sites)} " + ",".join(
                    sorted({s.gqa for s in rep.rewritten})) + f", engine, first token "
                f"{first:.3f} s", bytes=kvcompile.stats(model)["bytes_per_token"])
    eng.close()
    return info


def _teacher_forced(model, a, ids, ref: tuple, kw) -> str:
    """Along HF eager's own greedy path (its tokens forced): at the steps where eager's top two
    logits are more than 2 bf16 ulps apart (not a rounding tie), how often this model's top
    token is eager's, and the largest logit difference relative to the row's largest logit.
    ref: (eager's full sequences [B, prompt + new], its logits per step [B, V])."""
    from bench_generate import _Force, forced_agreement

    seq, eager = ref
    out = model.generate(ids, max_new_tokens=a.new, logits_processor=[_Force(seq)],
                         output_logits=True, return_dict_in_generate=True, **kw)
    agree, decisive, max_rel = forced_agreement(eager, out.logits)
    return (f"forced: {agree}/{decisive} decisive steps agree, max logit diff "
            f"{max_rel:.2e} of the row's largest")


def _same(tokens, ref, prompt: int) -> str:
    """Rows whose new tokens equal HF eager's, and the mean length of the common start of the
    new tokens (random weights in bf16: near-tied logits let a row part ways after a while)."""
    a, b = tokens[:, prompt:], ref[:, prompt:].to(tokens.device)
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    eq = (a == b).int()
    common = eq.cumprod(1).sum(1).float()
    return (f"{int((common == a.shape[1]).sum())}/{a.shape[0]} rows, common start "
            f"{common.mean():.1f}/{a.shape[1]}")


def capacity(a) -> None:
    """Bytes per token and concurrent 32k-token sequences in a fixed budget. kvcompile rows:
    the pool's own layout (LayerSpec.bytes_per_page: codes and scales) of a compiled 2-layer
    model with these attention widths, its pages counted whole; HF rows: transformers 5.x
    caches the latent and the rotary key in the model's dtype (bf16), older versions the
    expanded K and V of every head. Arithmetic on the storage layouts, not an allocation."""
    import transformers

    from kvcompile.api import state_of

    budget, L, ctx = int(a.capacity * (1 << 30)), a.capacity_layers, 32768
    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=2, first_k_dense_replace=2, hidden_size=64, intermediate_size=64,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=32, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=256,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    r, dr, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    rows = [("HF DynamicCache / StaticCache (transformers 5.x: latent + rotary key, bf16)",
             (r + dr) * 2 * L, None),
            ("HF, transformers < 5 (expanded K and V of 128 heads, bf16)",
             H * (cfg.qk_nope_head_dim + dr + cfg.v_head_dim) * 2 * L, None)]
    for fmt in ("bf16", "fp8_e4m3"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        kvcompile.compile(model, kvcompile.KVConfig(kv_dtype=fmt, max_kv_bytes=1 << 26,
                                                    inner="eager"))
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]))
        pool = state_of(model).pool
        per_layer = [sp.bytes_per_page(pool.page_size) for sp in pool.layers]
        assert len(set(per_layer)) == 1, per_layer
        page_bytes = per_layer[0] * L
        pages = int(budget // page_bytes)
        rows.append((f"kvcompile {fmt} latent pages (page {pool.page_size})",
                     page_bytes / pool.page_size, pages // -(-ctx // pool.page_size)))
        kvcompile.release(model)
    print(f"# MLA KV capacity: DeepSeek-V3 attention (128 heads, kv_lora 512, rope 64), {L} "
          f"layers, {a.capacity:g} GiB budget, 32,768-token sequences")
    print("| cache | KV bytes/token | x HF 5.x | concurrent 32k sequences | x HF 5.x |")
    print("|---|---|---|---|---|")
    base = rows[0][1]
    base_n = int(budget // (base * ctx))
    for name, bpt, n in rows:
        n = int(budget // (bpt * ctx)) if n is None else n
        ratio = f"{n / base_n:.2f}x" if base_n else "-"
        print(f"| {name} | {bpt:,.1f} | {base / bpt:.3f}x | {n} | {ratio} |")


def main():
    a = parse_args()
    if a.capacity:
        capacity(a)
        return
    import transformers

    _, dev = make_model(argparse.Namespace(**{**vars(a), "layers": 1}))
    ids = torch.randint(3, 256 if a.smoke else 32000, (a.batch, a.prompt), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(1))
    print(f"# DeepSeek-V3-shaped, {a.layers} layers, B {a.batch}, prompt {a.prompt}, new "
          f"{a.new}; torch {torch.__version__}, transformers {transformers.__version__}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    print("| row | sites rewritten | KV bytes/token | decode tok/s | vs hf eager | peak GiB "
          "(weights, cache, activations) | tokens = eager's |")
    print("|---|---|---|---|---|---|---|")
    ref = base = ref_logits = None
    if a.ref and os.path.exists(a.ref) and "hf_eager" not in a.rows.split(","):
        ref, base, eager_logits = torch.load(a.ref)
        ref = ref.to(dev)
        ref_logits = (ref, eager_logits)
    for row in a.rows.split(","):
        try:
            r = run_row(row, a, ids, ref_logits)
        except Exception as e:  # noqa: BLE001  (a row that fails says why; the rest run)
            print(f"| {row} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} |"
                  f" | | | | |", flush=True)
            # where it failed (to stderr: the table stays a table): the project's frames
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if "kvcompile" in f.filename or "benchmarks" in f.filename]
            print("".join(traceback.format_list(frames[-6:])), file=sys.stderr, flush=True)
            if _COMPILED and row.startswith(("kvc_", "engine_")):
                print(f"# {row} routes: {_routes(_COMPILED[0])}", file=sys.stderr, flush=True)
            _COMPILED.clear()
            continue
        if row == "hf_eager":
            ref, base = r["tokens"], r["tok_s"]
            ref_logits = (ref, r["logits"])
            if a.ref:
                torch.save((ref.cpu(), base, r["logits"]), a.ref)
        same = "-" if ref is None else _same(r["tokens"], ref, a.prompt)
        if "forced" in r:
            same += "; " + r["forced"]
        ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
        peak = "-" if r["peak"] is None else f"{r['peak']:.2f}"
        print(f"| {row} | {r['sites']} | {r['bytes']:,.1f} | {r['tok_s']:.1f} | {ratio} | "
              f"{peak} | {same} |", flush=True)


if __name__ == "__main__":
    main()
