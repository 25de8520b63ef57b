"""`kvcompile inspect MODEL`: what the passes found and did, the memory plan, and checks.

    kvcompile inspect smollm2                         # sites, rewrites, formats; memory plan
    kvcompile inspect smollm2 --passes [--pass NAME]  # each pass's summary and graph diff
    kvcompile inspect smollm2 --svg site.svg          # one site before / after
    kvcompile inspect smollm2 --verify                # eager vs compiled, per layer
"""

from __future__ import annotations

import os

from kvcompile.cli import trace as _trace
from kvcompile.cli.common import (
    EXIT_OK,
    EXIT_VERIFY,
    CLIError,
    Console,
    Result,
    kv_config,
    load,
    resolve_inner,
    table,
)
from kvcompile.cli.memory import policy_name
from kvcompile.passes import merge_projections, skinny_linears

CONTEXT_CAP = 32768


def run(args) -> Result:
    import kvcompile
    from kvcompile.cli.demo import _quiet_transformers
    from kvcompile.cli.memory import memory_plan, plan_text

    _check_args(args)
    console = Console.for_args(args)
    _quiet_transformers()
    show_passes = args.passes or args.stop_pass is not None
    lm = load(args, console)
    cfg = kv_config(args, inner=resolve_inner(args.inner, lm.device))
    ids = _trace.prompt_ids(lm, args.prompt, args.prompt_tokens) if lm.is_hf else None

    eager = None
    if args.verify:
        from kvcompile.cli import verify

        with console.stage("eager run"):
            eager = verify.capture(lm, lm.model, ids, args.steps)
    with _trace.recording(keep_code=show_passes, stop_after=args.stop_pass) as traces:
        lm.compiled = kvcompile.compile(lm.model, cfg)
        with console.stage(f"compiling (kv {cfg.kv_dtype}, inner {cfg.inner}) and running"):
            if args.verify:
                local = verify.LocalError(traces)
                _state(lm).hooks.insert(0, local)  # first: sees K/V before any other hook
                compiled = verify.capture(lm, lm.compiled, ids, args.steps, tokens=eager.tokens)
            else:
                _trace.drive(lm, ids)
    if not traces:
        raise CLIError(f"Dynamo produced no graph for {args.model}",
                       hint="is the forward empty, or disabled for torch.compile?", code=1)
    state = _state(lm)
    payload = {"model": args.model, "source": lm.source, "device": str(lm.device),
               "config": _config_dict(cfg), "graphs": len(traces),
               "graph_inputs": [t.inputs for t in traces]}
    text: list[str] = []

    rows = _site_rows(state, traces, args.stop_pass)
    payload["sites"] = rows
    payload["rewritten"] = sum(1 for r in rows if r["rewritten"])
    text.append(_sites_text(rows, len(traces), args.stop_pass))
    counters = state.counters if state is not None else {}
    merged = merge_projections.summary(counters)
    if merged:
        payload["projections"] = {k: counters.get(f"projections_{k}", 0)
                                  for k in ("linears", "merged", "copied", "gated_in_place")}
        text.append(merged)
    gemms = skinny_linears.summary(counters)
    if gemms:
        payload.update({k: v for k, v in counters.items()
                        if k.startswith("decode_gemms_") and v})
        text.append(gemms)
    misses = _near_misses(traces)
    payload["near_misses"] = misses
    if misses:
        text.append(_near_misses_text(misses))

    if state is not None and state.layer_specs and args.stop_pass in (None, "rewrite",
                                                                       "eviction"):
        context = args.context or _default_context(lm)
        plan = memory_plan(state, args.batch, context, args.tp)
        payload["memory"] = plan
        text.append(plan_text(plan))

    if show_passes:
        payload["passes"] = _passes(traces, args, text)
    if args.dot or args.svg:
        payload["pictures"] = _pictures(traces, args)
        text.append("wrote " + ", ".join(f"{p['file']} ({p['site']}, graph {p['graph']})"
                                         for p in payload["pictures"]))
    code = EXIT_OK
    if args.verify:
        from kvcompile.cli import verify

        if state is None:
            raise CLIError("no attention site was compiled, nothing to verify", code=1)
        res = verify.compare(eager, compiled, state, local.errors(),
                             next(lm.model.parameters()).dtype, next_token_logits=lm.is_hf)
        payload["verify"] = res
        text.append(verify.verify_text(res, args.steps if lm.is_hf else 0))
        if not res["ok"]:
            code = EXIT_VERIFY
    payload["exit_code"] = code
    return Result(payload, "\n\n".join(t for t in text if t), code)


def _check_args(args) -> None:
    if args.batch < 1:
        raise CLIError(f"--batch must be >= 1, got {args.batch}")
    if args.context is not None and args.context < 1:
        raise CLIError(f"--context must be >= 1, got {args.context}")
    if args.tp < 1:
        raise CLIError(f"--tp must be >= 1, got {args.tp}")
    if args.steps < 0:
        raise CLIError(f"--steps must be >= 0, got {args.steps}")
    if args.prompt_tokens < 1:
        raise CLIError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    for opt in ("dot", "svg"):
        path = getattr(args, opt)
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise CLIError(f"--{opt} {path}: folder {folder} does not exist",
                               hint="create it first, or write somewhere else")
    if (args.full or args.graph is not None) and not (args.passes or args.stop_pass):
        raise CLIError("--full and --graph go with --passes (or --pass NAME)")


def _state(lm):
    from kvcompile.api import state_of

    return state_of(lm.model)


def _config_dict(cfg) -> dict:
    return {k: (repr(v) if v is not None and not isinstance(v, (int, float, str, bool)) else v)
            for k, v in cfg.__dict__.items()}


def _default_context(lm) -> int:
    cfg = getattr(lm.model, "config", None)
    n = (getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
         or 4096)
    return int(min(n, CONTEXT_CAP))


# --- sites ------------------------------------------------------------------------------------

def _site_rows(state, traces, stop_pass) -> list[dict]:
    """One row per site. After a full pipeline: the report's records (latest graph per site,
    with the cache op seen by each graph). With --pass: the sites as that pass left them."""
    per_graph: dict[str, dict[int, str]] = {}
    for t in traces:
        for s in t.sites:
            per_graph.setdefault(s.name, {})[t.index] = s.cache_kind
    if state is not None and state.records and stop_pass in (None, "rewrite", "eviction"):
        latest = {}
        for rec in state.records:
            latest[rec.name] = rec
        rows = []
        for rec in latest.values():
            d = rec.as_dict()
            d["rewrite"] = _rewrite_label(rec.rewritten, rec.reason, stop_pass)
            d["cache_by_graph"] = per_graph.get(rec.name, {})
            rows.append(d)
        return rows
    last = traces[-1]
    rows = []
    for s in last.sites:
        rows.append({"name": s.name, "module_class": s.module_class, "pattern": s.pattern,
                     "gqa": s.gqa, "cache": s.cache_kind if s.k_cache else "-",
                     "rewritten": s.rewritten, "reason": s.reason,
                     "k_format": getattr(s, "k_format_name", "") or "",
                     "v_format": getattr(s, "v_format_name", "") or "",
                     "eviction": policy_name(s.config.eviction) if s.config is not None
                     else "-", "mask": s.mask_kind or "none", "graph": last.index,
                     "rewrite": _rewrite_label(s.rewritten, s.reason, stop_pass),
                     "cache_by_graph": per_graph.get(s.name, {})})
    return rows


def _rewrite_label(rewritten: bool, reason: str, stop_pass) -> str:
    if rewritten:
        return "kvcompile.attention (paged pool)"
    if reason:
        return f"left alone: {reason}"
    if stop_pass in ("find_attention", "find_cache", "resolve_config"):
        return f"not reached (stopped after {stop_pass})"
    return "none"


def _sites_text(rows: list[dict], graphs: int, stop_pass) -> str:
    n_rw = sum(1 for r in rows if r["rewritten"])
    head = (f"{len(rows)} attention site(s), {n_rw} rewritten, over {graphs} graph(s)"
            + (f" (stopped after pass {stop_pass})" if stop_pass else ""))
    body = []
    for r in rows:
        fmt = f"{r['k_format']}/{r['v_format']}" if r.get("k_format") else "-"
        status = "rewritten" if r["rewritten"] else r["rewrite"]
        caches = ",".join(sorted(set(r["cache_by_graph"].values()))) or r["cache"]
        body.append([r["name"], r["pattern"], r["gqa"], r.get("mask", "-"), caches, fmt,
                     r.get("eviction", "-"), status])
    return head + "\n" + table(body, ["site", "pattern", "gqa", "mask", "cache op",
                                      "K/V format", "eviction", "rewrite"])


def _near_misses(traces) -> list[dict]:
    """Softmaxes and attention-like ops that became no site, once each (the first graph's
    reason), with the pattern step that failed and the node it failed on."""
    seen: dict[tuple, dict] = {}
    for t in traces:
        for m in getattr(t.result, "near_misses", []):
            d = m.as_dict()
            d["graph"] = t.index
            seen.setdefault((m.name, m.node), d)
    return list(seen.values())


def _near_misses_text(misses: list[dict]) -> str:
    body = [[m["name"], m["node"], m["step"], m["at"], m["reason"]] for m in misses]
    return (f"{len(misses)} near miss(es): softmax / attention-like ops that are no attention "
            f"site\n" + table(body, ["module", "node", "failed step", "at node", "why"]))


# --- passes -----------------------------------------------------------------------------------

def _passes(traces, args, text: list[str]) -> list[dict]:
    chosen = traces
    if args.graph is not None:
        chosen = [t for t in traces if t.index == args.graph]
        if not chosen:
            raise CLIError(f"--graph {args.graph}: there are {len(traces)} graph(s)",
                           hint=f"use 1..{len(traces)}")
    out = []
    for t in chosen:
        diffs = t.diffs()
        entry = {"graph": t.index, "inputs": t.inputs, "passes": diffs}
        lines = [f"=== graph {t.index} (tensor inputs {_shapes(t.inputs)}) ==="]
        if args.full:
            entry["code_before"] = t.result.code_before
            lines += ["--- code before the passes ---", t.result.code_before or ""]
        for d, (_, _, code) in zip(diffs, t.stages()):
            lines.append(f"--- pass {d['pass']}: {d['summary']} "
                         f"({d['lines_changed']} line(s) changed)")
            if d["diff"]:
                lines.append(d["diff"].rstrip("\n"))
            if args.full:
                d["code_after"] = code
                lines += [f"--- code after {d['pass']} ---", code or ""]
        ran = [d["pass"] for d in diffs]
        if args.stop_pass and args.stop_pass not in ran:
            lines.append(f"(pass {args.stop_pass} did not run on this graph: "
                         f"{'no eviction policy' if args.stop_pass == 'eviction' else 'stopped'})")
        out.append(entry)
        text.append("\n".join(lines))
    return out


def _shapes(shapes) -> str:
    shown = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes[:4])
    return shown + (", ..." if len(shapes) > 4 else "")


# --- pictures ---------------------------------------------------------------------------------

def _pictures(traces, args) -> list[dict]:
    from kvcompile.cli.picture import site_subgraphs, to_dot, to_svg

    # the last graph holds the steady state (decode over a cache); it has every site
    trace = traces[-1] if args.graph is None else next(
        (t for t in traces if t.index == args.graph), None)
    if trace is None:
        raise CLIError(f"--graph {args.graph}: there are {len(traces)} graph(s)")
    site, before, after = site_subgraphs(trace, args.site)
    out = []
    for opt, render in (("dot", to_dot), ("svg", to_svg)):
        path = getattr(args, opt)
        if path:
            with open(path, "w") as f:
                f.write(render(site, before, after))
            out.append({"file": path, "format": opt, "site": site.name, "graph": trace.index,
                        "nodes_before": len(before), "nodes_after": len(after)})
    return out
