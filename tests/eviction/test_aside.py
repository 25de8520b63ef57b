"""Decode steps eviction steps aside for (eviction/aside.py): the fixed-shape reference against
the host path's attention (eviction/attend.py `attend_kept`, re-rotated sinks and H2O mass
included), the Triton kernel (sinks scored inside it) against that reference. The kernel's
`rot` input on its own: test_rot_kernel.py."""

from __future__ import annotations

import pytest
import torch

from kvcompile.eviction.aside import aside_reference, kernel_aside, sink_rotation
from kvcompile.eviction.attend import attend_kept, rotation
from kvcompile.kernels.reference import gather_pages
from kvcompile.testing import ASSERT_CLOSE, kernel_rel_err, rel_err
from tests.kernels.kernel_cases import compute_dtype, make_format, make_paged_kv

LENS = [37, 20, 53]
N_ROT = [2, 0, 3]       # re-rotated sinks per row (0: none)
SHIFT = [5, 0, 11]      # tokens evicted after them
HKV, G, D, P = 2, 2, 64, 16


def _inv_freq(d: int = D) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _case(fmt=("fp32",), seed: int = 0, page: int = P):
    gen = torch.Generator().manual_seed(seed)
    f = make_format(*fmt[:2], residual=len(fmt) > 2) if len(fmt) > 1 else make_format(fmt[0])
    kc, vc, bt, lens = make_paged_kv(f, f, LENS, HKV, D, page, device="cpu", gen=gen)
    q = torch.randn(len(LENS), HKV * G, 1, D, generator=gen)
    mass0 = torch.rand(len(LENS), HKV, 64, generator=gen)   # mass accumulated before the step
    shift = torch.tensor(SHIFT)
    cos, sin = sink_rotation(_inv_freq(), shift)
    rot = (torch.tensor(N_ROT), cos, sin, max(N_ROT))
    return kc, vc, bt, lens, q, mass0, rot


def _host_path(q, kc, vc, bt, lens, mass0, scale, softcap):
    """attend_kept row by row, as the eviction runtime attends on the host."""
    outs, masses = [], mass0.clone()
    for b, L in enumerate(lens.tolist()):
        k, v = gather_pages(kc, bt[b], L), gather_pages(vc, bt[b], L)      # [Hkv, L, D]
        pos = torch.arange(L).expand(HKV, L)
        slots = rot = None
        if N_ROT[b]:
            slots = torch.arange(N_ROT[b]).expand(HKV, N_ROT[b])
            rot = rotation(_inv_freq(), -SHIFT[b])
        o, m, _ = attend_kept(q[b], k, v, pos, torch.tensor([L - 1]), scale, softcap=softcap,
                              total=L, sink_slots=slots, sink_rot=rot, want_mass=True)
        outs.append(o)
        n = min(L, masses.shape[2])
        masses[b, :, :n] += m[:, :n]
    return torch.stack(outs), masses


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_reference_equals_host_path(softcap):
    kc, vc, bt, lens, q, mass0, rot = _case()
    scale = D ** -0.5
    want, want_mass = _host_path(q, kc, vc, bt, lens, mass0, scale, softcap)
    mass = mass0.clone()
    got = aside_reference(q, kc, vc, bt, lens, scale, softcap, mass, rot)
    atol, rtol = ASSERT_CLOSE[torch.float32]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(mass, want_mass, atol=atol, rtol=rtol)
    # without the rotation the rotated rows differ (the comparison above can fail)
    plain = aside_reference(q, kc, vc, bt, lens, scale, softcap)
    assert rel_err(plain[0], want[0]) > 1e-3 and rel_err(plain[1], want[1]) < 1e-5


@pytest.mark.parametrize("fmt", [("bf16",), ("fp8_e4m3", "page"),
                                 ("int4", "channel", "residual")],
                         ids=lambda f: "-".join(f))
def test_kernel_with_rotated_sinks_equals_reference(fmt):
    """The decode kernel (TRITON_INTERPRET on the CPU) with the sinks scored by the rotated
    query inside it and its attn_mass output: the reference's output and mass, rows with
    sinks included."""
    # (int codes with channel scales take pages of 32 or more: decode.channel_min_page)
    kc, vc, bt, lens, q, mass0, rot = _case(fmt, seed=1, page=32 if fmt[0] == "int4" else P)
    scale = D ** -0.5
    mass_ref = mass0.clone()
    want = aside_reference(q, kc, vc, bt, lens, scale, 0.0, mass_ref, rot)
    mass = mass0.clone()
    got = kernel_aside(q, kc, vc, bt, lens, scale, 0.0, mass, rot)
    tol = kernel_rel_err(compute_dtype(kc.fmt, "cpu"), "cpu")
    for b in range(len(LENS)):
        assert rel_err(got[b], want[b]) <= tol, f"row {b}"
        assert rel_err(mass[b], mass_ref[b]) <= tol, f"mass of row {b}"
    assert rel_err(mass[1], mass0[1]) > 1e-2, "the step added no mass"


@pytest.mark.parametrize("fmt", [("bf16",), ("int4", "channel", "residual")],
                         ids=lambda f: "-".join(f))
def test_reference_and_sink_rotation_have_no_host_sync(fmt):
    """What runs inside a replayed step on quantized pages off the kernel (dequantization by
    PagedTensor.read, the rotated sinks' scores) and beside it (the rotation's cos / sin)
    reads nothing back to the host. (Not fp8 here: its CPU-only widening, cache/fp8.py
    fp8_widen, reads a min / max on the host; on CUDA it is a cast.)"""
    from tests.engine.test_engine_eviction import _NoHostSync

    kc, vc, bt, lens, q, mass0, rot = _case(fmt, seed=2, page=32)
    with _NoHostSync():
        aside_reference(q, kc, vc, bt, lens, D ** -0.5, 0.0, mass0.clone(), rot)
        sink_rotation(_inv_freq(), torch.tensor(SHIFT))


HIDE = [(3, 20), (0, 0), (2, 9)]   # stored slots [lo, hi) a window hides, per row


def _hidden_mask(width: int = 32) -> torch.Tensor:
    from kvcompile.eviction.aside import AsideInputs, AsideSpec

    lo, hi = (torch.tensor(x) for x in zip(*HIDE))
    z = torch.zeros(len(HIDE), dtype=torch.int64)
    return AsideInputs(AsideSpec(hidden=width), z, z, z, lo, hi).key_mask()


def test_hidden_slots_equal_host_path_over_holes():
    """Slots a window hides (SinkWindow evicted without moving tokens): the reference with the
    key mask equals attend_kept over the same slots with those marked holes (pos -1), mass
    included; without the mask the rows that hide slots differ."""
    kc, vc, bt, lens, q, mass0, _ = _case(seed=3)
    scale = D ** -0.5
    km = _hidden_mask()
    assert km.shape == (3, 32) and not km[0, 3:20].any() and km[0, :3].all() and km[1].all()
    mass = mass0.clone()
    got = aside_reference(q, kc, vc, bt, lens, scale, 0.0, mass, None, km)
    atol, rtol = ASSERT_CLOSE[torch.float32]
    for b, L in enumerate(lens.tolist()):
        k, v = gather_pages(kc, bt[b], L), gather_pages(vc, bt[b], L)
        lo, hi = HIDE[b]
        pos = torch.arange(L)
        pos = torch.where((pos >= lo) & (pos < hi), -1, pos).expand(HKV, L)
        o, m, _ = attend_kept(q[b], k, v, pos, torch.tensor([L - 1]), scale, total=L,
                              want_mass=True)
        torch.testing.assert_close(got[b], o, atol=atol, rtol=rtol)
        n = min(L, mass.shape[2])
        torch.testing.assert_close(mass[b, :, :n], mass0[b, :, :n] + m[:, :n], atol=atol,
                                   rtol=rtol)
    plain = aside_reference(q, kc, vc, bt, lens, scale, 0.0)
    assert rel_err(plain[0], got[0]) > 1e-3 and rel_err(plain[1], got[1]) < 1e-6


@pytest.mark.parametrize("fmt", [("bf16",), ("fp8_e4m3", "token"), ("fp8_e4m3", "page")],
                         ids=lambda f: "-".join(f))
def test_kernel_with_hidden_slots_equals_reference(fmt):
    """The decode kernel (TRITON_INTERPRET) with the window's key mask, alone and beside
    re-rotated sinks in other rows (scored inside the kernel): the reference's output."""
    kc, vc, bt, lens, q, _, rot = _case(fmt, seed=4)
    scale = D ** -0.5
    km = _hidden_mask()
    tol = kernel_rel_err(compute_dtype(kc.fmt, "cpu"), "cpu")
    want = aside_reference(q, kc, vc, bt, lens, scale, 0.0, None, None, km)
    got = kernel_aside(q, kc, vc, bt, lens, scale, 0.0, None, None, km)
    for b in range(len(LENS)):
        assert rel_err(got[b], want[b]) <= tol, f"row {b}"
    # rows 0 and 2 hide slots and row 1 rotates no sink: give row 1 the sinks instead
    n_rot, cos, sin, sinks = rot
    rot1 = (torch.tensor([0, 2, 0]), cos, sin, sinks)
    want = aside_reference(q, kc, vc, bt, lens, scale, 0.0, None, rot1, km)
    got = kernel_aside(q, kc, vc, bt, lens, scale, 0.0, None, rot1, km)
    for b in range(len(LENS)):
        assert rel_err(got[b], want[b]) <= tol, f"row {b} beside rotated sinks"
