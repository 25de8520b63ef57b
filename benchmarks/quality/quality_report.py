"""Tables (GitHub markdown) and a plot from benchmarks/quality/quality_results.json.

    python benchmarks/quality/quality.py --report
    python benchmarks/quality/quality_report.py --only _h200 --no-plot      # some suites' tables
    python benchmarks/quality/quality_report.py --merge-from $OUT/quality_results_h200.json \
        --only _h200
"""

from __future__ import annotations

import argparse
import json
import math
import os

# SmolLM2-135M: 30 layers x 3 kv heads x 64 dims, K and V
ELEMS_PER_TOKEN = 30 * 3 * 64 * 2
ELEM_BYTES = {"auto": 4.0, "bf16": 2.0, "fp8_e4m3": 1.0 + 4 / (16 * 64),
              "fp8_e5m2": 1.0 + 4 / (16 * 64), "fp4_e2m1": 0.5 + 1 / 16 + 4 / (16 * 64),
              # K int4 + fp16 scale and zero per channel of a 64-token page, V int4 + fp16
              # scale and zero per token and head of 64 dims: 4.5 bits each
              "int4-kc-vt-p64-rot": 4.5 / 8}
FMT_NAME = {"auto": "fp32", "int4-kc-vt-p64-rot": "K int4/V int4 P64+rot"}
COMPARE_AT = 9216  # tokens of the published CPU streaming run: longer runs show that prefix too


def _rate(hits: list) -> str:
    return f"{100 * sum(hits) / len(hits):.0f}% ({sum(hits)}/{len(hits)})" if hits else "-"


def _retrieval_table(res: dict, title: str) -> list[str]:
    keys = sorted({k for v in res.values() for k in v}, key=lambda x: (len(x), x))
    out = [f"| {title} | " + " | ".join(keys) + " | all |",
           "|---|" + "---|" * (len(keys) + 1)]
    for label, per in res.items():
        allh = [h for k in keys for h in per.get(k, [])]
        out.append(f"| {label} | " + " | ".join(_rate(per.get(k, [])) for k in keys)
                   + f" | {_rate(allh)} |")
    return out


def _at(curve: list, end: int):
    """(ppl, tokens) of a row's curve point at `end` ([end, nll, n] points), or None."""
    for e, nll, n in curve or []:
        if e == end and n:
            return math.exp(nll / n), n
    return None


def _stream_table(key: str, s: dict) -> list[str]:
    """One streaming run: each row's ppl over what it covered; where a row stopped short of
    the run's tokens (a deadline), and at COMPARE_AT tokens (the published CPU run) when the run
    is longer, every row on the same prefix too (curve points of the streaming rows and of the
    sliding baselines score the same tokens; the consecutive-window baseline scores others)."""
    res, total = s["results"], s["tokens"]
    win = "2048-token windows"
    ups = [r.get("upto", total) for lab, r in res.items() if win not in lab]
    common = min(ups) if ups else total
    slides = [lab for lab in res if "sliding" in lab]
    ref = next((lab for lab in slides if "(stride 64)" in lab), slides[0] if slides else None)
    cols = [common] if 0 < common < total else []
    if total > COMPARE_AT and all(_at(r.get("curve"), COMPARE_AT)
                                  for lab, r in res.items() if win not in lab):
        cols.append(COMPARE_AT)
    out = [f"### {key}: streaming perplexity, {total:,} Lee tokens (chunks of {s['chunk']})", "",
           "| cache | ppl | tokens scored | vs " + (ref or "-") + " |"
           + "".join(f" ppl, first {c:,} tokens |" for c in cols),
           "|---|---|---|---|" + "---|" * len(cols)]
    for label, r in res.items():
        upto = r.get("upto", total)
        vs = "-"
        if ref and label != ref and win not in label and r.get("ppl") is not None:
            if upto == total and res[ref].get("upto", total) == total:
                vs = f"{100 * (r['ppl'] / res[ref]['ppl'] - 1):+.1f}%"
            else:
                b = _at(res[ref].get("curve"), upto)
                if b:
                    vs = f"{100 * (r['ppl'] / b[0] - 1):+.1f}% (same prefix)"
        cells = [label, "-" if r.get("ppl") is None else f"{r['ppl']:.2f}",
                 f"{r['tokens']:,}" + (f" (stopped at token {upto:,})" if upto < total else ""),
                 vs]
        for c in cols:
            v = None if win in label else _at(r.get("curve"), c)
            cells.append(f"{v[0]:.2f}" if v else "-")
        out.append("| " + " | ".join(cells) + " |")
    return out


def tables(data: dict) -> str:
    lines = []
    for key in [k for k in data if k.startswith("ppl")]:
        p = data[key]
        lines += [f"### {key}: perplexity after a compressed {p['ctx']}-token context "
                  f"({p['cont']} scored tokens x {p['windows']} windows of the Lee corpus)", "",
                  "| format | row | kept | ppl | KL vs full (nats) | top-1 agreement | "
                  "KB / token |", "|---|---|---|---|---|---|---|"]
        for fmt, rows in p["results"].items():
            for label, r in rows.items():
                kb = ELEMS_PER_TOKEN * ELEM_BYTES[fmt] * r["kept"] / 1024
                lines.append(f"| {FMT_NAME.get(fmt, fmt)} | {label} | {100 * r['kept']:.0f}% | "
                             f"{r['ppl']:.2f} | {r['kl']:.4f} | {100 * r['top1']:.1f}% | "
                             f"{kb:.1f} |")
        lines.append("")
    for key in [k for k in data if k.startswith("stream")]:
        lines += _stream_table(key, data[key]) + [""]
    titles = {"passkey": "passkey (tokens)", "kvpress": "kvpress press",
              "ruler": "RULER-like task", "kvpress_ruler": "kvpress press, RULER-like task"}
    for suite in data:
        base = next((t for t in sorted(titles, key=len, reverse=True) if suite.startswith(t)),
                    None)
        if base is not None:
            lines += [f"### {suite}", ""] + _retrieval_table(data[suite]["results"],
                                                             titles[base])
            lines.append("")
    return "\n".join(lines)


def plot(data: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.5), gridspec_kw={"wspace": 0.9})
    seen = set()
    for key in [k for k in data if k.startswith("ppl")]:
        ax = axes[0]
        for fmt, rows in data[key]["results"].items():
            for label, r in rows.items():
                if (fmt, label) in seen:  # a row measured again by a later run: same figure
                    continue
                seen.add((fmt, label))
                kb = ELEMS_PER_TOKEN * ELEM_BYTES[fmt] * r["kept"] / 1024
                pol = label.split("@")[0]
                ax.scatter(kb, r["ppl"], marker={"full": "o", "SinkWindow": "s", "H2O": "^",
                                                 "SnapKV": "D", "SnapKV-w8-shared": "*",
                                                 "TOVA-like": "P"}.get(pol, "x"),
                           label=f"{FMT_NAME.get(fmt, fmt)} {label}", s=22)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV cache KB per context token (all layers, K+V)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title("SmolLM2-135M, Lee corpus")
        ax.legend(fontsize=5, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if "passkey" in data:
        ax = axes[1]
        bars = []  # (label, % retrieved, n), kvcompile rows then kvpress presses
        for prefix in ("passkey", "kvpress"):
            # runs with the same prompts (--tag, --skip-lengths): one entry per (row, length)
            merged = {}
            for suite in [k for k in data if k.startswith(prefix) and "ruler" not in k]:
                kv = data[suite].get("kv", "auto")
                for label, per in data[suite]["results"].items():
                    if kv != "auto":   # (fp32 rows keep their names)
                        label = f"{FMT_NAME.get(kv, kv)} {label}"
                    for length, h in per.items():
                        merged.setdefault(label, {}).setdefault(length, h)
            for label, per in merged.items():
                hits = [h for v in per.values() for h in v]
                if hits:
                    name = label if prefix == "passkey" else f"kvpress {label}"
                    bars.append((name, 100 * sum(hits) / len(hits), len(hits)))
        y = list(range(len(bars)))[::-1]
        ax.barh(y, [b[1] for b in bars],
                color=["tab:orange" if b[0].startswith("kvpress") else "tab:blue" for b in bars])
        ax.set_yticks(y, [f"{b[0]} (n={b[2]})" for b in bars], fontsize=6)
        ax.set_xlim(0, 100)
        ax.set_xlabel("passkey retrieved (%)")
        lengths = sorted({k for s in data if s.startswith("passkey")
                          for v in data[s]["results"].values() for k in v}, key=int)
        ax.set_title(f"passkey at {'/'.join(lengths)} tokens (name@% evicted)")
    _plot_retrieval_bytes(axes[2], data)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


def retrieval_points(data: dict) -> dict:
    """{(task, format, row): (KB per context token, hits)}: passkey and the RULER-like
    multi-key needle of every format (a suite's "kv", fp32 when absent), each row at the bytes
    it keeps (format bytes x (1 - evicted share), from the row's "@pct")."""
    pts = {}
    for suite, s in data.items():
        task = ("passkey" if suite.startswith("passkey") else
                "multi-key" if suite.startswith("ruler") else None)
        if task is None:
            continue
        kv = s.get("kv", "auto")
        for label, per in s["results"].items():
            hits = [h for k, v in per.items() if task == "passkey" or k.startswith("multikey")
                    for h in v]
            if not hits:
                continue
            kept = 1 - int(label.split("@")[1]) / 100 if "@" in label else 1.0
            kb = ELEMS_PER_TOKEN * ELEM_BYTES[kv] * kept / 1024
            old = pts.get((task, kv, label), (kb, []))[1]
            pts[(task, kv, label)] = (kb, old + hits)
    return pts


def _plot_retrieval_bytes(ax, data: dict) -> None:
    """Retrieval (%) against KB per context token: format x eviction ratio."""
    pts = retrieval_points(data)
    colors = {"auto": "tab:blue", "bf16": "tab:cyan", "fp8_e4m3": "tab:green",
              "int4-kc-vt-p64-rot": "tab:red"}
    for (task, kv, label), (kb, hits) in sorted(pts.items()):
        pol = label.split("@")[0]
        c = colors.get(kv, "tab:gray")
        ax.scatter(kb, 100 * sum(hits) / len(hits), s=28, edgecolors=c,
                   facecolors="none" if task == "multi-key" else c,
                   marker={"full": "o", "SinkWindow": "s", "H2O": "^", "SnapKV": "D",
                           "SnapKV-w8-shared": "*", "TOVA-like": "P"}.get(pol, "x"),
                   label=f"{task}: {FMT_NAME.get(kv, kv)} {label} (n={len(hits)})")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-5, 105)
    ax.set_xlabel("KV cache KB per context token (all layers, K+V)")
    ax.set_ylabel("retrieved (%)")
    ax.set_title("passkey (filled) and multi-key needle (hollow)\nby format x eviction")
    ax.legend(fontsize=5, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def report(results_path: str, out_dir: str | None, only: str | None = None) -> None:
    """Print the tables of every suite (only: those whose name contains it); write the plot
    into out_dir (None: no plot)."""
    with open(results_path) as f:
        data = json.load(f)
    print(tables({k: v for k, v in data.items() if only is None or only in k}))
    if out_dir is None:
        return
    png = os.path.join(out_dir, "quality_eviction.png")
    if plot(data, png):
        print(f"plot: {png}")


def merge_into(results_path: str, other: str) -> list[str]:
    """Copy every suite of `other` (a run saved elsewhere, e.g. a GPU run's --results) into
    results_path, replacing suites of the same name; returns their names."""
    with open(other) as f:
        new = json.load(f)
    data = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            data = json.load(f)
    data.update(new)
    with open(results_path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(results_path + ".tmp", results_path)
    return list(new)


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(here, "quality_results.json"))
    ap.add_argument("--merge-from", default=None,
                    help="first copy this file's suites into --results (same names replaced)")
    ap.add_argument("--only", default=None, help="tables of the suites whose name has this")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    if a.merge_from:
        names = merge_into(a.results, a.merge_from)
        print(f"merged {', '.join(names)} from {a.merge_from} into {a.results}\n")
    report(a.results, None if a.no_plot else here, a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
