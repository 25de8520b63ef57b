"""Launchers of the prefill kernels: contract checks, tile configs and a small autotuner.

The launchers assert their contract (shapes, dtypes, strides, head dims) and raise
UnsupportedShapeError naming the problem and the way out. Configs are tuned once per key
(head dims, group, masks, formats, sequence-length bucket) over a handful of candidates; a
candidate that fails to compile (shared memory, an older triton) is skipped, not fatal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from kvcompile.cache.registry import (
    FMT_E2M1,
    FMT_PLAIN,
    SCALE_CODES,
    SCALE_NONE,
    SCALE_PAGE,
    SCALE_TOKEN,
    format_names,
    format_spec,
)
from kvcompile.errors import UnsupportedShapeError
from kvcompile.kernels.prefill_tiles import LOG2E, TensorDescriptor, interpreting, use_tma

HEAD_DIMS = (64, 128, 256)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_spec: bool = False

    def __str__(self):
        ws = "-ws" if self.warp_spec else ""
        return f"{self.block_m}x{self.block_n}-w{self.num_warps}-s{self.num_stages}{ws}"


# Candidates per head dim. 128x128 with 8 warps (two warpgroups of 64 rows) is FA3's tile for
# D <= 128; D = 256 halves BLOCK_N to fit K/V stages in shared memory.
_VARLEN = {
    64: [TileConfig(128, 128, 8, 3), TileConfig(128, 64, 4, 4), TileConfig(128, 128, 4, 2, True)],
    128: [TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 3), TileConfig(128, 128, 4, 2, True),
          TileConfig(128, 64, 4, 3, True)],
    256: [TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(128, 64, 4, 2, True)],
}
_PAGED = {
    64: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
    128: [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 3)],
    256: [TileConfig(128, 32, 8, 2), TileConfig(64, 64, 8, 2)],
}
INTERPRET_CONFIG = TileConfig(32, 16, 4, 1)


def candidates(table: dict, head_dim: int, group: int, warp_spec: bool) -> list[TileConfig]:
    """Configs for this head dim and group; warp-specialized ones only where they build
    (Hopper, triton's automatic warp specialization: bf16/fp16, not the FP8 kernel)."""
    cfgs = [c for c in table[head_dim] if c.block_m >= group and (warp_spec or not c.warp_spec)]
    if not cfgs:
        raise UnsupportedShapeError(
            f"prefill: {group} query heads per kv head exceeds the largest query tile (128 "
            f"rows); repeat the kv heads (k.repeat_interleave) to lower the group size.")
    return cfgs


class PrefillSwitches(NamedTuple):
    """Diagnostic switches of the packed varlen prefill (benchmarks/prefill_diag.py; set from
    KVConfig.prefill_tma / prefill_q_tma / prefill_scale_tma / prefill_warp_spec): tma=False
    forces the pointer path, q_tma=False loads only Q by pointers, scale_tma=True brings back
    the FP8 scale descriptors that fault on triton <= 3.8 (see launch_prefill), warp_spec=True
    offers the warp-specialized tiles (ws_ok), fp8_sm90=False keeps FP8 prefill on the Triton
    kernel where the Gluon one (kernels/prefill_sm90.py) would take it."""

    tma: bool = True
    q_tma: bool = True
    scale_tma: bool = False
    warp_spec: bool = False
    fp8_sm90: bool = True


DEFAULT_SWITCHES = PrefillSwitches()


def ws_ok(hopper: bool, fp8: bool, window: int, sinks: int, requested: bool = False) -> bool:
    """Whether to offer the warp-specialized tiles: Hopper, bf16/fp16 (triton 3.6's automatic
    warp specialization fails to build the FP8 kernel), one key range (not window + sinks), and
    only on request (PrefillSwitches.warp_spec): on the H200 (triton 3.6) every
    warp-specialized tile hangs (benchmarks/prefill_diag.py, 2026-11-30: none returned in 60 s,
    bf16, head_dim 64 / 128, GQA 1 / 4); the cause is not known."""
    if not requested:
        return False
    return hopper and not fp8 and not (window and sinks)


class Tuner:
    """Pick the fastest config per key by timing each once (triton.testing.do_bench)."""

    def __init__(self, name: str):
        self.name = name
        self.best: dict[tuple, TileConfig] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def run(self, key: tuple, configs: list[TileConfig], launch) -> TileConfig:
        if len(configs) == 1 or interpreting():
            launch(configs[0])
            return configs[0]
        cfg = self.best.get(key)
        if cfg is None:
            times, errors = {}, []
            for c in configs:
                try:
                    times[c] = triton.testing.do_bench(lambda c=c: launch(c), warmup=10, rep=40)
                except Exception as e:  # noqa: BLE001 - a config that does not build is skipped
                    errors.append(f"{c}: {type(e).__name__}: {str(e)[:200]}")
            if not times:
                raise RuntimeError(f"{self.name}: no tile config ran:\n" + "\n".join(errors))
            cfg = min(times, key=times.get)
            self.best[key] = cfg
            self.timings[key] = {str(c): t for c, t in times.items()} | {
                e.split(":")[0]: math.inf for e in errors}
        launch(cfg)
        return cfg


def seq_bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


def check_head_dims(op: str, d: int, dv: int) -> None:
    for name, x in (("head_dim", d), ("v head_dim", dv)):
        if x not in HEAD_DIMS:
            raise UnsupportedShapeError(
                f"{op}: {name} {x} is not supported (supported: {HEAD_DIMS}); pad the heads "
                f"to the next supported size or use KVConfig(kernels='reference').")


def check_heads(op: str, hq: int, hkv: int) -> int:
    if hkv < 1 or hq % hkv != 0:
        raise UnsupportedShapeError(
            f"{op}: {hq} query heads is not a multiple of {hkv} kv heads (GQA needs Hq % Hkv == 0)")
    return hq // hkv


def check_cu_seqlens(op: str, name: str, cu: torch.Tensor, device: torch.device) -> None:
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2 or cu.device != device:
        raise UnsupportedShapeError(
            f"{op}: {name} must be a 1-D int32 tensor [B+1] on {device}; got "
            f"{cu.dtype} {tuple(cu.shape)} on {cu.device}")


def check_sink_logits(op: str, sink_logits, hq: int, device: torch.device) -> None:
    """sink_logits (attention sinks, one logit per query head): None, or contiguous fp32 [Hq]."""
    if sink_logits is not None and (sink_logits.dtype != torch.float32 or tuple(
            sink_logits.shape) != (hq,) or not sink_logits.is_contiguous()
            or sink_logits.device != device):
        raise UnsupportedShapeError(f"{op}: sink_logits must be contiguous fp32 [{hq}] on "
                                    f"{device}; got {sink_logits.dtype} "
                                    f"{tuple(sink_logits.shape)}")


def check_last_dim(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise UnsupportedShapeError(
                f"{op}: {name} must be contiguous in its last dim (stride {t.stride()}); "
                f"call .contiguous() first")


def softmax_constants(scale: float, softcap: float) -> tuple[float, float, float]:
    """(score multiplier, softcap * log2e, 1 / softcap). Without softcap the multiplier already
    holds log2(e); with it, scores stay in natural units until the tanh."""
    if softcap > 0:
        return float(scale), float(softcap) * LOG2E, 1.0 / float(softcap)
    return float(scale) * LOG2E, 0.0, 0.0


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Host TMA descriptors need 16-byte aligned bases and row strides."""
    for t in tensors:
        if t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16 or t.stride(-1) != 1:
            return False
    return True


def descriptor(t2d: torch.Tensor, block: list[int]):
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block)


def device_has_tma(device: torch.device) -> bool:
    return use_tma(device) and TensorDescriptor is not None


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


# --- packed varlen prefill ---------------------------------------------------------------------

VARLEN_TUNER = Tuner("prefill")


def launch_prefill(q, k, v, cu_seqlens, out, scale, causal, window, sinks, softcap,
                   max_seqlen, fp8, config=None, cu_seqlens_k=None,
                   switches: PrefillSwitches = DEFAULT_SWITCHES, lse=None):
    # q: [T, Hq, D]  k: [Tk, Hkv, D]  v: [Tk, Hkv, Dv] (fp8: vt [Hkv*Dv, NB*128])
    # out: [T, Hq, Dv]; cu_seqlens_k [B+1] (default cu_seqlens): queries are each sequence's last
    # q_len positions of its k_len keys; lse [T, Hq] fp32 (not FP8): each row's log2-sum-exp2
    # of its scores (log2 units), for merging attentions over pieces of the keys
    import triton

    from kvcompile.kernels.prefill_varlen import SCALE_BLOCK, prefill_varlen_kernel

    op = "prefill_attention"
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    Dv = out.shape[2]
    B = cu_seqlens.numel() - 1
    group = check_heads(op, Hq, Hkv)
    check_head_dims(op, D, Dv)
    check_cu_seqlens(op, "cu_seqlens", cu_seqlens, q.device)
    check_last_dim(op, q=q, k=k, v=v, out=out)
    Tk = T
    if cu_seqlens_k is not None:
        check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_k.numel() != B + 1 or fp8 is not None:
            raise UnsupportedShapeError(f"{op}: cu_seqlens_k needs B+1 = {B + 1} entries and "
                                        f"is not supported on the FP8 path")
        Tk = k.shape[0]
    if k.shape != (Tk, Hkv, D) or out.shape != (T, Hq, Dv):
        raise UnsupportedShapeError(f"{op}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                    f"out {tuple(out.shape)} do not agree")
    f8 = torch.float8_e4m3fn
    if fp8 is not None:
        q_ok = q.dtype == f8 if fp8.q_descale is not None else q.dtype == torch.bfloat16
        if not q_ok or k.dtype != f8 or v.dtype != f8:
            raise UnsupportedShapeError(f"{op}: the FP8 path takes E4M3 k, v and E4M3 q (bf16 q "
                                        f"with q_descale None), from quantize_fp8_prefill; got "
                                        f"{q.dtype}, {k.dtype}, {v.dtype}")
        if v.dim() != 2 or v.shape[0] != Hkv * Dv or v.shape[1] % SCALE_BLOCK:
            raise UnsupportedShapeError(f"{op}: FP8 v must be transposed, [Hkv*Dv, NB*"
                                        f"{SCALE_BLOCK}] (quantize_fp8_prefill); got "
                                        f"{tuple(v.shape)}")
    elif q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedShapeError(f"{op}: q, k, v must share one of bf16/fp16/fp32 (or pass "
                                    f"fp8=True); got {q.dtype}, {k.dtype}, {v.dtype}")
    elif v.shape != (Tk, Hkv, Dv):
        raise UnsupportedShapeError(f"{op}: v {tuple(v.shape)} must be [{Tk}, Hkv, Dv]")
    if not causal and (window or sinks):
        raise UnsupportedShapeError(f"{op}: sliding_window/sinks need causal=True")
    if lse is not None and (fp8 is not None or lse.dtype != torch.float32
                            or lse.shape != (T, Hq) or lse.stride(1) != 1):
        raise UnsupportedShapeError(f"{op}: lse must be fp32 [{T}, {Hq}] with contiguous rows, "
                                    f"and is not supported on the FP8 path")
    if T == 0 or B == 0:
        return out
    if fp8 is not None and switches.fp8_sm90 and config is None:   # (lse: refused above)
        from kvcompile.kernels import prefill_sm90

        why = prefill_sm90.unsupported(q, k, v, out, causal, window, sinks, softcap,
                                       cu_seqlens_k)
        if why is None:
            return prefill_sm90.launch_prefill_fp8_sm90(q, k, v, fp8, cu_seqlens, out, scale,
                                                        max_seqlen)
    else:
        why = "PrefillSwitches(fp8_sm90=False) or a tile config given"
    if fp8 is not None and q.dtype != f8:   # only the Hopper kernel quantizes bf16 queries
        raise UnsupportedShapeError(f"{op}: bf16 q on the FP8 path needs the Hopper kernel "
                                    f"(kernels/prefill_sm90.py), which cannot take this prefill: "
                                    f"{why}; quantize q too (quantize_fp8_prefill(with_q=True))")

    mult, cap_l2, inv_cap = softmax_constants(scale, softcap)
    tma = switches.tma and device_has_tma(q.device)
    if fp8 is None:
        k2, v2 = k.reshape(Tk, Hkv * D), v.reshape(Tk, Hkv * Dv)
        if tma and not (k.stride(1) == D and v.stride(1) == Dv and tma_ok(k2, v2)):
            tma = False
    else:
        k2, v2 = k.reshape(T, Hkv * D), v
        tma = tma and tma_ok(k2, v2)
    q_tma = (tma and switches.q_tma and group & (group - 1) == 0
             and q.stride(1) == D and tma_ok(q.reshape(T, Hq * D)))
    dummy = cu_seqlens
    qd, kd, vd, cb = fp8 if fp8 is not None else (dummy, dummy, dummy, dummy)
    n_blocks = kd.shape[0] if fp8 is not None else 0
    # The FP8 K/V descales are read in the key loop by plain scalar loads. They used to come
    # through TMA as [Hkv * NB, 4] fp32 rows (16-byte boxes): triton <= 3.8 pipelines such a
    # load into a ring of 16-byte stages, and a TMA copy into a stage that is not 128-byte
    # aligned faults with CUDA "misaligned address" (num_stages >= 3: triton-lang/triton#10474,
    # fixed upstream by #10898, not in triton 3.6). PrefillSwitches.scale_tma keeps the old
    # form for benchmarks/prefill_diag.py only.
    scale_tma = fp8 is not None and tma and switches.scale_tma
    if scale_tma:
        kd, vd = (descriptor(x.t().reshape(-1, 1).expand(-1, 4).contiguous(), [1, 4])
                  for x in (kd, vd))
    hopper = is_hopper(q.device)
    tma_all = tma
    configs = ([config] if config is not None else
               [INTERPRET_CONFIG] if interpreting() else
               candidates(_VARLEN, D, group,
                          ws_ok(hopper, fp8 is not None, window, sinks, switches.warp_spec)))

    def launch(c: TileConfig):
        # FP8 V tiles by TMA hold whole 32-key chunks of vt_column order (P is permuted to match)
        tma = tma_all and (fp8 is None or c.block_n % 32 == 0)
        ws = c.warp_spec and tma and not (window and sinks)
        rows = 1 if ws else group  # query heads packed per tile (warp specialization: one)
        tok_m = max(c.block_m // rows, 1)
        if tma:
            qq = descriptor(q.reshape(T, Hq * D), [tok_m, rows * D]) if q_tma else q
            kk = descriptor(k2, [c.block_n, D])
            vv = descriptor(v2, [Dv, c.block_n] if fp8 is not None else [c.block_n, Dv])
        else:
            qq, kk, vv = q, k, v
        sv = (1, v.stride(0)) if fp8 is not None else (v.stride(0), v.stride(1))
        grid = (triton.cdiv(max_seqlen, tok_m), Hq // rows, B)
        prefill_varlen_kernel[grid](
            q, qq, kk, vv, out, cu_seqlens,
            cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, cb, qd, kd, vd,
            mult, cap_l2, inv_cap, int(window), int(sinks), seq_bucket(max_seqlen),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), sv[0], sv[1],
            out.stride(0), out.stride(1), n_blocks if scale_tma else Hkv, Hkv,
            lse if lse is not None else out, lse.stride(0) if lse is not None else 0,
            RATIO=group, GROUP=rows, HEAD_DIM=D, HEAD_DIM_V=Dv, CAUSAL=bool(causal),
            WINDOW=window > 0, SINKS=sinks > 0 and window > 0, SOFTCAP=softcap > 0,
            FP8=fp8 is not None, TMA=tma, Q_TMA=bool(tma and q_tma), SCALE_TMA=scale_tma,
            SCALE_BLK=SCALE_BLOCK,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, WARP_SPEC=ws, STORE_LSE=lse is not None,
            num_warps=c.num_warps, num_stages=c.num_stages)

    key = (D, Dv, group, causal, window > 0, sinks > 0, softcap > 0, fp8 is not None, tma,
           q_tma, scale_tma, q.dtype, seq_bucket(max_seqlen), Tk != T, lse is not None)
    VARLEN_TUNER.run(key, configs, launch)
    return out


# --- chunked prefill over pages ----------------------------------------------------------------

PAGED_TUNER = Tuner("paged_prefill")
def _prefill_formats() -> dict:
    """{format name: its FormatSpec} for the formats the prefill kernel reads (the registry's
    KernelSupport.prefill)."""
    return {n: format_spec(n) for n in format_names() if format_spec(n).kernels.prefill}


def _page_args(op, which, fmt, gran, data, scale, micro, num_kv_heads, dim):
    """Strides of one PagedTensor's tensors (page, head, token), checked against its format.
    Format codes and scale modes are the registry's (the decode kernel's numbering)."""
    specs = _prefill_formats()
    if fmt not in specs:
        raise UnsupportedShapeError(f"{op}: {which} format {fmt!r} is not supported by the "
                                    f"prefill kernel (supported: {sorted(specs)})")
    spec = specs[fmt]
    code = spec.kernels.code
    width = spec.stored_dim(dim)
    if (data.dtype != spec.storage_dtype or data.dim() != 4 or data.shape[1] != num_kv_heads
            or data.shape[3] != width or data.stride(3) != 1):
        raise UnsupportedShapeError(
            f"{op}: {which} pages must be [N, {num_kv_heads}, P, {width}] {spec.storage_dtype} "
            f"(last dim contiguous) for format {fmt}; got {data.dtype} {tuple(data.shape)}")
    d_str = (data.stride(0), data.stride(1), data.stride(2))
    gran_code, s_str, m_str = SCALE_NONE, (0, 0, 0), (0, 0, 0)
    if code != FMT_PLAIN:
        takes = spec.kernels.prefill
        if gran not in takes or scale is None or scale.dtype != torch.float32:
            raise UnsupportedShapeError(f"{op}: {which} format {fmt} needs an fp32 scale with "
                                        f"granularity {'/'.join(takes)}; got {gran!r}")
        gran_code = SCALE_CODES[gran]
        if gran_code == SCALE_PAGE:
            s_str = (scale.stride(0), scale.stride(1), 0)
        elif gran_code == SCALE_TOKEN:
            s_str = (scale.stride(0), scale.stride(1), scale.stride(2))
    if code == FMT_E2M1:
        if micro is None or micro.dtype != torch.float8_e4m3fn or micro.shape[3] != dim // 16:
            raise UnsupportedShapeError(f"{op}: {which} fp4 pages need E4M3 micro scales "
                                        f"[N, Hkv, P, {dim // 16}]")
        m_str = (micro.stride(0), micro.stride(1), micro.stride(2))
    return code, gran_code, d_str + s_str + m_str


def launch_paged_prefill(q, out, k, v, block_tables, cu_seqlens_q, seq_lens, kv_start, scale,
                          window, sinks, softcap, max_q_len, config=None, sink_logits=None):
    # q: [T, Hq, D]  out: [T, Hq, Dv]  k/v: (fmt, gran, data, scale, micro)
    # sink_logits: [Hq] fp32 attention sinks (one more softmax column per head) or None
    import triton

    from kvcompile.kernels.prefill_paged import paged_prefill_kernel

    op = "paged_prefill_attention"
    T, Hq, D = q.shape
    Dv = out.shape[2]
    Hkv, page = k[2].shape[1], k[2].shape[2]
    B = cu_seqlens_q.numel() - 1
    group = check_heads(op, Hq, Hkv)
    check_head_dims(op, D, Dv)
    check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.device)
    check_last_dim(op, q=q, out=out)
    if q.dtype not in FLOAT_DTYPES:
        raise UnsupportedShapeError(f"{op}: q must be bf16/fp16/fp32; got {q.dtype}")
    for name, t, shape in (("seq_lens", seq_lens, (B,)), ("kv_start", kv_start, (B,))):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != shape
                              or t.device != q.device):
            raise UnsupportedShapeError(f"{op}: {name} must be int32 [{B}] on {q.device}; got "
                                        f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
            or block_tables.shape[0] != B or block_tables.stride(1) != 1):
        raise UnsupportedShapeError(f"{op}: block_tables must be int32 [{B}, max_pages] with "
                                    f"contiguous rows; got {block_tables.dtype} "
                                    f"{tuple(block_tables.shape)}")
    if v[2].shape[1] != Hkv or v[2].shape[2] != page:
        raise UnsupportedShapeError(f"{op}: k and v pages disagree on kv heads / page size")
    check_sink_logits(op, sink_logits, Hq, q.device)
    k_fmt, k_gran, k_str = _page_args(op, "k", *k, Hkv, D)
    v_fmt, v_gran, v_str = _page_args(op, "v", *v, Hkv, Dv)
    if T == 0 or B == 0:
        return out
    if k_fmt or v_fmt:
        compute = torch.float32 if q.dtype == torch.float32 else torch.float16
    else:
        compute = q.dtype
    import triton.language as tl

    tl_compute = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                  torch.float32: tl.float32}[compute]
    mult, cap_l2, inv_cap = softmax_constants(scale, softcap)
    dummy = seq_lens
    kt = [x if x is not None else dummy for x in k[2:]]
    vt = [x if x is not None else dummy for x in v[2:]]
    configs = ([config] if config is not None else
               [INTERPRET_CONFIG] if interpreting() else
               candidates(_PAGED, D, group, warp_spec=False))

    def launch(c: TileConfig):
        tok_m = max(c.block_m // group, 1)
        grid = (triton.cdiv(max_q_len, tok_m), Hkv, B)
        paged_prefill_kernel[grid](
            q, out, block_tables, cu_seqlens_q, seq_lens,
            kv_start if kv_start is not None else dummy,
            sink_logits if sink_logits is not None else dummy, *kt, *vt,
            mult, cap_l2, inv_cap, int(window), int(sinks), seq_bucket(max_q_len),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            *k_str, *v_str,
            GROUP=group, HEAD_DIM=D, HEAD_DIM_V=Dv, PAGE=page, K_FMT=k_fmt, K_GRAN=k_gran,
            V_FMT=v_fmt, V_GRAN=v_gran, COMPUTE=tl_compute, WINDOW=window > 0,
            SINKS=sinks > 0 and window > 0, SOFTCAP=softcap > 0,
            HAS_KV_START=kv_start is not None, HAS_SINK=sink_logits is not None,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            NUM_STAGES=c.num_stages, num_warps=c.num_warps, num_stages=c.num_stages)

    key = (D, Dv, group, page, k[0], k[1], v[0], v[1], window > 0, sinks > 0, softcap > 0,
           kv_start is not None, sink_logits is not None, q.dtype, seq_bucket(max_q_len))
    PAGED_TUNER.run(key, configs, launch)
    return out
