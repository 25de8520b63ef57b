"""An engine request's inputs, checked before anything is queued: the prompt's token ids, the
request's lengths against the model and the pool, and what the engine reads off the model
(position limit, EOS ids, vocabulary size). Every problem raises `RequestError` naming it."""

from __future__ import annotations

import logging
import numbers

import torch

from kvcompile.engine.params import RequestError, SamplingParams

log = logging.getLogger("kvcompile.engine")


def _plain_ids(prompt) -> list[int] | None:
    """The ids of a prompt that is plainly integers, checked a container at a time (a list or
    tuple of Python ints by the set of its items' types, a 1-D integer tensor or array by its
    dtype); None for anything else, which the item-by-item check then takes (and names what is
    wrong). At 16 prompts of 4,096 tokens the item check took 24 ms of the host's time before
    the first step (the first request's wait for its first token includes the later ones')."""
    if isinstance(prompt, list | tuple):
        if set(map(type, prompt)) <= {int}:   # (bool is not int here: type(True) is bool)
            return list(prompt)
        return None
    dtype, ndim = getattr(prompt, "dtype", None), getattr(prompt, "ndim", None)
    if dtype is None or ndim != 1 or not hasattr(prompt, "tolist"):
        return None
    if isinstance(dtype, torch.dtype):
        ok = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    else:   # numpy: signed / unsigned integer kinds
        ok = getattr(dtype, "kind", "") in ("i", "u")
    return prompt.tolist() if ok else None


def token_ids(prompt, tokenizer) -> list[int]:
    """A prompt (a string, or token ids: a list, tensor or array of integers) -> ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a string prompt needs a tokenizer: Engine(model, tokenizer), "
                               "or pass token ids")
        return list(tokenizer(prompt).input_ids)
    plain = _plain_ids(prompt)
    if plain is not None:
        return plain
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    try:
        items = list(prompt)
    except TypeError:
        raise RequestError(f"prompt must be a string or a list of token ids, got "
                           f"{type(prompt).__name__}") from None
    for i, t in enumerate(items):
        # int() would truncate 3.7 to 3 and take True as 1: only integers are token ids
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestError(f"prompt token ids must be ints; item {i} is "
                               f"{type(t).__name__} {t!r}. Pass integer ids (a float or "
                               f"bool tensor: .long() only if that is what you mean)")
    return [int(t) for t in items]


def check_request(ids: list[int], p: SamplingParams, vocab_size: int, max_model_len: int,
                  pool) -> None:
    """RequestError for a request the engine can never run; nothing is queued yet."""
    n = len(ids)
    if n == 0:
        raise RequestError("the prompt is empty: give at least one token")
    bad = ([t for t in ids if not 0 <= t < vocab_size]
           if min(ids) < 0 or max(ids) >= vocab_size else [])
    if bad:
        raise RequestError(f"prompt token ids {bad[:4]} are outside the vocabulary "
                           f"[0, {vocab_size})")
    if n >= max_model_len:
        raise RequestError(f"the prompt has {n} tokens; the engine's max_model_len is "
                           f"{max_model_len} (prompt + at least one new token). "
                           f"Shorten the prompt or raise max_model_len / KVConfig budget.")
    if n + p.max_tokens > max_model_len:
        raise RequestError(f"prompt ({n}) + max_tokens ({p.max_tokens}) = {n + p.max_tokens}"
                           f" tokens exceeds max_model_len={max_model_len}; lower "
                           f"max_tokens to at most {max_model_len - n}")
    P = pool.page_size
    pages = -(-(n + p.max_tokens - 1) // P)
    if pages > pool.max_pages:
        raise RequestError(f"prompt ({n}) + max_tokens ({p.max_tokens}) needs {pages} "
                           f"pages, the whole pool holds {pool.max_pages}: it can never "
                           f"fit, even alone. Raise KVConfig.max_kv_bytes, use a smaller "
                           f"kv_dtype, or lower max_tokens.")


# layer types (transformers' `config.layer_types`) whose mask is more than causality within a
# sequence and the config's sliding window: the engine's packed steps attend each sequence
# causally (with the window) and read no mask of the model's (passes/mask_inputs.py
# drop_masks), so they cannot run such a layer. Chunked attention is causal within its first
# chunk: the engine runs it up to that length.
_MASKED_LAYER_TYPES = ("window_attention", "reference_sliding_attention", "indexed_attention",
                       "compressed_sparse_attention", "heavily_compressed_attention",
                       "minimax_m3_sparse")


def mask_limit(config) -> int | None:
    """The longest sequence the engine attends as the model does, from what the config says
    of its masks: None for no limit (causal, a sliding window), attention_chunk_size for
    chunked layers. RequestError for a model the engine cannot attend as it does at all
    (bidirectional attention, the layer types above)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    fix = ("the engine attends each sequence causally (with the config's sliding window) and "
           "reads no mask of the model's; generate with HF `generate` after "
           "kvcompile.compile(model), which applies the model's own mask")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise RequestError(f"this model's attention is bidirectional (config."
                           f"use_bidirectional_attention={cfg.use_bidirectional_attention!r}); "
                           f"{fix}")
    types = set(getattr(cfg, "layer_types", None) or ())
    other = sorted(types.intersection(_MASKED_LAYER_TYPES))
    if other:
        raise RequestError(f"this model has {', '.join(other)} layers (config.layer_types), "
                           f"whose masks are more than causal; {fix}")
    chunk = getattr(cfg, "attention_chunk_size", None)
    if "chunked_attention" in types and chunk:
        return int(chunk)
    return None


def max_model_len(model, state, requested) -> int:
    """max_model_len: the user's, at most the model's position limit (a learned position table
    has no row past it) and `mask_limit`; by default that limit, capped by
    KVConfig.max_seq_len and the pool."""
    cfg = model.config
    positions = next((int(v) for v in (getattr(cfg, "max_position_embeddings", None),
                                       getattr(cfg, "n_positions", None)) if v), None)
    chunk = mask_limit(cfg)
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
            raise RequestError(f"Engine max_model_len={requested!r}: must be an int >= 2")
        if chunk is not None and requested > chunk:
            raise RequestError(f"Engine max_model_len={requested} exceeds the model's attention "
                               f"chunk ({chunk} tokens, config.attention_chunk_size): the "
                               f"engine attends causally, which equals the model's chunked "
                               f"attention only within the first chunk; use max_model_len <= "
                               f"{chunk}, or HF `generate` after kvcompile.compile(model) for "
                               f"longer sequences")
        if positions is not None and requested > positions:
            raise RequestError(f"Engine max_model_len={requested} exceeds the model's position "
                               f"limit {positions} (config.max_position_embeddings); use "
                               f"max_model_len <= {positions}")
        cap = state.config.max_seq_len
        if cap and requested > cap:  # the pool would refuse such a sequence at every step
            raise RequestError(f"Engine max_model_len={requested} exceeds KVConfig.max_seq_len="
                               f"{cap}; use max_model_len <= {cap} or raise max_seq_len")
        return requested
    limits = [state.pool.max_pages * state.pool.page_size]   # (a growing pool: its budget)
    for v in (positions, state.config.max_seq_len):
        if v:
            limits.append(int(v))
    if chunk is not None and chunk < min(limits):
        log.warning("kvcompile engine: max_model_len capped at %d, the model's attention chunk "
                    "(config.attention_chunk_size): the engine attends causally, which equals "
                    "chunked attention only within the first chunk; HF `generate` after "
                    "kvcompile.compile(model) runs longer sequences", chunk)
        limits.append(chunk)
    return min(limits)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None),
                tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def vocab_size(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        return int(emb.num_embeddings)
    return int(model.config.vocab_size)
