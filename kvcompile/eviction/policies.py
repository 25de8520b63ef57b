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

The eviction runtime (runtime.py) asks a policy only through `rules_of(policy)`: a registry
keyed by the policy's config type, as torchao keys its transforms by config type. A new policy
is a frozen dataclass subclassing `kvcompile.EvictionPolicy` plus one
`register_policy(MyPolicy, PolicyRules(...))` (docs/adding-a-policy.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompile.config import H2O, EvictionPolicy, SinkWindow, SnapKV
from kvcompile.errors import KVConfigError


@dataclass(frozen=True)
class PolicyRules:
    """What the eviction runtime needs from one policy type. Every callable takes the policy
    (the config instance) first.

    budget(policy) -> int: tokens a sequence keeps per kv head; it evicts when it holds more.
    protected(policy, pos [H, L], start, total) -> [H, L] bool: tokens kept whatever their
        score (pos: logical index per slot, -1 a hole; start: the first real token; total:
        the sequence's logical length).
    scores(policy, mass [H, L] | None, obs [H, L] | [H, R, L] | None) -> [H, L] | None: the
        rank of the other tokens (higher = keep; None: by recency). None for a policy that
        keeps by position only (then nothing but `protected` is kept).
    accumulates_mass: the runtime adds each decode step's attention probabilities per slot
        (`mass`, what H2O ranks by).
    observe_rows(policy) -> int: how many of the last queries of a multi-token forward have
        their attention recorded (`obs`, what SnapKV ranks by); None: none.
    waits_for_observation: evict only after such an observed forward (SnapKV chooses at the
        end of prefill).
    rerotated_sinks(policy) -> int: the leading tokens kept as sinks whose keys the runtime
        re-rotates to sit just before the kept window (KVConfig `sink_positions="cache"`);
        None: sinks, if any, keep their positions.
    keeps_budget: every kv head keeps exactly `budget` tokens when it holds more, so an
        eviction between CUDA-graph decode steps knows the new length without reading the
        device (eviction/front.py).
    window(policy) -> (sinks, window): the policy keeps the first `sinks` tokens and the last
        `window`, by position only, the same in every head, so a sequence evicts it without
        moving a token (eviction/runtime.py `_evict_window`); None: it keeps by other rules.
    shares_heads(policy) -> bool: one selection for all kv heads of a layer: `scores` returns
        each head's scores and `token_scores` sums them over every kv head of the layer, on
        every tensor-parallel rank (`sum_heads`), so that all ranks keep the same tokens.
    kept_scores(policy) -> bool: the scores of an observed choice are kept per slot (the
        runtime's `_Book.score`, normalized by `kept_rank`) and rank the slots whenever the
        sequence evicts without a new observation (decode steps), with every token stored
        after the choice ranked above them, newer above older (`DECODED`). Such a policy
        evicts while decoding, so its budget holds (SnapKV(hold=True)); False: a policy that
        waits for an observation does not evict between observations.
    """
    budget: Callable
    protected: Callable
    scores: Callable | None = None
    accumulates_mass: bool = False
    observe_rows: Callable | None = None
    waits_for_observation: bool = False
    rerotated_sinks: Callable | None = None
    keeps_budget: bool = False
    shares_heads: Callable | None = None
    window: Callable | None = None
    kept_scores: Callable | None = None


_RULES: dict[type, PolicyRules] = {}


def register_policy(policy_type: type, rules: PolicyRules) -> None:
    """Run policies of `policy_type` (an EvictionPolicy subclass) by `rules`."""
    if not (isinstance(policy_type, type) and issubclass(policy_type, EvictionPolicy)):
        raise TypeError(f"register_policy: {policy_type!r} is not an EvictionPolicy subclass")
    if not isinstance(rules, PolicyRules):
        raise TypeError(f"register_policy: rules must be PolicyRules, got "
                        f"{type(rules).__name__}")
    _RULES[policy_type] = rules


def unregister_policy(policy_type: type) -> None:
    if policy_type in (SinkWindow, H2O, SnapKV):
        raise KVConfigError("eviction", policy_type.__name__, "a registered, non-built-in policy")
    _RULES.pop(policy_type, None)


def rules_of(policy: EvictionPolicy) -> PolicyRules:
    """The rules of `policy`'s type (or of its nearest registered base type)."""
    for t in type(policy).__mro__:
        if t in _RULES:
            return _RULES[t]
    raise KVConfigError("eviction", policy, "an instance of a registered policy type: "
                        + ", ".join(t.__name__ for t in _RULES),
                        hint="Register its type with kvcompile.eviction.policies."
                             "register_policy (docs/adding-a-policy.md).")


def budget_of(policy: EvictionPolicy) -> int:
    return rules_of(policy).budget(policy)


def accumulates_mass(policy: EvictionPolicy | None) -> bool:
    return policy is not None and rules_of(policy).accumulates_mass


def observe_rows(policy: EvictionPolicy | None) -> int:
    rows = policy is not None and rules_of(policy).observe_rows
    return rows(policy) if rows else 0


def waits_for_observation(policy: EvictionPolicy) -> bool:
    return rules_of(policy).waits_for_observation


def rerotated_sinks(policy: EvictionPolicy | None) -> int:
    sinks = policy is not None and rules_of(policy).rerotated_sinks
    return sinks(policy) if sinks else 0


def keeps_budget(policy: EvictionPolicy) -> bool:
    return rules_of(policy).keeps_budget


def kept_scores(policy: EvictionPolicy | None) -> bool:
    """The policy keeps its last choice's scores per slot and evicts by them while decoding."""
    kept = policy is not None and rules_of(policy).kept_scores
    return bool(kept and kept(policy))


def decode_budget(policy: EvictionPolicy | None) -> int | None:
    """The budget a decoding sequence is held to (None: decode steps do not evict: no policy,
    or one that chooses only after an observation and keeps no scores)."""
    if policy is None or (waits_for_observation(policy) and not kept_scores(policy)):
        return None
    return budget_of(policy)


# Score of a token stored after the kept choice (a decoded token): DECODED + its logical
# index, above every kept score (<= 1, `kept_rank`), newer above older; exact in fp32 for
# indices below 2**24 - DECODED.
DECODED = 2.0


def kept_rank(scores: torch.Tensor, pos: torch.Tensor, start: int) -> torch.Tensor:
    """[H, L] scores of a choice as kept per slot: each head's real tokens normalized to sum
    1 (so every kept score is <= 1 < DECODED; the order within a head is unchanged), 0 for
    holes and padding."""
    s = torch.where(pos >= start, scores.float().clamp(min=0), 0.0)
    return s / s.sum(-1, keepdim=True).clamp(min=1e-30)


def decoded_scores(pos: torch.Tensor) -> torch.Tensor:
    """Kept-score rank of tokens stored after the choice, from their logical indices."""
    return pos.float() + DECODED


def window_of(policy: EvictionPolicy | None) -> tuple[int, int] | None:
    """(sinks, window) of a policy that keeps those by position only, else None."""
    w = policy is not None and rules_of(policy).window
    return w(policy) if w else None


def real_tokens(pos: torch.Tensor, start: int) -> torch.Tensor:
    # pos [H, L] -> [H] tokens held per head (holes and padding excluded)
    return (pos >= start).sum(-1)


def over_budget(policy: EvictionPolicy, pos: torch.Tensor, start: int) -> bool:
    return int(real_tokens(pos, start).max()) > budget_of(policy)


def protected(policy: EvictionPolicy, pos: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """[H, L] bool: tokens the policy keeps whatever their score (sinks, recent window)."""
    return rules_of(policy).protected(policy, pos, start, total)


def token_scores(policy: EvictionPolicy, mass: torch.Tensor | None,
                 obs: torch.Tensor | None, sum_heads: Callable | None = None,
                 kept: torch.Tensor | None = None) -> torch.Tensor | None:
    """[H, L] fp32 score of each slot (higher = keep), or None (SinkWindow keeps by position).
    sum_heads: [1, L] -> [1, L], the sum over the other tensor-parallel ranks' heads too
    (TensorParallel.sum_heads); None on one rank. kept: the slots' kept scores of a policy
    with `kept_scores` (already shared by heads and ranks where the policy shares them),
    which rank the slots when there is no new observation."""
    rules = rules_of(policy)
    if rules.scores is None:
        return None
    if obs is None and kept is not None and kept_scores(policy):
        return kept
    s = rules.scores(policy, mass, obs)
    if s is None or not (rules.shares_heads and rules.shares_heads(policy)):
        return s
    shared = s.sum(0, keepdim=True)                               # [1, L]
    if sum_heads is not None:
        shared = sum_heads(shared)
    return shared.expand_as(s)


def select_tokens(policy: EvictionPolicy, pos: torch.Tensor, start: int, total: int,
                  scores: torch.Tensor | None) -> torch.Tensor:
    """keep [H, L] bool with at most budget tokens per head (token granularity). Batched rows
    [R, H, L] too (eviction/front.py), with `total` a tensor [R, 1, 1]."""
    real = pos >= start
    keep = protected(policy, pos, start, total)
    if rules_of(policy).scores is None:   # keeps by position only (SinkWindow)
        return keep
    room = budget_of(policy) - keep.sum(-1)                       # [H]
    if scores is None:  # SnapKV without an observation: keep the most recent
        scores = pos.float()
    cand = torch.where(real & ~keep, scores.float(), float("-inf"))
    order = cand.argsort(-1, descending=True)                     # [H, L]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=pos.device).expand_as(order))
    take = (rank < room[..., None].clamp(min=0)) & torch.isfinite(cand)
    return keep | take


def select_pages(policies: list, poss: list, start: int, total: int, scores: list,
                 page_size: int, sum_heads: Callable | None = None) -> torch.Tensor:
    """Page granularity: one decision for all layers (one block table serves them all).

    policies / poss / scores: per layer. Returns keep [n_pages] bool. A page is protected when
    any layer protects a token in it; the rest are ranked by the layers' scores (each layer's
    normalized to sum 1 per head, summed over the page's slots), and kept while the kept pages
    hold at most max(budget) tokens (rounded up to whole pages). sum_heads: the page scores
    summed over the other tensor-parallel ranks' heads too (None on one rank)."""
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
    if sum_heads is not None and any(s is not None for s in scores):
        score = sum_heads(score[None])[0]
    prot[-1] = True  # the last page is where the sequence grows
    keep = prot.clone()
    room = -(-budget // page_size) - int(prot.sum())
    if room > 0 and scores and any(s is not None for s in scores):
        cand = torch.where(prot, float("-inf"), score)
        top = cand.topk(min(room, n_pages)).indices
        keep[top[torch.isfinite(cand[top])]] = True
    return keep


# --- the built-in policies ---------------------------------------------------------------------

def _sink_window_protected(p: SinkWindow, pos, start, total):
    return (pos >= start) & ((pos - start < p.sinks) | (pos >= total - p.window))


def _h2o_protected(p: H2O, pos, start, total):
    return (pos >= start) & ((pos - start < p.sinks) | (pos >= total - p.recent))


def _snapkv_protected(p: SnapKV, pos, start, total):
    return (pos >= start) & (pos >= total - p.window)


def _snapkv_scores(p: SnapKV, mass, obs):
    if obs is None:
        return None
    if obs.dim() == 3:  # [H, R, L]: attention of each of the last R queries
        obs = obs[:, -p.window:].sum(1)
    k = p.kernel
    pooled = F.avg_pool1d(obs[:, None], k, stride=1, padding=k // 2,
                          count_include_pad=False)[:, 0]
    return pooled   # per_head=False: summed over the layer's heads by token_scores


register_policy(SinkWindow, PolicyRules(
    budget=lambda p: p.sinks + p.window, protected=_sink_window_protected,
    rerotated_sinks=lambda p: p.sinks, keeps_budget=True,
    window=lambda p: (p.sinks, p.window)))
register_policy(H2O, PolicyRules(
    budget=lambda p: p.budget, protected=_h2o_protected, scores=lambda p, mass, obs: mass,
    accumulates_mass=True, keeps_budget=True))
register_policy(SnapKV, PolicyRules(
    budget=lambda p: p.budget, protected=_snapkv_protected, scores=_snapkv_scores,
    observe_rows=lambda p: p.window, waits_for_observation=True, keeps_budget=True,
    shares_heads=lambda p: not p.per_head, kept_scores=lambda p: p.hold))
