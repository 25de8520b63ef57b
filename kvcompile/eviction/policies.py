"""Which tokens each policy keeps: pure functions over one layer's bookkeeping.

Every function takes `pos [H, L]`, the logical index of the token in each stored slot of each kv
head (-1 for a hole, an evicted slot not yet reused), and `start`, the first logical index that
is a real token (left padding before it). It returns `keep [H, L]` bool. A policy evicts only
when a sequence holds more real tokens than its budget; padding is dropped at the first eviction.

    SinkWindow(sinks, window)     the first `sinks` real tokens + the last `window` tokens
    H2O(budget, recent, sinks)    sinks + recent + the highest accumulated attention mass
    SnapKV(budget, window, kernel, per_head)
                                  the last `window` tokens + the highest pooled attention from
                                  the last `window` queries of the latest multi-token forward
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompile.config import H2O, EvictionPolicy, SinkWindow, SnapKV


def budget_of(policy: EvictionPolicy) -> int:
    if isinstance(policy, SinkWindow):
        return policy.sinks + policy.window
    return policy.budget


def real_tokens(pos: torch.Tensor, start: int) -> torch.Tensor:
    # pos [H, L] -> [H] tokens held per head (holes and padding excluded)
    return (pos >= start).sum(-1)


def over_budget(policy: EvictionPolicy, pos: torch.Tensor, start: int) -> bool:
    return int(real_tokens(pos, start).max()) > budget_of(policy)


def protected(policy: EvictionPolicy, pos: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """[H, L] bool: tokens the policy keeps whatever their score (sinks, recent window)."""
    real = pos >= start
    if isinstance(policy, SinkWindow):
        return real & ((pos - start < policy.sinks) | (pos >= total - policy.window))
    if isinstance(policy, H2O):
        return real & ((pos - start < policy.sinks) | (pos >= total - policy.recent))
    if isinstance(policy, SnapKV):
        return real & (pos >= total - policy.window)
    raise TypeError(f"unknown eviction policy {policy!r}")


def token_scores(policy: EvictionPolicy, mass: torch.Tensor | None,
                 obs: torch.Tensor | None) -> torch.Tensor | None:
    """[H, L] fp32 score of each slot (higher = keep), or None (SinkWindow keeps by position)."""
    if isinstance(policy, H2O):
        return mass
    if isinstance(policy, SnapKV):
        if obs is None:
            return None
        if obs.dim() == 3:  # [H, R, L]: attention of each of the last R queries
            obs = obs[:, -policy.window:].sum(1)
        k = policy.kernel
        pooled = F.avg_pool1d(obs[:, None], k, stride=1, padding=k // 2,
                              count_include_pad=False)[:, 0]
        if not policy.per_head:
            pooled = pooled.sum(0, keepdim=True).expand_as(pooled)
        return pooled
    return None


def select_tokens(policy: EvictionPolicy, pos: torch.Tensor, start: int, total: int,
                  scores: torch.Tensor | None) -> torch.Tensor:
    """keep [H, L] bool with at most budget tokens per head (token granularity)."""
    real = pos >= start
    keep = protected(policy, pos, start, total)
    if isinstance(policy, SinkWindow):
        return keep
    room = budget_of(policy) - keep.sum(-1)                       # [H]
    if scores is None:  # SnapKV without an observation: keep the most recent
        scores = pos.float()
    cand = torch.where(real & ~keep, scores.float(), float("-inf"))
    order = cand.argsort(-1, descending=True)                     # [H, L]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=pos.device).expand_as(order))
    take = (rank < room[:, None].clamp(min=0)) & torch.isfinite(cand)
    return keep | take


def select_pages(policies: list, poss: list, start: int, total: int, scores: list,
                 page_size: int) -> torch.Tensor:
    """Page granularity: one decision for all layers (one block table serves them all).

    policies / poss / scores: per layer. Returns keep [n_pages] bool. A page is protected when
    any layer protects a token in it; the rest are ranked by the layers' scores (each layer's
    normalized to sum 1 per head, summed over the page's slots), and kept while the kept pages
    hold at most max(budget) tokens (rounded up to whole pages)."""
    L = poss[0].shape[-1]
    n_pages = -(-L // page_size)
    pad = n_pages * page_size - L
    prot = torch.zeros(n_pages, dtype=torch.bool, device=poss[0].device)
    score = torch.zeros(n_pages, dtype=torch.float32, device=poss[0].device)
    budget = 0
    for policy, pos, sc in zip(policies, poss, scores):
        budget = max(budget, budget_of(policy))
        pr = F.pad(protected(policy, pos, start, total), (0, pad))
        prot |= pr.view(pos.shape[0], n_pages, page_size).any(-1).any(0)
        if sc is not None:
            s = torch.where(pos >= start, sc.float(), 0.0)
            s = s / s.sum(-1, keepdim=True).clamp(min=1e-30)
            score += F.pad(s, (0, pad)).view(pos.shape[0], n_pages, page_size).sum((0, 2))
    prot[-1] = True  # the last page is where the sequence grows
    keep = prot.clone()
    room = -(-budget // page_size) - int(prot.sum())
    if room > 0 and scores and any(s is not None for s in scores):
        cand = torch.where(prot, float("-inf"), score)
        top = cand.topk(min(room, n_pages)).indices
        keep[top[torch.isfinite(cand[top])]] = True
    return keep
