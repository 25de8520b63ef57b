"""`kvcompile inspect MODEL --verify`: eager and compiled side by side, layer by layer.

Both runs see the same tokens: the prompt, then `steps` decode steps fed with eager's greedy
tokens (teacher forcing), so every difference comes from the compiled path (the paged,
quantized cache and its attention), not from diverging text. Forward hooks on the attention
modules capture each layer's attention output (the module's output); the final logits are
compared by max error, KL divergence and top-1 agreement.

A layer diverges when its output is further from eager than the cache format allows: more than
twice the format's own error (the rule kernels are held to: at most 2x the error of PyTorch at
the same precision), with the bounds of kvcompile/testing.py: SQNR below
SQNR_FLOOR_DB[format] - 6.02 dB for fp8 / fp4, relative error above 2 * REL_ERR[dtype] for
unquantized storage. Errors compound through the layers, so the first layer past its bound is
where to look.
"""

from __future__ import annotations

import inspect as _inspect
import math
import re
from dataclasses import dataclass, field

import torch

from kvcompile.testing import REL_ERR, SQNR_FLOOR_DB, kl_divergence, rel_err, sqnr_db

_TWICE = 2.0                      # allowed error: twice the format's own
_TWICE_DB = 20 * math.log10(_TWICE)  # 6.02 dB
_ATTN_CLASS = re.compile(r"attention|attn", re.IGNORECASE)


@dataclass
class Capture:
    outputs: dict = field(default_factory=dict)   # module path -> [B, S_total, ...]
    logits: torch.Tensor | None = None            # [B, S_total, V]
    tokens: list = field(default_factory=list)    # the decode tokens fed (eager's greedy ones)


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that look like attention (class name has 'Attention' / 'Attn')."""
    return {name: m for name, m in model.named_modules()
            if name and _ATTN_CLASS.search(type(m).__name__)}


# Forward hooks route each attention module's output through this op. Inside a compiled graph
# it is one opaque node (no Python state for Dynamo to guard on, so no recompiles), and at run
# time, eager or compiled, it records the tensor.
_RECORDS: dict[str, list] = {}


@torch.library.custom_op("kvcompile_cli::record", mutates_args=())
def _record(x: torch.Tensor, name: str) -> torch.Tensor:
    _RECORDS.setdefault(name, []).append(x.detach().float().clone())
    return x.clone()


@_record.register_fake
def _(x, name):
    return torch.empty_like(x)


def _hook(name: str):
    def hook(_m, _args, out):
        if isinstance(out, torch.Tensor):
            return _record(out, name)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (_record(out[0], name), *out[1:])
        return None
    return hook


def capture(lm, fn, ids: torch.Tensor | None, steps: int, tokens: list | None = None) -> Capture:
    """Run `fn` (the eager or the compiled model) over the prompt and `steps` decode steps."""
    cap = Capture()
    _RECORDS.clear()
    handles = [mod.register_forward_hook(_hook(name))
               for name, mod in attention_modules(lm.model).items()]
    logits = []
    try:
        with torch.inference_mode():
            if lm.is_hf:
                cap.tokens = _run_hf(lm, fn, ids, steps, tokens, logits)
            else:
                out = fn(**lm.inputs) if isinstance(lm.inputs, dict) else fn(*lm.inputs)
                logits.append(_first_tensor(out).detach().float())
    finally:
        for h in handles:
            h.remove()
    cap.logits = torch.cat(logits, dim=-2) if logits[0].dim() >= 2 else logits[0]
    for name, outs in _RECORDS.items():
        try:
            cap.outputs[name] = torch.cat(outs, dim=1) if outs[0].dim() >= 2 else outs[-1]
        except RuntimeError:
            cap.outputs[name] = outs[-1]
    _RECORDS.clear()
    return cap


def _run_hf(lm, fn, ids, steps: int, tokens, logits: list) -> list:
    from transformers import DynamicCache

    model = lm.model
    params = _inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older transformers
        cache = DynamicCache()
    out = fn(input_ids=ids, use_cache=True, **{cache_kw: cache})
    logits.append(out.logits.detach().float())
    fed = []
    for i in range(steps):
        nxt = tokens[i] if tokens is not None else int(out.logits[0, -1].argmax())
        fed.append(nxt)
        step = torch.full((ids.shape[0], 1), nxt, dtype=ids.dtype, device=ids.device)
        out = fn(input_ids=step, use_cache=True, **{cache_kw: cache})
        logits.append(out.logits.detach().float())
    return fed


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def compare(eager: Capture, compiled: Capture, state) -> dict:
    """Per-layer and final-logit errors, and the first layer beyond tolerance."""
    fmt_of = {m["name"]: (m["k_format"], m["v_format"]) for m in state.layer_meta}
    rows, first_bad = [], None
    for rec in _sites_in_order(state):
        name = rec.name
        ref, out = eager.outputs.get(name), compiled.outputs.get(name)
        row = {"layer": name, "rewritten": rec.rewritten, "format": "/".join(fmt_of.get(
            name, ("-", "-"))), "captured": ref is not None and out is not None}
        if row["captured"] and ref.shape == out.shape:
            tol = _tolerance(fmt_of.get(name), ref.dtype if ref is not None else None,
                             state.config)
            err = rel_err(out, ref)
            sq = sqnr_db(ref, out)
            row.update(max_abs_err=(out - ref).abs().max().item(), rel_err=err, sqnr_db=sq,
                       tolerance=tol["text"])
            ok = (sq >= tol["sqnr_db"]) if "sqnr_db" in tol else (err <= tol["rel_err"])
            row["ok"] = bool(ok)
            if not ok and first_bad is None:
                first_bad = name
        else:
            row["ok"] = None  # not compared (module not hooked, or shapes differ)
        rows.append(row)
    logit_stats = _logits(eager.logits, compiled.logits)
    return {"layers": rows, "logits": logit_stats, "first_divergent_layer": first_bad,
            "ok": first_bad is None and logit_stats["finite"],
            "compared": sum(1 for r in rows if r["ok"] is not None)}


def _sites_in_order(state) -> list:
    latest = {}
    for rec in state.records:
        latest[rec.name] = rec
    order = {name: i for i, name in enumerate(state.layer_names)}
    return sorted(latest.values(), key=lambda r: (order.get(r.name, 1 << 30), r.name))


def _tolerance(formats, model_dtype, config) -> dict:
    """The bound a layer's attention output must meet (kvcompile/testing.py)."""
    if formats is None:  # left alone: compiled == eager up to the inner backend's rounding
        bound = REL_ERR[torch.float32] * 10
        return {"rel_err": bound, "text": f"rel<={bound:.0e} (not rewritten)"}
    worst = None
    for f in formats:
        if f in SQNR_FLOOR_DB and (worst is None or SQNR_FLOOR_DB[f] < SQNR_FLOOR_DB[worst]):
            worst = f
    if worst is not None:
        floor = SQNR_FLOOR_DB[worst] - _TWICE_DB
        return {"sqnr_db": floor, "text": f"SQNR>={floor:.1f}dB"}
    storage = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dts = [storage.get(f, torch.float32) for f in formats]
    bound = _TWICE * max(REL_ERR[d] for d in dts)
    if config.inner == "inductor":
        bound = max(bound, REL_ERR[torch.float32] * 10)  # inductor re-associates fp32 sums
    return {"rel_err": bound, "text": f"rel<={bound:.0e}"}


def _logits(ref: torch.Tensor, out: torch.Tensor) -> dict:
    finite = bool(torch.isfinite(out).all())
    if ref.shape != out.shape:
        return {"finite": finite, "error": f"shapes differ: {tuple(ref.shape)} vs "
                                           f"{tuple(out.shape)}"}
    stats = {"finite": finite, "positions": int(ref.numel() // ref.shape[-1]),
             "max_abs_err": (out - ref).abs().max().item(), "rel_err": rel_err(out, ref)}
    if ref.dim() >= 2 and ref.shape[-1] > 1:
        r2, o2 = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
        stats["kl_mean"] = kl_divergence(r2, o2)
        stats["kl_max"] = max(kl_divergence(r2[i:i + 1], o2[i:i + 1]) for i in range(len(r2)))
        stats["top1_agree"] = (r2.argmax(-1) == o2.argmax(-1)).float().mean().item()
    return stats


def verify_text(res: dict, steps: int) -> str:
    from kvcompile.cli.common import table

    rows = []
    for r in res["layers"]:
        if r["ok"] is None:
            rows.append([r["layer"], r["format"], "-", "-", "-", "-", "not captured"])
            continue
        rows.append([r["layer"], r["format"], f"{r['max_abs_err']:.3e}", f"{r['rel_err']:.2e}",
                     _db(r["sqnr_db"]), r["tolerance"], "ok" if r["ok"] else "DIVERGED"])
    lines = [f"verify: eager vs compiled over the prompt and {steps} teacher-forced decode "
             f"step(s); attention output of each layer", ""]
    lines += table(rows, ["layer", "K/V", "max |err|", "rel err", "SQNR", "tolerance",
                          "status"]).splitlines()
    lg = res["logits"]
    lines.append("")
    if "kl_mean" in lg:
        lines.append(f"final logits ({lg['positions']} positions): max |err| "
                     f"{lg['max_abs_err']:.3e}, KL mean {lg['kl_mean']:.3e} / max "
                     f"{lg['kl_max']:.3e} nats, top-1 agreement {100 * lg['top1_agree']:.1f}%")
    elif "error" in lg:
        lines.append(f"final logits: {lg['error']}")
    else:
        lines.append(f"final output: max |err| {lg['max_abs_err']:.3e}, rel err "
                     f"{lg['rel_err']:.2e}")
    if res["first_divergent_layer"]:
        lines.append(f"FIRST DIVERGENT LAYER: {res['first_divergent_layer']}")
    elif not lg["finite"]:
        lines.append("the compiled logits hold NaN/Inf")
    else:
        lines.append(f"all {res['compared']} compared layer(s) within tolerance")
    return "\n".join(lines)


def _db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f} dB"
