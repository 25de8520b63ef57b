"""Which tokens each policy keeps (token and page granularity)."""

from __future__ import annotations

import pytest
import torch

from kvcompile.config import H2O, SinkWindow, SnapKV
from kvcompile.errors import KVConfigError
from kvcompile.eviction import policies as P


def _pos(L, heads=2):
    return torch.arange(L).expand(heads, L).clone()


def _kept(keep, pos, h=0):
    return sorted(pos[h][keep[h]].tolist())


def test_sink_window_keeps_sinks_and_window_and_drops_padding():
    pos = _pos(20)
    keep = P.select_tokens(SinkWindow(2, 5), pos, 0, 20, None)
    assert _kept(keep, pos) == [0, 1, 15, 16, 17, 18, 19]
    keep = P.select_tokens(SinkWindow(2, 5), pos, 3, 20, None)   # 3 tokens of left padding
    assert _kept(keep, pos) == [3, 4, 15, 16, 17, 18, 19]
    assert P.over_budget(SinkWindow(2, 5), pos, 0)
    assert not P.over_budget(SinkWindow(2, 18), pos, 0)
    holes = pos.clone()
    holes[:, 5:] = -1
    assert not P.over_budget(SinkWindow(2, 3), holes, 0)            # holes do not count


def test_h2o_keeps_heavy_hitters_per_head():
    pos = _pos(20)
    mass = torch.zeros(2, 20)
    mass[0, [5, 6, 7, 8]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    mass[1, [9, 10, 11, 12]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    keep = P.select_tokens(H2O(budget=7, recent=3, sinks=1), pos, 0, 20, mass)
    assert _kept(keep, pos, 0) == [0, 5, 6, 7, 17, 18, 19]
    assert _kept(keep, pos, 1) == [0, 9, 10, 11, 17, 18, 19]
    assert keep.sum(-1).tolist() == [7, 7]


def test_snapkv_pools_scores_and_can_share_one_selection():
    pos = _pos(24)
    obs = torch.zeros(2, 24)
    obs[0, 6] = 10.0     # head 0 looks at 6, head 1 at 12
    obs[1, 12] = 10.0
    per_head = SnapKV(budget=7, window=4, kernel=3, per_head=True)
    keep = P.select_tokens(per_head, pos, 0, 24, P.token_scores(per_head, None, obs))
    assert _kept(keep, pos, 0) == [5, 6, 7, 20, 21, 22, 23]          # neighbours pooled in
    assert _kept(keep, pos, 1) == [11, 12, 13, 20, 21, 22, 23]
    shared = SnapKV(budget=7, window=4, kernel=1, per_head=False)
    keep = P.select_tokens(shared, pos, 0, 24, P.token_scores(shared, None, obs))
    assert _kept(keep, pos, 0) == _kept(keep, pos, 1)                # one selection
    assert {6, 12, 20, 21, 22, 23} <= set(_kept(keep, pos, 0)) and keep.sum(-1).tolist() == [7, 7]


def _other_rank(part: torch.Tensor):
    """sum_heads of a rank holding head 0 whose peer holds head 1: adds the peer's part."""
    return lambda mine: mine + part


def test_shared_selections_over_heads_split_across_ranks():
    """Tensor parallelism (TensorParallel.sum_heads, here with the peer's part given): a rank
    holding one of the two heads chooses what the whole layer chooses, and only with the sum."""
    pos = _pos(24)
    obs = torch.zeros(2, 24)
    obs[0, 6], obs[0, 3], obs[1, 12], obs[1, 13] = 10.0, 5.0, 9.0, 8.0
    shared = SnapKV(budget=6, window=4, kernel=1, per_head=False)
    whole = P.select_tokens(shared, pos, 0, 24, P.token_scores(shared, None, obs))
    peer = P.token_scores(shared, None, obs[1:])[:1]                  # what rank 1 sends
    rank0 = P.select_tokens(shared, pos[:1], 0, 24,
                            P.token_scores(shared, None, obs[:1], _other_rank(peer)))
    assert _kept(rank0, pos, 0) == _kept(whole, pos, 0) == [6, 12, 20, 21, 22, 23]
    alone = P.select_tokens(shared, pos[:1], 0, 24, P.token_scores(shared, None, obs[:1]))
    assert _kept(alone, pos, 0) == [3, 6, 20, 21, 22, 23]            # without the sum: head 0's
    # page eviction: page scores (each head's normalized mass) summed over the ranks
    h = H2O(budget=24, recent=4, sinks=2, granularity="page")         # room for one page
    pos40, mass = _pos(40), torch.zeros(2, 40)
    mass[0, 9], mass[0, 26], mass[1, 17] = 1.0, 1.0, 1.0   # head 0: pages 1 and 3; head 1: 2
    whole = P.select_pages([h], [pos40], 0, 40, [mass], 8)
    s1 = mass[1:] / mass[1:].sum(-1, keepdim=True)
    peer = s1.view(1, 5, 8).sum((0, 2))[None]                         # [1, n_pages]
    rank0 = P.select_pages([h], [pos40[:1]], 0, 40, [mass[:1]], 8, _other_rank(peer))
    assert rank0.tolist() == whole.tolist() == [True, False, True, False, True]
    alone = P.select_pages([h], [pos40[:1]], 0, 40, [mass[:1]], 8)
    assert alone.tolist() != whole.tolist()


def test_select_pages_is_one_decision_for_all_layers():
    pos = _pos(40)
    pol = SinkWindow(2, 10, granularity="page")
    keep = P.select_pages([pol, pol], [pos, pos], 0, 40, [None, None], 8)
    assert keep.tolist() == [True, False, False, True, True]          # sinks, window, tail
    h = H2O(budget=24, recent=4, sinks=2, granularity="page")
    mass = torch.zeros(2, 40)
    mass[:, 17] = 5.0                                                 # page 2 is heavy
    keep = P.select_pages([h, h], [pos, pos], 0, 40, [mass, mass], 8)
    assert keep.tolist() == [True, False, True, False, True]


def test_snapkv_uses_the_last_window_queries_of_the_observation():
    pos = _pos(16)
    obs = torch.zeros(2, 4, 16)       # 4 observed queries: the first looks at 3, the last at 9
    obs[:, 0, 3] = 10.0
    obs[:, 3, 9] = 1.0
    last_only = SnapKV(budget=2, window=1, kernel=1, per_head=False)
    keep = P.select_tokens(last_only, pos, 0, 16, P.token_scores(last_only, None, obs))
    assert _kept(keep, pos) == [9, 15]
    four = SnapKV(budget=5, window=4, kernel=1, per_head=False)
    keep = P.select_tokens(four, pos, 0, 16, P.token_scores(four, None, obs))
    assert _kept(keep, pos) == [3, 12, 13, 14, 15]


def test_snapkv_defaults_are_the_measured_ones():
    # Changed from the published window=32, per_head=True: on SmolLM2-135M at 50% compression
    # that setting retrieved no passkey (it kept some digits of the key), a short window shared
    # by the heads of a layer retrieved every one (benchmarks/RESULTS.md, "Quality: eviction").
    d = SnapKV()
    assert (d.window, d.kernel, d.per_head) == (8, 5, False)


def test_kept_scores_rank_decoded_tokens_above_the_choice():
    """SnapKV(hold=True): the kept scores (normalized per head, <= 1) rank the prompt's tokens,
    every token stored after the choice ranks above them, newer above older; without `hold`
    a decode step does not evict (decode_budget None)."""
    hold = SnapKV(budget=6, window=2, kernel=1, per_head=False, hold=True)
    grow = SnapKV(budget=6, window=2, kernel=1, per_head=False)
    assert P.decode_budget(hold) == 6 and P.decode_budget(grow) is None
    assert P.decode_budget(SinkWindow(2, 4)) == 6 and P.decode_budget(None) is None
    assert P.kept_scores(hold) and not P.kept_scores(grow)
    pos = _pos(10)                     # 7 prompt tokens (0..6) chosen, 3 decoded (7..9)
    raw = torch.tensor([[5.0, 1.0, 9.0, 0.5, 7.0, 3.0, 2.0]]).expand(2, -1) * 100
    kept = P.kept_rank(raw, pos[:, :7], 0)
    assert torch.allclose(kept.sum(-1), torch.ones(2)) and bool((kept <= 1).all())
    score = torch.cat([kept, P.decoded_scores(pos[:, 7:])], 1)
    s = P.token_scores(hold, None, None, kept=score)
    assert s is score                                  # no observation: the kept scores
    keep = P.select_tokens(hold, pos, 0, 10, s)
    # window 2 protects 8, 9; decoded 7 outranks every prompt token; then 2, 4, 0 by score
    assert _kept(keep, pos) == [0, 2, 4, 7, 8, 9]
    # a fresh observation wins over kept scores; a policy without kept scores ignores them
    obs = torch.zeros(2, 2, 10)
    obs[:, -1, 1] = 1.0
    assert P.token_scores(hold, None, obs, kept=score)[0, 1] > 0
    assert P.token_scores(grow, None, None, kept=score) is None
    assert P.kept_rank(raw, torch.tensor([[-1, 1, 2, 3, 4, 5, 6]]).expand(2, -1), 0)[0, 0] == 0


def test_snapkv_hold_is_validated():
    with pytest.raises(KVConfigError, match="eviction.hold"):
        SnapKV(budget=8, hold="yes")
    with pytest.raises(KVConfigError, match="eviction.per_head"):
        SnapKV(budget=8, per_head=1)
    assert SnapKV(budget=8, hold=True).hold is True and SnapKV().hold is False
