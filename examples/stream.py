"""Streaming, two ways, on a kvcompile-compiled model.

    python examples/stream.py                   # SmolLM2-135M
    python examples/stream.py --model tiny-llama

1. `Engine.stream`: one request's text as it is produced, while another request (added from a
   second thread) runs in the same batches.
2. Hugging Face `generate(..., streamer=TextStreamer(tok))` on the same compiled model: the KV
   cache is kvcompile's pool either way; its pages return to the pool when generate returns.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

import kvcompile
from kvcompile import Engine, SamplingParams
from kvcompile.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Write a short poem about paged memory.")
    return p.parse_args(argv)


def _ids(lm, text: str) -> list[int]:
    if lm.tokenizer is None:
        return lm.random_prompt(12)[0].tolist()
    tok = lm.tokenizer
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return tok(text).input_ids


def phase(what: str) -> None:
    """One line on stderr before a step that can take a while, so a log never sits silent."""
    print(f"[{what} ...]", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    phase(f"loading {args.model} (SmolLM2-135M: about 30 s on 2 CPU cores)")
    lm = load_model(args.model, device=args.device)
    # prefill_attends="stored": generate's prefill attends to the pages as the Engine's does, so
    # that both give the same tokens with lossy pages (by default generate's fresh prompt
    # attends to its K/V as computed; the Engine's packed prefill always reads the pages)
    cfg = kvcompile.KVConfig(kv_dtype=args.kv_dtype, max_kv_bytes=128 << 20,
                             prefill_attends="stored",
                             inner="inductor" if args.device.startswith("cuda") else "eager")
    phase("compiling with kvcompile: Dynamo traces the model (SmolLM2-135M on 2 CPU cores: about "
          "30 s, and the first request about 15 s more; on CUDA, inductor and CUDA-graph capture "
          "take a few minutes)")
    engine = Engine(lm.model, lm.tokenizer, cfg)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    print("== 1. Engine.stream (another request shares the batches)")
    other = {}
    t = threading.Thread(target=lambda: other.setdefault(
        "id", engine.add_request(_ids(lm, "Say hello in French."), params)))
    t.start()
    t0, n = time.perf_counter(), 0
    for delta in engine.stream(_ids(lm, args.prompt), params):
        print(delta.new_text if lm.tokenizer is not None else delta.new_token_ids,
              end="" if lm.tokenizer is not None else " ", flush=True)
        n += len(delta.new_token_ids)
    t.join()
    while engine.has_unfinished():   # the other request finishes too
        engine.step()
    print(f"\n[{n} tokens in {time.perf_counter() - t0:.1f} s]")

    print("\n== 2. Hugging Face generate with a TextStreamer, on the same compiled model")
    ids = torch.tensor([_ids(lm, args.prompt)], device=args.device)
    streamer = None
    if lm.tokenizer is not None:
        from transformers import TextStreamer

        streamer = TextStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    phase("the first Hugging Face generate traces its own prefill and decode graphs "
          "(SmolLM2-135M: about 40 s on 2 CPU cores)")
    out = lm.model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False,
                            streamer=streamer, pad_token_id=lm.model.config.pad_token_id or 0)
    if streamer is None:
        print(out[0, ids.shape[1]:].tolist())
    st = kvcompile.stats(lm.model)
    print(f"[pool after generate: {st['sequences']} sequences, {st['pages_used']} pages used "
          f"(the engine's prefix cache)]")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
