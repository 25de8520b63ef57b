"""Plain-PyTorch attention references: what the kernels are tested against (fp32 math)."""

from __future__ import annotations

import torch


def masked_softmax(s: torch.Tensor, allowed: torch.Tensor | None,
                   sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of scores s [..., L] (fp32), keys where `allowed` [..., L]
    (bool, broadcast to s; None: every key) -> p, shaped like s.

    sink: an attention sink logit per row (broadcast to s[..., :1], e.g. [1, Hq, 1, 1]), a
    column of the softmax whose probability is dropped (gpt-oss): p = exp(s) / (sum exp(s) +
    exp(sink)); a row that sees no key still gets all zeros.

    Every reference path uses this one (the references below, kernels/dense.py's exact fp32
    attention, eviction/attend.py): a masked key gets probability 0 whatever its score holds
    (NaN included); a row that sees no key gets all zeros (no 0 / 0); a NaN score of a seen key
    stays NaN in p, so the row's output p @ v is NaN, as in eager attention."""
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.float())
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(s - m)   # NaN stays NaN; -inf rows -> 0
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink.float() - m)
    return p / torch.where(denom > 0, denom, 1.0)


# --- decode references ---
# Plain-PyTorch versions of kernels/decode.py: pages dequantized with formats.py, fp32 math.

def gather_pages(cache, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens of a PagedTensor, dequantized: [H, length, D] fp32."""
    P = cache.page_size
    pages = table_row[:(length + P - 1) // P].long()
    x = cache.read(pages)                                   # [n, H, P, D]
    return x.permute(1, 0, 2, 3).reshape(cache.num_heads, -1, cache.head_dim)[:, :length]


def decode_mask_ref(q_pos: torch.Tensor, length: int, *, sliding_window: int = 0,
                    sinks: int = 0, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[Sq, L] bool: may the query at q_pos [Sq] see key j < L? Causal; with a window only
    q_pos - j < window, plus the first `sinks` keys; key_mask [Lm] hides keys j < Lm."""
    j = torch.arange(length, device=q_pos.device)
    ok = j[None, :] <= q_pos[:, None]
    if sliding_window:
        ok = ok & ((q_pos[:, None] - j[None, :] < sliding_window) | (j[None, :] < sinks))
    if key_mask is not None:
        km = torch.ones(length, dtype=torch.bool, device=q_pos.device)
        n = min(length, key_mask.shape[0])
        km[:n] = key_mask[:n]
        ok = ok & km[None, :]
    return ok


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *,
                               key_mask=None, sliding_window: int = 0, sinks: int = 0,
                               softcap: float = 0.0, attn_mass=None, sink_logits=None):
    """q [B, Hq, Sq, D]; query i at position seq_lens[b] - Sq + i. -> [B, Hq, Sq, Dv] fp32.
    sink_logits [Hq]: attention sinks (masked_softmax's `sink`).

    A row that sees no key outputs 0; values of keys that no row sees are treated as 0 (they may
    hold anything). attn_mass [B, Hkv, Lmax] fp32, if given, gets += each key's probability
    summed over the query heads of its group and the Sq queries (keys < Lmax)."""
    B, Hq, Sq, _ = q.shape
    Hkv = k_cache.num_heads
    g = Hq // Hkv
    out = torch.zeros(B, Hq, Sq, v_cache.head_dim, dtype=torch.float32, device=q.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        k = gather_pages(k_cache, block_tables[b], L).repeat_interleave(g, 0)   # [Hq, L, D]
        v = gather_pages(v_cache, block_tables[b], L).repeat_interleave(g, 0)   # [Hq, L, Dv]
        q_pos = torch.arange(L - Sq, L, device=q.device)
        allowed = decode_mask_ref(q_pos, L, sliding_window=sliding_window, sinks=sinks,
                                  key_mask=None if key_mask is None else key_mask[b])
        s = torch.einsum("hsd,hld->hsl", q[b].float(), k) * scale                # [Hq, Sq, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = masked_softmax(s, allowed, _sink(sink_logits, 3))
        v = torch.where(allowed.any(0)[None, :, None], v, torch.zeros_like(v))
        out[b] = torch.einsum("hsl,hld->hsd", p, v)
        if attn_mass is not None:
            n = min(L, attn_mass.shape[2])
            attn_mass[b, :, :n] += p.reshape(Hkv, g * Sq, L).sum(1)[:, :n]
    return out

# --- prefill references ---
# Plain-PyTorch versions of kernels/prefill.py, in fp32: what its kernels are tested against.

def prefill_mask_ref(q_pos, k_pos, kv_start: int = 0, *, causal: bool = True,
                     sliding_window: int = 0, sinks: int = 0):
    """[S, L] bool: may the query at q_pos [S] see the key at k_pos [L]?

    Keys before kv_start never; later keys only if causal allows; with a sliding window W only
    keys with q_pos - k_pos < W, except the first `sinks` keys from kv_start, always seen."""
    q, k = q_pos[:, None], k_pos[None, :]
    ok = k >= kv_start
    if causal:
        ok = ok & (k <= q)
    if sliding_window:
        near = (q - k) < sliding_window
        if sinks:
            near = near | (k < kv_start + sinks)
        ok = ok & near
    return ok


def _sink(sink_logits, dims: int):
    """sink_logits [Hq] as masked_softmax's `sink` for scores [Hq, S, L] (dims 3), or None."""
    return None if sink_logits is None else sink_logits.float().view(-1, *(1,) * (dims - 1))


def _prefill_attend_ref(q, k, v, allowed, scale: float, softcap: float, sink_logits=None):
    # q [S, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv], allowed [S, L] -> [S, Hq, Dv] fp32
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("shd,lhd->hsl", q.float(), kf) * scale               # [Hq, S, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = masked_softmax(s, allowed, _sink(sink_logits, 3))                 # no key seen -> 0
    seen = allowed.any(0)                                                 # [L]
    vf = torch.where(seen[:, None, None], vf, torch.zeros_like(vf))       # unseen slots: 0
    return torch.einsum("hsl,lhd->shd", p, vf)


def prefill_attention_ref(q, k, v, cu_seqlens, scale: float, *, causal: bool = True,
                          sliding_window: int = 0, sinks: int = 0, softcap: float = 0.0,
                          cu_seqlens_k=None):
    """q [T, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], cu_seqlens [B+1] -> [T, Hq, Dv] fp32.
    Each packed sequence attends to itself only. With cu_seqlens_k, sequence b has k_len keys
    and its q_len queries are the last q_len positions (k_len - q_len + i)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    cuk = cu if cu_seqlens_k is None else [int(x) for x in cu_seqlens_k.tolist()]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for b in range(len(cu) - 1):
        s0, s1, k0, k1 = cu[b], cu[b + 1], cuk[b], cuk[b + 1]
        if s1 == s0:
            continue
        q_pos = torch.arange(k1 - k0 - (s1 - s0), k1 - k0, device=q.device)
        allowed = prefill_mask_ref(q_pos, torch.arange(k1 - k0, device=q.device), 0,
                                   causal=causal, sliding_window=sliding_window, sinks=sinks)
        out[s0:s1] = _prefill_attend_ref(q[s0:s1], k[k0:k1], v[k0:k1], allowed, scale, softcap)
    return out


def prefill_attention_fp8_ref(q, k, v, cu_seqlens, scale: float, block: int = 128,
                              round_p: bool = True):
    """Causal attention over packed sequences as the FP8 prefill kernels compute it, from the
    dequantized E4M3 values (q, k, v fp32: `prefill.dequantize_fp8_prefill`): each sequence's
    keys in tiles of `block` from its start; after tile j a row's running max m_j (of scale *
    log2 e * q.k); the tile's weights P_j = 2^(s - m_j + 8) rounded to E4M3 (satfinite: 256 x
    p, so that small weights stay normal) before P V, their sum l from the unrounded values;
    every earlier tile rescaled by 2^(m_j' - m_j). -> [T, Hq, Dv] fp32. What the kernels add
    beyond this is fp32 summation order. round_p=False: P unrounded (plain attention, by
    tiles)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    g = Hq // Hkv
    c = scale * 1.4426950408889634
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=q.device)
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        n = s1 - s0
        if n == 0:
            continue
        J = (n + block - 1) // block
        pad = J * block - n
        qs = q[s0:s1].float().transpose(0, 1)                                   # [Hq, n, D]
        ks = k[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)           # [Hq, n, D]
        vs = v[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)           # [Hq, n, Dv]
        s = (qs @ ks.transpose(1, 2)) * c                                       # [Hq, n, n]
        pos = torch.arange(n, device=q.device)
        s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(Hq, n, J, block)
        m = s.amax(-1).cummax(-1).values                                        # [Hq, n, J]
        p = torch.exp2(s - m[..., None] + 8.0)
        p8 = p.clamp(max=448.0).to(torch.float8_e4m3fn).float() if round_p else p
        w = torch.exp2(m - m[..., -1:])                                         # [Hq, n, J]
        vt = torch.nn.functional.pad(vs, (0, 0, 0, pad)).view(Hq, J, block, Dv)
        o = torch.einsum("hnjk,hjkd->hnd", p8 * w[..., None], vt)
        lsum = (p.sum(-1) * w).sum(-1)
        out[s0:s1] = (o / lsum[..., None]).transpose(0, 1)
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                scale: float, *, sliding_window: int = 0, sinks: int = 0,
                                softcap: float = 0.0, kv_start=None, sink_logits=None):
    """Chunked prefill over pages, dequantized with formats.py (PagedTensor.read).

    q [T, Hq, D] packed chunks (cu_seqlens_q [B+1]); sequence b holds seq_lens[b] tokens in the
    pages of block_tables[b], its chunk's queries at positions seq_lens[b] - q_len + i.
    -> [T, Hq, Dv] fp32."""
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    starts = [0] * len(lens) if kv_start is None else [int(x) for x in kv_start.tolist()]
    P = k_cache.page_size
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.head_dim, dtype=torch.float32,
                      device=q.device)
    for b in range(len(cu) - 1):
        q0, q1, L = cu[b], cu[b + 1], lens[b]
        if q1 == q0:
            continue
        pages = block_tables[b, :(L + P - 1) // P].long()
        k = k_cache.read(pages).permute(0, 2, 1, 3).reshape(-1, k_cache.num_heads,
                                                           k_cache.head_dim)[:L]
        v = v_cache.read(pages).permute(0, 2, 1, 3).reshape(-1, v_cache.num_heads,
                                                           v_cache.head_dim)[:L]
        q_pos = torch.arange(L - (q1 - q0), L, device=q.device)
        allowed = prefill_mask_ref(q_pos, torch.arange(L, device=q.device), starts[b],
                                   sliding_window=sliding_window, sinks=sinks)
        out[q0:q1] = _prefill_attend_ref(q[q0:q1], k, v, allowed, scale, softcap, sink_logits)
    return out


def _e4m3_descale(amax):
    # an FP8 prefill scale: amax / 448, 1 where amax is 0 (or NaN)
    return torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))


def _e4m3_codes(x, descale):
    # RN(x / descale) clamped to +-448, as E4M3
    return (x.float() / descale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_rows_fp8_ref(q):
    """q [T, H, D] -> (codes E4M3, descale [T, H, 1] fp32): a scale per row, amax / 448 (1 for
    an all-zero row), codes RN(x / scale) clamped to +-448; the Hopper FP8 prefill kernel's own
    quantization of bf16 queries (kernels/prefill_sm90.py)."""
    s = _e4m3_descale(q.float().abs().amax(-1, keepdim=True))
    return _e4m3_codes(q, s), s


def quantize_fp8_prefill_ref(q, k, v, cu_seqlens, num_blocks: int, block: int = 128):
    """The torch form of prefill.quantize_fp8_prefill (its docstring says what it computes):
    -> q8, k8, vt8 [Hkv * Dv, max(num_blocks, 1) * block], (q_descale, k_descale, v_descale
    [max(num_blocks, 1), Hkv] fp32, cu_blocks [B+1] int32)."""
    T, Hq, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    nblk = (lens + block - 1) // block
    cu_blocks = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=q.device)
    cu_blocks[1:] = torch.cumsum(nblk, 0)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)  # [T]
    local = torch.arange(T, device=q.device) - cu_seqlens[:-1].long()[seq]
    blk = cu_blocks[:-1].long()[seq] + local // block  # [T]
    nb = max(num_blocks, 1)

    def scales(amax_tok):  # [T, Hkv] -> [nb, Hkv] descales
        amax = torch.zeros(nb, Hkv, dtype=torch.float32, device=q.device)
        amax.scatter_reduce_(0, blk[:, None].expand(T, Hkv), amax_tok.float(), "amax")
        return _e4m3_descale(amax)

    def encode(x, descale):  # x [T, Hkv, G, d]
        return _e4m3_codes(x, descale[blk][:, :, None, None])

    g = Hq // Hkv
    qg = q.reshape(T, Hkv, g, D)
    qs = scales(qg.abs().amax(dim=(2, 3)))
    ks = scales(k.abs().amax(dim=2))
    vs = scales(v.abs().amax(dim=2))
    q8 = encode(qg, qs).reshape(T, Hq, D)
    k8 = encode(k[:, :, None], ks).reshape(T, Hkv, D)
    v8 = encode(v[:, :, None], vs).reshape(T, Hkv * Dv)
    from kvcompile.kernels.prefill_quant import vt_column

    # [T]: each token's column in vt8 (within a 32-token chunk in P's lane order)
    col = cu_blocks[:-1].long()[seq] * block + vt_column(local)
    vt8 = torch.zeros(Hkv * Dv, nb * block, dtype=torch.float8_e4m3fn, device=q.device)
    vt8[:, col] = v8.t()
    return q8, k8, vt8, (qs, ks, vs, cu_blocks)
