"""Test helpers: tiny random Hugging Face checkpoints written by transformers itself.

`make_tiny_checkpoint(path, "qwen3" | "qwen2" | "llama", **overrides)` builds
`XForCausalLM(config)` under `torch.manual_seed(0)`, re-initialises the weights
deterministically (`init="spread"`, see `model.demo.spread_init`; `init="hf"`
keeps transformers' own N(0, 0.02) init) and calls `save_pretrained`. Defaults:
float32, vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads,
head_dim 16, max_position_embeddings 1024; EOS ids 2 (config.json) and [2, 3]
(generation_config.json); llama also has bos 1 and llama3 RoPE scaling.

config.json comes out in the installed transformers' style (v5: `rope_parameters`,
`dtype`); `to_transformers4_format` / `to_transformers5_format` rewrite it.

The checkpoints carry no tokenizer (tests use token ids). `make_tiny_tokenizer`
copies the demo tokenizer (1024 tokens, special ids 1021-1023) in and points the
EOS ids at it; the model's vocab must then be >= 1024, which
`make_tiny_checkpoint(..., tokenizer=True)` arranges by default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tapserve.model.demo import DEMO_VOCAB_SIZE, ensure_demo_checkpoint, spread_init

ARCHS = ("qwen3", "qwen2", "llama")
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EXTRA_SHARD = "model-extra.safetensors"
DEFAULT_EOS_IDS = (2, 3)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _config_kwargs(arch: str, overrides: dict) -> dict:
    """Default config fields for `arch`, with `overrides` applied on top."""
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        eos_token_id=DEFAULT_EOS_IDS[0],
        bos_token_id=None,
        tie_word_embeddings=arch == "qwen3",
    )
    if arch == "llama":
        kwargs.update(bos_token_id=1, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE_SCALING))
    else:
        kwargs.update(rope_theta=1000000.0)
    kwargs.update(overrides)
    kwargs["torch_dtype" if _transformers_major() < 5 else "dtype"] = "float32"
    return kwargs


def _build_model(arch: str, overrides: dict, init: str) -> torch.nn.Module:
    """Instantiate the transformers model for `arch` with seeded weights."""
    import transformers

    names = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}
    if arch not in names:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    config = getattr(transformers, names[arch] + "Config")(**_config_kwargs(arch, overrides))
    torch.manual_seed(0)
    model = getattr(transformers, names[arch] + "ForCausalLM")(config).float().eval()
    if init == "spread":
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(spread_init(name, tuple(param.shape), gen))
    elif init != "hf":
        raise ValueError(f"init must be 'spread' or 'hf', got {init!r}")
    return model


def _add_extra_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    """Put `extra` into model.safetensors, or (sharded) into a new shard + the index."""
    extra = {name: t.detach().cpu().contiguous() for name, t in extra.items()}
    index_path = path / "model.safetensors.index.json"
    if not index_path.exists():
        tensors = load_file(str(path / "model.safetensors"))
        if clash := sorted(set(tensors) & set(extra)):
            raise ValueError(f"extra tensors collide with model tensors: {clash}")
        save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    index = _read_json(index_path)
    if clash := sorted(set(index["weight_map"]) & set(extra)):
        raise ValueError(f"extra tensors collide with model tensors: {clash}")
    save_file(extra, str(path / EXTRA_SHARD), metadata={"format": "pt"})
    index["weight_map"].update({name: EXTRA_SHARD for name in extra})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    meta = index.setdefault("metadata", {})
    meta["total_size"] = meta.get("total_size", 0) + sum(
        t.numel() * t.element_size() for t in extra.values()
    )
    _write_json(index_path, index)


def _write_generation_config(
    path: Path, eos_ids: list[int], bos_id: int | None, pad_id: int | None = None
) -> None:
    content: dict = {"eos_token_id": eos_ids}
    if bos_id is not None:
        content["bos_token_id"] = bos_id
    if pad_id is not None:
        content["pad_token_id"] = pad_id
    _write_json(path / "generation_config.json", content)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str,
    *,
    sharded: bool = False,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    tokenizer: bool = False,
    init: str = "spread",
    eos_token_ids: tuple[int, ...] = DEFAULT_EOS_IDS,
    **config_overrides,
) -> Path:
    """Write a tiny random `arch` checkpoint into `path` (created) and return it.

    `config_overrides` go to the transformers config (e.g. num_key_value_heads=1,
    tie_word_embeddings=True, vocab_size=1024). `sharded=True` writes
    model-0000k-of-0000n.safetensors + model.safetensors.index.json (100KB shards).
    `extra_tensors` are added to the safetensors files (for a handler's weights).
    `tokenizer=True` copies the demo tokenizer in (vocab_size defaults to 1024).
    `eos_token_ids` go to generation_config.json; the first is config's eos_token_id.
    """
    path = Path(path)
    if tokenizer:
        config_overrides.setdefault("vocab_size", DEMO_VOCAB_SIZE)
    config_overrides.setdefault("eos_token_id", eos_token_ids[0])
    model = _build_model(arch, config_overrides, init)
    path.mkdir(parents=True, exist_ok=True)
    shard_size = "100KB" if sharded else "10GB"
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size=shard_size)
    if sharded and not (path / "model.safetensors.index.json").exists():
        raise RuntimeError("expected a sharded checkpoint; is the model too small?")
    _write_generation_config(path, list(eos_token_ids), model.config.bos_token_id)
    if extra_tensors:
        _add_extra_tensors(path, extra_tensors)
    if tokenizer:
        make_tiny_tokenizer(path)
    return path


def make_tiny_tokenizer(path: str | Path, demo_dir: str | Path | None = None) -> Path:
    """Copy the demo tokenizer into checkpoint `path` and re-point its EOS ids.

    Requires config.json's vocab_size >= 1024 (the demo tokenizer's size; ValueError
    otherwise). Afterwards config eos_token_id = `<|im_end|>` (1023) and
    generation_config eos_token_id = [1023, 1021], pad_token_id = 1021.
    """
    path = Path(path)
    config = _read_json(path / "config.json")
    if config["vocab_size"] < DEMO_VOCAB_SIZE:
        raise ValueError(
            f"model vocab_size {config['vocab_size']} < demo tokenizer size "
            f"{DEMO_VOCAB_SIZE}: build the checkpoint with vocab_size>=1024"
        )
    demo = ensure_demo_checkpoint(demo_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo / name, path / name)
    demo_gen = _read_json(demo / "generation_config.json")
    config["eos_token_id"] = demo_gen["eos_token_id"][0]
    config["pad_token_id"] = demo_gen["pad_token_id"]
    _write_json(path / "config.json", config)
    _write_generation_config(
        path, demo_gen["eos_token_id"], config.get("bos_token_id"), demo_gen["pad_token_id"]
    )
    return path


def to_transformers4_format(path: str | Path) -> Path:
    """Rewrite `path`/config.json in place to transformers-4 fields: `rope_theta` and
    `rope_scaling` (null for default RoPE) instead of `rope_parameters`, and
    `torch_dtype` instead of `dtype`. Idempotent. Returns the config.json path."""
    config_path = Path(path) / "config.json"
    config = _read_json(config_path)
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    if "rope_parameters" in config:
        rope = dict(config.pop("rope_parameters") or {})
        config["rope_theta"] = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        default = rope.get("rope_type", rope.get("type", "default")) == "default"
        config["rope_scaling"] = None if default else rope
    _write_json(config_path, config)
    return config_path


def to_transformers5_format(path: str | Path) -> Path:
    """Rewrite `path`/config.json in place to transformers-5 fields: `rope_parameters`
    (holding rope_theta, rope_type and any scaling fields) instead of `rope_theta` /
    `rope_scaling`, and `dtype` instead of `torch_dtype`. Idempotent."""
    config_path = Path(path) / "config.json"
    config = _read_json(config_path)
    if "torch_dtype" in config:
        config["dtype"] = config.pop("torch_dtype")
    if "rope_theta" in config or "rope_scaling" in config:
        rope = dict(config.pop("rope_scaling", None) or {})
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
        rope.setdefault("rope_type", "default")
        theta = config.pop("rope_theta", None)
        base = dict(config.get("rope_parameters") or {})
        rope["rope_theta"] = theta if theta is not None else base.get("rope_theta", 10000.0)
        config["rope_parameters"] = {**base, **rope}
    _write_json(config_path, config)
    return config_path
