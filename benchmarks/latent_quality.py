"""Quality of latent (MLA) page formats on a DeepSeek-V3-wide random-weight stack (issue 22:
"compare logits of a random-weight stack against fp32 and report the KL divergence per
token"; no MLA model ships offline here). CPU by default.

    python benchmarks/latent_quality.py [--layers 2] [--tokens 96] [--rows ...]

The model: transformers' DeepseekV3 with DeepSeek-V3's attention widths (kv_lora_rank 512,
rope 64, nope 128, v 128) at 16 heads (a tensor-parallel-8 shard's count), a smaller hidden
size, dense MLPs, fp32 weights, the output embeddings scaled x8 so that next-token choices
are decided by the model (random weights give near-uniform logits otherwise). Each row
compiles a copy with `prefill_attends="stored"` (every logit sees the stored pages) and runs
the same teacher-forced sequence: a prefill of half the tokens, then one decode step a token.
Per row: bytes per token (kvcompile.stats), mean KL(eager || kvcompile) of the next-token
distributions over every position, the logits' relative error, top-1 agreement with eager.
A row is "latent / rotary key" (k_dtype / v_dtype); "@channel" or "@token" sets
scale_granularity.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import kvcompile  # noqa: E402
from tests.passes.test_hf_families import teacher_forced_logits  # noqa: E402

ROWS = ("fp32/fp32,bf16/bf16,fp8_e4m3/fp8_e4m3,fp8_e4m3/bf16,fp8_e5m2/fp8_e5m2,"
        "int4/bf16,int4/bf16@token,int4/bf16@channel,int4/int4,fp4_e2m1/bf16")


def make_model(a):
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, first_k_dense_replace=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.heads, q_lora_rank=256,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=a.tokens + 16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def row_config(row: str) -> dict:
    fmts, _, gran = row.partition("@")
    k, _, v = fmts.partition("/")
    kw = dict(k_dtype=k, v_dtype=v or k)
    if gran:
        kw["scale_granularity"] = gran
    return kw


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=ROWS)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    base = make_model(a)
    ids = torch.randint(3, 4096, (a.batch, a.tokens),
                        generator=torch.Generator().manual_seed(a.seed + 1))
    prefill = a.tokens // 2
    ref = teacher_forced_logits(base, ids, prefill).float()
    lp_ref = ref.log_softmax(-1)
    print(f"# DeepseekV3 random weights: {a.layers} layers, {a.heads} heads, r 512, rope 64, "
          f"hidden {a.hidden}; batch {a.batch} x {a.tokens} tokens (prefill {prefill}, then "
          f"{a.tokens - prefill} decode steps); torch {torch.__version__}")
    print("| latent / rotary key | bytes/token | KL (nats) | logits rel err | top-1 | s |")
    print("|---|---|---|---|---|---|")
    for row in a.rows.split(","):
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        try:
            kvcompile.compile(model, kvcompile.KVConfig(
                inner="eager", max_kv_bytes=1 << 26, prefill_attends="stored",
                **row_config(row)))
            got = teacher_forced_logits(model, ids, prefill).float()
        except Exception as e:   # a format the latent pages refuse: said in its row
            print(f"| {row} | refused: {type(e).__name__}: {str(e)[:160]} | | | | |")
            continue
        kl = (lp_ref.exp() * (lp_ref - got.log_softmax(-1))).sum(-1).mean()
        rel = (got - ref).norm() / ref.norm()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
        bpt = kvcompile.stats(model)["bytes_per_token"]
        print(f"| {row} | {bpt:g} | {float(kl):.2e} | {float(rel):.2e} | {float(top1):.3f} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)
        kvcompile.release(model)


if __name__ == "__main__":
    main()
