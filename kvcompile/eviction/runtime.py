"""The eviction runtime: per-sequence bookkeeping, attention over kept tokens, and eviction.

One `EvictionRuntime` per compiled model, installed by the eviction pass (passes/eviction.py)
as a `RuntimeHook` (runtime/hooks.py). Per forward:

    before_write(layer)     logical index of each new token -> its slot (book.pos[layer])
    attend_kept(layer)      attention over the kept slots by logical position (attend.py),
                            accumulating H2O mass / SnapKV observation scores
    after_forward()         for each sequence over budget: choose (policies.py), then
                            token granularity: compact each (layer, head) into slots [0, n) by
                            moving the kept tokens of the tail into holes (pool.move_tokens),
                            and free the tail (pool.evict_tail);
                            page granularity: drop whole pages, one decision for all layers
                            (pool.evict_pages); no data moves
                            a window kept by position (SinkWindow, sinks at their text
                            positions): no data moves either (`_evict_window`): the pages
                            between the sinks and the window leave the sequence, the
                            tokens left between them are hidden from attention

Shapes inside the graph never change: only block tables and sequence lengths do. The model's
cache object keeps its logical length (`pool.logical_len`), so positions and masks follow the
text, not the cache.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvcompile.cache.compaction import moves_on_device
from kvcompile.config import EvictionPolicy
from kvcompile.errors import CacheStateError, UnsupportedShapeError
from kvcompile.eviction import policies as P
from kvcompile.eviction.aside import (
    AsideSpec,
    MassStore,
    attend_aside,
    attend_aside_latent,
    store_length,
)
from kvcompile.eviction.attend import attend_kept, rotation
from kvcompile.eviction.attend import prompt_mass as prompt_mass_torch
from kvcompile.eviction.front import evict_fronts
from kvcompile.kernels import masks
from kvcompile.kernels.masks import to_bool
from kvcompile.runtime.hooks import RuntimeHook

# Elements of an MLA layer's absorbed query ([H, rows, r + dr]) made at a time for the prompt
# scores of eviction (H2O's prompt mass): 128 Mi (256 MiB in bf16; 1,820 rows at DeepSeek-V3's
# 128 heads x 576), where the whole prompt's would be 4.8 GB a sequence at 32k.
ABSORB_ELEMENTS = 1 << 27

log = logging.getLogger("kvcompile")

_UNSET = object()   # (detach: a sequence without a per-sequence policy)

# Positions of kept sink tokens (SinkWindow): "cache" re-rotates them to sit just before the
# window, as StreamingLLM assigns positions within the cache; "original" leaves them where the
# text put them (their distance to the query grows without bound). See docs/architecture.md,
# "Eviction", for the measurement behind the default.
SINK_POSITIONS = ("cache", "original")


class _Book:
    """Bookkeeping of one sequence: per policy layer, the logical index in each slot
    (pos [Hkv, L] int64, -1 = hole), H2O mass [Hkv, L], SnapKV observation [Hkv, R, L], and
    the kept scores of a policy that evicts by its last choice while decoding (score [Hkv, L]
    fp32, policies.kept_rank; tokens stored since: policies.DECODED + their index)."""

    __slots__ = ("pos", "mass", "obs", "score", "start", "carry", "pending", "ragged",
                 "window", "stale", "holes", "padded")

    def __init__(self, start: int):
        self.pos: dict[int, torch.Tensor] = {}
        self.mass: dict[int, torch.Tensor] = {}
        self.obs: dict[int, torch.Tensor] = {}
        self.score: dict[int, torch.Tensor] = {}
        self.start = start  # first logical index that is a real token (left padding)
        # the last forward was held (the middle of an engine prompt): its observation rows
        # continue into the next forward's, as if both had been one forward
        self.carry = False
        # slots appended by decode steps the runtime stepped aside for (CUDA-graph replays):
        # one token per step, so their logical indices are known without recording them
        self.pending = 0
        # kept counts differ between heads or layers (holes): decode needs per-slot rules
        self.ragged = False
        # (lo, hi): a window evicted without moving tokens (`_evict_window`): stored slots
        # [0, lo) hold the sinks, [lo, hi) are hidden, slot i >= hi holds logical index
        # i + dropped (pool.dropped); the same in every layer and head. None: pos says.
        self.window: tuple[int, int] | None = None
        # pos is not built (a window book between evictions): `_catch_up` builds it
        self.stale = False
        # the prompt's mask was not causal + left padding (holes inside it, per-head rules):
        # its decode steps apply it by logical index, never replayed over the bare slots
        self.holes = False
        # slots may hold left padding (pos < start): a per-slot rule. False once an
        # eviction left none in any layer (`evict`: token-granular policies never keep
        # padding), so that the decode steps need no rule for it (`decode_aside`,
        # `_kernel_slots`); `start` keeps its meaning for the sinks and the positions
        self.padded = start > 0

    def per_slot(self) -> tuple:
        """The per-slot fp32 rows that follow their tokens when slots move or go (H2O mass,
        kept scores): {layer: [Hkv, L]} each."""
        return self.mass, self.score

    def copy(self) -> _Book:
        b = _Book(self.start)
        b.carry, b.pending, b.ragged = self.carry, self.pending, self.ragged
        b.window, b.stale, b.holes, b.padded = self.window, self.stale, self.holes, self.padded
        b.pos = {k: v.clone() for k, v in self.pos.items()}
        b.mass = {k: v.clone() for k, v in self.mass.items()}
        b.obs = {k: v.clone() for k, v in self.obs.items()}
        b.score = {k: v.clone() for k, v in self.score.items()}
        return b


# after_forward's evictions through the batched pass on the CPU too (tests; see `_batched`)
BATCH_ON_CPU = False


class _Facts(NamedTuple):
    """What the decode steps stepped aside for ask of one sequence's policies, at every step:
    worked out once (`EvictionRuntime._facts_of`), not per layer and step."""
    pols: tuple                 # the policy of each managed layer
    rerot: int                  # re-rotated sinks (0: none)
    uniform: bool               # one policy in every layer, token granularity
    mass: bool                  # a layer accumulates H2O mass
    mass_budget: int            # the largest budget of those layers (0: none)
    budget: int | None          # the budget decode steps evict to (`_decode_budget`)
    window: EvictionPolicy | None   # the policy if it evicts as a window (`_window_policy`)


class EvictionRuntime(RuntimeHook):
    def __init__(self, state):
        self.state = state
        self.policies: dict[int, EvictionPolicy] = {}   # layer index -> policy
        self.inv_freq: torch.Tensor | None = None       # RoPE frequencies, for sink positions
        self.sink_positions = "cache"
        self.books: dict[int, _Book] = {}
        # Per-sequence overrides (engine requests, side-by-side evaluation of policies on
        # forks of one prefill): the policy of every managed layer, and sink positions.
        self.seq_policy: dict[int, EvictionPolicy | None] = {}
        self.seq_sink_positions: dict[int, str] = {}
        # > 0: every managed layer records H2O mass and SnapKV observation scores (window of
        # this many queries) for every sequence, so that forks can be evicted by any policy.
        self.observe_all = 0
        # sequences whose next after_forward must not evict: an engine prompt computed in
        # chunks attends fully until its last chunk, as one forward would (`hold`)
        self.held: set[int] = set()
        # sequences whose next after_forward follows a decode step (the engine sets it, as
        # `held`): they evict every `interval` steps (`_due`), as the aside steps do
        self.decoding: set[int] = set()
        # decode steps evict when a sequence holds budget + interval - 1 tokens: 1 evicts
        # after every step (KVConfig.eviction_interval; the engine's eviction_interval)
        self.interval = getattr(state.config, "eviction_interval", 1)
        self.windowed = False   # a managed layer has a sliding window (a per-slot rule)
        # H2O mass of the sequences decoding aside (aside.py), made at the first such step;
        # `aside_rows` sequences at most (the engine's max_num_seqs)
        self.store: MassStore | None = None
        self.aside_rows = 256
        self._inv_freq_dev: dict = {}
        self._said: set[str] = set()
        self._pool = None
        self._facts: dict[int, _Facts] = {}
        self._facts_key = None
        self._latent_of = (-1, frozenset())   # `latent`, derived per count of policies

    def set_sequence_policy(self, seq_id: int, policy: EvictionPolicy | None,
                            sink_positions: str | None = None) -> None:
        """Evict `seq_id` with `policy` (None: never) in every layer that has a policy."""
        if sink_positions is not None and sink_positions not in SINK_POSITIONS:
            raise ValueError(f"sink_positions={sink_positions!r}: one of {SINK_POSITIONS}")
        self.seq_policy[seq_id] = policy
        if sink_positions is not None:
            self.seq_sink_positions[seq_id] = sink_positions
        self._facts.pop(seq_id, None)

    def hold(self, seq_ids) -> None:
        """The next forward of these sequences is a chunk in the middle of a prompt: nothing
        is evicted after it, and SnapKV's observation rows carry into the next chunk, so a
        prompt chunked any way evicts as the prompt in one forward does (the engine)."""
        self.held = set(seq_ids)

    def policy_of(self, seq_id: int, layer: int) -> EvictionPolicy | None:
        if layer not in self.policies:
            return None
        if seq_id in self.seq_policy:
            return self.seq_policy[seq_id]
        return self.policies[layer]

    # -- layout decisions ---------------------------------------------------------------------
    @property
    def page_mode(self) -> bool:
        return self.page_mode_of(None)

    def page_mode_of(self, seq_id: int | None) -> bool:
        """Whole pages can be dropped only if every layer evicts at page granularity."""
        n_layers = len(self.state.layer_specs)
        pols = [self.policies[li] if seq_id is None else self.policy_of(seq_id, li)
                for li in self.policies]
        return (n_layers > 0 and len(self.policies) == n_layers
                and all(getattr(p, "granularity", "token") == "page" for p in pols))

    def _rerotate(self, sid: int, policy) -> bool:
        where = self.seq_sink_positions.get(sid, self.sink_positions)
        if (where == "cache" and self.latent and self.inv_freq is not None
                and P.rerotated_sinks(policy) > 0):
            self._say("eviction: latent (MLA) layers keep SinkWindow's sinks at their text "
                      "positions (re-rotating a latent layer's rotary key is not implemented)")
            return False
        return (where == "cache" and self.inv_freq is not None
                and P.rerotated_sinks(policy) > 0)

    @property
    def latent(self) -> frozenset:
        """The managed layers that are MLA layers (`layer_meta`'s "latent", passes/
        site_formats.py): their pages hold the latent (keys) and the rotary key (values), and
        attention over kept slots runs in the latent space (`_kv`), on the host path or over
        their stored slots (runtime/dispatch.py `attend_latent`). Derived again only when the
        set of policies grows."""
        n, layers = self._latent_of
        if n != len(self.policies):
            meta = getattr(self.state, "layer_meta", None) or []
            layers = frozenset(li for li in self.policies
                               if li < len(meta) and meta[li].get("latent"))
            self._latent_of = (len(self.policies), layers)
        return layers

    def _kv(self, layer: int, sid: int):
        """(keys [Hkv, L, D], values [Hkv, L, Dv]) of a sequence's stored slots in fp32, as
        its attention sees them: the pages, or for an MLA layer (latent c, rotary key r) the
        absorbed form's keys [c, r] and values c (the query comes absorbed)."""
        k, v = self.state.pool.gather(layer, sid)
        if layer in self.latent:
            return torch.cat([k, v], -1), k
        return k, v

    def _out_dim(self, layer: int) -> int:
        pool = self.state.pool
        return pool.k[layer].head_dim if layer in self.latent else pool.v[layer].head_dim

    # -- bookkeeping ----------------------------------------------------------------------------
    def _watch(self, pool) -> None:
        if pool is not self._pool:
            pool.fork_listeners.append(self._on_fork)
            pool.free_listeners.append(self._forget)
            self._pool = pool
            self.books.clear()

    def release(self) -> None:
        """kvcompile.release(model): the pool goes, and every sequence's bookkeeping with it."""
        self._pool = None
        self.books.clear()
        self.store = None

    def detach(self, seq_id: int):
        """The bookkeeping of `seq_id` (its book, policy and sink positions), taken out before the
        pool frees the sequence to swap it out (engine/scheduler.py `swap_aside`); `attach`
        gives it to the sequence swapped back in. None if it has none."""
        book = self.books.get(seq_id)
        if book is not None and self.state.pool is not None and self.state.pool.has(seq_id):
            self._catch_up(seq_id, book)
            self._pull_mass(seq_id, book, self.state.pool.seq_len(seq_id))
        saved = (self.books.pop(seq_id, None), self.seq_policy.pop(seq_id, _UNSET),
                 self.seq_sink_positions.pop(seq_id, None))
        self._facts.pop(seq_id, None)
        return saved if saved[0] is not None or saved[1] is not _UNSET else None

    def attach(self, seq_id: int, saved) -> None:
        """`detach`'s bookkeeping, for the sequence `seq_id` that now holds the same tokens."""
        if saved is None:
            return
        book, policy, sinks = saved
        if book is not None:
            self.books[seq_id] = book
        if policy is not _UNSET:
            self.seq_policy[seq_id] = policy
        if sinks is not None:
            self.seq_sink_positions[seq_id] = sinks
        self._facts.pop(seq_id, None)

    def _forget(self, seq_id: int) -> None:
        """The pool freed `seq_id`: its bookkeeping and per-sequence settings go with it."""
        self.books.pop(seq_id, None)
        self.seq_policy.pop(seq_id, None)
        self.seq_sink_positions.pop(seq_id, None)
        self._facts.pop(seq_id, None)
        if self.store is not None:
            self.store.give_back(seq_id)

    def _on_fork(self, parent: int, child: int) -> None:
        if parent in self.books:
            book = self.books[parent]
            self._catch_up(parent, book)
            self._pull_mass(parent, book, self.state.pool.seq_len(parent))
            self.books[child] = book.copy()

    def _rows(self, plan):
        """(row, seq id, stored tokens before, new tokens) of each sequence of the plan."""
        for i, sid in enumerate(plan.seq_ids):
            n = plan.q_lens[i] if plan.packed else plan.new_tokens
            yield i, sid, plan.past_lens[i], n

    def _catch_up(self, sid: int, book: _Book, reserved: int = 0) -> None:
        """Record the slots of the decode steps stepped aside for (`book.pending`, the last
        stored slots before the `reserved` ones of the running forward); a window book's
        positions are built from its layout."""
        if book.stale:
            self._build_window_pos(sid, book, reserved)
            return
        k = book.pending
        if not k:
            return
        book.pending = 0
        pool = self.state.pool
        stored, end = pool.seq_len(sid) - reserved, pool.logical_len(sid) - reserved
        for layer, pos in book.pos.items():
            new = torch.arange(end - k, end, device=pos.device).expand(pos.shape[0], k)
            book.pos[layer] = torch.cat([pos[:, :stored - k], new], 1)
            if layer in book.mass:
                mass = book.mass[layer][:, :stored - k]
                book.mass[layer] = torch.cat([mass, mass.new_zeros(mass.shape[0], k)], 1)
            if layer in book.score:
                book.score[layer] = torch.cat([book.score[layer][:, :stored - k],
                                               P.decoded_scores(new)], 1)

    def _build_window_pos(self, sid: int, book: _Book, reserved: int) -> None:
        """pos of every layer of a window book (`_Book.window`), slots [0, seq_len - reserved)."""
        pool = self.state.pool
        stored = pool.seq_len(sid) - reserved
        lo, hi = book.window
        j = torch.arange(stored, device=pool.device)
        pos = torch.where(j < lo, j, torch.where(j < hi, -1, j + pool.dropped(sid)))
        for li in self.policies:
            book.pos[li] = pos.expand(pool.layers[li].num_kv_heads, stored)
        book.pending = 0
        book.stale = False

    def before_write(self, ctx, layer, k, v):
        if layer not in self.policies or ctx.plan.eviction_aside:
            return k, v
        plan, pool = ctx.plan, ctx.state.pool
        self._watch(pool)
        heads = pool.layers[layer].num_kv_heads
        for i, sid, past, n in self._rows(plan):
            book = self.books.get(sid)
            fresh = past == 0 and ("eviction_book", sid) not in plan.cache
            if book is None or fresh:  # a new sequence, or a prefill restarting it
                plan.cache[("eviction_book", sid)] = True
                if past and pool.evicted(sid):
                    raise CacheStateError(f"sequence {sid} lost its eviction bookkeeping")
                book = self.books[sid] = _Book(plan.kv_start[i] if not plan.packed else 0)
            self._catch_up(sid, book, n)
            self._pull_mass(sid, book, past)
            pos = book.pos.get(layer)
            if pos is None:  # a layer seen for the first time: nothing was evicted yet
                pos = torch.arange(past, device=k.device).expand(heads, past)
            if pos.shape[1] < past:
                raise CacheStateError(f"eviction bookkeeping of sequence {sid}, layer {layer} "
                                      f"holds {pos.shape[1]} slots, the pool {past}")
            first = pool.logical_len(sid) - n
            new = torch.arange(first, first + n, device=k.device).expand(heads, n)
            book.pos[layer] = torch.cat([pos[:, :past], new], 1)
            if (P.accumulates_mass(self.policy_of(sid, layer)) or self.observe_all
                    or layer in book.mass):
                mass = book.mass.get(layer, torch.zeros(heads, past, device=k.device))
                book.mass[layer] = torch.cat([mass[:, :past], mass.new_zeros(heads, n)], 1)
            if layer in book.score:   # (a new observation replaces them: `_scores`)
                book.score[layer] = torch.cat([book.score[layer][:, :past],
                                               P.decoded_scores(new)], 1)
        return k, v

    # -- attention ------------------------------------------------------------------------------
    def attend_kept(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale,
                    extras, rows=None, into=None, absorb=None):
        """Attention of a layer with a policy over its kept slots (runtime/dispatch.py asks
        this first), or None for a layer without one. rows (a packed plan): attend these rows
        only, writing them into `into` (the plain kernels' output of the whole step, in which
        the other rows are already right; `plain_rows`); returns `into`. absorb (an MLA
        layer, a plan that is not packed, no `rows`): q comes as the model's and each batch
        row is absorbed as it is attended (observe_prefill), not the whole batch at once."""
        if layer not in self.policies:
            return None
        if rows is not None:
            if window:
                self.windowed = True
            if len(rows) == len(plan.seq_lens_list):   # every row evicted: one kernel call
                out = self._attend_kernel(ctx, layer, q, plan, attn_mask, window, softcap,
                                          scale)   # for the step (one-token rows, re-rotated sinks)
                if out is not None:
                    return out
            return self._attend_rows(ctx, layer, q, plan, attn_mask, is_causal, window,
                                     softcap, scale, rows, into)
        if plan.eviction_aside:   # the plain decode step attends itself (runtime/dispatch.py)
            if plan.aside is None or not plan.aside.spec:
                return None
            return attend_aside(self.state, self.store, layer, q, plan, softcap, scale,
                                self._rope(q.device))
        if window:
            self.windowed = True
        pool = ctx.state.pool
        out = self._attend_kernel(ctx, layer, q, plan, attn_mask, window, softcap, scale)
        if out is not None:
            return out
        out = torch.empty((*q.shape[:-1], self._out_dim(layer)), dtype=torch.float32,
                          device=q.device)
        cu = plan.cu_seqlens_q.tolist() if plan.packed else None
        for i, sid, _past, n in self._rows(plan):
            book = self.books[sid]
            policy = self.policy_of(sid, layer)
            pos = book.pos[layer]
            k, v = self._kv(layer, sid)                        # [Hkv, L, D] fp32
            total = pool.logical_len(sid)
            q_pos = torch.arange(total - n, total, device=q.device)
            qi = q[0, :, cu[i]:cu[i + 1]] if plan.packed else q[i]
            if absorb is not None:
                qi = absorb(qi.unsqueeze(0))[0]
            mask_b = None
            if attn_mask is not None and not plan.packed:
                mask_b = _row_mask(attn_mask, i, n)
            sink_slots = sink_rot = None
            if self._rerotate(sid, policy):
                sink_slots, sink_rot = self._sinks(policy, pos, book.start)
            obs_rows = 0
            rows = self.observe_all or P.observe_rows(policy)
            if (n > 1 or book.carry) and rows:   # a prompt's last chunk may be one token
                obs_rows = min(rows, n)
            o, mass, obs = attend_kept(
                qi, k, v, pos, q_pos, scale, causal=is_causal or plan.packed, window=window,
                start=book.start, softcap=softcap, mask_b=mask_b, total=total,
                sink_slots=sink_slots, sink_rot=sink_rot,
                want_mass=layer in book.mass, obs_rows=obs_rows)
            if plan.packed:
                out[0, :, cu[i]:cu[i + 1]] = o
            else:
                out[i] = o
            if mass is not None:
                book.mass[layer] += mass
            if obs is not None:
                book.obs[layer] = _carried(book, layer, obs, rows)
        return out

    def _attend_rows(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap, scale,
                     rows, into):
        """`attend_kept` of some rows of a packed step (q [1, Hq, T, D]) into `into`: a decode
        row (one query, no observation carried) through the paged decode kernel where its
        kept slots allow (`_decode_rows`), the others over their kept slots in fp32
        (attend.py)."""
        cu = plan.cu_seqlens_q.tolist()
        single = [i for i, sid, _p, n in self._rows(plan)
                  if i in rows and n == 1 and not self.books[sid].carry]
        done = set(self._decode_rows(ctx, layer, q, plan, window, softcap, scale, single, cu,
                                     into)) if single else set()
        pool = ctx.state.pool
        for i, sid, _past, n in self._rows(plan):
            if i not in rows or i in done:
                continue
            book = self.books[sid]
            policy = self.policy_of(sid, layer)
            k, v = self._kv(layer, sid)                        # [Hkv, L, D] fp32
            total = pool.logical_len(sid)
            q_pos = torch.arange(total - n, total, device=q.device)
            sink_slots = sink_rot = None
            if self._rerotate(sid, policy):
                sink_slots, sink_rot = self._sinks(policy, book.pos[layer], book.start)
            obs_rows = 0
            want = self.observe_all or P.observe_rows(policy)
            if (n > 1 or book.carry) and want:
                obs_rows = min(want, n)
            o, mass, obs = attend_kept(
                q[0, :, cu[i]:cu[i + 1]], k, v, book.pos[layer], q_pos, scale, causal=True,
                window=window, start=book.start, softcap=softcap, total=total,
                sink_slots=sink_slots, sink_rot=sink_rot, want_mass=layer in book.mass,
                obs_rows=obs_rows)
            into[0, :, cu[i]:cu[i + 1]] = o.to(into.dtype)
            if mass is not None:
                book.mass[layer] += mass
            if obs is not None:
                book.obs[layer] = _carried(book, layer, obs, want)
            self.state.count("eviction_reference_rows")
        return into

    def _decode_rows(self, ctx, layer, q, plan, window, softcap, scale, rows, cu, into):
        """One-query rows of a packed step through the paged decode kernel, as a batch of
        their own (`_attend_kernel`'s conditions per row); returns the rows it attended."""
        state = ctx.state
        if not state.kernels.use_triton(q.device) or layer in self.latent:
            return []
        take, hidden, mass_rows = [], [], []
        for i, sid, _past, _n in self._rows(plan):
            if i not in rows:
                continue
            book, policy = self.books[sid], self.policy_of(sid, layer)
            kept = self._kernel_slots(sid, layer, state.pool.logical_len(sid), window)
            if kept is None:
                continue
            pos, lo, hi = kept
            if self._needs_rotation(sid, policy, pos, book.start):
                continue
            if hi > lo:
                hidden.append((len(take), lo, hi))
            take.append(i)
            mass_rows.append(layer in book.mass)
        if not take:
            return []
        from kvcompile.kernels.decode import paged_decode_attention

        pool = state.pool
        idx = torch.tensor(take, dtype=torch.int64, device=q.device)
        lens = [plan.seq_lens_list[i] for i in take]
        key = ("eviction_decode_rows", tuple(take))
        memo = plan.cache.get(key)
        if memo is None:   # one table, length and mask per forward, shared by the layers
            width = max(1, -(-max(lens) // pool.page_size))
            km = None
            if hidden:
                km = torch.ones(len(take), masks.key_mask_width(max(h for _r, _lo, h in hidden)),
                                dtype=torch.bool)
                for r, lo, hi in hidden:
                    km[r, lo:hi] = False
                km = km.to(q.device)
            memo = plan.cache[key] = (plan.block_tables.index_select(0, idx)[:, :width]
                                      .contiguous(), plan.seq_lens.index_select(0, idx), km)
        tables, seq_lens, key_mask = memo
        cols = torch.tensor([cu[i] for i in take], dtype=torch.int64, device=q.device)
        qd = q[0].index_select(1, cols).transpose(0, 1).unsqueeze(2).contiguous()  # [R,Hq,1,D]
        mass = None
        if any(mass_rows):
            mass = torch.zeros(len(take), pool.layers[layer].num_kv_heads, max(lens),
                               dtype=torch.float32, device=q.device)
        try:
            o = paged_decode_attention(qd, pool.k[layer], pool.v[layer], tables, seq_lens,
                                       scale, softcap=softcap, attn_mass=mass,
                                       key_mask=key_mask)
        except (ImportError, UnsupportedShapeError) as e:
            state.kernels._fallback(f"eviction decode rows: {type(e).__name__}: {e}")
            return []
        into[0][:, cols] = o[:, :, 0].transpose(0, 1).to(into.dtype)
        if mass is not None:
            self.add_row_mass(plan, layer, mass, take)
        state.count("eviction_kernel_decode_rows", len(take))
        return take

    def adds_mass(self, sid: int, layer: int) -> bool:
        """Whether `sid` adds up H2O mass in `layer` (its decode steps' probabilities)."""
        book = self.books.get(sid)
        return book is not None and layer in book.mass

    def add_row_mass(self, plan, layer: int, mass, rows) -> None:
        """A decode kernel's attn_mass output (mass [R, Hkv, Lm], R the kernel's batch) into
        the bookkeeping: its r-th row is the plan's row rows[r], whose sequence adds it where
        it keeps mass, over its stored slots."""
        for r, i in enumerate(rows):
            book = self.books[plan.seq_ids[i]]
            if layer in book.mass:
                L = book.mass[layer].shape[1]
                book.mass[layer] += mass[r, :, :L]

    def takes_plain_prefill(self, plan, layer: int) -> bool:
        """Whether a prefill forward (a prompt, or a chunk of one in the engine) may attend as
        without eviction (runtime/dispatch.py: SDPA over a fresh prompt's own K/V, or the
        paged prefill kernels): nothing of its sequences evicted yet, so every stored slot
        holds its own position, and no left padding. Not for decode steps (`decode_aside`),
        nor under observe_all. SnapKV's observation rows come from `observe_prefill`, H2O's
        prompt mass from `prompt_mass` (one extra pass over Q K^T)."""
        if plan.is_decode:
            return False
        if layer not in self.policies:
            return True
        return all(self.plain_rows(plan, layer))

    def plain_rows(self, plan, layer: int) -> list[bool]:
        """`takes_plain_prefill` row by row: for each row of the plan, whether it may attend as
        without eviction. An engine step packs prompt chunks with the decode rows of sequences
        already evicted; runtime/dispatch.py then runs the plain kernels for the whole step and
        `attend_kept` for the other rows only (`rows=`), so that a prompt chunk never goes to
        the fp32 reference because another sequence of its step evicted."""
        if plan.is_decode or (layer in self.policies and self.observe_all):
            return [False] * plan.batch
        if layer not in self.policies:
            return [True] * plan.batch
        pool = self.state.pool
        out = []
        for _i, sid, _past, n in self._rows(plan):
            book = self.books.get(sid)
            policy = self.policy_of(sid, layer)
            # a one-token row adding up mass is a decode step: its mass comes from the decode
            # kernel's attn_mass (`_decode_rows`), not from a prompt pass
            mass = layer in book.mass if book is not None else False
            mass = mass or (policy is not None and P.accumulates_mass(policy))
            out.append(not (book is None or book.start or pool.evicted(sid)
                            or book.window is not None or (mass and n == 1)))
        return out

    def latent_rows(self, plan, layer: int, mask_free: bool,
                    mass_ok: bool = False) -> list[str]:
        """How each row of an MLA layer's step attends (runtime/dispatch.py attend_latent):
        "plain": nothing of its sequence evicted and no left padding (as without eviction;
        SnapKV's observation and H2O's prompt mass apart, `plain_rows`); "stored": a
        one-token row whose stored slots are exactly its kept tokens with no per-slot rule
        (compacted: no holes or hidden window slots, no left padding, no observation
        carried, no sink to re-rotate; H2O's mass to add up only when `mass_ok`: the latent
        kernel attends the step and outputs it), attended by the latent kernels over them,
        the model's mask dropped (its columns are logical indices; only when `mask_free`: it
        hides no key); "host": over the kept slots in fp32 (attend.py, every rule applied,
        through `_kv`)."""
        pool = self.state.pool
        out = []
        for (_i, sid, _past, n), plain in zip(self._rows(plan), self.plain_rows(plan, layer)):
            if plain:
                out.append("plain")
                continue
            book = self.books.get(sid)
            ok = (book is not None and n == 1 and mask_free and not book.carry
                  and not book.padded and not book.holes
                  and (mass_ok or layer not in book.mass)
                  and not self.observe_all and not self._rerotate(sid, self.policy_of(sid, layer)))
            if ok:
                kept = self._kernel_slots(sid, layer, pool.logical_len(sid), 0)
                ok = kept is not None and kept[2] <= kept[1]
            out.append("stored" if ok else "host")
        return out

    def attend_aside_latent(self, layer: int, q_lat, plan, scale: float, latent_kernel):
        """An H2O decode step of an MLA layer stepped aside for (runtime/dispatch.py
        `_latent_aside_mass`): aside.py `attend_aside_latent` over this runtime's mass store."""
        return attend_aside_latent(self.state, self.store, layer, q_lat, plan, scale,
                                   latent_kernel)

    def observe_prefill(self, ctx, layer, q, plan, attn_mask, is_causal, window, softcap,
                        scale, only=None, absorb=None) -> None:
        """SnapKV's observation of a prefill that attended as without eviction: the last
        `observe_rows` queries' probabilities over the stored (quantized) keys, exactly the
        rows `attend_kept` would have kept, at rows x L cost instead of S x L. only: these
        rows of the plan (None: all). attn_mask: the model's mask (a masks.AndMask is built
        for the observed rows only). absorb: an MLA layer's q -> absorbed query
        ([1, H, s, dn + dr] -> [1, H, s, r + dr]), applied to the observed rows alone."""
        if layer not in self.policies:
            return
        pool = ctx.state.pool
        cu = plan.cu_seqlens_q.tolist() if plan.packed else None
        for i, sid, _past, n in self._rows(plan):
            if only is not None and i not in only:
                continue
            book, policy = self.books[sid], self.policy_of(sid, layer)
            rows = P.observe_rows(policy) if policy is not None else 0
            if not rows or not (n > 1 or book.carry):
                continue
            r = min(rows, n)
            qi = q[0, :, cu[i]:cu[i + 1]] if plan.packed else q[i]
            qo = qi[:, n - r:n]
            if absorb is not None:
                qo = absorb(qo.unsqueeze(0))[0]
            mask_b = None
            if attn_mask is not None and not plan.packed:
                mask_b = _row_mask(attn_mask, i, n, n - r)
            k, v = self._kv(layer, sid)                        # [Hkv, L, D] fp32
            total = pool.logical_len(sid)
            q_pos = torch.arange(total - r, total, device=q.device)
            _o, _m, obs = attend_kept(
                qo, k, v, book.pos[layer], q_pos, scale,
                causal=bool(is_causal) or plan.packed, window=window, start=book.start,
                softcap=softcap, mask_b=mask_b, total=total, obs_rows=r)
            book.obs[layer] = _carried(book, layer, obs, rows)
        self.state.count("eviction_plain_prefill")

    def prompt_mass(self, ctx, layer, q, plan, attn_mask, mask_info, is_causal, window,
                    softcap, scale, only=None, absorb=None) -> None:
        """H2O's mass of prompt rows that attended through the plain kernels (`plain_rows`):
        each stored slot's attention probability summed over the group's query heads and the
        row's queries, added to book.mass[layer], exactly `attend_kept`'s `mass`. One extra
        pass over Q K^T of the rows (kernels/prompt_mass.py: a per-query lse, then per key
        tile the sum of exp(s - lse)) where the Triton kernels run; elsewhere, or under a mask
        that is not causal + window (the model's own), `attend.prompt_mass` per row, in query
        blocks. attn_mask: the model's mask (None in a packed step; a masks.AndMask is built
        a row and a block of queries at a time); only: these rows. absorb: an MLA layer's
        q -> absorbed query (observe_prefill), applied to blocks of `_absorb_rows` queries,
        so that no absorbed query of the whole prompt is made (a 32k prompt at 128 heads:
        4.8 GB a sequence in bf16)."""
        if layer not in self.policies:
            return
        rows = [(i, sid, n) for i, sid, _past, n in self._rows(plan)
                if (only is None or i in only) and layer in self.books[sid].mass]
        if not rows:
            return
        state, pool = ctx.state, ctx.state.pool
        causal, custom = bool(is_causal) or plan.packed, False
        if attn_mask is not None and not plan.packed:
            if mask_info is not None and mask_info.exact and not any(mask_info.kv_start):
                causal = True   # (j >= 0) & causal & window: the kernel's own rules
                window = min((w for w in (window, mask_info.window) if w), default=0)
            else:
                custom = True
        if state.kernels.use_triton(q.device):
            if custom:
                self._say("H2O prompt mass under a mask that is not causal + window: the "
                          "torch path per sequence (eviction/attend.py prompt_mass)")
            elif self._kernel_mass(state, layer, q, plan, rows, causal, window, softcap,
                                   scale, absorb):
                return
        cu = plan.cu_seqlens_q.tolist() if plan.packed else None
        step = self._absorb_rows(layer, q) if absorb is not None else None
        for i, sid, n in rows:
            book = self.books[sid]
            k, _v = self._kv(layer, sid)                       # [Hkv, L, D] fp32
            total = pool.logical_len(sid)
            qi = q[0, :, cu[i]:cu[i + 1]] if plan.packed else q[i]
            q_pos = torch.arange(total - n, total, device=q.device)
            block = step or max(n, 1)   # (without absorb: the row whole)
            for lo in range(0, n, block):
                hi = min(n, lo + block)
                qb = qi[:, lo:hi]
                if absorb is not None:
                    qb = absorb(qb.unsqueeze(0))[0]
                mask_b = _row_mask(attn_mask, i, n, lo, hi) if custom else None
                book.mass[layer] += prompt_mass_torch(
                    qb, k, book.pos[layer], q_pos[lo:hi], scale, causal=causal,
                    window=window, start=book.start, softcap=softcap, mask_b=mask_b,
                    total=total)
        state.count("eviction_prompt_mass_torch", len(rows))

    def _absorb_rows(self, layer: int, q) -> int:
        """Query rows of an MLA layer absorbed at a time (prompt_mass): ABSORB_ELEMENTS of
        the absorbed query [H, rows, r + dr]."""
        pool = self.state.pool
        width = pool.k[layer].head_dim + pool.v[layer].head_dim
        return max(1, ABSORB_ELEMENTS // (q.shape[1] * width))

    def _kernel_mass(self, state, layer, q, plan, rows, causal, window, softcap,
                     scale, absorb=None) -> bool:
        """`prompt_mass` of all `rows` through kernels/prompt_mass.py: one read of their key
        pages, two launches (an MLA layer's absorbed query against its latent and rotary
        pages side by side; with `absorb`, two a row and block of `_absorb_rows` queries,
        each block absorbed as it goes). False if the kernels refuse (said once)."""
        pool = state.pool
        P_ = pool.page_size
        lens = [pool.seq_len(sid) for _i, sid, _n in rows]
        pages, first = [], []
        for (_i, sid, _n), L in zip(rows, lens):
            first.append(len(pages) * P_)
            pages.extend(pool.pages_of(sid)[:-(-L // P_)])
        dev = q.device
        ids = torch.tensor(pages, dtype=torch.int64, device=dev)
        kp = pool.k[layer].read(ids)                                    # [N, Hkv, P, D] fp32
        if layer in self.latent:   # the absorbed form's keys [c, r]: one "kv head", r + dr wide
            kp = torch.cat([kp, pool.v[layer].read(ids)], -1)
        dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
        k = kp.to(dt).permute(1, 0, 2, 3).reshape(kp.shape[1], -1, kp.shape[-1])
        i32 = dict(dtype=torch.int32, device=dev)
        qn = [n for _i, _s, n in rows]
        totals = [pool.logical_len(sid) for _i, sid, _n in rows]
        starts = [self.books[sid].start for _i, sid, _n in rows]
        cu = plan.cu_seqlens_q.tolist() if plan.packed else None
        try:
            from kvcompile.kernels.prompt_mass import prompt_mass as kernel_mass

            if absorb is None:
                if plan.packed:
                    qv, q_off = q[0], [cu[i] * q.stride(2) for i, _s, _n in rows]
                else:
                    qv, q_off = q.transpose(0, 1)[:, 0], [i * q.stride(0) for i, _s, _n in rows]
                mass = kernel_mass(
                    qv, k, torch.tensor(q_off, dtype=torch.int64, device=dev),
                    torch.tensor(qn, **i32), torch.tensor(first, **i32),
                    torch.tensor(lens, **i32),
                    torch.tensor([t - n for t, n in zip(totals, qn)], **i32),
                    torch.tensor(starts, **i32), scale, causal=causal, window=window,
                    softcap=softcap, max_q=max(qn), max_k=max(lens))
            else:
                mass = torch.zeros(k.shape[0], k.shape[1], dtype=torch.float32, device=dev)
                step = self._absorb_rows(layer, q)
                zero = torch.zeros(1, dtype=torch.int64, device=dev)
                for (i, _sid, n), lo_k, L, total, st in zip(rows, first, lens, totals, starts):
                    qi = q[0, :, cu[i]:cu[i + 1]] if plan.packed else q[i]
                    for lo in range(0, n, step):
                        hi = min(n, lo + step)
                        qb = absorb(qi[:, lo:hi].unsqueeze(0))[0]      # [H, hi - lo, r + dr]
                        part = kernel_mass(
                            qb, k, zero, torch.tensor([hi - lo], **i32),
                            torch.tensor([lo_k], **i32), torch.tensor([L], **i32),
                            torch.tensor([total - n + lo], **i32), torch.tensor([st], **i32),
                            scale, causal=causal, window=window, softcap=softcap,
                            max_q=hi - lo, max_k=L)
                        mass += part
        except (ImportError, UnsupportedShapeError) as e:
            self._say(f"H2O prompt mass kernel refused ({type(e).__name__}: {e}): the torch "
                      f"path per sequence (eviction/attend.py prompt_mass)")
            return False
        for (_i, sid, _n), lo, L in zip(rows, first, lens):
            self.books[sid].mass[layer][:, :L] += mass[:, lo:lo + L]
        state.count("eviction_prompt_mass_kernel", len(rows))
        return True

    def _attend_kernel(self, ctx, layer, q, plan, attn_mask, window, softcap, scale):
        """Decode through the paged decode kernel when the kept slots need no per-slot rule:
        no holes, no padding left, the model's mask and window see every kept key. Slot order
        does not matter to a single query. H2O mass comes from the kernel's `attn_mass`
        output. A window book's hidden slots are masked (`key_mask`). Re-rotated sinks in
        slots [0, n) (as compaction leaves them) are scored inside the kernel by the rotated
        query (aside.py `kernel_aside`, the kernel's `rot`), as the aside steps do; H2O rows
        beside them keep their mass (one softmax). Also the engine's packed steps of one token
        per sequence (q [1, Hq, B, D])."""
        state = ctx.state
        packed1 = plan.packed and all(n == 1 for n in plan.q_lens)
        if not ((plan.is_decode and not plan.packed) or packed1) or layer in self.latent:
            return None   # (MLA: the latent kernel serves the rows without a rule, dispatch.py)
        if not state.kernels.use_triton(q.device):
            return None
        if plan.packed:   # the model's mask of a packed step is over the packed tokens:
            attn_mask = None   # causal by logical position, as attend_kept takes it
        mass_rows, hidden, n_rot, shifts = [], [], [], []
        for i, sid, _past, _n in self._rows(plan):
            book, policy = self.books[sid], self.policy_of(sid, layer)
            total = state.pool.logical_len(sid)
            kept = self._kernel_slots(sid, layer, total, window)
            if kept is None:
                return None
            pos, lo, hi = kept
            if hi > lo:
                hidden.append((i, lo, hi))
            n, shift = 0, 0
            if self._rerotate(sid, policy):
                slots, shift = self._sink_layout(policy, pos, book.start)
                if slots is not None:
                    n = slots.shape[1]
                    if hi > lo or not bool((slots == torch.arange(n, device=slots.device)).all()):
                        return None   # (sinks elsewhere than slots [0, n): attend_kept)
            if attn_mask is not None and not _mask_sees_all(attn_mask, i, pos, total):
                return None
            mass_rows.append(layer in book.mass)
            n_rot.append(n)
            shifts.append(shift)
        from kvcompile.eviction.aside import kernel_aside, sink_rotation

        pool = state.pool
        mass = None
        if any(mass_rows):
            mass = torch.zeros(plan.batch, pool.layers[layer].num_kv_heads,
                               max(plan.seq_lens_list), dtype=torch.float32, device=q.device)
        key_mask = None
        if hidden:   # one mask per forward, shared by the layers
            key_mask = plan.cache.get("eviction_window_mask")
            if key_mask is None:
                width = masks.key_mask_width(max(hi for _i, _lo, hi in hidden))
                key_mask = torch.ones(plan.batch, width, dtype=torch.bool)
                for i, lo, hi in hidden:
                    key_mask[i, lo:hi] = False
                key_mask = plan.cache["eviction_window_mask"] = key_mask.to(q.device)
        rot = None
        if any(n_rot):   # one rotation per forward, shared by the layers
            rot = plan.cache.get(("eviction_host_rot", tuple(n_rot), tuple(shifts)))
            if rot is None:
                t = torch.tensor([n_rot, shifts], dtype=torch.int64).to(q.device)
                cos, sin = sink_rotation(self._rope(q.device), t[1])
                rot = (t[0], cos, sin, max(n_rot))
                plan.cache[("eviction_host_rot", tuple(n_rot), tuple(shifts))] = rot
        qd = q[0].transpose(0, 1).unsqueeze(2) if packed1 else q      # [B, Hq, 1, D]
        try:
            if rot is not None:
                out = kernel_aside(qd.contiguous(), pool.k[layer], pool.v[layer],
                                   plan.block_tables, plan.seq_lens, scale, softcap, mass, rot,
                                   key_mask)
            else:
                from kvcompile.kernels.decode import paged_decode_attention

                out = paged_decode_attention(qd.contiguous(), pool.k[layer], pool.v[layer],
                                             plan.block_tables, plan.seq_lens, scale,
                                             softcap=softcap, attn_mass=mass,
                                             key_mask=key_mask)
        except (ImportError, UnsupportedShapeError) as e:
            state.kernels._fallback(f"eviction decode: {type(e).__name__}: {e}")
            return None
        if mass is not None:
            for i, sid, _past, _n in self._rows(plan):
                book = self.books[sid]
                if layer in book.mass:
                    L = book.mass[layer].shape[1]
                    book.mass[layer] += mass[i, :, :L]
        self.state.count("eviction_kernel_decode")
        out = out.float()
        return out.squeeze(2).transpose(0, 1).unsqueeze(0) if packed1 else out

    def _kernel_slots(self, sid, layer: int, total: int, window):
        """(kept positions [Hkv, n] without a window book's hidden slots, lo, hi) of a row whose
        slots the paged decode kernel can read as far as holes, a left start and the model's
        window go (the hidden slots [lo, hi) are masked), or None (attend_kept)."""
        book = self.books[sid]
        pos = book.pos[layer]   # (before_write caught it up)
        lo, hi = book.window or (0, 0)
        if hi > lo:   # holes exactly at [lo, hi) (the layout): the kept slots around them
            pos = torch.cat([pos[:, :lo], pos[:, hi:]], 1)
        elif bool((pos < 0).any()):
            return None
        if book.padded or (window and total - int(pos.min()) > window):
            return None
        return pos, lo, hi

    def _needs_rotation(self, sid, policy, pos, start) -> bool:
        """Whether this sequence's sinks must be re-rotated at this layer (a row that does
        cannot go through the plain decode kernel)."""
        return self._rerotate(sid, policy) and self._sink_layout(policy, pos, start)[0] is not None

    def _sinks(self, policy: EvictionPolicy, pos: torch.Tensor, start: int):
        """Slots of the sinks [Hkv, n] and the rotation that moves them before the window."""
        slots, shift = self._sink_layout(policy, pos, start)
        if slots is None:
            return None, None
        return slots, rotation(self.inv_freq.to(pos.device), -shift)

    def _sink_layout(self, policy: EvictionPolicy, pos: torch.Tensor, start: int):
        """(slots of the sinks [Hkv, n], the shift in positions that moves them before the
        window), or (None, 0): nothing to rotate, or heads that keep different sink counts."""
        n_sinks = P.rerotated_sinks(policy)
        real = pos >= start
        sink = real & (pos - start < n_sinks)
        rest = torch.where(real & ~sink, pos, torch.iinfo(pos.dtype).max)
        oldest = int(rest.min())
        shift = oldest - (start + n_sinks)
        if shift <= 0 or oldest == torch.iinfo(pos.dtype).max:
            return None, 0
        counts = sink.sum(-1)
        if not bool((counts == counts[0]).all()):
            return None, 0
        return sink.nonzero()[:, 1].view(pos.shape[0], -1), shift

    # -- eviction -------------------------------------------------------------------------------
    def after_forward(self, ctx) -> None:
        plan, pool = ctx.plan, ctx.state.pool
        if plan is None or pool is None or not self.policies or plan.eviction_aside:
            return   # (a step stepped aside for: after_decode_step)
        if self.interval > 1:
            self._check_facts()
        due = []
        for _i, sid, past, n in self._rows(plan):
            book = self.books.get(sid)
            if book is None or not pool.has(sid):
                continue
            book.carry = sid in self.held
            if book.carry:
                continue
            # a decode step (the engine's, or a one-token forward of generate) evicts every
            # `interval` steps, as aside steps do
            decode = sid in self.decoding or (not plan.packed and n == 1 and past > 0)
            if decode and self.interval > 1 and not self._due(sid, book):
                continue
            due.append((sid, book))
        # every sequence the batched pass takes at once (front.py: no per-sequence host
        # loop), the rest one by one
        for sid, book in self._batched(due):
            self.evict(sid, book)
        if not self.observe_all:  # kept for forks evicted later (observe_all)
            for _sid, book in due:
                book.obs.clear()
        self.held.clear()
        self.decoding.clear()
        for sid in [s for s in self.books if not pool.has(s)]:
            del self.books[sid]
            self.seq_policy.pop(sid, None)
            self.seq_sink_positions.pop(sid, None)

    # -- decode steps it steps aside for (CUDA graphs) ---------------------------------------
    def _facts_of(self, sid: int) -> _Facts:
        f = self._facts.get(sid)
        if f is not None:
            return f
        pols = tuple(self.policy_of(sid, li) for li in self.policies)
        rot = [P.rerotated_sinks(p) for p in pols if p is not None and self._rerotate(sid, p)]
        uniform = len(set(pols)) == 1 and getattr(pols[0], "granularity", "token") == "token"
        masses = [P.budget_of(p) for p in pols if P.accumulates_mass(p)]
        budgets = [b for b in map(P.decode_budget, pols) if b is not None]
        window = None
        if (uniform and pols[0] is not None and not rot and P.window_of(pols[0]) is not None
                and len(self.policies) == len(self.state.layer_specs)
                and not self.latent):   # (latent layers compact)
            window = pols[0]
            if not self.state.config.window_eviction:   # (to time both)
                self._say("eviction: KVConfig.window_eviction is False: SinkWindow compacts "
                          "(moves tokens) instead of hiding them")
                window = None
        f = self._facts[sid] = _Facts(pols, rot[0] if rot else 0, uniform, bool(masses),
                                      max(masses, default=0), min(budgets) if budgets else None,
                                      window)
        return f

    def _check_facts(self) -> None:
        """Forget the facts when what they derive from changed (once per step)."""
        key = (self.sink_positions, tuple(self.policies.items()), self.inv_freq is not None,
               len(self.state.layer_specs))
        if key != self._facts_key:
            self._facts.clear()
            self._facts_key = key

    def decode_aside(self, seq_ids) -> bool:
        """Whether a decode step of these sequences can run without this runtime's host code
        inside it, so that it can replay a CUDA graph: the decode kernel over the stored slots
        attends as `attend_kept` would (slot order does not matter to one query), H2O's mass
        comes from the kernel's `attn_mass` output into the device store and re-rotated sinks
        are scored by a rotated query inside the step (aside.py). Not when a slot needs its
        own rule (holes, left padding, a sliding window), for the quality harness's
        observation of every policy, nor for re-rotated sinks whose layers differ in policy or
        evict whole pages (their sinks' slots and shift are not known on the host). Each
        reason is logged once."""
        why = None
        new_rows = 0   # H2O sequences that start decoding aside: each takes a store row
        if self.windowed:
            why = "a sliding window (a per-slot rule)"
        elif self.observe_all:
            why = "observe_all (every policy's scores are recorded)"
        elif len(self.policies) != len(self.state.layer_specs):
            why = "a layer without a policy (its slots are holes in the others)"
        self._check_facts()
        for sid in seq_ids if why is None else ():
            book = self.books.get(sid)
            if book is None or book.carry:
                return False   # (not a decode step of a known sequence)
            if book.padded or book.ragged:
                why = ("left padding not yet evicted, or heads that keep different counts "
                       "(per-slot rules)")
                break
            if book.holes:
                why = "a prompt mask that is not causal + left padding (per-slot rules)"
                break
            facts = self._facts_of(sid)
            rerot = facts.rerot > 0
            if (rerot and self.state.pool.device.type == "cuda"
                    and not self.state.config.rerotated_sinks_graphs):
                why = ("re-rotated sinks on CUDA with KVConfig.rerotated_sinks_graphs False "
                       "(KVCOMPILE_REROT_ASIDE=0); unset it to replay CUDA graphs")
                break
            if rerot and not facts.uniform:
                why = ("re-rotated sinks with per-layer policies or page granularity (the "
                       "sinks' shift is not known on the host)")
                break
            if facts.mass:
                new_rows += self.store is None or sid not in self.store.row_of
        free = len(self.store._free) if self.store is not None else self.aside_rows
        if why is None and new_rows > free:
            why = f"more H2O sequences than the mass store's {self.aside_rows} rows"
        if why is not None:
            self._say(f"eviction: decode steps run on the host path ({why})")
            return False
        return True

    def mark_holes(self, plan) -> None:
        """The prompt of a `generate` forward had a mask that is not causal + left padding
        (runtime/dispatch.py, from its analysis): its sequences' decode steps keep applying
        it by logical index (never `decode_aside`)."""
        for sid in plan.seq_ids:
            book = self.books.get(sid)
            if book is not None:
                book.holes = True

    def set_aside_rows(self, rows: int) -> None:
        """Sequences at most that decode aside with H2O mass at once (the engine's
        max_num_seqs); a store with fewer rows and none in use is dropped."""
        self.aside_rows = rows
        if self.store is not None and self.store.rows < rows and not self.store.row_of:
            self.store = None

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.warning("kvcompile: %s", why)

    def _rope(self, device):
        """The RoPE frequencies on `device`, copied once (no copy inside a captured step)."""
        if self.inv_freq is None:
            return None
        if device not in self._inv_freq_dev:
            self._inv_freq_dev[device] = self.inv_freq.to(device)
        return self._inv_freq_dev[device]

    def _mass_need(self, sid: int) -> int:
        """Slots of the store a sequence needs: its H2O budget + interval (the most it holds
        between evictions), or what it holds now if more."""
        return max(self._facts_of(sid).mass_budget + self.interval,
                   self.state.pool.seq_len(sid))

    def _ensure_store(self, need: int, device) -> MassStore:
        pool = self.state.pool
        length = store_length(need)
        if self.store is None:
            heads = {li: pool.layers[li].num_kv_heads for li in self.policies}
            self.store = MassStore(heads, self.aside_rows, length, device)
        elif self.store.length < length:
            self.store = self.store.grown(length)   # (graphs of the old store are dropped)
        return self.store

    def aside_inputs(self, seq_ids, device) -> tuple:
        """The spec and per-row inputs of a decode step stepped aside for (after `reserve`):
        (spec, mass rows, shifts, sink counts, hidden slots' lo, hi). Moves the mass of H2O
        sequences that start decoding aside into the store. Host work only, no sync."""
        pool = self.state.pool
        mass_len = sinks = hidden = 0
        rows, shifts, n_rot, los, his = [], [], [], [], []
        need = [self._mass_need(sid) for sid in seq_ids if self._facts_of(sid).mass]
        store = self._ensure_store(max(need), device) if need else self.store
        for sid in seq_ids:
            book = self.books[sid]
            lo, hi = book.window or (0, 0)
            if hi > lo:
                # the mask's width: the sinks' pages and one more (hi is below it after each
                # eviction), fixed per policy, so the graphs it keys stay few; aligned as the
                # sm_90 kernel reads it without a copy (masks.key_mask_width)
                Ps = pool.page_size
                hidden = max(hidden, masks.key_mask_width(-(-lo // Ps) * Ps + Ps))
            else:
                lo = hi = 0
            los.append(lo)
            his.append(hi)
            if book.window is not None:   # a window book keeps no mass and rotates no sink
                rows.append(store.scratch if store is not None else 0)
                shifts.append(0)
                n_rot.append(0)
                continue
            facts = self._facts_of(sid)
            row, shift, n = store.scratch if store is not None else 0, 0, 0
            if facts.mass:
                mass_len = store.length
                if sid not in store.row_of:
                    self._catch_up(sid, book, 1)
                    row = store.take(sid)
                    store.write(row, book.mass)
                row = store.row_of[sid]
            if facts.rerot:
                sinks = max(sinks, facts.rerot)
                # the run after the sinks is gone: rotate them (left padding, evicted first,
                # is no part of that run)
                if pool.evicted(sid) > book.start:
                    shift, n = pool.evicted(sid) - book.start, facts.rerot
            rows.append(row)
            shifts.append(shift)
            n_rot.append(n)
        return AsideSpec(mass_len, sinks, hidden), rows, shifts, n_rot, los, his

    def _pull_mass(self, sid: int, book: _Book, stored: int) -> None:
        """The sequence leaves the aside path (or evicts): its mass, slots [0, stored), back
        from the store into the bookkeeping, and its row given back."""
        st = self.store
        if st is None or sid not in st.row_of:
            return
        book.mass.update(st.read(st.row_of[sid], list(book.mass), stored))
        st.give_back(sid)

    def after_decode_step(self, seq_ids) -> None:
        """Each sequence added one token in a step stepped aside for: record it (lazily) and
        evict those that reached budget + interval - 1, on the device where the format moves
        tokens exactly (no host sync: the next step's graph replays at once). An H2O sequence
        ranks by the mass in the store, which goes back to its row after the eviction."""
        pool = self.state.pool
        self.state.count("eviction_aside_steps")
        due = []
        for sid in seq_ids:
            book = self.books.get(sid)
            if book is None or not pool.has(sid):
                continue
            book.pending += 1
            if self._due(sid, book):
                window = self._window_policy(sid, book)
                if window is not None:
                    self._evict_window(sid, book, window)
                else:
                    due.append((sid, book, self._decode_budget(sid)))
        # every other sequence due: one batched pass (front.py), the rest one by one
        for sid, book, _budget in self._evict_fronts(due) if due else ():
            self._catch_up(sid, book)
            row = self.store.row_of.get(sid) if self.store is not None else None
            self._pull_mass(sid, book, pool.seq_len(sid))
            self.evict(sid, book)
            if row is not None:
                self.store.write(self.store.take(sid), book.mass)

    def _due(self, sid: int, book: _Book) -> bool:
        """A decoding sequence evicts once it holds budget + interval tokens (hidden ones not
        counted): on the host path (after_forward) as after the steps stepped aside for, so
        that both keep the same tokens at any interval, and the host path pays one eviction
        per `interval` steps, not one per step."""
        budget = self._decode_budget(sid)
        held = self.state.pool.seq_len(sid)
        if book.window is not None:
            held -= book.window[1] - book.window[0]
        return budget is not None and held >= budget + self.interval

    def _decode_budget(self, sid: int) -> int | None:
        """The budget decode steps evict to (None: they do not evict: no policy, or SnapKV
        without `hold`, which chooses at the end of a prompt only)."""
        return self._facts_of(sid).budget

    def _evict_fronts(self, items: list) -> list:
        """Token-granular eviction with no host sync of every (seq id, book, budget) due in a
        step, batched over sequences and layers (front.py: the tail's kept tokens fill the
        holes below the budget). Returns the items it does not take (then `evict`, which reads
        counts on the host): mixed policies, page granularity, formats `moves_on_device` does
        not take (residual rows, a registered codec), a policy type whose kept count is not its
        budget."""
        left = evict_fronts(self, items)
        if left:
            pool = self.state.pool
            slow = sorted({f"{c.fmt.name}/{c.fmt.granularity}" for li in self.policies
                           for c in (pool.k[li], pool.v[li]) if not moves_on_device(c)})
            if slow:   # (said once: the cost is a host sync and a re-encode per sequence)
                self._say(f"eviction: {', '.join(slow)} pages re-encode the tokens they move "
                          f"on the host (residual rows or a registered codec), so decode-step "
                          f"evictions run on the host path (a sync and a re-encode per "
                          f"sequence and layer); the same format without residual=True moves "
                          f"them on the device")
        return left

    def _batched(self, due: list) -> list:
        """The sequences of a forward due to evict (after_forward) that the batched pass takes
        (front.py `evict_fronts`, every sequence and layer in one pass: the end of a prompt,
        a decode step on the host path), evicted there; returns the others, for `evict`.
        Taken: token granularity, every layer with a policy, nothing of the sequence hidden
        as a window or left ragged, no padding stored, over its budget, and for a policy that
        waits for an observation, an observation in every layer (a SnapKV prompt's end).
        Where host syncs cost something (not the CPU, unless BATCH_ON_CPU: the per-sequence
        path does less work there, 347 against 441 ms for B16 x 512-token fp8 prompts, 8
        layers, 2026-12-05)."""
        pool = self.state.pool
        if (not due or self.observe_all or self.page_mode
                or len(self.policies) != len(self.state.layer_specs)
                or pool.device.type == "cpu" and not BATCH_ON_CPU):
            return due
        items, rest = [], []
        for sid, book in due:
            policy = self.policy_of(sid, next(iter(self.policies)))
            ok = (policy is not None and book.window is None and not book.padded
                  and not book.ragged and self._window_policy(sid, book) is None)
            if ok:
                budget = P.budget_of(policy)
                waits = P.waits_for_observation(policy) and not P.kept_scores(policy)
                ok = (pool.seq_len(sid) > budget
                      and (not waits or set(book.obs) >= set(self.policies)))
            if ok:
                items.append((sid, book, budget))
            else:
                rest.append((sid, book))
        if not items:
            return rest
        left = {id(b) for _s, b, _k in self._evict_fronts(items)}
        return rest + [(sid, book) for sid, book, _k in items if id(book) in left]

    def _evict_front(self, sid: int, book: _Book, budget: int) -> bool:
        """`_evict_fronts` of one sequence: False where it does not apply."""
        return not self._evict_fronts([(sid, book, budget)])

    def _window_policy(self, sid: int, book: _Book) -> EvictionPolicy | None:
        """The policy of `sid` if it evicts without moving tokens (`_evict_window`): one
        window policy (SinkWindow) in every layer, token granularity, sinks at their text
        positions, no left padding, no scores recorded, no model window, and the sequence
        either in that layout already or not evicted yet. Not for latent (MLA) layers: they
        compact instead, so that their decode steps read exactly their stored slots through
        the latent kernels (runtime/dispatch.py `_latent_evicting`; one latent head a token
        makes a move cheap)."""
        if (book.start or book.ragged or book.mass or book.obs or book.score
                or self.observe_all or self.windowed or self.latent):
            return None
        self._check_facts()
        policy = self._facts_of(sid).window
        if policy is None:
            return None
        if book.window is None and self.state.pool.evicted(sid):
            return None   # evicted by compaction before: its slots are not in that layout
        return policy

    def _evict_window(self, sid: int, book: _Book, policy: EvictionPolicy) -> None:
        """Evict a window policy without moving a token, on the host's counts only (no device
        work, no sync): the tokens between the sinks and the window are hidden (book.window);
        the pages wholly among them leave the sequence (pool.evict_pages: freed unless another
        sequence holds them), so at most one page past the sinks' pages holds hidden tokens.
        The attention then masks the hidden slots (aside.py `hidden`, `_attend_kernel`'s
        key_mask, attend_kept's holes)."""
        pool = self.state.pool
        sinks, window = P.window_of(policy)
        L = pool.seq_len(sid)
        lo, hi = book.window or (sinks, sinks)
        kept = L - (hi - lo)
        if kept <= sinks + window:
            return
        hi = max(hi, L - window)   # the window's first slot (the last `window` are kept)
        Ps = pool.page_size
        first = -(-lo // Ps)   # the first page past the sinks' pages
        n_drop = max(0, hi // Ps - first)
        if n_drop:
            pool.evict_pages(sid, range(first, first + n_drop))
            hi -= n_drop * Ps
        book.window = (lo, hi)
        pool.hide(sid, hi - lo)
        book.pos.clear()
        book.stale, book.pending = True, 0
        self.state.count("eviction_runs")
        self.state.count("eviction_window_runs")
        self.state.count("evicted_tokens", kept - (pool.seq_len(sid) - (hi - lo)))
        if n_drop:
            self.state.count("evicted_pages", n_drop)

    def evict(self, sid: int, book: _Book) -> None:
        pool, state = self.state.pool, self.state
        window = self._window_policy(sid, book)
        if window is not None:
            self._evict_window(sid, book, window)
            return
        if book.window is not None:
            # the sequence no longer evicts as a window (its policy or the runtime's settings
            # changed): its hidden slots become holes, compacted away as any eviction's
            self._catch_up(sid, book)
            book.window = None
            self._evict_tokens(sid, book, pool.logical_len(sid), set())
            pool.hide(sid, 0)
            self._say("eviction: a sequence evicted as a window was compacted (its policy "
                      "or the runtime's settings changed)")
        self._catch_up(sid, book)
        total = pool.logical_len(sid)
        due = []
        for layer in self.policies:
            policy, pos = self.policy_of(sid, layer), book.pos.get(layer)
            if pos is None or policy is None:
                continue
            if P.waits_for_observation(policy) and not P.kept_scores(policy) \
                    and layer not in book.obs:
                continue  # SnapKV chooses at the end of a multi-token forward only
            if P.over_budget(policy, pos, book.start):
                due.append(layer)   # (its choice keeps the scores: `_scores`)
            elif layer in book.obs and P.kept_scores(policy):
                self._scores(sid, layer, book)   # kept for the decode steps' evictions
        if not due:
            return
        before = pool.seq_len(sid)
        if self.page_mode_of(sid):
            self._evict_pages(sid, book, total)
        else:
            self._evict_tokens(sid, book, total, set(due))
        if book.padded and not book.window and all(
                bool((p >= book.start).all()) for li, p in book.pos.items()
                if li in self.policies):
            book.padded = False   # the padding is gone from every layer (one host read)
        state.count("eviction_runs")
        state.count("evicted_tokens", before - pool.seq_len(sid))

    def _scores(self, sid, layer, book):
        """[H, L] scores of the layer's slots (None: by position or recency). A policy with
        kept scores keeps those of an observation in book.score (normalized, kept_rank), and
        without one ranks by them."""
        policy = self.policy_of(sid, layer)
        obs = book.obs.get(layer)
        s = P.token_scores(policy, book.mass.get(layer), obs, self._sum_heads,
                           kept=book.score.get(layer))
        if obs is not None and s is not None and P.kept_scores(policy):
            s = book.score[layer] = P.kept_rank(s, book.pos[layer], book.start)
        return s

    @property
    def _sum_heads(self):
        """Scores shared by a layer's heads are summed over every tensor-parallel rank."""
        tp = self.state.tp
        return tp.sum_heads if tp is not None else None

    def _evict_pages(self, sid, book, total) -> None:
        pool = self.state.pool
        layers = sorted(book.pos)
        keep = P.select_pages([self.policy_of(sid, li) for li in layers],
                              [book.pos[li] for li in layers], book.start, total,
                              [self._scores(sid, li, book) for li in layers], pool.page_size,
                              self._sum_heads)
        L, Ps = pool.seq_len(sid), pool.page_size
        full = L // Ps
        drop = [j for j in range(full) if not bool(keep[j])]
        if not drop:
            return
        pool.evict_pages(sid, drop)
        cols = torch.ones(L, dtype=torch.bool)
        for j in drop:
            cols[j * Ps:(j + 1) * Ps] = False
        for li in layers:
            c = cols.to(book.pos[li].device)
            book.pos[li] = book.pos[li][:, c]
            for rows in book.per_slot():
                if li in rows:
                    rows[li] = rows[li][:, c]
        self.state.count("evicted_pages", len(drop))

    def _evict_tokens(self, sid, book, total, due: set) -> None:
        pool = self.state.pool
        L = pool.seq_len(sid)
        lens = [L] if len(book.pos) < len(pool.layers) else []  # a layer without a policy
        for li in sorted(book.pos):
            pos = book.pos[li]
            if li in due:
                keep = P.select_tokens(self.policy_of(sid, li), pos, book.start, total,
                                       self._scores(sid, li, book))
            else:
                keep = pos >= 0
            lens.append(self._compact(sid, li, book, keep))
        new_len = max(lens)
        if min(lens) != new_len:
            book.ragged = True
        pool.evict_tail(sid, new_len)
        for li in book.pos:
            book.pos[li] = _fit(book.pos[li], new_len, -1)
            for rows in book.per_slot():
                if li in rows:
                    rows[li] = _fit(rows[li], new_len, 0.0)

    def _compact(self, sid, layer, book, keep: torch.Tensor) -> int:
        """Move kept tokens of slots >= n into holes below n, n = most kept by any head. A
        left-padded sequence's slots (`book.padded`: padding still stored) are compacted in
        slot order instead, so that the sinks, its first real tokens, end in slots [0, n
        sinks) as for any other sequence (the decode steps stepped aside for rotate those
        slots, aside.py)."""
        pos = book.pos[layer]
        counts = keep.sum(-1)
        n, least = torch.stack([counts.max(), counts.min()]).tolist()
        if least != n:
            book.ragged = True
        srcs, dsts, hs = [], [], []
        ordered = book.padded
        for h in range(pos.shape[0]):
            if ordered:   # every kept token to its rank among the kept
                movers = keep[h].nonzero()[:, 0]
                holes = torch.arange(movers.numel(), device=pos.device)
                stay = movers == holes
                movers, holes = movers[~stay], holes[~stay]
            else:
                holes = (~keep[h, :n]).nonzero()[:, 0]
                movers = keep[h, n:].nonzero()[:, 0] + n
            m = movers.numel()
            if m:
                srcs.append(movers)
                dsts.append(holes[:m])
                hs.append(torch.full((m,), h, dtype=torch.int64, device=pos.device))
        left = keep[:, :n]
        if ordered:   # (a slot whose token moved lower is a hole unless a move fills it: in
            # slot order, every slot below its head's count is filled, moved or staying)
            left = left & (torch.arange(n, device=pos.device) < counts[:, None])
        new_pos = torch.where(left, pos[:, :n], -1)
        # (per-slot rows of the layer: the old row, and the new one the kept slots fill)
        rows = [(d, d[layer], torch.where(left, d[layer][:, :n], 0.0))
                for d in book.per_slot() if layer in d]
        if srcs:
            src, dst, head = torch.cat(srcs), torch.cat(dsts), torch.cat(hs)
            self.state.pool.move_tokens(layer, sid, src, dst, head)
            new_pos[head, dst] = pos[head, src]
            for _d, old, new in rows:
                new[head, dst] = old[head, src]
            self.state.count("eviction_moves", src.numel())
        book.pos[layer] = torch.cat([new_pos, pos[:, n:].new_full((pos.shape[0],
                                                                   pos.shape[1] - n), -1)], 1)
        for d, old, new in rows:
            d[layer] = torch.cat([new, old.new_zeros(old.shape[0], old.shape[1] - n)], 1)
        return n


def _carried(book: _Book, layer: int, obs: torch.Tensor, rows: int) -> torch.Tensor:
    """obs [Hkv, R, L] of this forward, after the held forward's rows when it carries (the
    last `rows` in all): the earlier queries saw none of the new keys (causal), so zeros extend
    their rows exactly."""
    old = book.obs.get(layer) if book.carry else None
    if old is None:
        return obs
    old = F.pad(old, (0, obs.shape[-1] - old.shape[-1]))
    return torch.cat([old, obs], 1)[:, -rows:]


def _fit(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    if x.shape[1] >= n:
        return x[:, :n]
    return torch.cat([x, x.new_full((x.shape[0], n - x.shape[1]), fill)], 1)


def _mask_sees_all(attn_mask: torch.Tensor, row: int, pos: torch.Tensor, total: int) -> bool:
    """Does the last query's row of the model's mask allow every kept key?"""
    m = _row_mask(attn_mask, row, 1)                                    # [Hm, 1, Lm]
    if m.dtype != torch.bool:
        return False
    lm = m.shape[-1]
    col = pos - max(0, total - lm)
    if bool((col < 0).any()):
        return False
    return bool(m[:, -1][:, col.reshape(-1)].all())


def _row_mask(attn_mask, row: int, n: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """The model's mask for batch row `row` as [Hm, S, Lm] (bool if it is binary), of its
    query rows lo..hi only (default all n): a masks.AndMask builds only those rows (a whole
    B16 x 32k prompt's mask is 16 GiB of bool, one row's 1 GiB)."""
    hi = n if hi is None else hi
    if attn_mask.dim() == 4:
        r = row if attn_mask.shape[0] > 1 else 0
        rows = slice(lo, hi) if attn_mask.shape[2] > 1 else slice(None)
        m = attn_mask[r, :, rows]
    else:
        m = attn_mask
        while m.dim() < 3:
            m = m.unsqueeze(0)
        m = m[:, lo:hi] if m.shape[1] > 1 else m
    m = m.expand(m.shape[0], hi - lo, m.shape[-1])
    if m.dtype != torch.bool:
        allowed, binary = to_bool(m)
        if binary:
            return allowed
    return m
