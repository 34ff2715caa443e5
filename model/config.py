"""Model configuration: one dataclass for Qwen3, Qwen2 and Llama, read from HF config.json.

Both checkpoint formats load: transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`)
and transformers 5 (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
# the rope_scaling kinds served, and the fields each needs (as transformers reads them)
ROPE_SCALING_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
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
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"config field {name} must be an integer, got {getattr(self, name)!r}"
                )
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> ModelConfig:
        """The config of a checkpoint's config.json; a ValueError for anything it asks that
        is not served (architecture, activation, rope scaling, sliding windows) or lacks."""
        try:
            return cls._from_dict(raw, generation_config)
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e}") from None
        except TypeError as e:  # "two" layers, say
            raise ValueError(f"config.json has a field of the wrong type ({e})") from None

    @classmethod
    def _from_dict(cls, raw: dict, generation_config: dict | None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            raise ValueError(
                f'unknown architecture: config.json "architectures" is {archs!r}; '
                f"supported are {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        rope_params = dict(raw.get("rope_parameters") or {})  # transformers 5
        rope_theta = rope_params.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_scaling = _rope_scaling(
            raw.get("rope_scaling") or (rope_params if rope_params else None)
        )
        num_heads = raw["num_attention_heads"]
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' names for SiLU, the only one here
            raise ValueError(f"config.json hidden_act {act!r} is not supported (only silu)")
        _refuse_sliding_window(raw)
        attention_bias = _flag(raw, "attention_bias")
        eos = _as_list(raw.get("eos_token_id")) + _as_list(
            (generation_config or {}).get("eos_token_id")
        )
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=_positive_number("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_positive_number("rope_theta", rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings"),
            rope_scaling=rope_scaling,
            attention_bias=arch == "qwen2" or attention_bias,
            o_proj_bias=arch != "qwen2" and attention_bias,  # as transformers' models
            mlp_bias=arch == "llama" and _flag(raw, "mlp_bias"),
            qk_norm=arch == "qwen3",
            eos_token_ids=list(dict.fromkeys(eos)),
            bos_token_id=raw.get("bos_token_id"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        gen_file = path / "generation_config.json"
        gen = read_json(gen_file) if gen_file.is_file() else None
        raw = read_json(config_file)
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file}: not a JSON object")
        return cls.from_dict(raw, gen)


def _flag(raw: dict, name: str) -> bool:
    """A true/false field (null or absent: false); "false" as a string is not taken as true."""
    value = raw.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"config field {name} must be true or false, got {value!r}")
    return bool(value)


def _positive_number(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"config field {name} must be a finite positive number, got {value!r}")
    return float(value)


def _rope_scaling(scaling: dict | None) -> dict | None:
    """The rope scaling to apply (None for none or "default"); a ValueError for a kind not
    served or one that lacks a field it needs."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"config field rope_scaling must be an object, got {scaling!r}")
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_FIELDS:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_SCALING_FIELDS)})"
        )
    missing = [f for f in ROPE_SCALING_FIELDS[kind] if not isinstance(scaling.get(f), (int, float))]
    if missing:
        raise ValueError(f"config.json {kind} rope scaling lacks a number for {', '.join(missing)}")
    return scaling


def _refuse_sliding_window(raw: dict) -> None:
    """Sliding-window attention is not served: a config whose layers slide over a window
    shorter than its context is refused (served as full attention, its tokens would go
    wrong past the window). The layers slide as transformers' Qwen2/Qwen3 configs say:
    `layer_types`, else `use_sliding_window` from layer `max_window_layers` (28) on."""
    window = raw.get("sliding_window")
    if raw.get("layer_types") is not None:
        sliding = "sliding_attention" in raw["layer_types"]
    else:
        sliding = (
            bool(raw.get("use_sliding_window"))
            and window is not None
            and raw.get("max_window_layers", 28) < raw["num_hidden_layers"]
        )
    if sliding and (window is None or window < raw.get("max_position_embeddings", 4096)):
        raise ValueError(
            f"config.json asks for sliding-window attention (window {window}), "
            "which is not supported"
        )


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a ValueError naming the file when it does not parse."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
