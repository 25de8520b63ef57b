"""Chat with SmolLM2-135M-Instruct through kvcompile's continuous-batching engine.

    python examples/chat.py                                   # interactive (empty line quits)
    python examples/chat.py --say "Hi!" --say "What is a KV cache?"      # scripted turns
    python examples/chat.py --kv-dtype fp4_e2m1 --temperature 0.7

The KV cache lives in kvcompile's paged pool, stored as FP8 (E4M3) by default. Each turn's
prompt is the whole conversation: its earlier turns are served from the prefix cache, so only
the new message is computed. Replies stream token by token.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a HF directory, a .gguf file")
    p.add_argument("--kv-dtype", default="fp8_e4m3", help="bf16, fp8_e4m3, fp4_e2m1, auto, ...")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--system", default="You are a helpful, concise assistant.")
    p.add_argument("--say", action="append", default=[], help="a user turn (repeatable); "
                   "without any, read turns from stdin")
    p.add_argument("--kv-mib", type=int, default=256, help="KV pool budget in MiB")
    return p.parse_args(argv)


def make_engine(args) -> Engine:
    phase(f"loading {args.model} (SmolLM2-135M: about 30 s on 2 CPU cores)")
    lm = load_model(args.model, device=args.device)
    if lm.tokenizer is None:
        sys.exit(f"{args.model} has no tokenizer: chat needs one")
    cfg = kvcompile.KVConfig(kv_dtype=args.kv_dtype, max_kv_bytes=args.kv_mib << 20,
                             # CPU: skip inductor's C++ compile (minutes); GPU: inductor
                             inner="inductor" if args.device.startswith("cuda") else "eager")
    phase("compiling with kvcompile: Dynamo traces the model (SmolLM2-135M on 2 CPU cores: about "
          "30 s, and the first request about 15 s more; on CUDA, inductor and CUDA-graph capture "
          "take a few minutes)")
    return Engine(lm.model, lm.tokenizer, cfg, max_num_batched_tokens=512)


def phase(what: str) -> None:
    """One line on stderr before a step that can take a while, so a log never sits silent."""
    print(f"[{what} ...]", file=sys.stderr, flush=True)


def turns(args):
    if args.say:
        yield from args.say
        return
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            return
        if not line:
            return
        yield line


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    engine = make_engine(args)
    print(f"[{args.model} on {args.device}, KV {args.kv_dtype}, {engine.pool.num_pages} pages "
          f"of {engine.pool.page_size} tokens, ready in {time.perf_counter() - t0:.0f} s]")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for text in turns(args):
        if args.say:
            print(f"\nyou> {text}")
        messages.append({"role": "user", "content": text})
        prompt = engine.chat_prompt(messages)
        print("bot> ", end="", flush=True)
        t1, reply = time.perf_counter(), None
        for delta in engine.stream(prompt, params):
            print(delta.new_text, end="", flush=True)
            reply = delta
        dt = time.perf_counter() - t1
        print(f"\n[{len(reply.token_ids)} tokens in {dt:.1f} s, {reply.num_cached_tokens} of "
              f"{len(prompt)} prompt tokens from the prefix cache, {reply.finish_reason}]")
        messages.append({"role": "assistant", "content": reply.text})
    st = kvcompile.stats(engine.model)
    print(f"[pool: {st['pages_used']}/{st['pages_total']} pages used (prefix cache), "
          f"{st['bytes_per_token']:.0f} B/token, prefix hit rate "
          f"{100 * st['prefix_cache_hit_rate']:.0f}%]")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
