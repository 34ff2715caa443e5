"""A tiny Qwen3 config.json (random weights of these shapes run fast on a CPU)."""

from __future__ import annotations

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
