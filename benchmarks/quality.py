"""Quality of kvcompile's eviction policies and storage formats on SmolLM2-135M (CPU).

    python benchmarks/quality.py --suite passkey,ppl,stream,ruler,kvpress [--quick]
    python benchmarks/quality.py --report          # tables -> stdout, plot -> benchmarks/*.png
    kvcompile eval ...                              # the same (calls main(argv))

Suites (results accumulate in benchmarks/quality_results.json, one entry per suite):
  ppl      perplexity of 256 continuation tokens after a 1024-token Lee context compressed by each
           policy at 25/50/75%, per storage format; KL and top-1 agreement with the full cache
  stream   streaming perplexity over the Lee corpus: SinkWindow(4, 1020) (sink positions in the
           cache, and at their original positions) against window-only SinkWindow(0, 1024), and
           full attention in consecutive 2048-token windows
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
    load_smollm2,
    multikey_prompt,
    passkey_prompt,
    variable_tracking_prompt,
)
from quality_eval import (  # noqa: E402
    DEFAULT_ROWS,
    Evaluator,
    greedy,
    nll_and_agreement,
    policies_at,
    ppl,
)

from kvcompile.config import SinkWindow  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "quality_results.json")
FORMATS = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
BYTES = {"auto": 4.0, "bf16": 2.0, "fp8_e4m3": 1.0 + 4 / 16 / 64, "fp8_e5m2": 1.0 + 4 / 16 / 64,
         "fp4_e2m1": 0.5 + 1 / 16 + 4 / 16 / 64}   # per K or V element, page scales included


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


TAG = [""]  # --tag: suffix of the suite names saved by this run


def save(suite: str, data) -> None:
    """Replace one suite's entry of the results file (locked: suites may run in parallel
    processes)."""
    import fcntl
    import tempfile

    lock_path = os.path.join(tempfile.gettempdir(), "kvcompile_quality_results.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        allr = {}
        if os.path.exists(RESULTS):
            with open(RESULTS) as f:
                allr = json.load(f)
        allr[suite + TAG[0]] = data
        with open(RESULTS + ".tmp", "w") as f:
            json.dump(allr, f, indent=1)
        os.replace(RESULTS + ".tmp", RESULTS)


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
    ids = lee_corpus_ids(tok)
    ctx, cont, chunk = args.ctx, args.cont, 64
    n_win = args.windows
    stride = (len(ids) - ctx - cont) // max(1, n_win)
    ev = Evaluator(model)
    out = {}
    for fmt in args.formats:
        ratios = args.ratios if fmt == args.formats[0] else (0.5,)
        pols = row_policies(ratios, ctx, page=fmt == args.formats[0], rows=args.rows)
        ev.compile(fmt)
        acc = {k: [0.0, 0.0, 0, 0] for k in pols}
        kept = {k: 0.0 for k in pols}
        for w in range(n_win):
            s = w * stride
            rows = ev.prefill_and_fork(ids[s:s + ctx], pols)
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
    ids = lee_corpus_ids(tok)[:args.stream_tokens]
    chunk = 64
    if args.stream_baselines_only:  # add the full-attention rows to a saved streaming run
        with open(RESULTS) as f:
            res = json.load(f)["stream" + TAG[0]]["results"]
        return _stream_baselines(model, ids, chunk, args.slide_stride, res)
    ev = Evaluator(model).compile("auto")
    pols = {"sink4+window1020": SinkWindow(4, 1020), "sink4+window1020 (original pos)":
            SinkWindow(4, 1020), "window1024 (no sink)": SinkWindow(0, 1024)}
    sinkpos = {"sink4+window1020": "cache", "sink4+window1020 (original pos)": "original"}
    rows = ev.prefill_and_fork(ids[:chunk], pols, observe=0, sink_positions=sinkpos)
    acc = {k: [0.0, 0] for k in pols}
    prev = rows.last_logits
    t0 = time.time()
    res = {}
    for i in range(chunk, len(ids), chunk):
        x = ids[i:i + chunk]
        lg = ev.step(rows, x)
        preds = torch.cat([prev[:, None], lg[:, :-1]], 1)
        nll, _, _ = nll_and_agreement(preds, x)
        for r, k in enumerate(rows.labels):
            acc[k][0] += float(nll[r])
            acc[k][1] += x.numel()
        prev = lg[:, -1]
        if (i // chunk) % 16 == 0 or i + chunk >= len(ids):
            res = {k: {"ppl": ppl(a[0], a[1]), "tokens": a[1]} for k, a in acc.items()}
            log(f"stream {i + chunk}/{len(ids)} ({time.time() - t0:.0f}s): " + ", ".join(
                f"{k}={v['ppl']:.2f}" for k, v in res.items()))
            save("stream", {"tokens": i + chunk, "chunk": chunk, "results": res})
    rows.cache = None
    return _stream_baselines(model, ids, chunk, args.slide_stride, res)


def _stream_baselines(model, ids, chunk: int, stride: int, res: dict) -> dict:
    t0 = time.time()
    win = _windowed_ppl(model, ids, 2048)
    res["full attention, 2048-token windows"] = win
    save("stream", {"tokens": len(ids), "chunk": chunk, "results": res})
    log(f"stream windowed full attention: {win['ppl']:.2f} ({time.time() - t0:.0f}s)")
    t0 = time.time()
    slide = _sliding_ppl(model, ids, 1024, stride, chunk)
    res[f"full attention, sliding 1024-token window (stride {stride})"] = slide
    log(f"stream sliding-window full attention: {slide['ppl']:.2f} ({time.time() - t0:.0f}s)")
    save("stream", {"tokens": len(ids), "chunk": chunk, "results": res})
    return res


def _sliding_ppl(model, ids: torch.Tensor, window: int, stride: int, first: int) -> dict:
    """Plain HF model, full attention recomputed over a sliding window: the tokens scored by
    the streaming rows (ids[first:]), each `stride` tokens predicted from the `window` tokens
    that end with them (every token sees window - stride .. window - 1 tokens before it,
    fewer in the first window)."""
    fwd = model.__dict__.pop("forward", None)
    nll, n = 0.0, 0
    try:
        for i in range(first, len(ids), stride):
            end = min(i + stride, len(ids))
            s = max(0, end - window)
            x = ids[s:end][None]
            with torch.no_grad():
                lg = model(input_ids=x).logits.float()[0]
            m = end - i                                   # tokens scored: ids[i:end]
            lp = torch.log_softmax(lg[-m - 1:-1].double(), -1)
            nll -= float(lp.gather(-1, ids[i:end, None]).sum())
            n += m
    finally:
        if fwd is not None:
            model.forward = fwd
    return {"ppl": ppl(nll, n), "tokens": n}


def _windowed_ppl(model, ids: torch.Tensor, window: int) -> dict:
    """Plain HF model (not compiled), full attention in consecutive windows."""
    fwd = model.__dict__.pop("forward", None)
    nll, n = 0.0, 0
    try:
        for s in range(0, len(ids) - 1, window):
            x = ids[s:s + window][None]
            if x.shape[1] < 2:
                break
            with torch.no_grad():
                lg = model(input_ids=x).logits.float()
            lp = torch.log_softmax(lg[0, :-1].double(), -1)
            nll -= float(lp.gather(-1, x[0, 1:, None]).sum())
            n += x.shape[1] - 1
    finally:
        if fwd is not None:
            model.forward = fwd
    return {"ppl": ppl(nll, n), "tokens": n}


# --- retrieval -----------------------------------------------------------------------------------

def _retrieval(ev, tok, prompts, pols, max_new: int, what: str) -> dict:
    """prompts: [(key, text, answer)] -> {label: {key: hits}}; one prefill per prompt."""
    hits = {k: {} for k in pols}
    for key, text, answer in prompts:
        ids = tok(text, return_tensors="pt").input_ids[0]
        rows = ev.prefill_and_fork(ids[:-1], pols)
        gen = greedy(ev, rows, ids[-1:], max_new)
        for r, k in enumerate(rows.labels):
            txt = tok.decode(gen[r])
            hits[k].setdefault(key, []).append(answer in txt.replace(" ", "") or answer in txt)
        rows.cache = None
        log(f"{what} {key} ({len(ids)} tok): " + " ".join(
            f"{k}={'Y' if hits[k][key][-1] else '-'}" for k in pols))
    return hits


def suite_passkey(model, tok, args) -> dict:
    ev = Evaluator(model).compile("auto")
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
        h = _retrieval(ev, tok, [(key, text, ans)], p, 8, "passkey")
        for k, v in h.items():
            out.setdefault(k, {}).setdefault(key, []).extend(v[key])
        save("passkey", {"lengths": args.lengths, "depths": args.depths, "results": out})
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
                out.append((f"{task}/{length}", text, ans))
    return out


def suite_ruler(model, tok, args) -> dict:
    ev = Evaluator(model).compile("auto")
    out = {}
    for key, text, ans in _ruler_prompts(tok, args):
        n = len(tok(text).input_ids) - 1
        pols = row_policies((0.5,), n, page=False, rows=[r for r in args.rows if "@" not in r])
        h = _retrieval(ev, tok, [(key, text, ans)], pols, 8, key.split("/")[0])
        for k, v in h.items():
            for kk, vv in v.items():
                out.setdefault(k, {}).setdefault(kk, []).extend(vv)
        save("ruler", {"results": out})
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


SUITES = {"ppl": suite_ppl, "stream": suite_stream, "passkey": suite_passkey,
          "ruler": suite_ruler, "kvpress": suite_kvpress}


def parse(argv):
    ap = argparse.ArgumentParser(prog="kvcompile eval", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="passkey,ppl,stream,ruler,kvpress")
    ap.add_argument("--report", action="store_true", help="print tables and write the plot")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=1 << 30)
    ap.add_argument("--slide-stride", type=int, default=256,
                    help="stride of the sliding-window full-attention baseline (64: exact "
                    "match of the streaming chunks, 16x the compute of stride 1024)")
    ap.add_argument("--stream-baselines-only", action="store_true",
                    help="add the full-attention baselines to the saved streaming run")
    ap.add_argument("--lengths", default="1024,2048,4096,7680")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--skip-lengths", default="",
                    help="passkey lengths to leave out (the keys stay those of --lengths)")
    ap.add_argument("--ruler-lengths", default="1024,2048")
    ap.add_argument("--ruler-samples", type=int, default=5)
    ap.add_argument("--kvpress-python", default=None)
    ap.add_argument("--kvpress-lengths", default="1024,2048")
    ap.add_argument("--kvpress-ratios", default="0.5")
    ap.add_argument("--presses", default="StreamingLLMPress,SnapKVPress,TOVAPress,KnormPress")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help="policy rows (quality_eval.ROWS); Name@25 runs at that ratio only")
    ap.add_argument("--ratios", default="0.25,0.5,0.75")
    ap.add_argument("--kvpress-ruler", action="store_true",
                    help="also run the presses on the RULER-like prompts")
    ap.add_argument("--tag", default="", help="save suites as <suite><tag> (extra runs)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    a.formats = a.formats.split(",")
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.depths = [float(x) for x in a.depths.split(",")]
    a.skip_lengths = [int(x) for x in a.skip_lengths.split(",") if x]
    a.ruler_lengths = [int(x) for x in a.ruler_lengths.split(",")]
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
    if args.report:
        from quality_report import report

        report(RESULTS, HERE)
        return 0
    torch.set_num_threads(args.threads)
    TAG[0] = args.tag
    t = time.time()
    model, tok = load_smollm2()
    log(f"SmolLM2-135M loaded in {time.time() - t:.0f}s")
    for name in args.suite.split(","):
        t = time.time()
        SUITES[name](model, tok, args)
        log(f"suite {name} done in {time.time() - t:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
