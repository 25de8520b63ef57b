"""Engine capacity with eviction: concurrent sequences a fixed KV budget holds, by format and
eviction ratio, measured by running the scheduler (not from the layout alone).

    python benchmarks/engine_capacity_eviction.py            # CPU, a few minutes
    python benchmarks/engine_capacity_eviction.py --prompt 1024 --requests 48
    python benchmarks/engine_capacity_eviction.py --int4-page 64 --fit-pages   # see below
    python benchmarks/engine_capacity_eviction.py --long          # 32k-token requests, below

`--long` (issue 19's shape: 32,768-token prompts): `--prompt 32768 --new 512 --requests 24
--budget-seqs 2 --layers 1 --kv-heads 1 --int4-page 64 --no-attention --cases 0,2,4,3,5
--step-tokens 4096` (prompts in chunks of 4,096 tokens: the model's [T, T] mask of a 65k-token
step alone would take gigabytes). What
is scaled, and why the ratios stand: every byte of every format here is per kv head and per
layer (codes, page / channel / token scales, the residual page), so bytes per token, pages per
budget and every scheduling decision scale together with `--layers` and `--kv-heads` when the
budget does (it is `--budget-seqs` bf16 sequences of this model); `--check-scaling` runs the
same short requests at 1 and 2 layers, and 1 and 8 kv heads, and prints the rows side by side.
head_dim stays 128 (the token scales' share of a token depends on it). `--no-attention` puts a
RuntimeHook in front of the plain attention (prompt chunks, rows not evicted) that returns
zeros: the engine still writes every token into the pool in its format, the eviction runtime
still observes (SnapKV's window queries) and evicts, and evicted rows still attend over their
kept slots; only the prefill's quadratic attention math, which a 2-core CPU cannot do for 24 x
32k tokens, is skipped (the outputs are meaningless, the schedule is not: greedy tokens do not
enter it with `ignore_eos`).

Setup: a 2-layer Llama with Llama-3-8B's attention shape per layer (8 kv heads, head_dim 128;
hidden 512, 8 query heads, so the CPU can run it), random weights. `--requests` requests of
`--prompt` random tokens and `--new` greedy tokens are all queued at once; the pool holds
`--budget-seqs` bf16 sequences of prompt + new tokens (pages of 16). For each (format,
policy) the engine runs them to completion; the table gives the most requests running at once
and the mean over decode steps, relative to bf16 without eviction, and preemptions.

With eviction a prompt is held in full until its last token is computed (it attends in full),
then drops to the policy's budget: admission needs the whole prompt's pages, the steady state
only the budget's. SinkWindow(4, prompt/2 - 4) is "50%". The 4-bit format is the key-aware one
(int4, channel-scaled keys, token-scaled values) with its bf16 residual page, in pages of
`--int4-page` tokens (64: the Pareto configuration of benchmarks/RESULTS.md, "key-aware
quantization"; the default 16 reproduces the first table).

Fixed costs per sequence, which 32k-token requests make small and these short ones do not:
- a decode step stores budget + 1 tokens before it evicts back to the budget (interval 1), so
  a budget of whole pages takes one page more during every step; `--fit-pages` makes the 50%
  budget whole pages minus one token (SinkWindow(4, pages * P - 5));
- the bf16 residual rows (one page per sequence, layer, K and V) live outside the pool's
  budget: the table prints their peak bytes beside the budget ("residual" column).
The table also prints the bytes per token of each format (codes + scales, every layer).

Cases 7-9 run SnapKV holding its budget while decoding (`SnapKV(hold=True)`: decoded tokens
push out the lowest-ranked prompt tokens, so a decoder stays at the budget), case 9 in the
quality rows' 4-bit format (K int4 per channel, V int4 per token, pages of 64, Hadamard
rotation, no residual). `--swap-aside` runs `Engine(swap_aside=True)`: an evicting prompt
whose whole-prompt transient does not fit beside the decoders, while its evicted size does,
has one evicting decoder copied to host memory for its prefill (RESULTS.md, "SnapKV holding
its budget, and swap-aside").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvcompile import Engine, KVConfig, SamplingParams, SinkWindow, SnapKV  # noqa: E402
from kvcompile.runtime.hooks import RuntimeHook  # noqa: E402

# (kv_dtype, scale granularity, bf16 residual page, eviction ratio, policy)
CASES = (("bf16", "page", False, None, None), ("fp8_e4m3", "page", False, None, None),
         ("fp8_e4m3", "page", False, 0.5, "sinkwindow"), ("int4", "channel", True, 0.5,
                                                         "sinkwindow"),
         ("fp8_e4m3", "page", False, 0.5, "snapkv"), ("int4", "channel", True, 0.5, "snapkv"),
         ("int4", "channel", True, 0.5, "sinkwindow-vfp4"),
         # 7, 8: SnapKV holding its budget while decoding (SnapKV(hold=True))
         ("fp8_e4m3", "page", False, 0.5, "snapkv-hold"),
         ("int4", "channel", True, 0.5, "snapkv-hold"),
         # 9: the quality rows' 4-bit format (benchmarks/quality, "int4-kc-vt-p64-rot": K int4
         # per channel, V int4 per token, pages of 64, Hadamard rotation, no bf16 residual)
         ("int4", "channel", False, 0.5, "snapkv-hold-rot"))
LONG = dict(prompt=32768, new=512, requests=24, budget_seqs=2, layers=1, kv_heads=1,
            int4_page=64, no_attention=True, cases="0,2,4,3,5", step_tokens=4096)
PAGE = 16


class NoAttention(RuntimeHook):
    """--no-attention: zeros for every attention the plain path computes (see the docstring)."""

    def attend(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras):
        return q.new_zeros((*q.shape[:-1], ctx.state.pool.v[layer].head_dim),
                           dtype=torch.float32)


def skip_kept_attention(ev, kind) -> None:
    """--no-kept-attention (CPU, SinkWindow only): the evicted rows' attention over their kept
    slots returns zeros too (it gathers and dequantizes every kept token of every row, each
    step: most of a 32k run's CPU time). SinkWindow's choices depend on positions only (no
    scores, no mass), so the schedule is the same; `--check-kept` compares it step by step
    with the run that attends."""
    if ev is None:
        return
    if kind not in ("sinkwindow", "sinkwindow-vfp4"):
        raise SystemExit("--no-kept-attention: SinkWindow cases only (SnapKV / H2O choose by "
                         "attention scores)")
    real = ev.attend_kept

    def attend_kept(ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale, extras,
                    rows=None, into=None):
        if layer not in ev.policies:
            return real(ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale,
                        extras, rows=rows, into=into)
        if rows is not None:   # the plain rows are NoAttention's zeros; these rows too
            return into.zero_()   # (`into` may hold nothing yet for them: torch.empty)
        return q.new_zeros((*q.shape[:-1], ctx.state.pool.v[layer].head_dim),
                           dtype=torch.float32)

    ev.attend_kept = attend_kept


def snapshot(eng, st) -> dict:
    """One step of --decompose: each running request's phase and pages, after the step."""
    pool = eng.pool
    reqs = []
    for r in eng.scheduler.running:
        if r.seq_id is None:
            continue
        reqs.append((r.id, int(r.num_computed < len(r.prompt_ids)),
                     len(pool.pages_of(r.seq_id)), pool.seq_len(r.seq_id)))
    return dict(step=st.step, running=st.num_running, waiting=st.num_waiting,
                decode=st.decode_tokens, prefill=st.prefill_tokens, free=pool.num_available,
                finished=eng.stats.requests_finished,
                reqs=reqs)


def decompose(trace, eng, budget_bytes, ratio, args) -> dict:
    """Where the pool's sequences go over the metric's steps (decode steps with requests
    waiting), from the engine's own per-step state (`snapshot`), in sequence equivalents of
    F = the pages one decoding sequence holds (median over those steps):
        pool pages / F = decoding + prefilling                       (the metric: running)
                         + (prefill pages / F - prefilling)           (prompts' transient)
                         + (decoding pages / F - decoding)            (decoders above/below F)
                         + free pages / F                             (admission waits)
    exactly, step by step (every page is free or held by a running request)."""
    import statistics as st

    steps = [t for t in trace if t["decode"] and t["waiting"]]
    if not steps:
        return {}
    dec_pages = [p for t in steps for _i, pre, p, _n in t["reqs"] if not pre]
    F = st.median(dec_pages)
    pool_pages = eng.pool.max_pages
    rows = []
    for t in steps:
        d = sum(1 for r in t["reqs"] if not r[1])
        p = sum(1 for r in t["reqs"] if r[1])
        dp = sum(r[2] for r in t["reqs"] if not r[1])
        pp = sum(r[2] for r in t["reqs"] if r[1])
        rows.append((d, p, pp / F - p, dp / F - d, t["free"] / F,
                     (pool_pages - dp - pp - t["free"]) / F))
    m = [st.mean(c) for c in zip(*rows)]
    first_end = next((t["step"] for t in trace if t["finished"]), None)
    # the byte ceiling: the budget over one steady sequence's bytes (budget + 1 tokens)
    toks = (int(args.prompt * ratio) + 1) if ratio else args.prompt + args.new
    out = dict(F_pages=F, pool_pages=pool_pages, watermark=eng.scheduler.watermark,
               byte_ceiling=budget_bytes / (eng.pool.bytes_per_token * toks),
               page_ceiling=pool_pages / F, whole_seqs=pool_pages // F,
               whole_seqs_past_watermark=(pool_pages - eng.scheduler.watermark) // F,
               steps=len(steps), decoding=m[0], prefilling=m[1], running=m[0] + m[1],
               prefill_transient=m[2], decoder_excess=m[3], free=m[4], unaccounted=m[5],
               max_prefill_pages=max((r[2] for t in steps for r in t["reqs"] if r[1]),
                                     default=0))
    # the same over the steps after the first request ended (ramp-up excluded)
    ended = [t for t in steps if t["step"] >= (first_end or 0)]
    if first_end and ended:
        out["after_first_end"] = dict(steps=len(ended), first_end_step=first_end,
                                      running=st.mean(t["running"] for t in ended),
                                      decoding=st.mean(t["decode"] for t in ended))
    return out


def model(args):
    import transformers

    heads = args.kv_heads
    hidden = 512 if heads == 8 else 128
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=heads,
                                   num_key_value_heads=heads, head_dim=128,
                                   max_position_embeddings=max(8192, 2 * (args.prompt + args.new)))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def run(args, kv, gran, residual, ratio, kind, budget_bytes) -> dict:
    torch._dynamo.reset()
    m = model(args)
    dev = dict(inner="eager")   # (a tiny model: no inductor compile per case)
    if args.device != "cpu":   # bf16 weights, the default kernels (not the CPU's reference)
        m = m.to(args.device, torch.bfloat16)
    else:
        dev["kernels"] = "reference"
    page = args.int4_page if kv == "int4" else PAGE
    policy = None
    extra = {}
    if kind == "sinkwindow-vfp4":
        extra = dict(k_dtype="int4", v_dtype="fp4_e2m1")
    if kind == "snapkv-hold-rot":
        extra = dict(rotate="hadamard")
    if ratio is not None:
        budget = int(args.prompt * ratio)
        if args.fit_pages:   # budget + the step's token fill whole pages
            budget = budget // page * page - 1
        policy = (SnapKV(budget, hold=kind.startswith("snapkv-hold")) if kind.startswith("snapkv")
                  else SinkWindow(4, budget - 4))
    cfg = KVConfig(kv_dtype=kv, scale_granularity=gran, residual=residual, page_size=page,
                   max_kv_bytes=budget_bytes, eviction=policy, **dev, **extra)
    eng = Engine(m, config=cfg, max_num_batched_tokens=args.step_tokens or args.prompt * 2,
                 max_num_seqs=args.requests, enable_prefix_caching=False,
                 prefill_eviction_chunk=args.prefill_eviction_chunk,
                 swap_aside=args.swap_aside)
    eng.scheduler.reserve_prefill = args.admission != "first-chunk"
    eng.scheduler.lifetime_credit = args.admission in ("lifetime", "lifetime-watermark")
    eng.scheduler.exact_margin = args.admission == "lifetime"
    eng.scheduler.reserve_plain = args.plain_admission == "lifetime"
    if args.no_attention:
        from kvcompile.api import state_of

        state_of(m).hooks.insert(0, NoAttention())
        if args.no_kept_attention:
            skip_kept_attention(state_of(m).eviction, kind)
    trace = []
    if args.decompose:
        eng.on_step.append(lambda st: trace.append(snapshot(eng, st)))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (args.prompt,), generator=g).tolist()
               for _ in range(args.requests)]
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new,
                                                ignore_eos=True))
    bad = [(o.request_id, o.finish_reason, len(o.token_ids), o.error) for o in outs
           if o.finish_reason != "length" or len(o.token_ids) != args.new]
    if bad:   # every request must end by its max_tokens (an error would shorten the run)
        raise SystemExit(f"requests that did not run to max_tokens: {bad}")
    running = [s.num_running for s in eng.history if s.decode_tokens]
    # decode steps with the queue not yet empty (the steady state: ramp-up included, drain not)
    queued = [s.num_running for s in eng.history if s.decode_tokens and s.num_waiting]
    # sequences that produced a token in a decode step (prompts in prefill not counted)
    decoding = [s.decode_tokens for s in eng.history if s.decode_tokens]
    decoding_q = [s.decode_tokens for s in eng.history if s.decode_tokens and s.num_waiting]
    pool = eng.pool
    decomposition = decompose(trace, eng, budget_bytes, ratio, args) if args.decompose else None
    res = sum(t.res_data.numel() * t.res_data.element_size() for t in pool.k + pool.v
              if t.res_data is not None)
    fmt = (f"{kv} ({gran}, P{page})" if not extra else f"K int4 ({gran}) / V fp4, P{page}"
           if "v_dtype" in extra else f"{kv} ({gran}, P{page}) + {extra['rotate']} rotation")
    row = dict(format=fmt + (" + residual" if residual else ""),
               eviction="none" if ratio is None else f"{policy!r} ({int(100 * ratio)}%)",
               queued_mean_running=statistics.mean(queued) if queued else 0.0,
               residual_bytes=res, budget_bytes=budget_bytes,
               pages=eng.pool.num_pages, bytes_per_token=eng.pool.bytes_per_token,
               max_running=max(s.num_running for s in eng.history),
               mean_running=statistics.mean(running) if running else 0.0,
               mean_decoding=statistics.mean(decoding) if decoding else 0.0,
               queued_mean_decoding=statistics.mean(decoding_q) if decoding_q else 0.0,
               computed_tokens=eng.stats.computed_tokens,
               preemptions=eng.stats.preemptions, steps=eng.stats.steps,
               swapped_aside=eng.state.counters.get("swapped_aside", 0),
               seconds=time.perf_counter() - t0)
    if decomposition is not None:
        row["decomposition"] = decomposition
        if args.trace_out:
            import json

            with open(f"{args.trace_out}.case{kv}-{kind}.json", "w") as f:
                json.dump(trace, f)
    eng.close()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--budget-seqs", type=int, default=4,
                   help="the pool holds this many bf16 sequences of prompt + new tokens")
    p.add_argument("--int4-page", type=int, default=16, help="page size of the 4-bit case")
    p.add_argument("--swap-aside", action="store_true",
                   help="Engine(swap_aside=True): evicting decoders swapped to host memory for "
                        "an evicting prompt's transient when its evicted size fits")
    p.add_argument("--cases", default="0,1,2,3",
                   help="indices into CASES (ratios are against case 0 when it runs)")
    p.add_argument("--fit-pages", action="store_true",
                   help="50%% budgets of whole pages minus the decode step's token")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu",
                   help="cpu (reference kernels, eager) or cuda (bf16 weights, default kernels)")
    p.add_argument("--step-tokens", type=int, default=0,
                   help="max_num_batched_tokens (default: two prompts)")
    p.add_argument("--prefill-eviction-chunk", type=int, default=0,
                   help="Engine(prefill_eviction_chunk=N): evicting prompts are evicted "
                        "after every N tokens (0: at their end only)")
    p.add_argument("--admission", default="lifetime",
                   choices=("lifetime", "lifetime-watermark", "reserve", "first-chunk"),
                   help="lifetime (the Engine's default): an evicting prompt is admitted when "
                        "its peak fits beside the prompts in prefill, counting the pages of "
                        "evicting requests their max_tokens ends in time; reserve: the same "
                        "without that credit; first-chunk: when its first chunk fits (the "
                        "rule before issue 19's evict19f); lifetime-watermark: lifetime "
                        "with the 1%% watermark kept beside evicting requests alone and "
                        "prompts growing a whole step budget a step (the rule before "
                        "cap19h: Scheduler.exact_margin off)")
    p.add_argument("--plain-admission", default="first-chunk",
                   choices=("first-chunk", "lifetime"),
                   help="requests that keep every token (the bf16 baseline): admitted on "
                        "their first chunk (the Engine's default: they overcommit the pool "
                        "and are preempted) or by their whole life (Scheduler.reserve_plain: "
                        "never preempted, as the evicting rows' admission)")
    p.add_argument("--kv-heads", type=int, default=8, choices=(1, 8),
                   help="kv heads (= query heads) of head_dim 128")
    p.add_argument("--no-kept-attention", action="store_true",
                   help="with --no-attention: the evicted rows' attention too (SinkWindow "
                        "cases; the schedule is unchanged: see skip_kept_attention)")
    p.add_argument("--decompose", action="store_true",
                   help="per-step trace: where the pool's sequences go (see decompose)")
    p.add_argument("--trace-out", default="", help="with --decompose: write the trace here")
    p.add_argument("--no-attention", action="store_true",
                   help="zeros for the plain path's attention (see the docstring)")
    p.add_argument("--long", action="store_true",
                   help="32k-token requests: " + " ".join(f"{k}={v}" for k, v in LONG.items()))
    p.add_argument("--check-scaling", action="store_true",
                   help="the given cases at 1 / 2 layers and 1 / 8 kv heads")
    a = p.parse_args(argv)
    if a.long:
        # LONG fills in what the command line did not give (a flag given with its default value
        # counts as given: the GPU job's --kv-heads 8 once became 1 here)
        words = [w.split("=")[0] for w in (sys.argv[1:] if argv is None else argv)]
        given = {act.dest for act in p._actions if set(act.option_strings) & set(words)}
        for k, v in LONG.items():
            if k == "no_attention" and a.device != "cpu":
                continue   # a GPU attends for real
            if k not in given:
                setattr(a, k, v)
    if a.check_scaling:
        rows = {}
        for layers, heads in ((1, 8), (2, 8), (1, 1), (2, 1)):
            a.layers, a.kv_heads = layers, heads
            rows[(layers, heads)] = table(a)
        print("\n| layers | kv heads | case | pages | max running | mean running | "
              "steady mean | preemptions |")
        print("|---|---|---|---|---|---|---|---|")
        for (layers, heads), rs in rows.items():
            for r in rs:
                print(f"| {layers} | {heads} | {r['format']}, {r['eviction']} | {r['pages']} | "
                      f"{r['max_running']} | {r['mean_running']:.2f} | "
                      f"{r['queued_mean_running']:.2f} | {r['preemptions']} |")
        return 0
    table(a)
    return 0


def table(a) -> list:
    torch.set_num_threads(1)
    # layers x (K, V) x kv heads x head_dim x bytes
    bf16_token = a.layers * 2 * a.kv_heads * 128 * 2
    pages = a.budget_seqs * -(-(a.prompt + a.new) // PAGE)
    budget = pages * PAGE * bf16_token
    import transformers

    print(dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
               transformers=transformers.__version__, prompt=a.prompt, new=a.new,
               requests=a.requests, budget_bytes=budget, layers=a.layers,
               kv_heads=a.kv_heads, no_attention=a.no_attention,
               prefill_eviction_chunk=a.prefill_eviction_chunk, admission=a.admission,
               plain_admission=a.plain_admission, swap_aside=a.swap_aside),
          flush=True)
    rows = []
    cases = [int(x) for x in a.cases.split(",")]
    for i in cases:
        rows.append(run(a, *CASES[i], budget))
        print(rows[-1], flush=True)
    base = rows[0] if cases[0] == 0 else None   # bf16 without eviction

    def ratio(r, key):
        return f"{r[key] / base[key]:.2f}" if base else "-"

    print("\n| format | eviction | pages | bytes/token | max running | x bf16 | mean running "
          "(decode steps) | x bf16 | steady mean (queue not empty) | x bf16 | steady mean "
          "decoding | x bf16 | preemptions | computed tokens | residual (outside the budget) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        res = (f"{r['residual_bytes'] / 2**20:.2f} MiB "
               f"({100 * r['residual_bytes'] / r['budget_bytes']:.0f}% of the budget)"
               if r["residual_bytes"] else "-")
        print(f"| {r['format']} | {r['eviction']} | {r['pages']} | {r['bytes_per_token']:.0f} | "
              f"{r['max_running']} | {ratio(r, 'max_running')} | "
              f"{r['mean_running']:.2f} | {ratio(r, 'mean_running')} | "
              f"{r['queued_mean_running']:.2f} | {ratio(r, 'queued_mean_running')} | "
              f"{r['queued_mean_decoding']:.2f} | {ratio(r, 'queued_mean_decoding')} | "
              f"{r['preemptions']} | {r['computed_tokens']} | {res} |")
    if any("decomposition" in r for r in rows):
        print("\n| format | F (pages of a decoding seq) | byte ceiling | pool / F | whole seqs "
              "(past watermark) | running | = decoding | + prefilling | prompts' transient | "
              "decoders vs F | free | after first end: running / decoding |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            d = r.get("decomposition")
            if not d:
                continue
            a = d.get("after_first_end", {})
            print(f"| {r['format']}, {r['eviction']} | {d['F_pages']} | {d['byte_ceiling']:.2f} | "
                  f"{d['page_ceiling']:.2f} | {d['whole_seqs']} ({d['whole_seqs_past_watermark']}) | "
                  f"{d['running']:.2f} | {d['decoding']:.2f} | {d['prefilling']:.2f} | "
                  f"{d['prefill_transient']:+.2f} | {d['decoder_excess']:+.2f} | {d['free']:.2f} | "
                  f"{a.get('running', 0):.2f} / {a.get('decoding', 0):.2f} |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
