"""Which prefill kernel variant fails on the GPU, and how: one subprocess per variant.

    python benchmarks/prefill_diag.py [--jobs 12] [--timeout 75] [--budget 200] [--only SUBSTR]
                                      [--json out.json]

A CUDA error ("misaligned address", "illegal memory access") is sticky: every later launch in the
same process fails with it, so one bad kernel makes a whole matrix look broken. Here every variant
(bf16 / fp16 / FP8 varlen, chunked prefill over pages in each stored format; head_dim 64 / 128;
GQA 1 / 4; each candidate tile config; TMA on / off, Q through TMA or pointers, warp
specialization on / off, the old FP8 scale descriptors) runs alone in a fresh process with
CUDA_LAUNCH_BLOCKING=1 on a small input, against the fp32 references of kernels/reference.py,
under a timeout (a hung kernel is reported as TIMEOUT). The table gives variant -> status, relative
error / bound, max abs error, and the first error line.

The switches are environment variables, the defaults of KVConfig's prefill_* fields (read by
kvcompile/config.py), which each child passes to kernels/prefill_launch.py as PrefillSwitches:
KVCOMPILE_PREFILL_TMA=0 (no tensor descriptors at all), KVCOMPILE_PREFILL_Q_TMA=0 (K/V through
TMA, Q by pointers), KVCOMPILE_PREFILL_WARP_SPEC=1 (offer the warp-specialized tiles),
KVCOMPILE_PREFILL_SCALE_TMA=1 (FP8 K/V descales through 16-byte [1, 4] TMA boxes, the form of the
first H200 run). Without a GPU the children run under TRITON_INTERPRET=1 on shrunken inputs
(a dry run of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LENS = [1, 17, 300, 1000, 129]  # odd lengths, a 1-token sequence, tiles past sequence ends
PLENS, PQ = [1200, 700, 129], [300, 700, 1]  # paged: chunk of each sequence's last q tokens


def variants() -> list[dict]:
    """The matrix. Configs are named by TileConfig fields so the child needs no import here."""
    v = []
    # (block_m, block_n, num_warps, num_stages, warp_spec) candidates, as in prefill_launch
    varlen = {64: [(128, 128, 8, 3), (128, 64, 4, 4)], 128: [(128, 128, 8, 2), (128, 64, 8, 3)]}
    ws = {64: [(128, 128, 4, 2, True)], 128: [(128, 128, 4, 2, True), (128, 64, 4, 3, True)]}
    paged = {64: [(128, 64, 8, 3), (64, 64, 4, 3)],
             128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)]}

    def add(name, **kw):
        v.append(dict(name=name, env=kw.pop("env", {}), **kw))

    for D in (64, 128):
        for G in (1, 4):
            for c in varlen[D]:
                add(f"varlen bf16 D{D} G{G} tma {cfg_str(c)}", kind="varlen", dt="bf16", D=D,
                    G=G, cfg=c)
            add(f"varlen bf16 D{D} G{G} no-tma {cfg_str(varlen[D][0])}", kind="varlen",
                dt="bf16", D=D, G=G, cfg=varlen[D][0], env={"KVCOMPILE_PREFILL_TMA": "0"})
            add(f"varlen bf16 D{D} G{G} q-ptr kv-tma {cfg_str(varlen[D][0])}", kind="varlen",
                dt="bf16", D=D, G=G, cfg=varlen[D][0], env={"KVCOMPILE_PREFILL_Q_TMA": "0"})
            for c in varlen[D]:
                add(f"varlen fp8 D{D} G{G} tma {cfg_str(c)}", kind="fp8", D=D, G=G, cfg=c)
    for D in (64, 128):
        for c in varlen[D]:  # the first H200 run's form: descales through [1, 4] TMA boxes
            add(f"varlen fp8 D{D} G1 tma+scale-tma {cfg_str(c)}", kind="fp8", D=D, G=1, cfg=c,
                env={"KVCOMPILE_PREFILL_SCALE_TMA": "1"})
    add("varlen fp8 D128 G4 no-tma 128x128-w8-s2", kind="fp8", D=128, G=4,
        cfg=varlen[128][0], env={"KVCOMPILE_PREFILL_TMA": "0"})
    for D in (64, 128):
        for G in (1, 4):
            for c in ws[D]:
                add(f"varlen bf16 D{D} G{G} warp-spec {cfg_str(c)}", kind="varlen", dt="bf16",
                    D=D, G=G, cfg=c, env={"KVCOMPILE_PREFILL_WARP_SPEC": "1"})
    c128 = varlen[128][0]
    add("varlen fp16 D128 G4 tma", kind="varlen", dt="fp16", D=128, G=4, cfg=c128)
    add("varlen bf16 D128 G4 window+sinks", kind="varlen", dt="bf16", D=128, G=4, cfg=c128,
        mask=dict(sliding_window=256, sinks=4))
    add("varlen bf16 D128 G1 softcap", kind="varlen", dt="bf16", D=128, G=1, cfg=c128,
        mask=dict(softcap=30.0))
    add("varlen bf16 D128 G4 non-causal", kind="varlen", dt="bf16", D=128, G=4, cfg=c128,
        mask=dict(causal=False))
    add("varlen bf16 D128 G4 cu_seqlens_k (chunk over contiguous K/V)", kind="varlen",
        dt="bf16", D=128, G=4, cfg=c128, k_lens=[40, 2000, 300, 1000, 129])
    fmts = [("bf16", "page"), ("fp16", "page"), ("fp8_e4m3", "page"), ("fp8_e4m3", "token"),
            ("fp8_e5m2", "tensor"), ("fp4_e2m1", "page"), ("fp4_e2m1", "token")]
    for f, g in fmts:
        add(f"paged {f}/{g} D128 G4 P16 {cfg_str(paged[128][0])}", kind="paged", fmt=f,
            gran=g, D=128, G=4, P=16, cfg=paged[128][0])
    for f, g in (("bf16", "page"), ("fp8_e4m3", "page")):
        for c in paged[128][1:]:
            add(f"paged {f}/{g} D128 G4 P16 {cfg_str(c)}", kind="paged", fmt=f, gran=g, D=128,
                G=4, P=16, cfg=c)
        for c in paged[64]:
            add(f"paged {f}/{g} D64 G1 P32 {cfg_str(c)}", kind="paged", fmt=f, gran=g, D=64,
                G=1, P=32, cfg=c)
    add("paged fp8_e4m3/page D128 G4 P64 kv_start+window+sinks", kind="paged", fmt="fp8_e4m3",
        gran="page", D=128, G=4, P=64, cfg=paged[128][0],
        mask=dict(kv_start=[100, 0, 3], sliding_window=400, sinks=2))
    return v


def cfg_str(c) -> str:
    return f"{c[0]}x{c[1]}-w{c[2]}-s{c[3]}" + ("-ws" if len(c) > 4 and c[4] else "")


# --- child: one variant --------------------------------------------------------------------

def child(spec: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    from kvcompile.config import KVConfig
    from kvcompile.kernels import prefill_launch as L
    from kvcompile.kernels.prefill import dequantize_fp8_prefill, quantize_fp8_prefill
    from kvcompile.kernels.reference import paged_prefill_attention_ref, prefill_attention_ref
    from kvcompile.testing import REL_ERR, poison_, rel_err
    from tests.kernels.test_prefill import FP8_REL_ERR, cu_of, make_format, make_paged_kv, make_qkv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv = KVConfig()   # the switches, from this child's environment
    switches = L.PrefillSwitches(kv.prefill_tma, kv.prefill_q_tma, kv.prefill_scale_tma,
                                 kv.prefill_warp_spec)
    gen = torch.Generator().manual_seed(1234)
    cfg = L.TileConfig(*spec["cfg"])
    lens, plens, pq = LENS, PLENS, PQ
    k_lens = spec.get("k_lens")
    hkv = 2
    hq = hkv * spec["G"]
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if dev == "cpu":  # interpreter dry run: small inputs, its bf16 dot is broken
        cfg = L.INTERPRET_CONFIG
        lens, plens, pq = [1, 17, 40], [70, 33], [20, 33]
        k_lens = [40, 60, 40] if k_lens else None
        dts["bf16"] = torch.float32
    mask = dict(spec.get("mask", {}))
    scale = spec["D"] ** -0.5
    t0 = time.time()
    if spec["kind"] == "varlen":
        dt = dts[spec["dt"]]
        q, k, v = make_qkv(lens, hq, hkv, spec["D"], dt, gen=gen, k_lens=k_lens)
        cu = cu_of(lens)
        cu_k = cu_of(k_lens) if k_lens else None
        out = poison_(torch.empty_like(q))
        L.launch_prefill(q, k, v, cu, out, scale, mask.get("causal", True),
                         mask.get("sliding_window", 0), mask.get("sinks", 0),
                         mask.get("softcap", 0.0), max(lens), None, config=cfg, cu_seqlens_k=cu_k,
                         switches=switches)
        torch.cuda.synchronize() if dev == "cuda" else None
        ref = prefill_attention_ref(q, k, v, cu, scale, cu_seqlens_k=cu_k, **mask)
        bound = REL_ERR[dt] if dt != torch.float32 else REL_ERR[torch.bfloat16]
    elif spec["kind"] == "fp8":
        q, k, v = make_qkv(lens, hq, hkv, spec["D"], torch.bfloat16, gen=gen)
        cu = cu_of(lens)
        q8, k8, vt8, sc = quantize_fp8_prefill(q, k, v, cu)
        out = poison_(torch.empty(q.shape, dtype=torch.bfloat16, device=dev))
        L.launch_prefill(q8, k8, vt8, cu, out, scale, True, 0, 0, 0.0, max(lens), sc,
                         config=cfg, switches=switches)
        torch.cuda.synchronize() if dev == "cuda" else None
        ref = prefill_attention_ref(*dequantize_fp8_prefill(q8, k8, vt8, sc, cu), cu, scale)
        bound = FP8_REL_ERR
    else:
        fmt = make_format(spec["fmt"], spec["gran"])
        kc, vc, bt, sl = make_paged_kv(fmt, plens, hkv, spec["D"], spec["P"], gen=gen)
        cu = cu_of(pq)
        q = torch.randn(int(cu[-1]), hq, spec["D"], generator=gen).to(dev, torch.bfloat16)
        ks = mask.pop("kv_start", None)
        ks = None if ks is None else torch.tensor([min(x, n // 2) for x, n in zip(ks, plens)],
                                                  dtype=torch.int32,
                                                  device=dev)
        out = poison_(torch.empty_like(q))
        L.launch_paged_prefill(q, out, (fmt.name, fmt.granularity, kc.data, kc.scale, kc.micro),
                               (fmt.name, fmt.granularity, vc.data, vc.scale, vc.micro), bt, cu,
                               sl, ks, scale, mask.get("sliding_window", 0),
                               mask.get("sinks", 0), mask.get("softcap", 0.0), max(pq),
                               config=cfg)
        torch.cuda.synchronize() if dev == "cuda" else None
        ref = paged_prefill_attention_ref(q, kc, vc, bt, cu, sl, scale, kv_start=ks, **mask)
        # plain pages compute in q's dtype (bf16 here), quantized pages in fp16
        bound = REL_ERR[torch.bfloat16] if spec["fmt"] in ("bf16", "fp16") else REL_ERR[
            torch.float16]
        if dev == "cpu":
            bound = max(bound, REL_ERR[torch.bfloat16])
    err = rel_err(out, ref)
    max_abs = (out.float() - ref.float()).abs().max().item()
    return dict(status="ok" if err <= bound else "WRONG", rel_err=err, bound=bound,
                max_abs=max_abs, seconds=round(time.time() - t0, 1))


def first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for key in ("misaligned", "illegal", "CUDA error", "Error", "error"):
        for ln in reversed(lines):
            if key in ln and not ln.startswith("File "):
                return ln[:220]
    return (lines[-1] if lines else "")[:220]


# --- parent ---------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=75.0, help="seconds per variant")
    ap.add_argument("--budget", type=float, default=200.0, help="no variant starts after it")
    ap.add_argument("--only", default=None, help="run the variants whose name has SUBSTR")
    ap.add_argument("--json", default=None)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        try:
            row = child(spec)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            traceback.print_exc()
            row = dict(status="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        print("ROW " + json.dumps(row), flush=True)
        return 0
    vs = variants()
    if args.only:
        vs = [v for v in vs if args.only in v["name"]]
    if args.list:
        print("\n".join(v["name"] for v in vs))
        return 0
    import torch
    import triton

    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(json.dumps(info), flush=True)
    t0 = time.time()
    pending, running, rows = list(vs), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            v = pending.pop(0)
            if time.time() - t0 > args.budget:
                rows.append(dict(name=v["name"], status="SKIPPED (budget)"))
                continue
            env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1", **v["env"])
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                  json.dumps(v)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=False)
            running.append((v, p, time.time()))
        time.sleep(0.2)
        for item in list(running):
            v, p, ts = item
            timed_out = time.time() - ts > args.timeout
            if p.poll() is None and not timed_out:
                continue
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0] or ""
            running.remove(item)
            row = next((json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith("ROW ")),
                       None)
            if row is None:
                row = dict(status=f"TIMEOUT ({args.timeout:.0f} s)" if timed_out else
                           f"CRASH (exit {p.returncode})")
            if row["status"] not in ("ok",):
                row["error_line"] = row.get("error") or first_error_line(out)
            row["name"] = v["name"]
            row["wall_s"] = round(time.time() - ts, 1)
            rows.append(row)
            print(f"{row['status']:<8} {v['name']}  ({row['wall_s']} s)"
                  + (f"  | {row['error_line']}" if "error_line" in row else ""), flush=True)
    order = {v["name"]: i for i, v in enumerate(vs)}
    rows.sort(key=lambda r: order.get(r["name"], 1 << 30))
    print(f"\n## prefill diag: {info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
          f"CUDA {info['cuda']}, {info['date']}, {time.time() - t0:.0f} s")
    print("| variant | status | rel err / bound | max abs err | error line |")
    print("|---|---|---|---|---|")
    for r in rows:
        e = (f"{r['rel_err']:.2e} / {r['bound']:.1e}" if "rel_err" in r else "-")
        m = f"{r['max_abs']:.2e}" if "max_abs" in r else "-"
        print(f"| {r['name']} | {r['status']} | {e} | {m} | {r.get('error_line', '')} |")
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows) - len(bad)} ok, {len(bad)} not ok of {len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
