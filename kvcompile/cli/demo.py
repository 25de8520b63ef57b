"""`kvcompile demo`: SmolLM2-135M, compiled with kvcompile, answers a prompt.

It prints the answer, the attention sites rewritten, the KV bytes per token against a bf16
cache, and the time of each step. CPU by default, CUDA when present.
"""

from __future__ import annotations

import time

import torch

from kvcompile.cli.common import (
    EXIT_OK,
    CLIError,
    Console,
    Result,
    fmt_bytes,
    kv_config,
    load,
    load_about,
    resolve_inner,
)

DEFAULT_PROMPT = "What does a cache do in a computer? Answer in one sentence."


def run(args) -> Result:
    import kvcompile

    console = Console.for_args(args)
    _quiet_transformers()
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    lm = load(args, console)
    if not lm.is_hf:
        raise CLIError(f"the demo generates text: {args.model} is not a Hugging Face model",
                       hint="use `kvcompile inspect` for plain modules")
    model, tok = lm.model, lm.tokenizer
    inner = resolve_inner(args.inner, lm.device, cpu_default="eager")
    cfg = kv_config(args, inner=inner)
    prompt = args.prompt or DEFAULT_PROMPT
    inputs = _encode(lm, prompt, chat=not args.no_chat_template)
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if tok is not None and tok.eos_token_id is not None:
        gen_kw["pad_token_id"] = tok.eos_token_id

    kvcompile.compile(model, cfg)
    # The first generate traces and compiles the prefill graph and the decode graphs (the second
    # decode step turns the KV length dynamic), so 3 tokens compile everything the answer needs.
    real = load_about(args.model) is not None  # a real checkpoint: its steps take a while
    with console.stage(f"compiling with kvcompile: kv {cfg.kv_dtype}, inner {inner}",
                       about=_compile_about(model, inner) if real else None) as compile_t:
        with torch.inference_mode():
            model.generate(**inputs, **dict(gen_kw, max_new_tokens=3))
    clock = _StepClock(model)
    with console.stage(f"generating up to {args.max_new_tokens} tokens",
                       about=_generate_about(args.max_new_tokens, lm.device) if real
                       else None) as gen_t:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(**inputs, **gen_kw, stopping_criteria=[clock])
    n_prompt = inputs["input_ids"].shape[1]
    new_ids = out[0, n_prompt:]
    answer = (tok.decode(new_ids, skip_special_tokens=True).strip() if tok is not None
              else " ".join(str(int(i)) for i in new_ids))

    rep = kvcompile.report(model)
    layers = _layer_bytes(model)
    n_new = int(new_ids.numel())
    ttft = clock.times[0] - t0 if clock.times else float("nan")
    decode_s = clock.times[-1] - clock.times[0] if len(clock.times) > 1 else 0.0
    decode_tps = (len(clock.times) - 1) / decode_s if decode_s > 0 else float("nan")
    payload = {
        "model": args.model, "source": lm.source, "device": str(lm.device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "kv_dtype": cfg.kv_dtype, "inner": inner, "prompt": prompt,
        "chat_template": not args.no_chat_template and tok is not None,
        "answer": answer, "prompt_tokens": n_prompt, "new_tokens": n_new,
        "sites": {"found": len(rep.sites), "rewritten": len(rep.rewritten),
                  "skipped": [{"name": s.name, "reason": s.reason} for s in rep.skipped],
                  "patterns": sorted({f"{s.pattern}/{s.gqa}/{s.cache}" for s in rep.sites})},
        "graphs": rep.graphs,
        "kv_bytes_per_token": layers["bytes_per_token"],
        "bf16_bytes_per_token": layers["bf16_bytes_per_token"],
        "kv_ratio_vs_bf16": layers["ratio"],
        "cache_at_last_step": clock.pool,
        "seconds": {"load": lm.load_seconds, "compile": compile_t["seconds"],
                    "passes_and_inner_compile": rep.compile_seconds,
                    "generate": gen_t["seconds"], "time_to_first_token": ttft,
                    "total": lm.load_seconds + compile_t["seconds"] + gen_t["seconds"]},
        "decode_tokens_per_second": decode_tps,
        "tokens_per_second": n_new / gen_t["seconds"] if gen_t["seconds"] > 0 else None,
    }
    return Result(payload, _text(payload), EXIT_OK)


def _compile_about(model, inner: str) -> str:
    """What the compile step does and roughly how long it takes (SmolLM2-135M, 30 layers, on 2
    CPU cores with inner=eager: 14-18 s, nearly all of it Dynamo tracing the model's code)."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or 30
    what = "Dynamo traces the prefill and decode graphs, kvcompile's passes rewrite them"
    if inner == "inductor":
        return f"{what}, inductor compiles them: a few minutes"
    return f"{what}; about {max(10, round(0.6 * layers, -1)):.0f} s on 2 CPU cores"


def _generate_about(max_new_tokens: int, device) -> str:
    if torch.device(device).type == "cuda":
        return "seconds"
    return f"about {max(5, round(max_new_tokens / 4, -1)):.0f} s on 2 CPU cores"


def _encode(lm, prompt: str, chat: bool) -> dict:
    tok = lm.tokenizer
    if tok is None:
        ids = lm.random_prompt(16)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if chat and getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
    else:
        enc = tok(prompt, return_tensors="pt")
    return {k: v.to(lm.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


class _StepClock:
    """A stopping criterion that never stops: it timestamps each generated token and keeps the
    pool's occupancy at the last one (pages are freed when generate returns)."""

    def __init__(self, model):
        self.model, self.times, self.pool = model, [], {}

    def __call__(self, input_ids, scores, **kwargs):
        import kvcompile

        self.times.append(time.perf_counter())
        st = kvcompile.stats(self.model)
        self.pool = {k: st.get(k, 0) for k in ("tokens", "pages_used", "pages_total",
                                               "bytes_used", "internal_waste")}
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _layer_bytes(model) -> dict:
    """Bytes per token of the compiled cache (all layers, K + V, scales) and of a bf16 cache."""
    from kvcompile.api import state_of
    from kvcompile.cache.formats import KVFormat

    st = state_of(model)
    page = st.config.page_size
    kv, bf16 = 0.0, 0.0
    for spec in st.layer_specs:
        kv += (spec.k_format.bytes_per_token(spec.num_kv_heads, spec.head_dim, page)
               + spec.v_format.bytes_per_token(spec.num_kv_heads, spec.v_head_dim, page))
        b = KVFormat("bf16")
        bf16 += (b.bytes_per_token(spec.num_kv_heads, spec.head_dim, page)
                 + b.bytes_per_token(spec.num_kv_heads, spec.v_head_dim, page))
    return {"bytes_per_token": kv, "bf16_bytes_per_token": bf16,
            "ratio": kv / bf16 if bf16 else float("nan")}


def _text(p: dict) -> str:
    s, sec = p["sites"], p["seconds"]
    lines = [
        f"kvcompile demo: {p['model']} on {p['device']} ({p['dtype']}), KV cache {p['kv_dtype']}",
        "",
        f"prompt: {p['prompt']}",
        f"answer: {p['answer']}",
        "",
        f"attention sites rewritten: {s['rewritten']} of {s['found']} "
        f"({', '.join(s['patterns'])}; {p['graphs']} graph(s))",
    ]
    for sk in s["skipped"]:
        lines.append(f"  left alone: {sk['name']}: {sk['reason']}")
    c = p["cache_at_last_step"]
    lines += [
        f"KV bytes per token: {p['kv_bytes_per_token']:.0f} B vs {p['bf16_bytes_per_token']:.0f} "
        f"B in bf16 ({100 * p['kv_ratio_vs_bf16']:.1f}%, all layers, K+V, scales included)",
        f"KV cache at the last token: {c.get('tokens', 0)} tokens in {c.get('pages_used', 0)} "
        f"pages, {fmt_bytes(c.get('bytes_used', 0))} (bf16 cache: "
        f"{fmt_bytes(c.get('tokens', 0) * p['bf16_bytes_per_token'])})",
        f"time: load {sec['load']:.1f} s, compile {sec['compile']:.1f} s, generate "
        f"{sec['generate']:.1f} s for {p['new_tokens']} tokens "
        f"(first token {1000 * sec['time_to_first_token']:.0f} ms, decode "
        f"{p['decode_tokens_per_second']:.1f} tok/s)",
        # seconds.compile is the first, 3-token generate; the backend's share of it (passes
        # and the inner compiler, per graph) is the state's compile_seconds
        f"  compile = the first generate (3 tokens): Dynamo tracing {p['graphs']} graph(s) and "
        f"running them {max(0.0, sec['compile'] - sec['passes_and_inner_compile']):.1f} s + "
        f"kvcompile passes and the {p['inner']} backend {sec['passes_and_inner_compile']:.1f} s",
    ]
    return "\n".join(lines)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
