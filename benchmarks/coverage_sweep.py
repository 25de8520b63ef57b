"""Coverage sweep: every causal LM family in transformers, tiny and random, through kvcompile.

For each `model_type` in transformers' MODEL_FOR_CAUSAL_LM_MAPPING, in its own process with a
time limit: build it from a tiny config (2 layers, hidden 64, vocab 256) on the CPU, generate 32
greedy tokens eagerly and through `kvcompile.compile` (fp32 pages), and record one row:

    built | sites rewritten of found | token-identical | left alone and why | error

A family whose compiled graphs hold no softmax attention (state-space, recurrent, linear
attention) is "not applicable". A family with softmax attention where no site was rewritten and
kvcompile did not warn is a *silent* zero-site compile, counted apart.

    python benchmarks/coverage_sweep.py                    # all families -> docs/coverage.md
    python benchmarks/coverage_sweep.py --only llama gpt2  # some families, merged into results
    python benchmarks/coverage_sweep.py --jobs 2 --timeout 240
    python benchmarks/coverage_sweep.py --skip-done             # the families not yet swept
    python benchmarks/coverage_sweep.py --doc-only              # the table from stored results

Results accumulate in benchmarks/results/coverage.json (one entry per family; a later run of a
family replaces its entry), and docs/coverage.md is regenerated from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "coverage.json"
DOC = ROOT / "docs" / "coverage.md"
NEW_TOKENS = 32
PROMPT = 8

# Tiny sizes, set on every config (and sub-config) that has the attribute.
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256, d_model=64, num_layers=2,
    num_heads=4, ffn_dim=128, decoder_layers=2, decoder_attention_heads=4,
    decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, hidden_dim=64,
    word_embed_proj_dim=64, embedding_size=64, num_kv_heads=2, multi_query_group_num=2,
    attention_head_dim=16, d_ff=128, d_kv=16, ffn_hidden_size=128, n_inner=128,
    tie_word_embeddings=False, rotary_dim=8, n_layers=2, n_heads=4,
    attention_types=[[["global", "local"], 1]],
    # hybrids: put an attention layer among the two (Jamba's default puts it at layer 4)
    attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
)
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)

# Families whose architecture has no softmax attention over a KV cache, with the reason (used
# when the run confirms it: kvcompile found no softmax/attention op in any graph).
NO_ATTENTION = {
    "mamba": "state-space model (selective scan), no attention",
    "mamba2": "state-space model (SSD), no attention",
    "falcon_mamba": "state-space model, no attention",
    "rwkv": "linear-attention RNN (WKV recurrence), no softmax attention",
    "xlstm": "recurrent (mLSTM/sLSTM), no softmax attention",
    "recurrent_gemma": "RG-LRU recurrence plus local attention",
}

# What a separate diagnosis measured for a family whose row alone does not explain its status
# (shown in its row, after the reasons the run recorded).
NOTES = {
    "gemma3n_text": "diagnosed 2026-12-03: built only at its own 35 layers (head_dim 256; its "
                    "15 KV-sharing layers and their 2 source layers left alone, the rest "
                    "rewritten); prefill logits equal eager's, the first decode step's differ "
                    "by 1.5e-4 at most, growing smoothly to 3e-2 over 19 steps (fp32 rounding "
                    "through 35 random layers, no jump), until a greedy near-tie (top-2 gap "
                    "3.6e-3) flips at step 20; a 6-layer copy with 2 shared layers is "
                    "token-identical",
}


# --- one family, in a child process ------------------------------------------------------------

def _tiny_kwargs(cfg_cls_defaults: dict) -> dict:
    kw = {k: v for k, v in TINY.items() if k in cfg_cls_defaults}
    kw.update({k: v for k, v in SPECIAL_IDS.items() if k in cfg_cls_defaults})
    return kw


# Each family is tried with these overrides in turn, until it builds and generates eagerly:
# all of TINY; TINY without the head-dim and MLA sizes (which some configs derive from others);
# only the core sizes, with the family's own layer count (hybrids place attention by index).
CORE = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "n_embd", "n_head", "d_model", "num_heads", "ffn_dim",
        "tie_word_embeddings", "num_experts", "num_local_experts", "n_routed_experts",
        "moe_intermediate_size", "num_experts_per_tok")
# all of TINY again, with the config's per-layer lists cut to two layers (_two_layers): for
# configs that validate their lists against the layer count (Llama4, Zamba), which otherwise
# only build at the last level, at their full depth (48 and 76 layers: timeouts)
LEVELS = (
    lambda k: True,
    lambda k: k not in ("head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank",
                        "qk_rope_head_dim", "qk_nope_head_dim", "attention_head_dim", "d_kv"),
    lambda k: True,
    lambda k: k in CORE,
)
TRIM_LEVEL = 2
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")


def _two_layers(d: dict) -> dict:
    """Per-layer lists of a config dict cut to the layers kept: the first layer of each kind
    (by `layer_types`-like lists), so a hybrid keeps an attention layer; lists of layer indices
    (`moe_layers`) are dropped, the config's default applies."""
    n = next((d[k] for k in _LAYER_COUNTS if isinstance(d.get(k), int)), None)
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and n and len(v) == n
                 and len(v) > 2}
    if not per_layer:
        return {}
    kinds = next((v for k, v in per_layer.items() if "type" in k), None)
    keep = sorted({kinds.index(t) for t in kinds} if kinds else {0})[:2]
    keep = (keep + [i for i in range(n) if i not in keep])[:2]
    keep.sort()
    out = {}
    for k, v in per_layer.items():
        if k.endswith("_layers") and all(isinstance(x, int) and not isinstance(x, bool)
                                         and x >= 2 for x in v[2:]) and v == sorted(v):
            out[k] = None         # indices of layers, not one entry per layer
        else:
            out[k] = [v[i] for i in keep]
    return out


def _tiny_config(model_type: str, level: int = 0):
    import transformers

    keep = LEVELS[level]
    base = transformers.AutoConfig.for_model(model_type)

    def tiny(d):
        kw = {k: v for k, v in TINY.items() if k in d and keep(k)}
        kw.update({k: v for k, v in SPECIAL_IDS.items() if k in d})
        if "kv_lora_rank" in d and "num_key_value_heads" in kw:
            # MLA expands one key/value head per query head (DeepSeek-V3 ships 128 and 128);
            # fewer kv heads make HF repeat the expansion past the query's heads
            kw["num_key_value_heads"] = kw.get("num_attention_heads", d.get(
                "num_attention_heads"))
        return kw

    trim = level == TRIM_LEVEL
    kw = tiny(base.to_dict())
    if trim:
        kw.update({k: v for k, v in _two_layers(base.to_dict()).items() if v is not None})
    # sub-configs (multimodal text towers, decoders)
    for name in ("text_config", "decoder", "decoder_config", "language_config", "llm_config"):
        sub = getattr(base, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kw[name] = {**sub.to_dict(), **tiny(sub.to_dict())}
            if trim:
                for key, v in _two_layers(sub.to_dict()).items():
                    kw[name].pop(key) if v is None else kw[name].__setitem__(key, v)
                continue
            for key in ("layer_types", "mlp_layer_types", "sliding_window_pattern"):
                kw[name].pop(key, None)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    if hasattr(cfg, "is_decoder"):
        cfg.is_decoder = True     # BERT-style *ForCausalLM: only meaningful as a decoder
    return cfg


def _build(model_type: str, level: int):
    import torch
    import transformers

    cfg = _tiny_config(model_type, level)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001  (no SDPA path: the family's own attention)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.float().eval()
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)   # greedy decided by the model, not by rounding
    vocab = getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, 256), (1, PROMPT),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.generate(ids, **GEN)
    return model, cfg, ids, want


GEN = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
           pad_token_id=0, eos_token_id=None)


def run_family(model_type: str) -> dict:
    import warnings

    import torch

    import kvcompile
    from kvcompile.errors import KVCompileWarning

    torch.set_num_threads(1)
    row = dict(family=model_type, built=False, applicable=None, sites=0, rewritten=0,
               identical=None, left_alone="", error="", warned=False, seconds=0.0)
    t0 = time.time()
    stage = "build"
    try:
        errors = []
        for level in range(len(LEVELS)):
            try:
                model, cfg, ids, want = _build(model_type, level)
                break
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        else:
            raise RuntimeError(errors[0])
        row["built"], row["attn"], row["level"] = True, cfg._attn_implementation, level
        gen = GEN
        stage = "kvcompile"
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            kvcompile.compile(model, kvcompile.KVConfig(kv_dtype="auto", inner="eager",
                                                        max_kv_bytes=1 << 24))
            with torch.no_grad():
                got = model.generate(ids, **gen)
        msgs = [str(w.message) for w in rec if issubclass(w.category, KVCompileWarning)
                or str(w.message).startswith("kvcompile")]
        row["warned"] = bool(msgs)
        rep = kvcompile.report(model)
        row["sites"], row["rewritten"] = len(rep.sites), len(rep.rewritten)
        row["identical"] = bool(torch.equal(got, want))
        reasons = sorted({s.reason for s in rep.sites if not s.rewritten})
        near = [str(m) for m in rep.near_misses]
        row["applicable"] = bool(rep.sites or near)
        row["left_alone"] = "; ".join(reasons)[:400]
        row["near_misses"] = near[:3]
        row["warnings"] = [m[:300] for m in msgs[:3]]
    except Exception as e:  # noqa: BLE001
        from kvcompile.errors import KVCompileError

        text = str(e).strip().splitlines()
        row["error"] = f"{stage}: {type(e).__name__}: {text[0][:400] if text else ''}"
        row["stage"] = stage
        # kvcompile refused with the reason and the fix (an error it raises on purpose, where
        # going on would give a wrong answer): not a crash
        row["refused"] = stage == "kvcompile" and isinstance(e, KVCompileError)
    row["seconds"] = round(time.time() - t0, 1)
    return row


# --- the sweep ---------------------------------------------------------------------------------

def _child(model_type: str, timeout: float) -> dict:
    # the child runs benchmarks/coverage_sweep.py, so sys.path[0] is benchmarks/: put this
    # checkout first, or `import kvcompile` finds whichever copy is installed (another worktree)
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=path,
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", model_type], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(family=model_type, built=None, error=f"timeout after {timeout:.0f} s",
                    stage="timeout", seconds=round(time.time() - t0, 1))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return dict(family=model_type, built=None, error=f"process died (rc {p.returncode}): {tail}",
                stage="process", seconds=round(time.time() - t0, 1))


def status(row: dict) -> str:
    """One word per row: ok, partial, not-identical, left-alone, refused, n/a, not-built,
    timeout, crash."""
    if row.get("stage") in ("config", "build", "eager generate"):
        return "not-built"
    if row.get("stage") == "timeout":
        return "timeout"
    if row.get("refused"):
        return "refused"
    if row.get("error"):
        return "crash"
    if not row.get("applicable"):
        return "n/a"
    if row["rewritten"] == 0:
        return "left-alone" if row.get("warned") else "silent"
    if not row.get("identical"):
        return "not-identical"
    return "ok" if row["rewritten"] == row["sites"] else "partial"


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def write_doc(rows: dict[str, dict]) -> str:
    import torch
    import transformers

    counts: dict[str, int] = {}
    for r in rows.values():
        counts[status(r)] = counts.get(status(r), 0) + 1
    built = sum(1 for r in rows.values() if status(r) not in ("not-built", "timeout"))
    applicable = sum(1 for r in rows.values() if status(r) not in ("not-built", "n/a",
                                                                    "timeout"))
    ok = counts.get("ok", 0) + counts.get("partial", 0)
    lines = [
        "# Coverage: transformers' causal LM families through kvcompile",
        "",
        f"Generated by `benchmarks/coverage_sweep.py` on {time.strftime('%Y-%m-%d')} "
        f"(transformers {transformers.__version__}, torch {torch.__version__}, CPU). "
        f"Each family is built from a tiny random config (2 layers, hidden 64, vocab 256, fp32, "
        f"SDPA where the family has it), generates {NEW_TOKENS} greedy tokens from an "
        f"{PROMPT}-token prompt eagerly and through `kvcompile.compile` (fp32 pages), each in "
        f"its own process.",
        "",
        f"**{len(rows)} families swept; {built} built on the CPU; {applicable} have softmax "
        f"attention over a cache; {ok} of them rewritten and token-identical to eager "
        f"({counts.get('partial', 0)} with some sites left alone); "
        f"{counts.get('left-alone', 0)} left alone with a warning; "
        f"{counts.get('refused', 0)} refused with an error naming the reason; "
        f"{counts.get('not-identical', 0)} rewritten but not token-identical; "
        f"{counts.get('crash', 0)} crashes; {counts.get('silent', 0)} silent zero-site "
        f"compiles; {counts.get('timeout', 0)} timed out.**",
        "",
        "Status: `ok` every site rewritten, tokens identical; `partial` some sites rewritten, "
        "tokens identical, the rest left alone with the reason shown; `left-alone` no site "
        "rewritten, kvcompile warned why; `refused` kvcompile raised an error naming why it "
        "cannot run the model correctly and the fix (never a wrong answer); `n/a` no softmax "
        "attention in the model's graphs; "
        "`not-built` the tiny model could not be built or generate eagerly (nothing to do with "
        "kvcompile); `timeout` the family (eager and compiled runs together) did not finish "
        "in its time on the shared 2-core CPU; `crash` kvcompile raised; `silent` attention "
        "present, nothing rewritten, no warning.",
        "",
        "| family | status | sites rewritten | identical | left alone / reason | s |",
        "|---|---|---|---|---|---|",
    ]
    for fam in sorted(rows):
        r = rows[fam]
        st = status(r)
        why = r.get("error") or r.get("left_alone") or ""
        if st == "n/a":
            why = NO_ATTENTION.get(fam, "no softmax attention op in the compiled graphs of the "
                                        "tiny 2-layer config (a hybrid may place none there)")
        if st == "not-identical" and not why and r.get("warnings"):
            why = r["warnings"][0]    # e.g. a forward Dynamo stopped compiling
        if st in ("left-alone", "silent") and not why and r.get("near_misses"):
            why = "near miss: " + r["near_misses"][0]
        if fam in NOTES:
            why = NOTES[fam] + ("; left alone: " + why if why else "")
        sites = f"{r.get('rewritten', 0)} / {r.get('sites', 0)}" if st not in (
            "not-built", "n/a", "timeout") else ""
        ident = {True: "yes", False: "**no**", None: ""}[r.get("identical")] if st not in (
            "not-built", "timeout") else ""
        why = why.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {fam} | {st} | {sites} | {ident} | {why[:300 + len(NOTES.get(fam, ''))]} | "
                     f"{r.get('seconds', '')} |")
    alone = [f for f in sorted(rows) if status(rows[f]) in ("left-alone", "partial",
                                                             "refused")]
    if alone:
        by_cause: dict[str, list[str]] = {}
        for f in alone:
            r = rows[f]
            text = " ".join([r.get("left_alone") or "", r.get("error") or ""]
                            + (r.get("near_misses") or []))
            by_cause.setdefault(_cause(text), []).append(f)
        lines += ["", "Left alone, by cause (each family's reason is in its row):", ""]
        lines += [f"- {cause}: {', '.join(fams)}" for cause, fams in
                  sorted(by_cause.items(), key=lambda kv: -len(kv[1]))]
    missing = [f for f in families() if f not in rows]
    if missing:
        lines += ["", f"Not swept in this run ({len(missing)} of transformers' "
                  f"{len(families())} families; run `python benchmarks/coverage_sweep.py "
                  f"--skip-done` to add them): " + ", ".join(missing) + "."]
    DOC.write_text("\n".join(lines) + "\n")
    return next(x for x in lines if x.startswith("**")).strip("*")


# reason text -> the cause it belongs to, first match wins (write_doc's summary by cause)
CAUSES = (
    ("while its cache lives in kvcompile's pool", "Dynamo recompiles the forward at every new "
     "length (the model turns it into a Python int) until its recompile limit, then runs it "
     "without kvcompile: refused with an error, never a wrong answer"),
    ("attention sink", "attention sinks written in a way kvcompile does not read"),
    ("computed from the cached tensors", "keys/values projected from a cached latent after "
     "the cache update (MLA): kvcompile pages the K/V attention reads"),
    ("keys computed in this graph", "a cache extended twice in one forward (a layer run twice "
     "reading its first pass's keys; DeepSeek-V4's compressed KV appended to its window "
     "cache): kvcompile pages one cache per attention"),
    ("also read by", "the cache is also read by other ops (two attentions over one cache, a "
     "mask computed from the cached values)"),
    ("used elsewhere", "the scores or probabilities are used by more than the attention"),
)


def _cause(text: str) -> str:
    return next((c for key, c in CAUSES if key in text),
                "the scores are combined in a way no pattern reads (near miss)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these families (default: all)")
    ap.add_argument("--skip-done", action="store_true", help="skip families already in results")
    ap.add_argument("--jobs", type=int, default=1, help="families run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per family")
    ap.add_argument("--doc-only", action="store_true", help="rewrite docs/coverage.md from "
                    "the stored results, running nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("ROW " + json.dumps(run_family(a.child)), flush=True)
        return
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if a.doc_only:
        print(write_doc(rows))
        return
    todo = a.only or families()
    if a.skip_done:
        todo = [f for f in todo if f not in rows]
    t0 = time.time()

    def one(fam):
        r = _child(fam, a.timeout)
        rows[fam] = r
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(rows, indent=1, sort_keys=True))
        print(f"{fam:28s} {status(r):14s} {r.get('rewritten', 0)}/{r.get('sites', 0)} "
              f"{r.get('seconds')}s {r.get('error') or r.get('left_alone', '')}"[:200],
              flush=True)

    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(one, todo))
    print(write_doc(rows))
    print(f"{len(todo)} families in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
