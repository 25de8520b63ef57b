"""Eviction inside decode steps that replay CUDA graphs: H2O's attention mass and re-rotated
sinks, with fixed shapes and no host sync.

A decode step the eviction runtime steps aside for (runtime.py `decode_aside`) attends over
the stored slots with the decode kernel; eviction runs after it, every `eviction_interval`
steps. Two policies need something inside the step itself:

- H2O adds each step's attention probabilities to every kept slot's mass. The mass of the
  sequences that decode this way lives on the device in a `MassStore`: per layer
  `[R + 1, Hkv, Lm]` fp32, one row per sequence, the last row scratch (padding rows, rows
  that keep no mass). Each layer of a step gathers the rows of its batch (`mass_rows [B]`),
  the decode kernel adds the step's probabilities (its `attn_mass` output; the reference's
  off CUDA) and the rows are written back. Eviction reads a row, compacts, and writes it back;
  a step on the host path first reads it back into the bookkeeping (runtime.py `_pull_mass`).
- SinkWindow with its sinks re-rotated to sit just before the window (sink_positions="cache",
  the default): slots [0, n_rot) hold the sinks (compaction keeps slot order) and their scores
  use the query rotated by -shift, where shift is the number of tokens evicted so far
  (SinkWindow evicts the run of tokens after the sinks, so the oldest kept token is
  sinks + shift). The decode kernel scores them itself (its `rot` input: cos / sin of the
  rotation per row, computed here once per step; the query is rotated in registers), in the
  same softmax as the other slots.

- SinkWindow with its sinks at their text positions (sink_positions="original") evicts without
  moving a token (runtime.py `_evict_window`): pages wholly between the sinks and the window
  leave the block table, and the tokens left between them, stored slots [hide_lo, hide_hi) of
  each row (less than a page past the sinks' pages), are hidden from the kernel by a key mask
  of `hidden` columns (keys past it are seen; a multiple of 16, which the sm_90 kernel reads
  without a copy), built once per step. A step whose only need is that mask runs the packed
  decode path of a step without eviction (runtime/dispatch.py `_packed_decode`, the mask
  passed on): the same ops, kernel and output dtype.

Shapes depend only on the graph's bucket and its `AsideSpec` (mass length, sink count, hidden
columns); before
each replay the host writes each row's mass row, shift and sink count into static buffers.

    out = attend_aside(state, store, layer, q, plan, softcap, scale, inv_freq)
    # q: [1, Hq, B, D] packed (one token per sequence) -> out [1, Hq, B, Dv]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.eviction.attend import rotate_half
from kvcompile.kernels.reference import masked_softmax
from kvcompile.runtime.kernel_formats import kernel_readable

MASS_ALIGN = 64   # the store's length is a multiple of this (fewer regrowths, graph variants)


@dataclass(frozen=True)
class AsideSpec:
    """What the decode steps of one graph do for eviction: add H2O mass to rows of a store of
    `mass_len` slots (0: no mass), score the first slots of rows with a rotated query, up to
    `sinks` of them (0: no rotation). The empty spec is the plain decode step."""

    mass_len: int = 0
    sinks: int = 0
    hidden: int = 0   # key-mask columns of rows whose window hides slots (0: none)

    def __bool__(self) -> bool:
        return bool(self.mass_len or self.sinks or self.hidden)


@dataclass
class AsideInputs:
    """Per-row inputs of a step (device tensors; a graph's static buffers when replayed).
    mass_rows [B] int64: the store row of each batch row; shift [B] int64: sink rotation in
    positions; n_rot [B] int64: how many leading slots are re-rotated sinks (0: none);
    hide_lo, hide_hi [B] int64: stored slots [lo, hi) hidden from the row's query (lo = hi:
    none)."""

    spec: AsideSpec
    mass_rows: torch.Tensor
    shift: torch.Tensor
    n_rot: torch.Tensor
    hide_lo: torch.Tensor | None = None
    hide_hi: torch.Tensor | None = None

    def key_mask(self) -> torch.Tensor | None:
        """[B, hidden] bool, False at the hidden slots (None: nothing hidden). Built once per
        step (attend_aside caches it), read by every layer's kernel as it is."""
        if not self.spec.hidden:
            return None
        j = torch.arange(self.spec.hidden, device=self.hide_lo.device)[None, :]
        return (j < self.hide_lo[:, None]) | (j >= self.hide_hi[:, None])


class MassStore:
    """H2O mass of the sequences decoding aside: per layer [rows + 1, Hkv, length] fp32."""

    def __init__(self, heads: dict[int, int], rows: int, length: int, device):
        self.rows, self.length = rows, length
        self.mass = {li: torch.zeros(rows + 1, h, length, dtype=torch.float32, device=device)
                     for li, h in heads.items()}
        self.row_of: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    @property
    def scratch(self) -> int:
        return self.rows

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.mass.values())

    def take(self, sid: int) -> int | None:
        if sid in self.row_of:
            return self.row_of[sid]
        if not self._free:
            return None
        r = self.row_of[sid] = self._free.pop()
        return r

    def give_back(self, sid: int) -> None:
        r = self.row_of.pop(sid, None)
        if r is not None:
            self._free.append(r)

    def write(self, row: int, mass: dict[int, torch.Tensor]) -> None:
        """Row `row` := the bookkeeping's mass [Hkv, L] per layer, zeros after L."""
        for li, m in mass.items():
            dst = self.mass[li][row]
            n = m.shape[1]
            dst[:, :n].copy_(m)
            dst[:, n:].zero_()

    def read(self, row: int, layers, length: int) -> dict[int, torch.Tensor]:
        return {li: self.mass[li][row, :, :length].clone() for li in layers}

    def grown(self, length: int) -> MassStore:
        """A store of `length` slots holding this one's rows (a longer H2O budget arrived)."""
        heads = {li: t.shape[1] for li, t in self.mass.items()}
        dev = next(iter(self.mass.values())).device
        new = MassStore(heads, self.rows, length, dev)
        for li, t in self.mass.items():
            new.mass[li][:, :, :self.length].copy_(t)
        new.row_of, new._free = dict(self.row_of), list(self._free)
        return new


def store_length(need: int) -> int:
    return -(-need // MASS_ALIGN) * MASS_ALIGN


def sink_rotation(inv_freq: torch.Tensor, shift: torch.Tensor):
    """cos, sin [B, D] of RoPE rotations by -shift[b] positions (HF rotate_half layout): the
    same double-precision products as attend.py `rotation`, so the scores are the host path's."""
    ang = inv_freq.double()[None, :] * (-shift).double()[:, None]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def attend_aside(state, store: MassStore | None, layer: int, q: torch.Tensor, plan,
                 softcap: float, scale: float, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """q [1, Hq, B, D] packed, one token per sequence -> [1, Hq, B, Dv] (the module docstring);
    or, a `generate` decode step (plan not packed, integrations/hf_graphs.py), q [B, Hq, 1, D]
    -> [B, Hq, 1, Dv]. The decode kernel where it reads the pages (CUDA, or
    kernels="triton"), else the plain PyTorch `aside_reference`; both without a host sync."""
    a = plan.aside
    pool = state.pool
    kc, vc = pool.k[layer], pool.v[layer]
    key_mask = None
    if a.spec.hidden:   # one mask per forward, shared by the layers
        key_mask = plan.cache.get("eviction_key_mask")
        if key_mask is None:
            key_mask = plan.cache["eviction_key_mask"] = a.key_mask()
    if not (a.spec.mass_len or a.spec.sinks):
        # a key mask only (SinkWindow with its sinks at their text positions): the packed
        # decode step of no eviction, with the mask (the same ops, kernel and output dtype)
        from kvcompile.runtime.dispatch import _packed_decode

        out = _packed_decode(state, layer, q, plan, 0, softcap, scale, {}, key_mask=key_mask)
        if out is not None:
            return out
    packed = plan.packed
    qd = q[0].transpose(0, 1).unsqueeze(2).contiguous() if packed else q.contiguous()
    mass = None
    if a.spec.mass_len:
        mass = store.mass[layer].index_select(0, a.mass_rows)   # [B, Hkv, Lm]
    rot = None
    if a.spec.sinks:   # one rotation per forward, shared by the layers
        if inv_freq is None:
            raise UnsupportedShapeError("eviction: re-rotated sinks need the model's RoPE "
                                        "inv_freq (the eviction pass found none)")
        rot = plan.cache.get(("eviction_sink_rot", id(inv_freq)))
        if rot is None:
            cos, sin = sink_rotation(inv_freq, a.shift)
            rot = (a.n_rot, cos, sin, a.spec.sinks)
            plan.cache[("eviction_sink_rot", id(inv_freq))] = rot
    out = None
    if state.kernels.use_triton(q.device):
        out = _kernel(state, qd, kc, vc, plan, scale, softcap, mass, rot, key_mask)
    if out is None:
        out = aside_reference(qd, kc, vc, plan.block_tables, plan.seq_lens, scale, softcap,
                              mass, rot, key_mask)
        state.count("eviction_aside_reference")
    if mass is not None:
        store.mass[layer].index_copy_(0, a.mass_rows, mass)
    return out.squeeze(2).transpose(0, 1).unsqueeze(0) if packed else out


def attend_aside_latent(state, store: MassStore, layer: int, q_lat: torch.Tensor, plan,
                        scale: float, latent_kernel) -> torch.Tensor:
    """An H2O decode step of an MLA layer stepped aside for (one token a row, the stored slots
    exactly the kept tokens, no sink to re-rotate: latent layers compact and keep sinks at
    their text positions): `latent_kernel` (runtime/dispatch.py `_latent_kernel`) attends
    over the stored slots and adds each slot's probability, summed over the query heads, to
    the batch's rows of the mass store (the latent kernel's attn_mass output; no second
    pass), else the plain PyTorch `aside_reference` over the latent pages; no host sync
    either way. q_lat: the absorbed query ([B, H, 1, r + dr], or [1, H, B, r + dr] packed)
    -> the weighted latents in its layout, fp32."""
    a, pool = plan.aside, state.pool
    if a.spec.sinks or a.spec.hidden:
        raise UnsupportedShapeError("eviction: a latent (MLA) decode step with sinks to "
                                    "re-rotate or hidden slots (latent layers compact and "
                                    "keep sinks at their text positions)")
    mass = store.mass[layer].index_select(0, a.mass_rows)              # [B, 1, Lm]
    o = latent_kernel(state, q_lat, pool.k[layer], pool.v[layer], plan, None, None, 0, 0.0,
                      scale, attn_mass=mass)
    if o is not None:
        o_lat, route = o
        state.count(f"latent_decode_{route}")
    else:
        qd = q_lat[0].transpose(0, 1).unsqueeze(2) if plan.packed else q_lat   # [B, H, 1, W]
        o_lat = aside_reference(qd, pool.k[layer], pool.v[layer], plan.block_tables,
                                plan.seq_lens, scale, 0.0, mass, latent=True)
        if plan.packed:
            o_lat = o_lat.squeeze(2).transpose(0, 1).unsqueeze(0)
        state.count("eviction_aside_reference")
    store.mass[layer].index_copy_(0, a.mass_rows, mass)
    return o_lat


def _kernel(state, qd, kc, vc, plan, scale, softcap, mass, rot, key_mask=None):
    if not (kernel_readable(kc) and kernel_readable(vc)):
        state.kernels._fallback(f"eviction aside decode: {kc.fmt.name}/{vc.fmt.name} pages "
                                f"have no Triton decode kernel")
        return None
    try:
        out = kernel_aside(qd, kc, vc, plan.block_tables, plan.seq_lens, scale, softcap, mass,
                           rot, key_mask)
    except (ImportError, UnsupportedShapeError) as e:
        state.kernels._fallback(f"eviction aside decode: {e}")
        return None
    state.count("eviction_aside_kernel")
    return out


def kernel_aside(qd, kc, vc, block_tables, seq_lens, scale: float, softcap: float, mass=None,
                 rot=None, key_mask=None) -> torch.Tensor:
    """`aside_reference`'s contract on the decode kernel: hidden slots masked (key_mask),
    `mass` added (its attn_mass output), the rows' sinks scored inside the kernel by the query
    rotated in registers (its `rot` input: slots < n_rot, one softmax, so the mass of a row
    with sinks includes theirs). -> [B, Hq, 1, Dv] in q's dtype (as the plain decode step; the
    attention op's output dtype, so no cast follows). Without sinks to rotate the kernel is
    the decode path's default (the CUDA kernel for fp8 pages on Hopper), else Triton."""
    from kvcompile.kernels.decode import paged_decode_attention

    out = paged_decode_attention(qd, kc, vc, block_tables, seq_lens, scale, key_mask=key_mask,
                                 softcap=softcap, attn_mass=mass, direct=True,
                                 backend="triton" if rot is not None else "auto",
                                 rot=None if rot is None else tuple(rot[:3]))
    return out


def _rotated_scores(qd, k, n_rot, cos, sin, scale, softcap):
    """Scores [B, Hkv, G, n] of the rotated query against keys k [B, Hkv, n, D]; -inf past
    each row's n_rot."""
    B, Hq, _, D = qd.shape
    Hkv, n = k.shape[1], k.shape[2]
    qf = qd.float()[:, :, 0]                                         # [B, Hq, D]
    qr = qf * cos[:, None] + rotate_half(qf) * sin[:, None]
    s = torch.einsum("bhgd,bhnd->bhgn", qr.view(B, Hkv, Hq // Hkv, D), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = torch.arange(n, device=qd.device)[None, :] < n_rot[:, None]   # [B, n]
    return torch.where(seen[:, None, None], s, float("-inf")), seen


def aside_reference(qd, kc, vc, block_tables, seq_lens, scale: float, softcap: float,
                    mass=None, rot=None, key_mask=None, latent: bool = False) -> torch.Tensor:
    """Plain PyTorch (fp32) decode over every slot of the block tables' width, with fixed
    shapes and no host sync: qd [B, Hq, 1, D]; seq_lens [B] int32 -> [B, Hq, 1, Dv] fp32.
    mass [B, Hkv, Lm] fp32 or None: += each slot's probability summed over the group;
    rot (n_rot [B], cos [B, D], sin [B, D], sinks) or None: slots < n_rot scored with the
    rotated query (the module docstring); key_mask [B, Lm] bool or None: slot j < Lm seen
    only where True (the decode kernel's key_mask); latent: MLA pages (kc the latent c, vc
    the rotary key; keys [c, k_rope], values c, one head: kernels/latent.py), qd the absorbed
    query [B, H, 1, r + dr] -> [B, H, 1, r] (the latent decode kernel's contract)."""
    B, Hq, _, D = qd.shape
    Hkv, P = kc.num_heads, kc.page_size
    W = block_tables.shape[1]
    L = W * P
    pages = block_tables.long().reshape(-1)
    k = kc.read(pages).view(B, W, Hkv, P, -1).transpose(1, 2).reshape(B, Hkv, L, -1)
    v = vc.read(pages).view(B, W, Hkv, P, -1).transpose(1, 2).reshape(B, Hkv, L, -1)
    if latent:
        k, v = torch.cat([k, v], -1), k
    G = Hq // Hkv
    s = torch.einsum("bhgd,bhld->bhgl", qd.float()[:, :, 0].view(B, Hkv, G, D), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if rot is not None:
        n_rot, cos, sin, sinks = rot
        n = min(sinks, L)
        sr, seen = _rotated_scores(qd, k[:, :, :n], n_rot, cos, sin, scale, softcap)
        s = torch.cat([torch.where(seen[:, None, None], sr, s[..., :n]), s[..., n:]], -1)
    allowed = torch.arange(L, device=qd.device)[None, :] < seq_lens[:, None].long()  # [B, L]
    if key_mask is not None:
        n = min(L, key_mask.shape[1])
        allowed = torch.cat([allowed[:, :n] & key_mask[:, :n], allowed[:, n:]], 1)
    p = masked_softmax(s, allowed[:, None, None, :])                  # [B, Hkv, G, L]
    v = torch.where(allowed[:, None, :, None], v, 0.0)
    out = torch.einsum("bhgl,bhld->bhgd", p, v).reshape(B, Hq, 1, -1)
    if mass is not None:
        n = min(L, mass.shape[2])
        mass[:, :, :n] += p.sum(2)[:, :, :n]
    return out
