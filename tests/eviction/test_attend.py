"""Attention over kept slots: equal to dense attention over the same tokens in logical order,
with the model's mask mapped through positions, and sink re-rotation equal to re-encoding."""

from __future__ import annotations

import torch

from kvcompile.eviction.attend import attend_kept, rotate_half, rotation
from kvcompile.kernels.dense import dense_attention
from kvcompile.testing import assert_rel_close

HQ, HKV, D = 4, 2, 16


def _qkv(S, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HQ, S, D, generator=g), torch.randn(HKV, L, D, generator=g),
            torch.randn(HKV, L, D, generator=g))


def test_identity_positions_equal_dense_causal():
    q, k, v = _qkv(5, 12)
    pos = torch.arange(12).expand(HKV, 12)
    out, mass, _ = attend_kept(q, k, v, pos, torch.arange(7, 12), 0.25, want_mass=True)
    ref = dense_attention(q[None], k[None], v[None], None, 0.25, True, 0, 0.0)[0]
    assert_rel_close(out, ref, torch.float32)
    torch.testing.assert_close(mass.sum(-1), torch.full((HKV,), 2.0 * 5))  # G rows x S


def test_scattered_slots_with_holes_equal_dense_over_kept_tokens():
    q, k, v = _qkv(3, 10, seed=1)
    # head 0 keeps logical 0, 4, 7, 8, 9 (slots scrambled), head 1 keeps 1, 2, 7, 8, 9
    pos = torch.tensor([[7, 0, -1, 9, 4, 8, -1, -1, -1, -1],
                        [2, 9, 8, 1, 7, -1, -1, -1, -1, -1]])
    mask = torch.rand(1, 3, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[..., 9] = True
    out, _, _ = attend_kept(q, k, v, pos, torch.tensor([9, 10, 11]), 0.3, mask_b=mask,
                            total=12, causal=True)
    for h in range(HKV):
        slots = (pos[h] >= 0).nonzero()[:, 0]
        order = slots[pos[h][slots].argsort()]
        lp = pos[h][order]
        allowed = mask[0][:, lp] & (lp[None] <= torch.tensor([9, 10, 11])[:, None])
        qh = q[2 * h:2 * h + 2]
        s = torch.einsum("gsd,ld->gsl", qh, k[h, order]) * 0.3
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        ref = torch.einsum("gsl,ld->gsd", p, v[h, order])
        assert_rel_close(out[2 * h:2 * h + 2], ref, torch.float32)


def _rope(x, p, inv_freq):
    cos, sin = rotation(inv_freq, float(p))
    return x * cos + rotate_half(x) * sin


def test_sink_rotation_equals_keys_encoded_at_shifted_positions():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    g = torch.Generator().manual_seed(3)
    q_raw, k_raw = torch.randn(HQ, 1, D, generator=g), torch.randn(HKV, 6, D, generator=g)
    v = torch.randn(HKV, 6, D, generator=g)
    pos = torch.tensor([0, 1, 50, 51, 52, 53]).expand(HKV, 6)
    q = _rope(q_raw, 53, inv_freq)
    k = torch.stack([torch.stack([_rope(k_raw[h, j], int(pos[h, j]), inv_freq)
                                  for j in range(6)]) for h in range(HKV)])
    shift = 48                                        # sinks moved to 48, 49: before the window
    k_moved = k.clone()
    for h in range(HKV):
        for j in (0, 1):
            k_moved[h, j] = _rope(k_raw[h, j], j + shift, inv_freq)
    ref, _, _ = attend_kept(q, k_moved, v, pos, torch.tensor([53]), 0.25)
    sinks = torch.tensor([[0, 1]] * HKV)
    out, _, _ = attend_kept(q, k, v, pos, torch.tensor([53]), 0.25, sink_slots=sinks,
                            sink_rot=rotation(inv_freq, -shift))
    assert_rel_close(out, ref, torch.float32, factor=5)
    plain, _, _ = attend_kept(q, k, v, pos, torch.tensor([53]), 0.25)
    assert (plain - ref).abs().max() > 1e-4
