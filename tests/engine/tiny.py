"""Tiny models and a byte tokenizer for the generation tests (engine and HF generate).

Models come from tests/passes/zoo.py (random weights, LM head sharpened so that greedy decoding
is decided by the model, not by rounding). The tokenizer is byte-level with no merges: its 256
ids are the 256 bytes, so it fits the zoo's vocabulary, decodes any id sequence, and produces
multi-byte UTF-8 characters across tokens (incomplete ones decode to U+FFFD).
"""

from __future__ import annotations

import functools

import torch

from kvcompile.config import KVConfig
from tests.passes.zoo import VOCAB, make_hf  # noqa: F401  (re-exported)


@functools.lru_cache(maxsize=1)
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=alphabet[0],
                                   eos_token=alphabet[2], bos_token=alphabet[1])


@functools.lru_cache(maxsize=1)
def _byte_map() -> dict:
    # GPT-2's bytes_to_unicode: byte b is the printable char ord(b) or 256 + k
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_of(c: str) -> int:
    return _byte_map()[c]


def config(**kw) -> KVConfig:
    """A CPU test config: Dynamo + the passes, no inner compiler (fast to build)."""
    base = dict(inner="eager", kernels="reference", max_kv_bytes=1 << 22)
    base.update(kw)
    return KVConfig(**base)


def random_prompts(rng, n: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi + 1))]
            for _ in range(n)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: eager Hugging Face greedy decoding of one prompt, n new tokens."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_llama64(dtype=torch.float32, seed: int = 0):
    """A tiny Llama with head_dim 64 (the Triton decode kernel's smallest)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=512,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype)
