"""Build a CausalLM and fill it from safetensors (single file or sharded with an index),
shard by shard with a progress bar; or with random weights (`--load-format dummy`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from tapserve.model.config import ModelConfig, read_json
from tapserve.model.decoder import AttentionBackend, CausalLM
from tapserve.model.layers import TPGroup

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless asked otherwise."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose from {['auto', *sorted(DTYPES)]}")
    return DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    cfg: ModelConfig,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend | None = None,
    max_positions: int | None = None,
) -> CausalLM:
    with _default_dtype(dtype), torch.device(device):
        return CausalLM(cfg, tp, backend, max_positions).eval()


def open_safetensors(path: Path, device: str = "cpu") -> Any:
    """safe_open of one file; a ValueError naming it when it is not a safetensors file
    (truncated, corrupt), where safetensors' own message names no file."""
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as e:  # (a folder by that name: "No such device")
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map object")
        files = [model_dir / str(f) for f in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {missing[:3]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_weights(model: CausalLM, model_dir: Path, show_progress: bool = True) -> None:
    """Copy this rank's shard of every checkpoint tensor the model uses; ignore the others.
    Raises on a missing or mis-shaped tensor, naming it."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc="loading shards", disable=not show_progress or len(files) < 2):
        with open_safetensors(path) as f:
            for hf_name in f.keys():
                target = _map_name(model, hf_name)
                if (
                    target is not None
                    and target[0] not in params
                    and _in_a_layer(target[0], model.config.num_hidden_layers)
                ):
                    raise ValueError(
                        f"checkpoint tensor {hf_name} is part of a layer's attention"
                        " or MLP, but the model has no such parameter: its "
                        "config.json asks for what tapserve does not implement"
                    )
                if target is None or target[0] not in params:
                    continue  # a tensor the model does not use (a head's weights, say)
                name, shard_id = target
                try:
                    params[name].weight_loader(params[name], f.get_tensor(hf_name), shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {hf_name}: {e}") from None
                loaded.add(f"{name}:{shard_id}")
    _check_complete(model, params, loaded)


def _map_name(model: CausalLM, hf_name: str) -> tuple[str, object] | None:
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    for hf_part, (ours, shard_id) in model.packed_modules.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard_id
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None
    return name, None


def _in_a_layer(name: str, num_layers: int) -> bool:
    """name (ours) is the attention or MLP tensor of one of the model's decoder layers: one
    the model must use (a checkpoint may hold more layers than its config.json declares;
    those are ignored, as transformers ignores them)."""
    parts = name.split(".")
    return (
        len(parts) > 3
        and parts[0] == "layers"
        and parts[1].isdigit()
        and int(parts[1]) < num_layers
        and parts[2] in ("self_attn", "mlp")
    )


def _check_complete(model: CausalLM, params: dict, loaded: set[str]) -> None:
    """Raise naming, as the checkpoint spells them, the tensors the model needs but did not get."""
    packed: dict[str, list[tuple[str, object]]] = {}  # our fragment -> [(HF fragment, shard id)]
    for hf_part, (ours, shard_id) in model.packed_modules.items():
        packed.setdefault(ours, []).append((hf_part, shard_id))
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        ours = next((o for o in packed if f".{o}." in name), None)
        parts = (
            [(name, None)]
            if ours is None
            else [
                (name.replace(f".{ours}.", f".{hf_part}."), shard)
                for hf_part, shard in packed[ours]
            ]
        )
        missing += [
            hf_name if hf_name.startswith("lm_head.") else f"model.{hf_name}"
            for hf_name, shard in parts
            if f"{name}:{shard}" not in loaded
        ]
    if missing:
        raise ValueError(
            f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the right shapes (benchmarks): small normal values, norms at 1."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
