"""The README's figures, as PNGs, from the JSON the benchmark scripts write.

    python benchmarks/plots.py [--results DIR] [--out docs/img]

Inputs (each figure is skipped, with a note, when its input is missing), looked up in
`--results` (default benchmarks/results/) and then in the scripts' own default places:

    memory.png    computed: KV bytes per token of each storage format (formats.format_table)
                  for SmolLM2-135M and a Llama-3-8B-shaped model. Needs no measurement.
    decode.png    bench_decode.json (bench_decode.py run --out DIR): decode time of each format
                  against SDPA over contiguous bf16, per shape, and the bandwidth reached
    prefill.png   bench_prefill.json (bench_prefill.py --json FILE): TFLOP/s per contender
    quality.png   quality_results.json (quality.py): perplexity of each storage format and
                  eviction policy against the full bf16 cache, and passkey retrieval accuracy

Needs matplotlib (`pip install 'kvcompile[plots]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# name: (layers, kv heads, head_dim)
MODEL_SHAPES = {"SmolLM2-135M": (30, 3, 64), "Llama-3-8B": (32, 8, 128)}
COLOURS = {"bf16": "#7f7f7f", "fp16": "#bcbd22", "fp32": "#c7c7c7", "fp8_e4m3": "#1f77b4",
           "fp8_e5m2": "#17becf", "fp4_e2m1": "#d62728", "int4": "#2ca02c", "int2": "#9467bd"}


def find(name: str, results_dir: str, fallbacks: tuple[str, ...] = ()) -> str | None:
    for folder in (results_dir, *fallbacks):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# --- memory (computed) -------------------------------------------------------------------------

def plot_memory(out_dir: str, page_size: int = 16) -> str:
    import matplotlib.pyplot as plt

    from kvcompile.cache.formats import format_table

    fig, axes = plt.subplots(1, len(MODEL_SHAPES), figsize=(11, 3.8))
    for ax, (model, (layers, heads, dim)) in zip(axes, MODEL_SHAPES.items()):
        rows = [r for r in format_table(layers, heads, dim, page_size)
                if r["granularity"] in ("-", "page") and r["format"] not in ("fp16", "fp32")]
        names = [r["format"] for r in rows]
        kib = [r["bytes_per_token"] / 1024 for r in rows]
        bars = ax.bar(names, kib, color=[COLOURS.get(n, "#333") for n in names])
        for b, r in zip(bars, rows):
            ax.annotate(f"{100 * r['ratio_vs_bf16']:.0f}%", (b.get_x() + b.get_width() / 2,
                        b.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{model}: {layers} layers, {heads} kv heads, head_dim {dim}", fontsize=9)
        ax.set_ylabel("KV cache KiB per token")
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle(f"KV bytes per token (all layers, K+V, scales included; page {page_size}), "
                 f"% of bf16", fontsize=10)
    return _save(fig, out_dir, "memory.png")


# --- decode -----------------------------------------------------------------------------------

def plot_decode(data: dict, out_dir: str) -> str:
    import matplotlib.pyplot as plt

    rows = data["final"]
    formats = list(rows[0]["kernels"])
    shapes = [r["shape"] for r in rows]
    width = 0.8 / len(formats)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for i, fmt in enumerate(formats):
        xs = [j + (i - (len(formats) - 1) / 2) * width for j in range(len(shapes))]
        ratio = [r["kernels"][fmt]["ratio"] for r in rows]
        tbs = [r["kernels"][fmt]["tbs"] for r in rows]
        ax.bar(xs, ratio, width, label=fmt, color=COLOURS.get(fmt.split()[0], None))
        ax2.bar(xs, tbs, width, label=fmt, color=COLOURS.get(fmt.split()[0], None))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("time / SDPA bf16 (lower is better)")
    ax.set_title("paged decode vs SDPA over contiguous bf16", fontsize=10)
    sdpa_tbs = [r["sdpa_tbs"] for r in rows]
    ax2.plot(range(len(shapes)), sdpa_tbs, "k_", ms=30, mew=2, label="SDPA bf16")
    ax2.set_ylabel("TB/s of stored bytes read")
    ax2.set_title("bandwidth reached", fontsize=10)
    for a in (ax, ax2):
        a.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_dir, "decode.png")


# --- prefill ----------------------------------------------------------------------------------

def plot_prefill(data: dict, out_dir: str) -> str:
    import matplotlib.pyplot as plt

    results = data["results"]
    shapes = list(results)
    names: list[str] = []
    for rows in results.values():
        for r in rows:
            if r["name"] not in names:
                names.append(r["name"])
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(12, 4))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, shape in enumerate(shapes):
            hit = [r for r in results[shape] if r["name"] == name]
            if hit and hit[0].get("tflops") is not None and math.isfinite(hit[0]["tflops"]):
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(hit[0]["tflops"])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(shapes)), [s[:28] for s in shapes], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    info = data.get("info", {})
    ax.set_title(f"prefill attention, {info.get('gpu', '')} {info.get('date', '')}", fontsize=10)
    ax.legend(fontsize=6, ncol=3)
    return _save(fig, out_dir, "prefill.png")


# --- quality ----------------------------------------------------------------------------------

def plot_quality(data: dict, out_dir: str) -> str | None:
    import matplotlib.pyplot as plt

    panels = [k for k in ("ppl", "passkey") if k in data]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "ppl":
            _ppl_panel(ax, data["ppl"])
        else:
            _passkey_panel(ax, data["passkey"])
    return _save(fig, out_dir, "quality.png")


def _ppl_panel(ax, suite: dict) -> None:
    res = suite["results"]
    formats = list(res)
    base_fmt = "auto" if "auto" in res else formats[0]
    base = res[base_fmt]["full"]["ppl"]
    policies = [p for p in res[base_fmt] if p != "full"]
    full = [100 * (res[f]["full"]["ppl"] / base - 1) for f in formats]
    ax.bar(range(len(formats)), full, color=[COLOURS.get(f, "#1f77b4") for f in formats],
           label="full cache")
    for p in policies[:6]:
        ys = [100 * (res[f][p]["ppl"] / base - 1) if p in res[f] else float("nan")
              for f in formats]
        ax.plot(range(len(formats)), ys, "o", ms=4, label=p)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(formats)), formats, fontsize=8, rotation=15)
    ax.set_ylabel(f"perplexity change vs {base_fmt} full cache (%)")
    ax.set_title(f"SmolLM2-135M, Lee corpus ({suite.get('ctx')} context + {suite.get('cont')} "
                 f"scored)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)


def _passkey_panel(ax, suite: dict) -> None:
    res = suite["results"]
    names = list(res)
    acc = []
    for n in names:
        hits = [h for per_len in res[n].values() for h in per_len]
        acc.append(100 * sum(bool(h) for h in hits) / len(hits) if hits else 0.0)
    ax.barh(range(len(names)), acc, color="#1f77b4")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlim(0, 100)
    ax.set_xlabel("passkey retrieved (%)")
    lengths = ", ".join(str(x) for x in suite.get("lengths", []))
    ax.set_title(f"passkey retrieval at {lengths} tokens (policy@% evicted)", fontsize=9)


# --- main -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("plots.py needs matplotlib: pip install 'kvcompile[plots]'", file=sys.stderr)
        return 5
    os.makedirs(args.out, exist_ok=True)
    made, skipped = [plot_memory(args.out)], []
    inputs = {
        "decode": ("bench_decode.json", (HERE,), plot_decode),
        "prefill": ("bench_prefill.json", (HERE,), plot_prefill),
        "quality": ("quality_results.json", (os.path.join(HERE, "quality"),), plot_quality),
    }
    for what, (name, fallbacks, plot) in inputs.items():
        path = find(name, args.results, fallbacks)
        if path is None:
            skipped.append(f"{what}: no {name} in {args.results} or {', '.join(fallbacks)}")
            continue
        try:
            out = plot(load_json(path), args.out)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            skipped.append(f"{what}: {path} has an unexpected layout ({type(e).__name__}: {e})")
            continue
        if out:
            made.append(out)
    for p in made:
        print(f"wrote {os.path.relpath(p, ROOT)}")
    for s in skipped:
        print(f"skipped {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
