"""The decode kernel's rotated leading keys (kernels/decode.py `rot`: the re-rotated sinks of
eviction/aside.py, scored by the query rotated in registers inside the kernel's softmax)
against the plain PyTorch `aside_reference`, under TRITON_INTERPRET: GQA, bf16 pages, fp8
with token / page / channel scales and int4 codes (int zero points: the rotated query's sum),
direct and split-K launches, softcap, H2O mass, rows with and without sinks to rotate in one
batch; a row without sinks is the plain kernel's bit for bit, and without the rotation the
rows with sinks differ (the comparison can fail). Int4 channel scales with residual pages
(two-page PAIR tiles): test_aside.py."""

from __future__ import annotations

import os

import pytest
import torch

from kvcompile.errors import UnsupportedShapeError
from kvcompile.eviction.aside import aside_reference, sink_rotation
from kvcompile.kernels.decode import launch_decode, paged_decode_attention
from kvcompile.testing import kernel_rel_err, rel_err
from tests.kernels.kernel_cases import compute_dtype, make_format, make_paged_kv

LENS = [37, 20, 53, 9]
N_ROT = [2, 0, 40, 12]    # 0: none; 40 spans tiles and pages; 12 > the row's 9 tokens
SHIFT = [5, 0, 11, 300]   # rotation by -shift positions
HKV, D, P = 2, 64, 16
FORMATS = [("bf16",), ("fp8_e4m3", "token"), ("fp8_e4m3", "page"), ("fp8_e4m3", "channel"),
           ("int4", "token")]


def _inputs(fmt, G: int, seed: int, n_rot=N_ROT, dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    f = make_format(*fmt)
    kc, vc, bt, lens = make_paged_kv(f, f, LENS, HKV, D, P, device="cpu", gen=gen)
    q = torch.randn(len(LENS), HKV * G, 1, D, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cos, sin = sink_rotation(inv_freq, torch.tensor(SHIFT))
    n = torch.tensor(n_rot, dtype=dtype)
    mass0 = torch.rand(len(LENS), HKV, 64, generator=gen)   # mass accumulated before the step
    return kc, vc, bt, lens, q, (n, cos, sin), mass0


def _kernel(q, kc, vc, bt, lens, softcap, splits, rot=None, mass=None, config=None):
    """The launcher with `splits` splits and `config` (None: its default tiles)."""
    out = torch.empty(*q.shape[:3], D, dtype=q.dtype)
    launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt, lens, None,
                  mass, out, kc.fmt.name, kc.fmt.granularity, vc.fmt.name, vc.fmt.granularity,
                  D ** -0.5, 0, 0, softcap, splits,
                  config, kz=kc.zero, vz=vc.zero,
                  backend="triton", rot=rot)
    return out.float()


_LAUNCHES = [("direct", 1, None), ("split3", 3, {"BLOCK_T": 16}),
             ("split3-nopeel", 3, {"BLOCK_T": 16, "ROT_PEEL": 0})]
_GS = [(1, 0.0), (4, 30.0)]
# every format and every launch meet both (G, softcap); KVCOMPILE_TEST_FULL=1: every triple
# (30 cases against 15, ~30 s of the test command under the interpreter)
ROT_CASES = [(fmt, *_GS[g], splits, config, f"{name}-{g_}-{sc}-{'-'.join(fmt)}")
             for fi, fmt in enumerate(FORMATS) for li, (name, splits, config) in
             enumerate(_LAUNCHES) for g, (g_, sc) in enumerate(_GS)
             if os.environ.get("KVCOMPILE_TEST_FULL") or (fi + li) % 2 == g]


@pytest.mark.parametrize("fmt,G,softcap,splits,config",
                         [c[:5] for c in ROT_CASES], ids=[c[5] for c in ROT_CASES])
def test_rotated_keys_equal_reference(fmt, G, softcap, splits, config):
    """Direct launches with the default tile (128 keys: every sink in the first tile), and
    three splits of 16-key tiles (40 sinks over three tiles and two splits), with the tiles
    that hold rotated keys in a loop of their own (ROT_PEEL) or masked in the split's loop."""
    kc, vc, bt, lens, q, rot, mass0 = _inputs(fmt, G, seed=G + splits)
    mass_ref = mass0.clone()
    want = aside_reference(q, kc, vc, bt, lens, D ** -0.5, softcap, mass_ref,
                           (*rot, max(N_ROT)))
    mass = mass0.clone()
    got = _kernel(q, kc, vc, bt, lens, softcap, splits, rot, mass, config)
    tol = kernel_rel_err(compute_dtype(kc.fmt, "cpu"), "cpu")
    for b in range(len(LENS)):
        assert rel_err(got[b], want[b]) <= tol, f"row {b}"
        assert rel_err(mass[b], mass_ref[b]) <= tol, f"mass of row {b}"
    assert rel_err(mass[2], mass0[2]) > 1e-2, "the step added no mass"
    # the plain kernel: the row without sinks bit for bit, the rows with sinks off the reference
    plain = _kernel(q, kc, vc, bt, lens, softcap, splits, config=config)
    assert torch.equal(plain[1], got[1])
    for b in (0, 2, 3):
        assert rel_err(plain[b], want[b]) > 10 * tol, f"row {b} without the rotation"


@pytest.mark.parametrize("fmt", FORMATS[1:2], ids=lambda f: "-".join(f))
def test_no_rotated_key_is_the_plain_kernel(fmt):
    """n_rot 0 in every row (int64, as the graphs' static buffers hold it): the output and
    the mass are the plain kernel's, bit for bit (the rotated dots never run)."""
    kc, vc, bt, lens, q, rot, mass0 = _inputs(fmt, 4, seed=7, n_rot=[0] * len(LENS),
                                              dtype=torch.int64)
    m1, m2 = mass0.clone(), mass0.clone()
    got = _kernel(q, kc, vc, bt, lens, 0.0, 1, rot, m1)
    plain = _kernel(q, kc, vc, bt, lens, 0.0, 1, None, m2)
    assert torch.equal(got, plain) and torch.equal(m1, m2)


def test_rot_contract():
    kc, vc, bt, lens, q, (n, cos, sin), _ = _inputs(("bf16",), 2, seed=0)
    with pytest.raises(UnsupportedShapeError, match="backend='triton'"):
        paged_decode_attention(q, kc, vc, bt, lens, 0.1, direct=True, rot=(n, cos, sin))
    with pytest.raises(UnsupportedShapeError, match="rot needs direct=True"):
        paged_decode_attention(q, kc, vc, bt, lens, 0.1, rot=(n, cos, sin))
    with pytest.raises(UnsupportedShapeError, match=r"cos must be contiguous fp32 \[4, 64\]"):
        paged_decode_attention(q, kc, vc, bt, lens, 0.1, direct=True, backend="triton",
                               rot=(n, cos[:, :32], sin))
    with pytest.raises(UnsupportedShapeError, match="n_rot must be contiguous int32"):
        paged_decode_attention(q, kc, vc, bt, lens, 0.1, direct=True, backend="triton",
                               rot=(n.float(), cos, sin))
