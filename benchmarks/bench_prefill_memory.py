"""Peak memory and time to first token of a long prompt batch: kvcompile pages vs HF's caches.

    python benchmarks/bench_prefill_memory.py                 # H200: every row, own processes
    python benchmarks/bench_prefill_memory.py --format fp8_e4m3   # one row, this process
    python benchmarks/bench_prefill_memory.py --smoke         # CPU: tiny model, every row

Setup: an 8-layer Llama-3-8B-shaped model (hidden 4096, 32 q / 8 kv heads,
head_dim 128, MLP 14336, vocab 32,000), random bf16 weights, B=16 prompts of 32,768 tokens, no
padding (`--pad N`: row b gets b*N pad tokens on the left). A row is `generate(max_new_tokens=1)`
(the prefill and one token): TTFT is its wall time, the peak is `torch.cuda.max_memory_allocated`
over that call (reset before), both from the second call (the first compiles and autotunes).

Rows (each in its own process: the driver spawns them and prints one table):
  mask_analysis    kernels/masks.py alone on HF's [B, 1, S, S] mask: extra peak over the mask,
                   time, exactness, a one-element hole refused (PASS / FAIL in `note`)
  hf_dynamic       HF DynamicCache, eager (HF's default)
  hf_static        HF StaticCache (its prefill runs eagerly: HF compiles only decode steps)
  bf16 / fp8_e4m3 / fp4_e2m1   kvcompile.compile(model, kv_dtype=..., inner inductor); the
                   pool sized by max_kv_bytes for exactly the workload; prefill chunked
                   automatically (integrations/hf_prefill.py) when it would not fit
  bf16_whole / fp8_e4m3_whole  the same, automatic chunking off (one prefill forward)
  *_stored         the same, KVConfig(prefill_attends="stored"): a fresh prompt attends to the
                   pages just written, not to its K/V as computed (the default, "fresh")
The `fresh` column counts attention calls that took the fresh-prompt SDPA path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GIB = 1 << 30
ROWS = ("mask_analysis", "hf_static", "fp8_e4m3", "bf16", "fp4_e2m1", "hf_dynamic", "bf16_whole",
        "fp8_e4m3_whole", "fp8_e4m3_stored", "bf16_stored", "fp4_e2m1_stored")
DEFAULT_ROWS = "mask_analysis,hf_static,fp8_e4m3,bf16,fp4_e2m1,bf16_whole"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=ROWS, help="run this one row here (else: the driver)")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="driver: rows, in order")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pad", type=int, default=0, help="left padding step per row")
    p.add_argument("--budget-s", type=float, default=540.0, help="driver: total time")
    p.add_argument("--row-timeout-s", type=float, default=240.0)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, reference kernels")
    p.add_argument("--json", default=None, help="driver: also write the rows here")
    p.add_argument("--trace", action="store_true",
                   help="CUDA: record the second call's allocations and report the blocks "
                        "live at its peak, grouped by the code that allocated them")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.layers, a.vocab = 2, 2, 512
        a.prompt = 96 if a.prompt == 32768 else a.prompt
    return a


def model_config(args):
    from transformers import LlamaConfig

    if args.smoke:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=args.layers, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=args.layers, num_attention_heads=32,
                          num_key_value_heads=8, max_position_embeddings=2 * args.prompt,
                          rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return cfg


def kv_bytes_for(args, cfg, kv_dtype: str, page: int = 16) -> int:
    """Pool bytes that hold exactly B sequences of prompt + 1 tokens (and a few pages)."""
    from kvcompile.cache.formats import resolve_format
    from kvcompile.cache.pool import LayerSpec

    d = cfg.hidden_size // cfg.num_attention_heads
    fmt = resolve_format(kv_dtype, torch.bfloat16, "page")
    spec = LayerSpec(cfg.num_key_value_heads, d, d, fmt, fmt)
    pages = args.batch * math.ceil((args.prompt + 1) / page) + 8
    return math.ceil(pages * cfg.num_hidden_layers * spec.bytes_per_page(page)) + 1


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def mask_analysis_row(args) -> dict:
    """The mask analysis alone on HF's own [B, 1, S, L] bool mask (left padding 256 * b tokens
    per row): extra peak memory over the mask, time, and that a one-element hole is refused."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from kvcompile.kernels import masks
    from kvcompile.runtime.context import StepPlan

    device = torch.device("cpu" if args.smoke else "cuda")
    B, S = args.batch, args.prompt
    pads = [min(256 * b, S - 1) for b in range(B)]
    am = torch.ones(B, S, dtype=torch.bool, device=device)
    for b, p in enumerate(pads):
        am[b, :p] = False
    mask = sdpa_mask(batch_size=B, q_length=S, kv_length=S, mask_function=causal_mask_function,
                     attention_mask=am, allow_is_causal_skip=False, device=device)

    def plan():
        return StepPlan(seq_ids=list(range(B)), batch=B, new_tokens=S, past_lens=[0] * B,
                        slots=torch.zeros(1, dtype=torch.long, device=device),
                        block_tables=torch.zeros(B, 1, dtype=torch.int32, device=device),
                        seq_lens=torch.full((B,), S, dtype=torch.int32, device=device),
                        seq_lens_list=[S] * B, kv_start=[0] * B)

    row = dict(row=args.format, batch=B, prompt=S, mask_gib=mask.numel() / GIB)
    for _ in range(2):                             # the second call is the one reported
        sync(device)
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        info = masks.analyze(plan(), mask, True, 0)
        sync(device)
        row["analysis_ms"] = 1e3 * (time.perf_counter() - t0)
        if device.type == "cuda":
            row["analysis_extra_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    row["exact"] = info.exact
    row["kv_start_ok"] = info.kv_start == pads
    mask[B - 1, 0, S - 1, S // 2] = False          # one hole in the last real query row
    row["hole_refused"] = not masks.analyze(plan(), mask, True, 0).exact
    ok = row["exact"] and row["kv_start_ok"] and row["hole_refused"]
    row["error"] = "PASS" if ok else "FAIL"
    return row


def run_row(args) -> dict:
    if args.format == "mask_analysis":
        return mask_analysis_row(args)
    from transformers import AutoModelForCausalLM

    import kvcompile
    from kvcompile.integrations import hf_prefill
    from kvcompile.runtime.hooks import RuntimeHook

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = model_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, args.vocab, (args.batch, args.prompt), generator=g)
    am = torch.ones_like(ids)
    for b in range(args.batch):
        am[b, :min(b * args.pad, args.prompt - 1)] = 0
    ids, am = ids.to(device), am.to(device)
    row = dict(row=args.format, batch=args.batch, prompt=args.prompt)
    kw = dict(attention_mask=am, max_new_tokens=1, min_new_tokens=1, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    forwards = []
    fmt = args.format
    if fmt.startswith("hf_"):
        if fmt == "hf_static":
            kw["cache_implementation"] = "static"
    else:
        kv_dtype = fmt.removesuffix("_whole").removesuffix("_stored")
        if fmt.endswith("_whole"):
            hf_prefill.prefill_activation_budget = lambda device, state: None  # one forward
        elif args.smoke:  # the CPU has no device budget: one that splits the prompt in 3
            per_token = hf_prefill.activation_bytes_per_token(model)
            hf_prefill.MIN_CHUNK = 16
            hf_prefill.prefill_activation_budget = (
                lambda device, state: args.batch * (args.prompt // 3) * per_token)
        kvcompile.compile(model, kvcompile.KVConfig(
            kv_dtype=kv_dtype, max_kv_bytes=kv_bytes_for(args, cfg, kv_dtype),
            prefill_attends="stored" if fmt.endswith("_stored") else "fresh",
            inner="eager" if args.smoke else "inductor",
            kernels="reference" if args.smoke else "auto"))
        row["kv_bytes_gib"] = kv_bytes_for(args, cfg, kv_dtype) / GIB
        # the automatic chunking's inputs, to hold against the measured peak
        row["est_bytes_per_token"] = hf_prefill.activation_bytes_per_token(model)
        budget = hf_prefill.prefill_activation_budget(device, None)
        row["chunk_budget_gib"] = budget / GIB if budget else None

        class Forwards(RuntimeHook):
            def after_forward(self, ctx):
                forwards.append(ctx.plan.new_tokens)

        kvcompile.api.state_of(model).hooks.append(Forwards())
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    row["weights_gib"] = base / GIB
    t0 = time.perf_counter()
    try:
        model.generate(ids, **kw)                     # compiles, autotunes, builds the pool
        sync(device)
        row["warm_s"] = time.perf_counter() - t0
        forwards.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        if args.trace and device.type == "cuda":
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=400000)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        sync(device)
        row["ttft_s"] = time.perf_counter() - t0
        if args.trace and device.type == "cuda":
            row["peak_live"] = live_at_peak(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as e:  # noqa: BLE001 - an OOM (also one raised inside a compiled kernel)
        row["error"] = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:160]
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    if not fmt.startswith("hf_"):
        st = kvcompile.stats(model)
        row["chunks"] = "+".join(str(n) for n in forwards) or "-"
        row["reference_fallbacks"] = st.get("reference_fallback", 0)
        row["prefill_triton"] = st.get("prefill_triton", 0)
        row["prefill_gather"] = st.get("prefill_gather", 0)   # chunks by the gathered route
        row["prefill_fresh"] = st.get("prefill_fresh_sdpa", 0)
        row["pool_gib"] = st.get("bytes_total", 0) / GIB
        row["graphs"] = st.get("graphs")
        row["sites_left_alone"] = st.get("attention_skipped", 0)
        if row["sites_left_alone"] and "error" not in row:
            row["error"] = f"{row['sites_left_alone']} attention site(s) left alone"
    return row


def _site(frames) -> str:
    """Where a block was allocated: the innermost frames in kvcompile, transformers, or an
    inductor-generated module (its buffer line), as 'file:line fn' joined by ' < '."""
    keep = []
    for f in frames or []:
        name = f.get("filename", "")
        if any(k in name for k in ("kvcompile/", "transformers/", "torchinductor", "/tmp/")):
            keep.append(f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}")
        if len(keep) == 3:
            break
    return " < ".join(keep) or "?"


def live_at_peak(snapshot, top: int = 14) -> list:
    """Replay the allocation trace; the blocks live at the highest point (bytes above the
    trace's start), grouped by allocating site: [[GiB, count, site], ...], largest first."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live, cur, peak, peak_i = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            cur -= live.pop(e["addr"])
    live = {}
    for e in events[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups = {}
    for e in live.values():
        g = groups.setdefault(_site(e.get("frames")), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    out = sorted(([b / GIB, n, site] for site, (b, n) in groups.items()), reverse=True)
    return [[round(peak / GIB, 3), len(live), "TOTAL above the trace's start"]] + out[:top]


def driver(args) -> list[dict]:
    t_end = time.perf_counter() + args.budget_s
    rows = []
    for name in args.rows.split(","):
        left = t_end - time.perf_counter()
        if left < 60:
            rows.append(dict(row=name, error=f"skipped: {left:.0f} s of the budget left"))
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--format", name,
               "--batch", str(args.batch), "--prompt", str(args.prompt),
               "--layers", str(args.layers), "--vocab", str(args.vocab), "--pad", str(args.pad)]
        if args.smoke:
            cmd.append("--smoke")
        if args.trace:
            cmd.append("--trace")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True,
                               timeout=min(args.row_timeout_s, left))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            if lines:
                rows.append(json.loads(lines[-1][4:]))
            else:
                tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
                rows.append(dict(row=name, error=f"rc {p.returncode}: " + " | ".join(tail)))
        except subprocess.TimeoutExpired:
            rows.append(dict(row=name, error="timed out"))
        rows[-1]["process_s"] = time.perf_counter() - t0
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    static = next((r.get("peak_gib") for r in rows if r["row"] == "hf_static"), None)
    ttft0 = next((r.get("ttft_s") for r in rows if r["row"] == "hf_static"), None)
    head = (f"{'row':16s} {'peak GiB':>9s} {'vs static':>9s} {'TTFT s':>7s} {'vs static':>9s} "
            f"{'weights':>7s} {'pool':>6s} {'chunks (tokens/row)':22s} {'ref':>4s} "
            f"{'fresh':>5s} note")
    out = [head, "-" * len(head)]

    def f(r, key, fmt="{:.2f}"):
        v = r.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    for r in rows:
        if r["row"] == "mask_analysis":
            continue
        rel = (f"{r['peak_gib'] / static:.2f}x" if static and r.get("peak_gib") else "-")
        trel = (f"{r['ttft_s'] / ttft0:.2f}x" if ttft0 and r.get("ttft_s") else "-")
        out.append(f"{r['row']:16s} {f(r, 'peak_gib'):>9s} {rel:>9s} "
                   f"{f(r, 'ttft_s', '{:.3f}'):>7s} {trel:>9s} {f(r, 'weights_gib'):>7s} "
                   f"{f(r, 'pool_gib'):>6s} "
                   f"{str(r.get('chunks', '-')):22s} {str(r.get('reference_fallbacks', '-')):>4s}"
                   f" {str(r.get('prefill_fresh', '-')):>5s} {r.get('error', '')}")
    for r in rows:
        for gib, n, site in r.get("peak_live", []):
            out.append(f"  {r['row']} at peak: {gib:8.3f} GiB {n:5d} blocks  {site}")
    for r in rows:
        if r["row"] == "mask_analysis":
            out.append(f"mask analysis on HF's mask ({f(r, 'mask_gib')} GiB bool): extra peak "
                       f"{f(r, 'analysis_extra_peak_gib', '{:.3f}')} GiB, "
                       f"{f(r, 'analysis_ms', '{:.1f}')} ms, {r.get('error', '')}")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    if args.format:
        print("ROW " + json.dumps(run_row(args)), flush=True)
        return
    rows = driver(args)
    print(f"B{args.batch} x P{args.prompt}, {args.layers} layers, vocab {args.vocab}, "
          f"pad step {args.pad}; generate(max_new_tokens=1), second call")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
