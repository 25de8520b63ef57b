"""Batch generation: many prompts through kvcompile's engine, with throughput and pool stats.

    python examples/batch_generate.py                           # SmolLM2-135M, 16 prompts
    python examples/batch_generate.py --model tiny-llama --num-prompts 64 --kv-dtype fp4_e2m1

Prompts are questions about a shared preamble, so the prefix cache serves the preamble's pages
to every request after the first; requests are cut into chunks under the step's token budget
and batched with the decodes of the others.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.models import load_model

PREAMBLE = ("The following are short questions about everyday science. Answer each in one or "
            "two sentences, plainly, without lists.\n\n")
TOPICS = ["why the sky is blue", "how a refrigerator keeps food cold", "what causes tides",
          "why ice floats on water", "how a rainbow forms", "why leaves change colour",
          "how bread rises", "what makes thunder", "how magnets work", "why salt melts ice",
          "how a compass points north", "why the moon has phases", "what a KV cache is",
          "how vaccines train the immune system", "why metal feels cold", "how bees make honey"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-llama, a HF directory")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-mib", type=int, default=256)
    p.add_argument("--show", type=int, default=4, help="print this many answers")
    return p.parse_args(argv)


def prompts_for(lm, n: int) -> list:
    rng = random.Random(0)
    if lm.tokenizer is None:  # random-weight model: random token prompts with a shared stem
        stem = lm.random_prompt(48, seed=1)[0].tolist()
        return [stem + lm.random_prompt(rng.randrange(4, 24), seed=i)[0].tolist()
                for i in range(n)]
    out = []
    for i in range(n):
        q = f"{PREAMBLE}Question: {TOPICS[i % len(TOPICS)]}?"
        if lm.tokenizer.chat_template:
            ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   add_generation_prompt=True, tokenize=True)
            out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        else:
            out.append(q)
    return out


def phase(what: str) -> None:
    """One line on stderr before a step that can take a while, so a log never sits silent."""
    print(f"[{what} ...]", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    phase(f"loading {args.model} (SmolLM2-135M: about 30 s on 2 CPU cores)")
    lm = load_model(args.model, device=args.device)
    cfg = kvcompile.KVConfig(kv_dtype=args.kv_dtype, max_kv_bytes=args.kv_mib << 20,
                             inner="inductor" if args.device.startswith("cuda") else "eager")
    phase("compiling with kvcompile: Dynamo traces the model (SmolLM2-135M on 2 CPU cores: about "
          "30 s, and the first request about 15 s more; on CUDA, inductor and CUDA-graph capture "
          "take a few minutes)")
    engine = Engine(lm.model, lm.tokenizer, cfg,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = prompts_for(lm, args.num_prompts)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    phase("compiling the batched prefill and decode steps (one short request)")
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # compile
    phase(f"generating {len(prompts)} requests")
    t0 = time.perf_counter()
    steps0 = engine.stats.steps
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outs[:args.show]:
        print(f"--- request {o.request_id} ({len(o.prompt_token_ids)} prompt tokens, "
              f"{o.num_cached_tokens} cached, {o.finish_reason})")
        print(o.text.strip() if lm.tokenizer is not None else o.token_ids)
    gen = sum(len(o.token_ids) for o in outs)
    peak = max(s.num_running for s in list(engine.history)[-(engine.stats.steps - steps0):])
    st = kvcompile.stats(engine.model)
    print(f"\n{len(outs)} requests, {gen} tokens in {dt:.2f} s: {gen / dt:.1f} tok/s, "
          f"{engine.stats.steps - steps0} steps, up to {peak} running at once, "
          f"{engine.stats.preemptions} preemptions, prefix hit rate "
          f"{100 * st['prefix_cache_hit_rate']:.0f}%, KV {st['bytes_per_token']:.0f} B/token "
          f"({args.kv_dtype})")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
