"""Sampling the next token of each sequence of a step from its logits.

Each request samples with its own generator, one row at a time where randomness is involved,
so a request draws the same tokens whether it runs alone or among others (given the same
logits). Greedy rows take a batched argmax. Rows with non-finite logits are reported, never
sampled: the engine fails that request alone.
"""

from __future__ import annotations

import torch

from kvcompile.engine.params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list,
           histories: list[list[int]], banned: list[list[int]] | None = None
           ) -> tuple[list[int], list[float | None], list[bool]]:
    """logits [B, V] (any float dtype), one params / generator / token history / banned
    token list (EOS before min_tokens) per row -> (tokens [B], logprob of each token (None
    unless asked), ok [B]). A row with a NaN or +Inf logit, or with every logit -Inf, is not
    ok (its token is -1). `sample_on_device` and one device-to-host transfer."""
    return read_back(pack(*sample_on_device(logits, params, generators, histories, banned))
                     .tolist(), params)


def pack(tokens: torch.Tensor, bad: torch.Tensor, lps: torch.Tensor | None) -> torch.Tensor:
    """`sample_on_device`'s outputs as one [2 or 3, B] float64 tensor (token ids and fp32
    values are exact in it): one device-to-host copy reads them all."""
    rows = [tokens, bad] + ([lps] if lps is not None else [])
    return torch.stack([r.to(torch.float64) for r in rows])


def read_back(rows: list[list[float]], params: list[SamplingParams]
              ) -> tuple[list[int], list[float | None], list[bool]]:
    """`pack`'s rows, read on the host -> (tokens, logprobs, ok) as `sample` returns them."""
    ok = [not f for f in rows[1]]
    tokens = [int(t) if good else -1 for t, good in zip(rows[0], ok)]
    logprobs: list[float | None] = [None] * len(params)
    if len(rows) > 2:
        logprobs = [v if good and p.logprobs else None
                    for v, good, p in zip(rows[2], ok, params)]
    return tokens, logprobs, ok


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                     histories: list[list[int]], banned: list[list[int]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`sample` without reading anything back: no host sync, so the engine's overlapped steps
    (engine/overlap.py) can feed the tokens to the next step on the device. Returns tokens [B]
    int64 (a bad row's token is 0, a valid id the next step may embed), bad [B] bool, and the
    logprobs [B] fp32 when a row asks for them (else None). Each random row draws from its own
    generator with the same calls as before, so the tokens do not depend on the loop."""
    x = logits.to(torch.float32, copy=True)  # banned tokens / penalties edit it in place
    bad = torch.isnan(x).any(-1) | (x == float("inf")).any(-1) | ~torch.isfinite(x).any(-1)
    for i, ban in enumerate(banned or []):
        if ban:
            x[i].index_fill_(0, _on(ban, x.device), float("-inf"))
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0 and histories[i]:
            _penalize(x[i], histories[i], p.repetition_penalty)
    tokens = x.argmax(-1)
    want_lp = any(p.logprobs for p in params)
    lps = torch.zeros(len(params), dtype=torch.float32, device=x.device) if want_lp else None
    for i, p in enumerate(params):
        if p.greedy and not p.logprobs:
            continue
        row = x[i] if p.greedy else _filter(x[i] / p.temperature, p)
        if not p.greedy:
            tokens[i] = _draw(torch.softmax(row, -1), generators[i])
        if p.logprobs:
            lps[i] = torch.log_softmax(row, -1).gather(0, tokens[i:i + 1])[0]
    return tokens.masked_fill(bad, 0), bad, lps


def _on(ids: list[int], device: torch.device) -> torch.Tensor:
    """ids as an int64 tensor on `device`, copied without waiting on the device's queue (a
    pageable copy to CUDA would synchronize with every kernel queued before it)."""
    t = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _penalize(row: torch.Tensor, history: list[int], penalty: float) -> None:
    # HF RepetitionPenaltyLogitsProcessor: positive logits / penalty, negative ones * penalty
    ids = _on(sorted(set(history)), row.device)
    vals = row[ids]
    row[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row [V] (already divided by the temperature) with filtered-out tokens at -inf."""
    if not p.filters:
        return row
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(row, -1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_row, order = torch.sort(row, descending=True)
        cum = torch.softmax(sorted_row, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_row, -1) >= p.top_p   # keep the token that crosses
        drop[0] = False
        # (scattered back as a mask: boolean indexing would read its count on the host)
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return row


def _draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token (a 0-dim device tensor) from probs [V] with this request's generator
    (exponential race: argmax of p / E, E ~ Exp(1), is a draw from p)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax()


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
