"""Eviction between CUDA-graph decode steps, batched: every sequence that reached its budget +
interval - 1 in a step, every layer at once, with no host sync.

    left = evict_fronts(runtime, [(seq_id, book, budget), ...])   # the items it did not take

Each kv head of each layer keeps exactly `budget` tokens (policies with `keeps_budget`). The
kept tokens that sit at slots >= budget move into the holes below it, the i-th such token into
the i-th hole in slot order, so an event moves at most (stored - budget) tokens per head, not
the whole kept cache; the slots past `budget` are then dropped (pool.evict_tail). One pass
serves all items:

    pos   [R, H, Lmax]   logical index per slot of every (item, layer) row (-1 past a row's end)
    keep  [R, H, Lmax]   the policy's choice (policies.select_tokens on the stacked rows)
    src, dst [R, H, M]   M = max(stored - budget): the tail's kept slots and the holes they fill;
                         a row with fewer moves pads with its last slot onto itself (dropped
                         after, never a destination)

then per layer one gather and one scatter of each stored part, or for page- and channel-scaled
formats (fp8, fp4, int) a re-encode of the (page, head)s whose parameters a moved token changes
(compaction.move_slots_device, still with no sync), and the H2O mass rows of the store moved the
same way. The host only adds lengths and page lists.
A policy with kept scores (SnapKV(hold=True)) ranks by the books' `score` rows, the slots of
the steps stepped aside for ranked as decoded tokens (policies.DECODED + index), and the rows
move with the slots. Not taken (the runtime's per-sequence path does them): mixed policies in
one sequence, page granularity, a policy whose kept count is not its budget, fresh scores
shared by heads other than an observation in every layer (a SnapKV prompt's end: the runtime's
`_scores` shares them), formats `moves_on_device` does not take (residual pages, a registered
codec), heads of different counts across layers. Items are evicted in passes of at most
MAX_CELLS (page, head) cells.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from kvcompile.cache.compaction import (
    move_exact_at,
    move_planned,
    moves_exactly,
    moves_on_device,
    plan_at,
    plan_moves,
)
from kvcompile.eviction import policies as P

# (page, head) cells one batched pass re-encodes at most per layer and K / V (about 270 MB of
# fp32 pages at page 16, head_dim 128): more items are evicted in several passes
MAX_CELLS = 1 << 15


def _cells_a_row(moves: int, budget: int, page_size: int) -> int:
    """The destination (page, head) cells of one row's moves in a layer, at most (the bound
    compaction.move_slots_device's `max_cells` relies on): its real moves fill holes below
    its budget (ceil(budget / page_size) pages), its padding moves the last slot's page."""
    return min(moves, -(-budget // page_size) + 1)


def _policy(rt, sid, book=None):
    """The one policy of every layer of `sid`, if the batched path takes it, else None.
    Scores shared by a layer's heads are taken when they are kept scores (shared already) or
    when the book holds an observation for every layer (`EvictionRuntime._scores` shares
    them: the end of a prompt)."""
    pols = {rt.policy_of(sid, li) for li in rt.policies}
    if len(pols) != 1:
        return None
    policy = pols.pop()
    rules = P.rules_of(policy)
    observed = book is not None and set(book.obs) >= set(rt.policies)
    if (not rules.keeps_budget or getattr(policy, "granularity", "token") != "token"
            or (rules.shares_heads and rules.shares_heads(policy)
                and not P.kept_scores(policy) and not observed)):
        return None   # (kept scores are shared by the heads already: any head's row serves)
    return policy


def _upto(x: torch.Tensor, w: int) -> torch.Tensor:
    """x[..., :w], without the slice where x is that wide already (a slice costs host time:
    front.py takes one a sequence and layer)."""
    return x if x.shape[-1] == w else x[..., :w]


def _stack_rows(rows: list, width: int, fill: float) -> torch.Tensor:
    """[R, H, width] from rows [H, l_r], padded with `fill` past each row's length: one
    stack where the rows have one length (the usual case: sequences that evict together hold
    the same count), else a copy per row. (A copy per row and layer is a device launch each:
    2,000 at B16 x 61 layers.)"""
    if len({r.shape[-1] for r in rows}) == 1:
        out = torch.stack(rows)
        return torch.nn.functional.pad(out, (0, width - out.shape[-1]), value=fill)
    out = pad_sequence([r.T for r in rows], batch_first=True, padding_value=fill)
    out = torch.nn.functional.pad(out, (0, 0, 0, width - out.shape[1]), value=fill)
    return out.transpose(1, 2).contiguous()


def evict_fronts(rt, items: list) -> list:
    """Evict the items (seq id, _Book, budget) that the batched path takes; returns the rest."""
    pool = rt.state.pool
    layers = sorted(rt.policies)
    heads = {pool.layers[li].num_kv_heads for li in layers}
    if (not items or len(heads) != 1 or not all(moves_on_device(pool.k[li])
                                                and moves_on_device(pool.v[li])
                                                for li in layers)):
        return list(items)
    store = rt.store
    H = heads.pop()
    chunk, left, groups, cells = [], [], {}, 0
    for item in items:
        sid, book, budget = item
        policy = _policy(rt, sid, book)
        in_store = store is not None and sid in store.row_of
        if policy is None or (book.mass and not in_store and set(book.mass) != set(layers)):
            left.append(item)
            continue
        # a pass holds at most MAX_CELLS cells, so that a long prompt's end (a 32k prompt:
        # ~8,000 cells a sequence at 8 kv heads) does not make one transient of every
        # sequence's pages at once
        need = H * _cells_a_row(max(1, pool.seq_len(sid) - budget), budget, pool.page_size)
        if chunk and cells + need > MAX_CELLS:
            _evict(rt, pool, layers, H, chunk, groups)
            chunk, groups, cells = [], {}, 0
        chunk.append(item)
        groups.setdefault(policy, []).append(len(chunk) - 1)
        cells += need
    if chunk:
        _evict(rt, pool, layers, H, chunk, groups)
    return left


def _evict(rt, pool, layers, H, items, groups) -> None:
    dev, Ps, Ly = pool.device, pool.page_size, len(layers)
    store = rt.store
    n = len(items)
    stored = [pool.seq_len(sid) for sid, _b, _k in items]
    total = [pool.logical_len(sid) for sid, _b, _k in items]
    budget = [k for _s, _b, k in items]
    pending = [b.pending for _s, b, _k in items]
    Lmax = max(stored)
    M = max(L - k for L, k in zip(stored, budget))
    # [R, H, Lmax] logical index per slot (R = item-major, layer-minor); the slots of steps
    # stepped aside for are not in the books yet: row b's last `pending` slots hold positions
    # total - pending ... total - 1
    pos = _stack_rows([_upto(book.pos[li], L - k) for (_s, book, _b), L, k
                       in zip(items, stored, pending) for li in layers], Lmax, -1)   # [R, H, Lmax]
    starts = [b.start for _s, b, _k in items]   # (left padding: gone from the slots by now,
    # decode_aside; the sinks and positions still count from it)
    # each item's values repeated for its layers on the host: one copy to the device
    ints = torch.tensor([[x for x in col for _ in range(Ly)]
                         for col in (stored, pending, total, budget, starts)],
                        dtype=torch.int64).to(dev)
    L_r, k_r, T_r, K_r, S_r = (t[:, None, None] for t in ints)
    j = torch.arange(Lmax, device=dev)
    pos = torch.where((j >= L_r - k_r) & (j < L_r), T_r - L_r + j, pos)
    # H2O mass [R, H, Lmax]: the store's rows, or the books'
    mass = None
    in_store = [store is not None and sid in store.row_of for sid, _b, _k in items]
    if any(in_store) or any(b.mass for _s, b, _k in items):
        mass = torch.zeros(n, Ly, H, Lmax, dtype=torch.float32, device=dev)
        if any(in_store):
            srows = torch.tensor([store.row_of.get(sid, store.scratch) for sid, _b, _k in items],
                                 dtype=torch.int64).to(dev)
            w = min(Lmax, store.length)
            for i, li in enumerate(layers):
                mass[:, i, :, :w] = store.mass[li].index_select(0, srows)[:, :, :w]
        books = [b for b in range(n) if not in_store[b] and items[b][1].mass]
        if books:   # (every layer of a book has its mass row: evict_fronts takes no other)
            got = _stack_rows([_upto(items[b][1].mass[li], stored[b] - pending[b])
                               for b in books for li in layers], Lmax, 0.0)
            mass[torch.tensor(books, device=dev)] = got.view(len(books), Ly, H, Lmax)
        mass = mass.view(n * Ly, H, Lmax)
    # kept scores [R, H, Lmax] (SnapKV(hold=True)): the books' rows, the steps stepped aside
    # for ranked as decoded tokens; a book without them (never observed) ranks by recency
    kept, kept_rows = None, set()
    if any(P.kept_scores(pol) for pol in groups):
        for sid, book, _k in items:   # a fresh observation's scores are kept first
            if book.obs and P.kept_scores(rt.policy_of(sid, layers[0])):
                for li in layers:
                    rt._scores(sid, li, book)
        kept = pos.float()
        have = [(b * Ly + i, _upto(book.score[li], L - k))
                for b, ((_s, book, _k), L, k) in enumerate(zip(items, stored, pending))
                for i, li in enumerate(layers) if li in book.score]
        if len(have) == n * Ly and len({x.shape[-1] for _r, x in have}) == 1:
            w = have[0][1].shape[-1]   # every row has its scores, of one length: one copy
            kept[:, :, :w] = torch.stack([x for _r, x in have])
        else:
            for r, x in have:
                kept[r, :, :x.shape[-1]] = x
        kept = torch.where((j >= L_r - k_r) & (j < L_r), P.decoded_scores(pos), kept)
    # the policies' choice, one pass per policy over its rows
    keep = torch.zeros(n * Ly, H, Lmax, dtype=torch.bool, device=dev)
    for policy, idx in groups.items():
        r = torch.tensor([b * Ly + i for b in idx for i in range(Ly)], dtype=torch.int64,
                         device=dev)
        T_g = T_r.index_select(0, r)
        # (an int where every row starts alike, as a registered policy's rules may expect)
        S_g = starts[0] if len(set(starts)) == 1 else S_r.index_select(0, r)
        p = pos.index_select(0, r)
        scores = None
        if P.kept_scores(policy):
            kept_rows.update(idx)
            scores = kept.index_select(0, r)
        elif P.rules_of(policy).scores is not None and any(items[b][1].obs for b in idx):
            # observation scores (SnapKV; its engine decode steps do not evict): per row
            rows_s = []
            for b in idx:
                sid, book, _k = items[b]
                for li in layers:
                    sc = rt._scores(sid, li, book)
                    sc = sc if sc is not None else book.pos[li].float()
                    rows_s.append(sc[:, :Lmax].T)
            scores = pad_sequence(rows_s, batch_first=True).transpose(1, 2)
            scores = torch.nn.functional.pad(scores, (0, Lmax - scores.shape[-1]))
        elif P.rules_of(policy).scores is not None:
            m = mass.index_select(0, r) if mass is not None else None
            scores = P.token_scores(policy, m, None)
        keep[r] = P.select_tokens(policy, p, S_g, T_g, scores)
    # holes below the budget, and the kept slots at or past it, each in slot order: the i-th of
    # the tail fills the i-th hole; rows with fewer than M pad with their last slot
    hole = ~keep & (j < K_r)
    tail = keep & (j >= K_r)
    dst = torch.sort((~hole).to(torch.uint8), dim=-1, stable=True).indices[..., :M]
    src = torch.sort((~tail).to(torch.uint8), dim=-1, stable=True).indices[..., :M]
    moves = torch.minimum(tail.sum(-1, keepdim=True), hole.sum(-1, keepdim=True))
    valid = torch.arange(M, device=dev) < moves                                 # [R, H, M]
    last = (L_r - 1).expand_as(src)
    src = torch.where(valid, src, last)
    dst = torch.where(valid, dst, last)
    # book and mass follow the moves
    pos = pos.scatter(-1, dst, pos.gather(-1, src))
    if mass is not None:
        mass = mass.scatter(-1, dst, mass.gather(-1, src))
        mass = torch.where(j < K_r, mass, 0.0)
    if kept is not None:
        kept = kept.scatter(-1, dst, kept.gather(-1, src)).view(n, Ly, H, Lmax)
    # token index -> global slot through each sequence's block-table row (pages below the
    # budget that another sequence shares are copied first)
    for (sid, _b, _k), k in zip(items, budget):
        pool.make_private(sid, range(-(-k // Ps)))
    table = pool.table()
    trows = torch.tensor([pool.row_of(sid) for sid, _b, _k in items], dtype=torch.int64)
    bt = table.index_select(0, trows.to(dev)).to(torch.int64)                   # [n, W]
    bt = bt.repeat_interleave(Ly, 0)[:, None, :].expand(n * Ly, H, bt.shape[1])
    gsrc = bt.gather(-1, src // Ps) * Ps + src % Ps
    gdst = bt.gather(-1, dst // Ps) * Ps + dst % Ps
    hh = torch.arange(H, device=dev)[None, :, None].expand(n, H, M)
    gsrc, gdst = gsrc.view(n, Ly, H, M), gdst.view(n, Ly, H, M)
    real = valid.view(n, Ly, H, M)   # (the padding moves a token onto itself: no part in
    # a page scale's growth)
    cells = n * H * _cells_a_row(M, max(budget), Ps)
    coords = plans = None
    for i, li in enumerate(layers):
        here = None   # layer i's plan (views of `plans`), shared by its K and V pages
        for paged in (pool.k[li], pool.v[li]):
            if moves_exactly(paged):   # one gather and one scatter a part; the (page, slot)
                # of every layer's moves computed once; the padding moves are onto themselves
                if coords is None:
                    coords = (gsrc // Ps, gsrc % Ps, gdst // Ps, gdst % Ps)   # [n, Ly, H, M]
                move_exact_at(paged, *(c[:, i] for c in coords), hh)
                continue
            if plans is None:   # every layer's grouped moves planned at once ([Ly, n * H * M]
                # rows: one sort and scan, not one a layer), for its K and V pages
                flat = tuple(x.transpose(0, 1).reshape(Ly, -1).contiguous()   # (rows the
                             for x in (gsrc, gdst, real))   # move kernel reads densely)
                plans = plan_moves(*flat[:2], hh.reshape(-1), flat[2], Ps, H, max_cells=cells)
            here = plan_at(plans, i) if here is None else here
            move_planned(paged, here)
    # commit: lengths, books, the store's mass rows
    pos = pos.view(n, Ly, H, Lmax)
    if mass is not None:
        mass = mass.view(n, Ly, H, Lmax)
        if any(in_store):
            w = min(Lmax, store.length)
            for i, li in enumerate(layers):
                rows_m = store.mass[li].index_select(0, srows)
                rows_m[:, :, :w] = mass[:, i, :, :w]
                rows_m[:, :, w:] = 0
                store.mass[li].index_copy_(0, srows, rows_m)
    evicted = 0
    for b, ((sid, book, _k), L, k) in enumerate(zip(items, stored, budget)):
        pool.evict_tail(sid, k)
        evicted += L - k
        # each layer's row of item b: one slice and unbind an item, not a slice a layer
        book.pos.update(zip(layers, pos[b, :, :, :k].unbind(0)))
        if mass is not None and book.mass:   # (the store's row holds the same)
            book.mass.update(zip(layers, mass[b, :, :, :k].unbind(0)))
        if b in kept_rows:
            for li, row in zip(layers, kept[b, :, :, :k].unbind(0)):
                if li in book.score:
                    book.score[li] = row
        book.pending = 0
    st = rt.state
    st.count("eviction_runs", n)
    st.count("eviction_device_runs", n)
    st.count("evicted_tokens", evicted)
    st.count("eviction_moved_slots", n * Ly * H * M)
