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
    ok (its token is -1)."""
    x = logits.to(torch.float32, copy=True)  # banned tokens / penalties edit it in place
    bad = torch.isnan(x).any(-1) | (x == float("inf")).any(-1) | ~torch.isfinite(x).any(-1)
    for i, ban in enumerate(banned or []):
        if ban:
            x[i, torch.tensor(ban, device=x.device)] = float("-inf")
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0 and histories[i]:
            _penalize(x[i], histories[i], p.repetition_penalty)
    # one device-to-host transfer for the common case: validity and argmax of every row
    flags, best = torch.stack([bad.long(), x.argmax(-1)]).tolist()
    ok = [not f for f in flags]
    tokens = [b if ok[i] and p.greedy else -1 for i, (b, p) in enumerate(zip(best, params))]
    logprobs: list[float | None] = [None] * len(params)
    for i, p in enumerate(params):
        if not ok[i]:
            continue
        if not p.greedy:
            row = _filter(x[i] / p.temperature, p)
            tokens[i] = _draw(torch.softmax(row, -1), generators[i])
        if p.logprobs:
            row = x[i] if p.greedy else _filter(x[i] / p.temperature, p)
            logprobs[i] = float(torch.log_softmax(row, -1)[tokens[i]])
    return tokens, logprobs, ok


def _penalize(row: torch.Tensor, history: list[int], penalty: float) -> None:
    # HF RepetitionPenaltyLogitsProcessor: positive logits / penalty, negative ones * penalty
    ids = torch.tensor(sorted(set(history)), device=row.device)
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
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def _draw(probs: torch.Tensor, generator) -> int:
    """One token from probs [V] with this request's generator (exponential race: argmax of
    p / E, E ~ Exp(1), is a draw from p)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e).argmax())


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
