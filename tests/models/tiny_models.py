"""Tiny random Qwen3, Llama and Qwen2 checkpoints built with transformers (the test oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def build(family: str, out_dir: Path, **save_kwargs):
    """Save a tiny random model of `family` to out_dir; return the transformers model (fp32, eval)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed({"qwen3": 1, "llama": 2, "qwen2": 3}[family])
    if family == "qwen3":
        # Qwen3: explicit head_dim larger than hidden/heads, q/k norms, separate lm_head.
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    elif family == "llama":
        # Llama 3: rope scaling, tied embeddings (as SmolLM2).
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_scaling=scaling, rope_theta=50000.0,
                                                   tie_word_embeddings=True))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(family)
    # Random init leaves biases at zero; make them count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(out_dir, **save_kwargs)
    return model
