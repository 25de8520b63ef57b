"""Tables (GitHub markdown) and a plot from benchmarks/quality_results.json.

    python benchmarks/quality.py --report
"""

from __future__ import annotations

import json
import os

# SmolLM2-135M: 30 layers x 3 kv heads x 64 dims, K and V
ELEMS_PER_TOKEN = 30 * 3 * 64 * 2
ELEM_BYTES = {"auto": 4.0, "bf16": 2.0, "fp8_e4m3": 1.0 + 4 / (16 * 64),
              "fp8_e5m2": 1.0 + 4 / (16 * 64), "fp4_e2m1": 0.5 + 1 / 16 + 4 / (16 * 64)}
FMT_NAME = {"auto": "fp32"}


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
    if "stream" in data:
        s = data["stream"]
        lines += [f"### Streaming perplexity, first {s['tokens']} Lee tokens "
                  f"(chunks of {s['chunk']})", "", "| cache | ppl | tokens |", "|---|---|---|"]
        for label, r in s["results"].items():
            lines.append(f"| {label} | {r['ppl']:.2f} | {r['tokens']} |")
        lines.append("")
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
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"wspace": 0.9})
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
                for label, per in data[suite]["results"].items():
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
        lengths = sorted({k for v in data["passkey"]["results"].values() for k in v}, key=int)
        ax.set_title(f"passkey at {'/'.join(lengths)} tokens (name@% evicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


def report(results_path: str, out_dir: str) -> None:
    with open(results_path) as f:
        data = json.load(f)
    print(tables(data))
    png = os.path.join(out_dir, "quality_eviction.png")
    if plot(data, png):
        print(f"plot: {png}")
