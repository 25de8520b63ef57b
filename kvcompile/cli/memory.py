"""The memory plan of `kvcompile inspect`: bytes per token and pages for a batch and context,
against a bf16 Hugging Face cache (DynamicCache: every token of every layer, no pages).
`--tp N` adds each tensor-parallel rank's share: a rank's pool holds num_kv_heads / N heads of
every layer (scales per head), and each rank sizes its pool from its own budget."""

from __future__ import annotations

import math

from kvcompile.cli.common import CLIError, fmt_bytes, table


def memory_plan(state, batch: int, context: int, tp: int = 1) -> dict:
    """Per layer and in all: bytes per token, tokens kept, pages, bytes; bf16 reference; with
    tp > 1, the same per tensor-parallel rank."""
    from kvcompile.cache.formats import KVFormat

    P = state.config.page_size
    bf16 = KVFormat("bf16")
    layers, kept_max = [], 0
    for spec, meta in zip(state.layer_specs, state.layer_meta):
        per_tok = (spec.k_format.bytes_per_token(spec.num_kv_heads, spec.head_dim, P)
                   + spec.v_format.bytes_per_token(spec.num_kv_heads, spec.v_head_dim, P))
        per_tok_bf16 = (bf16.bytes_per_token(spec.num_kv_heads, spec.head_dim, P)
                        + bf16.bytes_per_token(spec.num_kv_heads, spec.v_head_dim, P))
        if spec.num_kv_heads % tp:
            raise CLIError(
                f"--tp {tp}: layer {meta.get('name', '?')} has {spec.num_kv_heads} KV heads, "
                f"which do not divide by {tp}, so a rank would hold part of a head",
                hint=f"use a --tp that divides num_key_value_heads={spec.num_kv_heads}")
        h = spec.num_kv_heads // tp
        per_rank = (spec.k_format.bytes_per_token(h, spec.head_dim, P)
                    + spec.v_format.bytes_per_token(h, spec.v_head_dim, P))
        policy = meta.get("eviction")
        kept = min(context, policy.tokens_kept(context)) if policy is not None else context
        kept_max = max(kept_max, kept)
        layers.append({"layer": meta.get("name", "?"), "k_format": spec.k_format.name,
                       "v_format": spec.v_format.name, "kv_heads": spec.num_kv_heads,
                       "head_dim": spec.head_dim, "bytes_per_token": per_tok,
                       "bf16_bytes_per_token": per_tok_bf16, "tokens_kept": kept,
                       "kv_heads_per_rank": h, "bytes_per_token_per_rank": per_rank,
                       "eviction": policy_name(policy)})
    per_tok = sum(r["bytes_per_token"] for r in layers)
    per_tok_bf16 = sum(r["bf16_bytes_per_token"] for r in layers)
    # Page ids are shared by all layers: a sequence holds ceil(kept / P) pages, each of which
    # holds P tokens of every layer.
    pages_per_seq = math.ceil(kept_max / P)
    page_bytes = per_tok * P
    pool_bytes = batch * pages_per_seq * page_bytes
    bf16_bytes = batch * context * per_tok_bf16
    per_rank = sum(r["bytes_per_token_per_rank"] for r in layers)
    budget = state.config.max_kv_bytes
    # each rank's budget holds its own pages: tp times as many sequences fit in it
    page_budget = per_rank * P if tp > 1 else page_bytes
    plan = {
        "batch": batch, "context": context, "page_size": P, "layers": layers,
        "bytes_per_token": per_tok, "bf16_bytes_per_token": per_tok_bf16,
        "ratio_per_token": per_tok / per_tok_bf16 if per_tok_bf16 else None,
        "tokens_kept_per_sequence": kept_max, "pages_per_sequence": pages_per_seq,
        "pages": batch * pages_per_seq, "bytes_per_page": page_bytes,
        "pool_bytes": pool_bytes, "bf16_cache_bytes": bf16_bytes,
        "ratio": pool_bytes / bf16_bytes if bf16_bytes else None,
        "budget_bytes": budget,
        "sequences_in_budget": (int(budget // (pages_per_seq * page_budget))
                                if budget and pages_per_seq else None),
        "tp": tp, "bytes_per_token_per_rank": per_rank,
        "bytes_per_page_per_rank": per_rank * P,
        "pool_bytes_per_rank": batch * pages_per_seq * per_rank * P,
        "formats": _format_alternatives(state, batch, context, bf16_bytes),
    }
    return plan


def policy_name(policy) -> str:
    if policy is None:
        return "none"
    args = ", ".join(f"{k}={v}" for k, v in policy.__dict__.items())
    return f"{type(policy).__name__}({args})"


def _format_alternatives(state, batch: int, context: int, bf16_bytes: float) -> list[dict]:
    """The same batch and context in each storage format (uniform layers only)."""
    from kvcompile.cache.formats import format_table

    specs = state.layer_specs
    shapes = {(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in specs}
    if len(shapes) != 1:
        return []
    h, d, dv = shapes.pop()
    if d != dv:
        return []
    P = state.config.page_size
    pages = batch * math.ceil(context / P)
    rows = []
    for r in format_table(len(specs), h, d, P):
        nbytes = pages * P * r["bytes_per_token"]
        rows.append({"format": r["format"], "granularity": r["granularity"],
                     "bytes_per_token": r["bytes_per_token"],
                     "bits_per_value": r["bits_per_value"], "pool_bytes": nbytes,
                     "ratio_vs_bf16_cache": nbytes / bf16_bytes if bf16_bytes else None})
    return rows


def plan_text(plan: dict) -> str:
    lines = [f"memory plan: batch {plan['batch']} x context {plan['context']}, pages of "
             f"{plan['page_size']} tokens"]
    fmts = sorted({f"{r['k_format']}/{r['v_format']}" for r in plan["layers"]})
    evs = sorted({r["eviction"] for r in plan["layers"]})
    lines.append(f"  {len(plan['layers'])} layer(s), K/V {', '.join(fmts)}, eviction "
                 f"{', '.join(evs)}")
    lines.append(f"  bytes per token: {plan['bytes_per_token']:.1f} B (bf16: "
                 f"{plan['bf16_bytes_per_token']:.0f} B, {100 * plan['ratio_per_token']:.1f}%)")
    lines.append(f"  pages: {plan['pages_per_sequence']} per sequence "
                 f"({plan['tokens_kept_per_sequence']} tokens kept), {plan['pages']} in all, "
                 f"{fmt_bytes(plan['bytes_per_page'])} each")
    lines.append(f"  KV pool: {fmt_bytes(plan['pool_bytes'])}   bf16 DynamicCache: "
                 f"{fmt_bytes(plan['bf16_cache_bytes'])}   ratio {100 * plan['ratio']:.1f}%")
    if plan["tp"] > 1:
        heads = sorted({r["kv_heads_per_rank"] for r in plan["layers"]})
        lines.append(f"  tensor parallel, {plan['tp']} ranks: each holds "
                     f"{'/'.join(map(str, heads))} KV head(s) per layer, "
                     f"{plan['bytes_per_token_per_rank']:.1f} B/token, KV pool "
                     f"{fmt_bytes(plan['pool_bytes_per_rank'])} per rank")
    if plan["sequences_in_budget"] is not None:
        lines.append(f"  budget {fmt_bytes(plan['budget_bytes'])}"
                     f"{' per rank' if plan['tp'] > 1 else ''} holds "
                     f"{plan['sequences_in_budget']} such sequence(s)")
    if plan["formats"]:
        rows = [[r["format"], r["granularity"], f"{r['bytes_per_token']:.1f}",
                 f"{r['bits_per_value']:.2f}", fmt_bytes(r["pool_bytes"]),
                 f"{100 * r['ratio_vs_bf16_cache']:.1f}%"]
                for r in plan["formats"] if r["granularity"] in ("-", "page", "token")]
        lines.append("  the same batch and context in other formats:")
        lines += ["    " + ln for ln in table(rows, ["format", "scale", "B/token", "bits/value",
                                                       "pool", "vs bf16"]).splitlines()]
    return "\n".join(lines)
