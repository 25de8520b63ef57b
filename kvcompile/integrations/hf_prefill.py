"""Chunked prefill for Hugging Face `generate`: a prompt batch whose activations would not fit
beside the pool is prefilled in chunks of C tokens per row.

The mechanism is HF's own (`GenerationConfig.prefill_chunk_size`, transformers 5.x): HF splits
the prompt, slices the attention mask to each chunk's end and calls the model once per chunk;
every chunk after the first is a prefill over the pages the earlier chunks wrote (the paged
prefill kernel, kernels/prefill.py). kvcompile only picks C when the caller did not set it. Why
HF's mechanism and not a split inside kvcompile: the compiled graph is the whole model (embedding
to logits), and HF's loop already slices every input the model reads (ids, mask, position ids,
token types, multimodal features) for both versions in use (5.17 and 5.24); a split inside the
graph runner would have to know which graph inputs are per-token.

What one forward costs beside the pool is bounded by `PREFILL_MEMORY_FRACTION` of the device's
memory: activations ~ B x C x (2 hidden + 3 intermediate) x dtype bytes (the MLP's gate, up and
their product beside the residual stream, with a 1.25 margin), plus the [1, 1, C, L] bool mask
the attention op reads (HF's [B, 1, C, L] mask is split by passes/mask_inputs.py into that and
a [B, 1, 1, L] key mask). C is a multiple of the page size (a page is never written by two
chunks) and, where a page less allows it, no chunk is 8 tokens or fewer (such a forward takes
the decode path).

Chunking costs time: every chunk after the first attends over pages (the paged prefill
kernels), the first over its fresh K/V (dispatch._fresh_prefill, torch SDPA). So a prompt batch
is prefilled whole whenever it fits. Measured on the H200 (2026-12-03, 8-layer Llama-3-8B
shape, B16 x 32,768 tokens, transformers 5.17; HF StaticCache: 78.04 GiB, TTFT 5.59 s): fp8
pages whole 68.93 GiB / 5.28 s, in two chunks 40.12 GiB / 7.27 s; bf16 whole 76.92 GiB /
5.28 s, two chunks 48.10 GiB / 6.15 s. The activations measured 117 KB per token against the
128 KB estimated. The fraction (0.55 of 140 GiB: 77 GiB) lets that batch run whole.
"""

from __future__ import annotations

import math

import torch

PREFILL_MEMORY_FRACTION = 0.55  # of the device's total memory, for one prefill forward
MIN_CHUNK = 512                 # tokens per row: below this chunking costs more than it saves
_DECODE_TOKENS = 8              # StepPlan.is_decode: <= 8 new tokens over a prefix


def activation_bytes_per_token(model) -> int:
    """Peak bytes of one prefill token's activations (one layer at a time)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = getattr(cfg, "intermediate_size", 0) or 4 * hidden
    if isinstance(inter, (list, tuple)):   # one size per layer (Gemma 3n): the largest
        inter = max(inter)
    inter = int(inter)
    elem = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    return math.ceil(1.25 * elem * (2 * hidden + 3 * inter))


def prefill_activation_budget(device: torch.device, state=None) -> int | None:
    """Bytes one prefill forward may use beside the pool, or None where not known (CPU):
    PREFILL_MEMORY_FRACTION of the device, and once the pool exists at most 0.9 of what is
    left beside it (free + cached by torch but unused); less the workspace of the gathered
    chunk route (KVConfig.prefill_gather_bytes, kernels/prefill_gather.py), which a chunk
    after the first may take in one layer's attention."""
    if device.type != "cuda":
        return None
    budget = PREFILL_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
    if state is not None and state.pool is not None:
        free = torch.cuda.mem_get_info(device)[0]
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = min(budget, 0.9 * free)
    if state is not None and state.config.prefill_chunk_route != "paged":
        budget -= state.config.prefill_gather_bytes
    return max(int(budget), 0)


def chunk_size(batch: int, prompt: int, per_token: int, budget: int | None,
               page: int) -> int | None:
    """Tokens per row per chunk (a multiple of `page`), or None when the whole prompt fits.
    A forward of C tokens per row needs batch x C x per_token bytes of activations and C x
    prompt bytes of mask (the [1, 1, C, L] part, L <= prompt)."""
    need = batch * prompt * per_token + prompt * prompt
    if budget is None or prompt <= MIN_CHUNK or need <= budget:
        return None
    chunks = math.ceil(need / budget)
    size = max(MIN_CHUNK, math.ceil(prompt / chunks))
    size = max(page, size // page * page)          # the most a chunk may take, in pages
    # the chunks that takes, balanced (at most `size`, a page apart): cut at the budget alone,
    # 32,768 tokens became 3 chunks of 10,912 and a 4th of 32, and a short chunk over a long
    # prefix takes the slow paths (an MLA layer's absorbed form over every cached token)
    size = max(page, -(-math.ceil(prompt / math.ceil(prompt / size)) // page) * page)
    while 0 < prompt % size <= _DECODE_TOKENS and size > page:
        size -= page
    return size if size < prompt else None


def auto_prefill_chunk(model, input_ids, generation_config, model_kwargs, state) -> int | None:
    """The chunk size for this generate call's prefill, or None (not chunked: the caller set
    one, the cache is not a fresh DynamicCache, the prompt comes as embeddings, or it fits)."""
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return None
    if input_ids is None or input_ids.dim() != 2 or model_kwargs.get("inputs_embeds") is not None:
        return None
    cache = next((model_kwargs[k] for k in ("cache", "past_key_values")
                  if model_kwargs.get(k) is not None), None)
    if cache is None or type(cache).__name__ != "DynamicCache" or _cached_tokens(cache) != 0:
        return None
    B, S = input_ids.shape
    size = chunk_size(B, S, activation_bytes_per_token(model),
                      prefill_activation_budget(input_ids.device, state),
                      state.config.page_size)
    if size is not None:
        state.count("prefill_chunked")
    return size


def _cached_tokens(cache) -> int | None:
    """Tokens an attention layer of `cache` holds; None when it has none (a state-space
    model's DynamicCache holds only LinearAttention layers and raises on get_seq_length)."""
    try:
        return cache.get_seq_length()
    except ValueError:
        return None


def prefill(original, model, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """HF's `_prefill` (`original`), chunked when `auto_prefill_chunk` says so
    (generation_config is the call's own copy; its prefill_chunk_size is restored after)."""
    state = model.__dict__.get("_kvcompile_state")
    size = None if state is None else auto_prefill_chunk(
        model, input_ids, generation_config, model_kwargs, state)
    if size is None:
        return original(input_ids, generation_config, model_kwargs, *args, **kwargs)
    generation_config.prefill_chunk_size = size
    try:
        return original(input_ids, generation_config, model_kwargs, *args, **kwargs)
    finally:
        generation_config.prefill_chunk_size = None
