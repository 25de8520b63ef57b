"""An engine request's inputs, checked before anything is queued: the prompt's token ids, the
request's lengths against the model and the pool, and what the engine reads off the model
(position limit, EOS ids, vocabulary size). Every problem raises `RequestError` naming it."""

from __future__ import annotations

import numbers

import torch

from kvcompile.engine.params import RequestError, SamplingParams


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


def max_model_len(model, state, requested) -> int:
    """max_model_len: the user's, at most the model's position limit (a learned position table
    has no row past it); by default that limit, capped by KVConfig.max_seq_len and the pool."""
    cfg = model.config
    positions = next((int(v) for v in (getattr(cfg, "max_position_embeddings", None),
                                       getattr(cfg, "n_positions", None)) if v), None)
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
            raise RequestError(f"Engine max_model_len={requested!r}: must be an int >= 2")
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
