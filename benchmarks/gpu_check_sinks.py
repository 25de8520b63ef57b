"""Attention sinks (sink_logits [Hq]) in the compiled Triton kernels, on the GPU (H200).

    python benchmarks/gpu_check_sinks.py

The paged decode kernel (one split: the direct epilogue; several: the combine) and the chunked
prefill kernel, bf16 / fp16 / fp8 pages, against the fp32 references of kernels/reference.py
on fresh random inputs, outputs poisoned with NaN; the CPU tests (tests/kernels/
test_sink_logits.py) run the same kernels under the interpreter in fp32 only. Also checks that
the CUDA decode kernel declines sinks (fast_path_reason). Exit status 1 if any case fails.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from kvcompile.kernels import prefill_launch as L  # noqa: E402
from kvcompile.kernels.decode import fast_path_reason  # noqa: E402
from kvcompile.kernels.reference import paged_prefill_attention_ref  # noqa: E402
from kvcompile.testing import REL_ERR, poison_, rel_err  # noqa: E402
from tests.kernels.kernel_cases import make_format, make_paged_kv, run_case  # noqa: E402

DECODE = [  # format, granularity, head_dim, G, page, Sq, splits, lens
    ("bf16", "page", 128, 4, 16, 1, 1, [300, 17]),
    ("bf16", "page", 128, 8, 32, 3, 0, [4000, 129, 1]),
    ("fp16", "page", 64, 4, 16, 1, 7, [1000, 33]),
    ("fp8_e4m3", "page", 128, 4, 16, 1, 0, [2048, 70]),
    ("fp8_e4m3", "token", 128, 8, 64, 2, 1, [511]),
]
PREFILL = [  # format, head_dim, G, page, lens, q_lens, q dtype
    ("bf16", 128, 4, 16, [300, 77], [300, 20], torch.bfloat16),
    ("fp16", 64, 8, 32, [129, 64], [64, 64], torch.float16),
    ("fp8_e4m3", 128, 4, 16, [256, 40], [100, 40], torch.bfloat16),
]


def main() -> int:
    dev = "cuda"
    failed = 0
    gen = torch.Generator().manual_seed(0)
    for fmt, gran, D, G, P, Sq, splits, lens in DECODE:
        Hkv = 2
        sinks = (torch.randn(Hkv * G, generator=gen) * 2).to(dev)
        f = make_format(fmt, gran)
        err, bound, _, (mass, mass_ref) = run_case(
            f, f, lens, Hkv, G, D, P, Sq=Sq, splits=splits, with_mass=True, device=dev,
            gen=gen, q_dtype=torch.bfloat16, sink_logits=sinks)
        bound = max(bound, REL_ERR[torch.bfloat16])
        mass_err = rel_err(mass, mass_ref)
        ok = err <= bound and mass_err <= 1e-3
        failed += not ok
        print(f"decode  {fmt:9s} {gran:5s} D{D} G{G} P{P} Sq{Sq} splits{splits}: "
              f"rel err {err:.2e} (bound {bound:.1e}), mass {mass_err:.1e} "
              f"{'ok' if ok else 'FAIL'}")
    for fmt, D, G, P, lens, q_lens, dtype in PREFILL:
        Hkv = 2
        f = make_format(fmt, "page")
        kc, vc, bt, sl = make_paged_kv(f, f, lens, Hkv, D, P, device=dev, gen=gen)
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        cu = torch.tensor(cu, dtype=torch.int32, device=dev)
        q = torch.randn(int(cu[-1]), Hkv * G, D, generator=gen).to(dev, dtype)
        sinks = (torch.randn(Hkv * G, generator=gen) * 2).to(dev)
        out = poison_(torch.empty_like(q))
        L.launch_paged_prefill(q, out, (f.name, f.granularity, kc.data, kc.scale, kc.micro),
                               (f.name, f.granularity, vc.data, vc.scale, vc.micro), bt, cu, sl,
                               None, D ** -0.5, 0, 0, 0.0, max(q_lens), sink_logits=sinks)
        ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, D ** -0.5, sink_logits=sinks)
        err = rel_err(out, ref)
        bound = REL_ERR[torch.bfloat16]
        ok = err <= bound
        failed += not ok
        print(f"prefill {fmt:9s} D{D} G{G} P{P} q_lens {q_lens}: rel err {err:.2e} "
              f"(bound {bound:.1e}) {'ok' if ok else 'FAIL'}")
    q = torch.randn(1, 8, 1, 128, device=dev, dtype=torch.bfloat16)
    why = fast_path_reason(q, "bf16", "page", "bf16", "page", 128, 128, 16, 4, sinks=True)
    ok = "sink" in why
    failed += not ok
    print(f"CUDA decode kernel with sinks: {why!r} {'ok' if ok else 'FAIL'}")
    print(f"{'all passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
