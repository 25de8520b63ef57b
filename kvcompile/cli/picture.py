"""Pictures of one attention site before and after the rewrite: Graphviz DOT, or SVG.

The subgraph is the site's own nodes (q, k, v, the attention chain, the mask, the cache ops)
plus the nodes one step around them; after the rewrite, the `kvcompile.attention` node of the
site, what feeds it and what uses it. SVG comes from Graphviz `dot` when it is installed, else
from a small built-in layered layout (no dependency).
"""

from __future__ import annotations

import html
import shutil
import subprocess

import torch
import torch.fx as fx

from kvcompile.cli.common import EXIT_USAGE, CLIError

MAX_NODES = 60


def site_subgraphs(trace, site_name: str | None) -> tuple[object, list, list]:
    """(site, before nodes, after nodes) of the named site (default: first rewritten)."""
    sites = trace.sites
    if not sites:
        raise CLIError(f"graph {trace.index} has no attention site to draw",
                       hint="see the site list of `kvcompile inspect MODEL`")
    if site_name is None:
        site = next((s for s in sites if s.rewritten), sites[0])
    else:
        match = [s for s in sites if s.name == site_name]
        if not match:
            raise CLIError(f"no site named {site_name!r}",
                           hint="sites: " + ", ".join(s.name for s in sites[:6]) +
                                (", ..." if len(sites) > 6 else ""), code=EXIT_USAGE)
        site = match[0]
    core = [site.q, site.k, site.v, site.output, *site.chain]
    if isinstance(site.mask, fx.Node):
        core.append(site.mask)
    for cop in (site.k_cache, site.v_cache):
        if cop is None:
            continue
        core += [n for n in (cop.new, cop.past, cop.buffer, cop.positions)
                 if isinstance(n, fx.Node)]
        core += list(cop.write_nodes)
    before_core = [trace.copies[n] for n in core if n in trace.copies]
    before = _neighbourhood(before_core, trace.copies.get(site.output))
    after = _after_nodes(trace.after.graph, site)
    return site, before, after


def _neighbourhood(core: list[fx.Node], output: fx.Node | None) -> list[fx.Node]:
    """The core nodes, what feeds them, and what uses the attention output."""
    if not core:
        return []
    keep = dict.fromkeys(core)
    for n in core:
        for a in n.all_input_nodes:
            keep.setdefault(a)
    if output is not None:
        for u in output.users:
            keep.setdefault(u)
    return [n for n in core[0].graph.nodes if n in keep][:MAX_NODES]


def _after_nodes(graph: fx.Graph, site) -> list[fx.Node]:
    ops = [n for n in graph.nodes if n.op == "call_function" and _is_kvc(n.target)
           and site.name in [a for a in n.args if isinstance(a, str)]]
    if not ops:
        return []  # left alone: nothing replaced it
    op = ops[0]
    keep = dict.fromkeys([op])
    for a in op.all_input_nodes:
        keep.setdefault(a)
        for b in a.all_input_nodes:
            keep.setdefault(b)
    for u in op.users:
        keep.setdefault(u)
    for a in op.all_input_nodes[1:3]:  # k_new, v_new: the stubs made from them
        for u in a.users:
            keep.setdefault(u)
            for uu in u.users:
                keep.setdefault(uu)
    return [n for n in graph.nodes if n in keep][:MAX_NODES]


def _is_kvc(target) -> bool:
    name = getattr(target, "__module__", "") or ""
    text = str(target)
    return "kvcompile" in text or "kvcompile" in name


# --- DOT --------------------------------------------------------------------------------------

def _label(n: fx.Node) -> tuple[str, str]:
    """(op text, shape text) of a node."""
    if n.op == "placeholder":
        op = "input"
    elif n.op == "output":
        op = "output"
    elif n.op == "call_method":
        op = f".{n.target}()"
    elif n.op == "get_attr":
        op = f"attr {n.target}"
    else:
        op = getattr(n.target, "__name__", None) or str(n.target)
        if "kvcompile" in str(n.target):
            op = "kvcompile.attention"
    v = n.meta.get("example_value", n.meta.get("val"))
    shape = ""
    if isinstance(v, torch.Tensor):
        shape = "[" + ", ".join(str(s) for s in v.shape) + "] " + \
                str(v.dtype).replace("torch.", "")
    return op, shape


def to_dot(site, before: list[fx.Node], after: list[fx.Node]) -> str:
    lines = ["digraph kvcompile_site {", "  rankdir=TB;", "  node [shape=box, style=rounded, "
             "fontname=Helvetica, fontsize=10];",
             f'  label="{_esc(site.name)}: {site.pattern}/{site.gqa}, cache {site.cache_kind}";']
    for tag, nodes, title in (("b", before, "before"), ("a", after, "after (kvcompile)")):
        lines.append(f"  subgraph cluster_{tag} {{")
        lines.append(f'    label="{title}";')
        ids = {n: f"{tag}_{n.name}" for n in nodes}
        for n in nodes:
            op, shape = _label(n)
            colour = ', color="#1f77b4", penwidth=2' if "kvcompile" in op else ""
            lines.append(f'    {ids[n]} [label="{_esc(n.name)}\\n{_esc(op)}\\n{_esc(shape)}"'
                         f"{colour}];")
        for n in nodes:
            for a in n.all_input_nodes:
                if a in ids:
                    lines.append(f"    {ids[a]} -> {ids[n]};")
        if not nodes:
            lines.append(f'    {tag}_none [label="(site left alone: {_esc(site.reason)})"];')
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _esc(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"')


# --- SVG --------------------------------------------------------------------------------------

def to_svg(site, before: list[fx.Node], after: list[fx.Node]) -> str:
    """Graphviz's rendering when `dot` is installed, else the built-in layout."""
    dot = shutil.which("dot")
    if dot:
        try:
            res = subprocess.run([dot, "-Tsvg"], input=to_dot(site, before, after), text=True,
                                 capture_output=True, timeout=60, check=True)
            return res.stdout
        except (subprocess.SubprocessError, OSError):
            pass
    return _builtin_svg(site, before, after)


_W, _H, _GX, _GY, _PAD = 190, 46, 24, 34, 30


def _layout(nodes: list[fx.Node]) -> dict:
    """Layered layout: a node's row is its longest path from a source inside the subgraph."""
    inside = set(nodes)
    rank: dict = {}
    for n in nodes:  # graph order is topological
        rank[n] = 1 + max((rank[a] for a in n.all_input_nodes if a in inside), default=-1)
    rows: dict[int, list] = {}
    for n in nodes:
        rows.setdefault(rank[n], []).append(n)
    pos = {}
    for r, row in rows.items():
        for i, n in enumerate(row):
            pos[n] = (i * (_W + _GX), r * (_H + _GY))
    width = max((len(row) for row in rows.values()), default=1) * (_W + _GX)
    height = (max(rows, default=0) + 1) * (_H + _GY)
    return {"pos": pos, "width": width, "height": height}


def _builtin_svg(site, before, after) -> str:
    panels = [("before", before), ("after (kvcompile)", after)]
    layouts = [_layout(nodes) for _, nodes in panels]
    width = sum(lay["width"] for lay in layouts) + 3 * _PAD
    height = max(lay["height"] for lay in layouts) + 3 * _PAD + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="Helvetica,Arial,sans-serif" font-size="10">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/>'
           '</marker></defs>',
           f'<text x="{_PAD}" y="18" font-size="13" font-weight="bold">'
           f'{html.escape(site.name)}: {site.pattern}/{site.gqa}, cache {site.cache_kind}'
           '</text>']
    x0 = _PAD
    for (title, nodes), lay in zip(panels, layouts):
        y0 = 2 * _PAD + 10
        out.append(f'<text x="{x0}" y="{y0 - 8}" font-size="12">{html.escape(title)}</text>')
        pos = lay["pos"]
        for n in nodes:
            for a in n.all_input_nodes:
                if a in pos:
                    (ax, ay), (bx, by) = pos[a], pos[n]
                    out.append(f'<line x1="{x0 + ax + _W / 2}" y1="{y0 + ay + _H}" '
                               f'x2="{x0 + bx + _W / 2}" y2="{y0 + by}" stroke="#555" '
                               'marker-end="url(#arrow)"/>')
        for n in nodes:
            x, y = pos[n]
            op, shape = _label(n)
            stroke = "#1f77b4" if "kvcompile" in op else "#333"
            out.append(f'<rect x="{x0 + x}" y="{y0 + y}" width="{_W}" height="{_H}" rx="6" '
                       f'fill="#fff" stroke="{stroke}" stroke-width="{2 if stroke != "#333" else 1}"/>')
            for i, text in enumerate((n.name, op, shape)):
                out.append(f'<text x="{x0 + x + 6}" y="{y0 + y + 13 + 12 * i}">'
                           f'{html.escape(_clip(text))}</text>')
        if not nodes:
            out.append(f'<text x="{x0}" y="{y0 + 14}">(site left alone: '
                       f'{html.escape(site.reason)})</text>')
        x0 += lay["width"] + _PAD
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _clip(text: str, n: int = 34) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
