"""`kvcompile inspect MODEL --verify`: eager and compiled side by side, layer by layer.

Both runs see the same tokens: the prompt, then `steps` decode steps fed with eager's greedy
tokens (teacher forcing), so every difference comes from the compiled path (the paged,
quantized cache and its attention), not from diverging text.

Per layer (a RuntimeHook, first in `state.hooks`, keeps the full-precision K/V each layer
writes and reads its pages back after each attention):
- stored K / V SQNR: the pages read back vs the K/V written. Judged: SQNR_FLOOR_DB[format] -
  6.02 dB (twice the format's own error), or 2 * REL_ERR[storage dtype] when unquantized.
- impl: the layer's attention vs the reference attention over the same stored pages (kernels,
  paging, masks). Judged: 2 * REL_ERR[model dtype].
- attn SQNR: the layer's attention vs exact attention over the full-precision K/V: what the
  format costs this layer. Reported.
- drift: the attention module's output (forward hooks) vs the eager model's. It compounds
  through the layers, so it is judged (2 * REL_ERR[model dtype]) only when the storage loses
  nothing against the model; else reported.
The final logits get max error, KL divergence and top-1 agreement, and a verdict: KL mean and
top-1 agreement against the bounds of the storage format (LOGIT_BOUNDS, measured on SmolLM2).
"""

from __future__ import annotations

import inspect as _inspect
import math
import re
from dataclasses import dataclass, field

import torch

from kvcompile.runtime.dispatch import attended_fresh
from kvcompile.runtime.hooks import RuntimeHook
from kvcompile.testing import REL_ERR, SQNR_FLOOR_DB, kl_divergence, rel_err, sqnr_db

_TWICE = 2.0                      # allowed error: twice the format's own
_TWICE_DB = 20 * math.log10(_TWICE)  # 6.02 dB
# Integer formats with one scale per page and head lose more on real K/V than on the Gaussian
# data their SQNR floors come from (outlier channels stretch the scale): SmolLM2's layer 0 V in
# int4 page scales measured 10.6 dB against 17.5 dB on Gaussian data (2026-12-03). Their
# allowance is three times their own error on Gaussian data instead of twice.
_INT_DB = 20 * math.log10(3.0)      # 9.54 dB
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


class LocalError(RuntimeHook):
    """A RuntimeHook, first in `state.hooks`: keeps the full-precision K/V each layer stores
    (batch row 0's sequence) and, after each attention, reads the layer's pages back, so that
    each layer's own error splits into storage, implementation and quantization effects."""

    def __init__(self, traces):
        self.traces = traces                 # GraphTrace list: site scale / softcap per layer
        self.k: dict[int, list] = {}
        self.v: dict[int, list] = {}
        self.outs: dict[int, list] = {}      # layer -> [(exact, over stored, out)], [Hq, S, Dv]
        self.stored: dict[int, tuple] = {}   # layer -> (K, K stored, V, V stored) at the end

    def before_write(self, ctx, layer, k, v):
        # k, v: [T, Hkv, D] new tokens (single sequence: T = S)
        self.k.setdefault(layer, []).append(k.detach().float().clone())
        self.v.setdefault(layer, []).append(v.detach().float().clone())
        return k, v

    def after_attention(self, ctx, layer, q, out, extras):
        # q: [1, Hq, S, D]  out: [1, Hq, S, Dv]
        from kvcompile.kernels.dense import attend_fp32

        site = self._site(layer)
        if site is None or q.shape[0] != 1 or ctx.plan is None:
            return
        K = torch.cat(self.k[layer]).transpose(0, 1)   # [Hkv, L, D]
        V = torch.cat(self.v[layer]).transpose(0, 1)
        Ks, Vs = ctx.state.pool.gather(layer, ctx.plan.seq_ids[0])   # as stored, dequantized
        S, L = q.shape[2], K.shape[1]
        scale = site.scale if site.scale else 1.0 / math.sqrt(q.shape[-1])
        rows = torch.arange(L - S, L, device=q.device)[:, None]
        allowed = torch.arange(L, device=q.device)[None, :] <= rows   # [S, L] causal
        cap = site.softcap or 0.0
        sinks = extras.get("sink_logits")
        exact = attend_fp32(q[0], K, V, allowed, None, scale, cap, sinks)
        if Ks.shape != K.shape:  # eviction dropped tokens: no token-for-token comparison
            over_stored = None
        elif attended_fresh(ctx.plan, layer):
            # a fresh prompt's prefill attends to the K/V as computed (KVConfig.prefill_attends)
            over_stored = exact
            self.stored[layer] = (K, Ks, V, Vs)
        else:
            over_stored = attend_fp32(q[0], Ks, Vs, allowed, None, scale, cap, sinks)
            self.stored[layer] = (K, Ks, V, Vs)
        self.outs.setdefault(layer, []).append((exact, over_stored,
                                                out[0].detach().float().clone()))

    def _site(self, layer: int):
        for t in reversed(self.traces):
            for s in t.sites:
                if s.layer_index == layer and s.rewritten:
                    return s
        return None

    def errors(self) -> dict[int, dict]:
        out = {}
        for layer, calls in self.outs.items():
            exact = torch.cat([e for e, _, _ in calls], dim=1)
            got = torch.cat([g for _, _, g in calls], dim=1)
            row = {"local_rel_err": rel_err(got, exact), "local_sqnr_db": sqnr_db(exact, got)}
            if all(s is not None for _, s, _ in calls) and layer in self.stored:
                ref = torch.cat([s for _, s, _ in calls], dim=1)
                row["impl_rel_err"] = rel_err(got, ref)
                K, Ks, V, Vs = self.stored[layer]
                row["k_sqnr_db"], row["v_sqnr_db"] = sqnr_db(K, Ks), sqnr_db(V, Vs)
                row["storage_rel_err"] = max(rel_err(Ks, K), rel_err(Vs, V))
            out[layer] = row
        return out


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


def compare(eager: Capture, compiled: Capture, state, local: dict[int, dict] | None = None,
            model_dtype: torch.dtype = torch.float32, next_token_logits: bool = True) -> dict:
    """Per-layer storage / implementation / quantization / drift errors, final-logit errors
    and their verdict (`judge_logits`), and the first divergent layer. `next_token_logits`:
    the output is a language model's logits (a Hugging Face model), so it can be judged."""
    fmt_of = {m["name"]: (m["k_format"], m["v_format"]) for m in state.layer_meta}
    local = local or {}
    rows, first_bad = [], None
    for rec in _sites_in_order(state):
        name = rec.name
        formats = fmt_of.get(name)
        tol = _tolerance(formats, model_dtype)
        row = {"layer": name, "rewritten": rec.rewritten,
               "format": "/".join(formats or ("-", "-")), "tolerance": tol["text"]}
        idx = state.layer_names.get(name)
        loc = local.get(idx) if idx is not None else None
        if loc is not None:
            row.update(loc)
            if "impl_rel_err" in loc:
                row["storage_ok"] = (min(loc["k_sqnr_db"], loc["v_sqnr_db"]) >= tol["sqnr_db"]
                                     if "sqnr_db" in tol else
                                     loc["storage_rel_err"] <= tol["rel_err"])
                row["impl_ok"] = loc["impl_rel_err"] <= tol["impl_rel_err"]
        ref, out = eager.outputs.get(name), compiled.outputs.get(name)
        if ref is not None and out is not None and ref.shape == out.shape:
            row.update(max_abs_err=(out - ref).abs().max().item(), rel_err=rel_err(out, ref),
                       sqnr_db=sqnr_db(ref, out))
            if tol["lossless"]:
                row["drift_ok"] = row["rel_err"] <= tol["drift_rel_err"]
        verdicts = [row[k] for k in ("storage_ok", "impl_ok", "drift_ok") if k in row]
        row["ok"] = bool(all(verdicts)) if verdicts else None
        if row["ok"] is False and first_bad is None:
            first_bad = name
        rows.append(row)
    logit_stats = _logits(eager.logits, compiled.logits)
    metas = [m for m in state.layer_meta if m["name"] in state.layer_names]
    formats = sorted({m[k] for m in metas for k in ("k_format", "v_format")})
    why_not = None
    if not next_token_logits:
        why_not = "a plain module's output, not next-token logits"
    elif any(m.get("eviction") for m in metas):
        why_not = "an eviction policy drops tokens; the bounds cover the storage format only"
    logit_stats.update(judge_logits(logit_stats, formats, model_dtype, why_not=why_not))
    return {"layers": rows, "logits": logit_stats, "first_divergent_layer": first_bad,
            "ok": first_bad is None and logit_stats["verdict"] != "fail",
            "compared": sum(1 for r in rows if r["ok"] is not None),
            "within_tolerance": sum(1 for r in rows if r["ok"])}


def _sites_in_order(state) -> list:
    latest = {}
    for rec in state.records:
        latest[rec.name] = rec
    order = {name: i for i, name in enumerate(state.layer_names)}
    return sorted(latest.values(), key=lambda r: (order.get(r.name, 1 << 30), r.name))


_STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def _tolerance(formats, model_dtype: torch.dtype) -> dict:
    """Bounds of one layer, from kvcompile/testing.py, each twice the error that is expected:
    stored K/V against their full-precision values: SQNR_FLOOR_DB[format] - 6.02 dB (quantized)
    or 2 * REL_ERR[storage dtype]; the attention the layer computed against the reference over
    the same stored pages: 2 * REL_ERR[model dtype]; drift against eager, when the storage loses
    nothing against the model: 2 * REL_ERR[model dtype]."""
    drift = _TWICE * REL_ERR.get(model_dtype, REL_ERR[torch.float32])
    impl = drift
    if formats is None:  # left alone: compiled must equal eager up to rounding
        return {"rel_err": drift, "impl_rel_err": impl, "lossless": True,
                "drift_rel_err": drift, "text": f"drift<={drift:.0e} (left alone)"}
    quantized = [f for f in formats if f in SQNR_FLOOR_DB]
    lossless = all(f in _STORAGE and (_STORAGE[f] == model_dtype or _STORAGE[f] == torch.float32)
                   for f in formats)
    if quantized:
        floor = min(SQNR_FLOOR_DB[f] - (_INT_DB if f.startswith("int") else _TWICE_DB)
                    for f in quantized)
        return {"sqnr_db": floor, "impl_rel_err": impl, "lossless": False,
                "text": f"K/V SQNR>={floor:.1f}dB, impl<={impl:.0e}"}
    dts = [_STORAGE.get(f, torch.float32) for f in formats]
    bound = _TWICE * max(REL_ERR[d] for d in dts)
    text = f"K/V rel<={bound:.0e}, impl<={impl:.0e}" + (f", drift<={drift:.0e}" if lossless
                                                          else "")
    return {"rel_err": bound, "impl_rel_err": impl, "lossless": lossless,
            "drift_rel_err": drift, "text": text}


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


# --- the final logits' verdict ------------------------------------------------------------------
#
# The compiled model's next-token distributions against eager's, over the prompt and the decode
# steps: KL(eager || compiled), averaged over the positions, must stay at or below the format's
# first number; the share of positions whose top-1 token agrees at or above its second (judged
# over TOP1_MIN_POSITIONS positions or more: over fewer, one flipped near-tie moves it by more
# than 6 points). The bound is the loosest of the rewritten layers' K and V formats and of the
# model's dtype (a bf16 model agrees with its own eager run no better than bf16 rounding).
#
# These are what a correct cache of each format costs, with margin; no quality target. Where
# the numbers come from: `kvcompile inspect smollm2 --verify --kv-dtype F` on the CPU (fp32
# model, default prompt and --steps 4: 31 positions; a 82-token paragraph and --steps 8: 90
# positions; for fp8_e4m3 and fp4_e2m1 four more prompts of 5-21 positions), 2026-12:
#
#   format     KL mean, nats                      top-1 agreement
#   fp32       5e-13, 7e-13                       100%, 100%
#   fp16       1.0e-6, 3.7e-7                     100%, 100%
#   bf16       1.3e-4, 2.4e-5 (bf16 model: 0, 5.2e-5)   100%, 98.9%
#   fp8_e4m3   0.034, 0.0091; 0.0032-0.018        83.9%, 92.2%; 78.6-100%
#   fp8_e5m2   0.091, 0.029                       67.7%, 86.7%
#   fp4_e2m1   0.137, 0.075; 0.057-0.22           71.0%, 81.1%; 80-86%
#   int4       0.88, 0.47 (page scales)           61.3%, 55.6%
#   int3       2.6, 3.1                           35.5%, 22.2%
#   int2       6.4, 8.9                           6.5%, 3.3%
#
# They are the figures of correct caches: plain-PyTorch rounding of K/V to fp8_e4m3 with page
# scales gives 0.038 / 90.3% and 0.0091 / 91.1% on the same two prompts, and through the pool
# bf16 / fp8 pages give, to 1e-4, the perplexity of that rounding (tests/test_realmodel.py):
# +0 / +1.1% over bf16, fp4 +9.4% (README, "Measured"). Each KL bound is 2-3x the largest KL
# measured for its format and below what the next coarser format measured on the default
# prompt (fp8_e4m3: 0.08, where fp4 pages give 0.137); each top-1 bound is below the lowest
# agreement measured. KL varies 4-10x between prompts (fp8_e4m3: 0.003-0.034), so neighbouring
# formats overlap (fp4 gives 0.057 on one prompt, under fp8_e4m3's 0.08): the bound catches a
# cache that costs several times its format's error; the per-layer checks judge the stored K/V
# of each format more finely. A 4% scale error on every layer's K or V cost nothing measurable
# here (KL 0.032-0.036).
TOP1_MIN_POSITIONS = 16
LOGIT_BOUNDS: dict[str, tuple[float, float]] = {
    # format:    (KL mean <=, top-1 agreement >=)
    "fp32": (1e-7, 0.95),
    "fp16": (1e-5, 0.95),
    "bf16": (1e-3, 0.95),
    "fp8_e4m3": (0.08, 0.75),
    "fp8_e5m2": (0.3, 0.55),
    "fp4_e2m1": (0.5, 0.55),
    "int4": (2.0, 0.4),
    "int3": (6.0, 0.1),
    "int2": (20.0, 0.0),
}
_MODEL_DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def judge_logits(stats: dict, formats, model_dtype: torch.dtype = torch.float32, *,
                 why_not: str | None = None) -> dict:
    """The final logits' verdict against LOGIT_BOUNDS. `stats`: `_logits`' dict (finite,
    kl_mean, top1_agree, or error); `formats`: the storage formats of the rewritten layers (K
    and V); the bound is the loosest of theirs and the model dtype's (a bf16 model computes in
    bf16: compiled agrees with eager no better than bf16 rounding, whatever the pages hold).
    Returns {"verdict": "pass" | "fail" | "not judged", "reason", and when judged
    "bound_format", "kl_mean_bound", "top1_bound", "failed": [what failed]}."""
    if not stats.get("finite", True):
        return {"verdict": "fail", "reason": "the compiled logits hold NaN/Inf",
                "failed": ["finite"]}
    if "error" in stats:
        return {"verdict": "fail", "reason": stats["error"], "failed": ["shape"]}
    if why_not:
        return {"verdict": "not judged", "reason": why_not}
    if "kl_mean" not in stats:
        return {"verdict": "not judged", "reason": "no next-token distributions in the output"}
    formats = set(formats)
    names = formats | {_MODEL_DTYPE_NAME.get(model_dtype, "fp32")}
    unknown = sorted(n for n in names if n not in LOGIT_BOUNDS)
    if unknown:
        return {"verdict": "not judged",
                "reason": f"no measured bound for {', '.join(unknown)}"}
    # the loosest; on a tie, the pages' format rather than the model dtype's
    fmt = max(sorted(names), key=lambda n: (LOGIT_BOUNDS[n][0], -LOGIT_BOUNDS[n][1],
                                            n in formats))
    kl_bound, top1_bound = LOGIT_BOUNDS[fmt]
    failed, why = [], []
    if not stats["kl_mean"] <= kl_bound:
        failed.append("kl_mean")
        why.append(f"KL mean {stats['kl_mean']:.3g} > {kl_bound:g} nats")
    top1_judged = stats.get("positions", TOP1_MIN_POSITIONS) >= TOP1_MIN_POSITIONS
    if top1_judged and not stats["top1_agree"] >= top1_bound:
        failed.append("top1_agree")
        why.append(f"top-1 agreement {_pct(stats['top1_agree'])} < {_pct(top1_bound)}")
    bound = f"KL mean {stats['kl_mean']:.3g} <= {kl_bound:g} nats, " + (
        f"top-1 agreement {_pct(stats['top1_agree'])} >= {_pct(top1_bound)}" if top1_judged
        else f"top-1 not judged over {stats['positions']} positions")
    return {"verdict": "fail" if failed else "pass",
            "reason": ", ".join(why) if why else bound,
            "bound_format": fmt, "kl_mean_bound": kl_bound,
            "top1_bound": top1_bound if top1_judged else None, "failed": failed}


def _pct(x: float) -> str:
    text = f"{100 * x:.1f}"
    return (text[:-2] if text.endswith(".0") else text) + "%"


def summary_line(res: dict) -> str:
    """What was judged and what was not: 'layers: 30 of 30 within tolerance; logits: FAIL,
    top-1 agreement 87.1% < 95% (fp8_e4m3 threshold)'."""
    n_rows, compared = len(res["layers"]), res["compared"]
    ok = res.get("within_tolerance", compared if res["first_divergent_layer"] is None else 0)
    layers = f"layers: {ok} of {compared} within tolerance"
    if compared < n_rows:
        layers += f" ({n_rows - compared} not compared)"
    if res["first_divergent_layer"]:
        layers += f", first divergent: {res['first_divergent_layer']}"
    lg = res["logits"]
    verdict = lg.get("verdict", "not judged")
    if verdict == "pass":
        logits = f"logits: pass ({lg['reason']}, {lg['bound_format']} threshold)"
    elif verdict == "fail":
        logits = f"logits: FAIL, {lg['reason']}" + (f" ({lg['bound_format']} threshold)"
                                                    if "bound_format" in lg else "")
    else:
        logits = f"logits: not judged ({lg.get('reason', '')})"
    return f"{layers}; {logits}"


def verify_text(res: dict, steps: int) -> str:
    from kvcompile.cli.common import table

    def num(r, key, f):
        return f(r[key]) if key in r else "-"

    rows = []
    for r in res["layers"]:
        status = {None: "not compared", True: "ok", False: "DIVERGED"}[r["ok"]]
        kv = (f"{_db(r['k_sqnr_db'])} / {_db(r['v_sqnr_db'])}" if "k_sqnr_db" in r else "-")
        rows.append([r["layer"], r["format"], kv, num(r, "impl_rel_err", lambda x: f"{x:.1e}"),
                     num(r, "local_sqnr_db", _db), num(r, "rel_err", lambda x: f"{x:.2e}"),
                     r["tolerance"], status])
    lines = [f"verify: eager vs compiled over the prompt and {steps} teacher-forced decode "
             f"step(s), per layer:",
             "  stored K/V SQNR: the pages read back vs the full-precision K/V written",
             "  impl: the layer's attention vs the reference attention over the same pages",
             "  attn SQNR: the layer's attention vs exact attention over full-precision K/V",
             "  drift: the attention module's output vs eager's (compounds through layers)", ""]
    lines += table(rows, ["layer", "K/V", "stored K / V SQNR", "impl rel", "attn SQNR",
                          "drift rel", "tolerance", "status"]).splitlines()
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
    lines.append(summary_line(res))
    if any(r["ok"] is not None and "drift_ok" not in r for r in res["layers"]):
        lines.append("(drift is judged only for lossless storage: --kv-dtype fp32 checks the "
                     "rewrite itself exactly)")
    return "\n".join(lines)


def _db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f} dB"
