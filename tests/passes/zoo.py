"""Tiny random-weight models for the compiler tests: Hugging Face families and custom modules.

Random tiny models have near-tied logits, so a greedy comparison would flip on noise. `make_hf`
sharpens the LM head (x8) so that greedy decoding is decided by the model, not by rounding, and
token identity between eager and compiled runs is a real check of the attention path.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _cfg(family: str):
    t = transformers
    if family == "llama":
        return t.LlamaConfig(**BASE)
    if family == "qwen2":
        return t.Qwen2Config(**BASE)
    if family == "qwen3":
        return t.Qwen3Config(head_dim=16, **BASE)
    if family == "mistral":  # sliding window shorter than the test's sequences
        return t.MistralConfig(sliding_window=12, **BASE)
    if family == "gemma2":  # logit soft-capping + alternating sliding windows
        return t.Gemma2Config(head_dim=16, sliding_window=12, attn_logit_softcapping=20.0,
                              final_logit_softcapping=None, query_pre_attn_scalar=16, **BASE)
    if family == "phi3":  # fused qkv projection
        kw = dict(BASE)
        return t.Phi3Config(**kw)
    if family == "granite":  # attention multiplier instead of 1/sqrt(d)
        return t.GraniteConfig(attention_multiplier=0.2, **BASE)
    if family == "starcoder2":  # biases, plain MHA-style projections, sliding window option
        return t.Starcoder2Config(sliding_window=None, **BASE)
    if family == "gpt2":  # MHA, fused qkv (Conv1D), absolute positions
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt_neox":  # fused qkv, partial rotary
        return t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5,
                               max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0)
    if family == "opt":  # MHA, learned positions, q scaled before the matmul
        return t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=512,
                           word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    raise ValueError(family)


HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "granite", "starcoder2",
               "gpt2", "gpt_neox", "opt")


def make_hf(family: str, attn: str = "sdpa", dtype=torch.float32, seed: int = 0):
    cfg = _cfg(family)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
    return model.to(dtype)


def num_attention_layers(model) -> int:
    cfg = model.config
    return getattr(cfg, "num_hidden_layers", None) or cfg.n_layer


# --- custom models ----------------------------------------------------------------------------

class GptFastAttention(nn.Module):
    """gpt-fast style: fused wqkv, static k_cache / v_cache buffers written with index_put."""

    def __init__(self, dim=64, n_head=4, n_kv=2, max_len=128, batch=2):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (batch, n_kv, max_len, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, mask, input_pos):
        # x: [B, S, dim]  mask: [1, 1, S, max_len] bool  input_pos: [S]
        B, S, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_head * self.hd, self.n_kv * self.hd,
                                      self.n_kv * self.hd], dim=-1)
        q = q.view(B, S, self.n_head, self.hd).transpose(1, 2)
        k = k.view(B, S, self.n_kv, self.hd).transpose(1, 2)
        v = v.view(B, S, self.n_kv, self.hd).transpose(1, 2)
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        k = k_out.repeat_interleave(self.n_head // self.n_kv, dim=1)
        v = v_out.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class GptFast(nn.Module):
    def __init__(self, vocab=VOCAB, dim=64, layers=2, max_len=128, batch=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(GptFastAttention(dim, max_len=max_len, batch=batch)
                                    for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)),
                             persistent=False)

    def forward(self, idx, input_pos):
        # idx: [B, S]  input_pos: [S]
        mask = self.causal[None, None, input_pos]
        x = self.tok(idx) + self.pos(input_pos)[None]
        for attn, mlp in zip(self.layers, self.mlps):
            x = x + attn(x, mask, input_pos)
            x = x + mlp(x)
        return self.head(x)


class NanoGPTAttention(nn.Module):
    """nanoGPT: hand-written causal attention over the whole sequence, no cache."""

    def __init__(self, dim=64, n_head=4, block=128):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoGPT(nn.Module):
    def __init__(self, vocab=VOCAB, dim=64, layers=2, block=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.attn = nn.ModuleList(NanoGPTAttention(dim, block=block) for _ in range(layers))
        self.ln = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        # idx: [B, T] -> logits [B, T, vocab]
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))[None]
        for attn, ln in zip(self.attn, self.ln):
            x = x + attn(ln(x))
        return self.head(x)


def seeded(cls, *args, seed=0, **kw):
    torch.manual_seed(seed)
    m = cls(*args, **kw).eval()
    with torch.no_grad():
        m.head.weight.mul_(8.0)
    return m


def gptfast_generate(model, idx, steps: int):
    """Greedy continuation [B, steps] of a gpt-fast model (idx [B, S]), one token per forward
    after the prefill."""
    S = idx.shape[1]
    with torch.no_grad():
        logits = model(idx, torch.arange(S))
        out = [logits[:, -1].argmax(-1)]
        for i in range(steps - 1):
            logits = model(out[-1][:, None], torch.tensor([S + i]))
            out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, 1)
