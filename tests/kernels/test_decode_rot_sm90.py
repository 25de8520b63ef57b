"""The paged decode kernel compiled for sm_90 (Hopper) on a machine without a GPU, with and
without rotated leading keys (`rot`, HAS_ROT: the re-rotated sinks of eviction/aside.py), in
the column layouts the rotated query is loaded in: all columns (bf16 pages), first / second
halves (fp8, SPLIT), even / odd (int4 channel scales, two-page PAIR tiles, residual rows), and
beside H2O's attn_mass output. The launches go through the real launcher (its tile configs),
with a stand-in driver that reports an sm_90 target and `warmup` in place of the launch. The
interpreter accepts what the compiler refuses (a non-constexpr global read in a kernel, a
variable whose shape differs between the branches of an `if`); the negative case is such a
kernel, which must fail here. Not a substitute for the CUDA run, and this Triton may differ
from the GPU image's."""

from __future__ import annotations

import json

import pytest
import triton
import triton.language as tl

from tests.kernels.sm90_compile import compile_rows, innermost_error

pytestmark = pytest.mark.slow   # 12 compiles, about a minute on the 2-core machine

# (pages, scale granularity, page size, attn_mass): SmolLM2's heads (9 / 3, head_dim 64)
CASES = [("bf16", "page", 16, False), ("fp8_e4m3", "token", 16, False),
         ("fp8_e4m3", "token", 16, True), ("fp8_e4m3", "page", 16, False),
         ("int4", "channel", 32, False)]
# and fp8 token scales with the launcher's ROT_PEEL off (one masked loop): 2 * 5 + 1 kernels
_NOT_CONSTEXPR = 3   # a plain global: the GPU compiler refuses to read it in a kernel


@triton.jit
def _reads_a_global(X):
    tl.store(X, tl.load(X) * _NOT_CONSTEXPR)


def _stand_in():
    """An sm_90 target for Triton, and a launcher that compiles (`warmup`) instead of running
    and accepts CPU tensors (its contract asks for CUDA ones outside the interpreter)."""
    import kvcompile.kernels.decode as dec
    from kvcompile.testing import install_sm90_stand_in

    install_sm90_stand_in()
    check = dec._check

    def check_on_cpu(*a):
        dec.interpreting = lambda: True
        try:
            return check(*a)
        finally:
            dec.interpreting = lambda: False

    dec._check, dec.interpreting, dec._sm_count = check_on_cpu, (lambda: False), (lambda d: 132)
    return dec


def _compiled(fn, grid, *args, **kw) -> str:
    try:
        fn.warmup(*args, grid=grid, **kw)
    except Exception as e:  # reported to the test, which fails with the innermost cause
        return innermost_error(e)
    return "ok"


def _main() -> None:
    import torch

    from kvcompile.eviction.aside import sink_rotation
    from tests.kernels.kernel_cases import make_format, make_paged_kv

    dec = _stand_in()
    real = dec.decode_split_kernel
    result = []

    class Warmup:   # stands in for decode_split_kernel[grid](...)
        def __getitem__(self, grid):
            return lambda *a, **kw: result.append((_compiled(real, grid, *a, **kw), kw))

    class Skip:   # the combine and attn_mass kernels: unchanged by rot, not compiled here
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    dec.decode_split_kernel, dec.attn_mass_kernel, dec.combine_splits_kernel = \
        Warmup(), Skip(), Skip()
    Hkv, G, D = 3, 3, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    for name, gran, page, mass in CASES:
        gen = torch.Generator().manual_seed(0)
        f = make_format(name, gran, residual=name == "int4")
        kc, vc, bt, lens = make_paged_kv(f, f, [70, 33], Hkv, D, page, device="cpu", gen=gen)
        q = torch.randn(2, Hkv * G, 1, D, dtype=torch.bfloat16, generator=gen)
        cos, sin = sink_rotation(inv_freq, torch.tensor([9, 0]))
        sinks = (torch.tensor([4, 0]), cos, sin)
        for rot, cfg in ((None, None), (sinks, None), (sinks, {"ROT_PEEL": 0})):
            if cfg is not None and (name, gran, mass) != ("fp8_e4m3", "token", False):
                continue
            result.clear()
            m = torch.zeros(2, Hkv, 72) if mass else None
            dec.launch_decode(q, kc.data, kc.scale, kc.micro, vc.data, vc.scale, vc.micro, bt,
                              lens, None, m, None, name, gran, name, gran, D ** -0.5, 0, 0,
                              0.0, 1, cfg, kz=kc.zero, vz=vc.zero, k_res=kc.res_data,
                              k_res_slot=kc.res_slot, v_res=vc.res_data,
                              v_res_slot=vc.res_slot, backend="triton", rot=rot)
            (msg, kw), = result
            label = f"{name} {gran}{' mass' if mass else ''} rot={rot is not None} {cfg or ''}"
            flags = {k: kw[k] for k in ("HAS_ROT", "ROT_PEEL", "SPLIT", "PAIR", "KRES", "ASM")}
            print(json.dumps([label, msg, flags]), flush=True)
    x = torch.zeros(16)
    print(json.dumps(["negative: a non-constexpr global",
                      _compiled(_reads_a_global, (1,), x), {}]), flush=True)


def test_decode_kernel_with_rotated_keys_compiles_for_sm90():
    rows = compile_rows("tests.kernels.test_decode_rot_sm90")
    assert len(rows) == 2 * len(CASES) + 2, rows
    *kernels, negative = rows
    bad = [f"{label}: {msg}" for label, msg, _ in kernels if msg != "ok"]
    assert not bad, "\n".join(bad)
    assert sum(f["HAS_ROT"] for _, _, f in kernels) == len(CASES) + 1
    assert any(f["HAS_ROT"] and not f["ROT_PEEL"] for _, _, f in kernels)
    # the layouts the rotated query is loaded in were reached: SPLIT halves, PAIR tiles with
    # residual rows (even / odd columns)
    assert any(f["HAS_ROT"] and f["SPLIT"] for _, _, f in kernels)
    assert any(f["HAS_ROT"] and f["PAIR"] and f["KRES"] for _, _, f in kernels)
    assert negative[1] != "ok", "the stand-in compiled a kernel the GPU compiler refuses"
