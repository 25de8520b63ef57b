"""Checks on what a compiled Hugging Face model is called with, made before Dynamo sees it.

Inside Dynamo a bad input fails as a multi-line `TorchRuntimeError` from fake-tensor tracing (or
an IndexError deep in an embedding); checked here, each is one line naming the input and the
fix (`InvalidInputError`):

- `input_ids` that are not an integer tensor, or empty;
- a sequence that would pass the last learned absolute position (GPT-2's `n_positions`, OPT's
  `max_position_embeddings`). Rotary models extrapolate past theirs and are not checked.

The checks cost a few attribute reads per call; a device sync only when the length bound says a
position may be past the limit and exact `position_ids` must be read.
"""

from __future__ import annotations

import torch

from kvcompile.errors import InvalidInputError
from kvcompile.integrations.hf_graphs import GraphedForward


class CheckedForward(GraphedForward):
    """`model.forward` of a kvcompile-compiled HF model, checking its inputs first."""

    def __init__(self, compiled, state, model, **kwargs):
        super().__init__(compiled, state, model, **kwargs)
        self.model_name = type(model).__name__
        self.position_limit = position_limit(model)

    def __call__(self, *args, **kwargs):
        check_inputs(self.model_name, self.position_limit, args, kwargs)
        return super().__call__(*args, **kwargs)


def position_limit(model) -> tuple[int, str] | None:
    """(positions, config field) of a model with learned absolute position embeddings."""
    cfg = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0 and _learned_positions(model, n):
            return n, name
    return None


def _learned_positions(model, n: int) -> bool:
    # GPT-2 `wpe` has n rows; OPT's `embed_positions` n + 2 (an offset of 2)
    for path, mod in model.named_modules():
        leaf = path.rsplit(".", 1)[-1].lower()
        if isinstance(mod, torch.nn.Embedding) and mod.num_embeddings in (n, n + 2) and (
                "pos" in leaf or leaf == "wpe"):
            return True
    return False


def check_inputs(model_name: str, limit, args, kwargs) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        if not isinstance(ids, torch.Tensor):
            raise InvalidInputError(
                f"input_ids must be a tensor of token ids [batch, length], got "
                f"{type(ids).__name__}; pass torch.tensor([ids]) (or the tokenizer's "
                f"return_tensors='pt')")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidInputError(
                f"input_ids has dtype {ids.dtype}, but token ids are integers: pass "
                f"input_ids.long() (the tokenizer's output is already torch.long)")
        if ids.numel() == 0:
            raise InvalidInputError(
                f"input_ids is empty (shape {list(ids.shape)}): give at least one token per "
                f"sequence (a BOS token for an empty prompt)")
    if limit is None:
        return
    n = _new_tokens(ids, kwargs)
    # transformers names the cache argument `cache` (5.2x) or `past_key_values` (earlier)
    past = _past_len(kwargs.get("past_key_values", kwargs.get("cache")))
    if n is None or past is None or past + n <= limit[0]:
        return  # positions never exceed past + n - 1
    last = past + n
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.numel():
        last = int(pos.max()) + 1   # left padding: real positions are lower
        if last <= limit[0]:
            return
    raise InvalidInputError(
        f"input_ids reach position {last - 1}, past the {limit[0]} learned positions of "
        f"{model_name} (config.{limit[1]}={limit[0]}); keep prompt + max_new_tokens <= "
        f"{limit[0]} (shorten the prompt, lower max_new_tokens, or crop the cache)")


def _new_tokens(ids, kwargs) -> int | None:
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return ids.shape[-1]
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor) and emb.dim() == 3:
        return emb.shape[1]
    return None


def _past_len(cache) -> int | None:
    """Tokens already cached, without a device sync (None: not known cheaply)."""
    if cache is None:
        return 0
    if "Static" in type(cache).__name__:
        return None  # its length is read from the buffers' contents
    fn = getattr(cache, "get_seq_length", None)
    if fn is None:
        return None
    try:
        return int(fn())
    except Exception:  # noqa: BLE001  (a cache class we do not know: do not judge)
        return None
