"""Model configuration: one dataclass for Qwen3, Qwen2 and Llama, read from HF config.json.

Both checkpoint formats load: transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`)
and transformers 5 (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


@dataclass
class ModelConfig:
    architecture: str  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama, Qwen3 by config)
    o_proj_bias: bool = False  # bias on o too (Llama, Qwen3 with attention_bias; never Qwen2)
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: str = "bfloat16"  # dtype the checkpoint was stored in

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unknown architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unknown architecture: config.json \"architectures\" is {archs!r}; "
                             f"supported are {sorted(SUPPORTED_ARCHITECTURES)}")
        rope_params = dict(raw.get("rope_parameters") or {})  # transformers 5
        rope_theta = rope_params.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.pop("rope_theta", None)
            if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
                rope_scaling = None
        num_heads = raw["num_attention_heads"]
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' names for SiLU, the only one here
            raise ValueError(f"config.json hidden_act {act!r} is not supported (only silu)")
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _as_list(raw.get("eos_token_id")) + _as_list((generation_config or {}).get("eos_token_id"))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=arch == "qwen2" or attention_bias,
            o_proj_bias=arch != "qwen2" and attention_bias,  # as transformers' models
            mlp_bias=arch == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=list(dict.fromkeys(eos)),
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(json.loads(config_file.read_text()), gen)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
