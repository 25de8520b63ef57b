"""The tiny Llama the GPU tests share (4 layers, 8 q / 2 kv heads, fp32 on CUDA)."""

import torch


def tiny_llama(seed: int = 0, max_positions: int = 2048):
    import transformers as t

    torch.manual_seed(seed)
    cfg = t.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    m = t.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # sharper logits: greedy decided by the model, not rounding
    return m.to("cuda", torch.float32)
