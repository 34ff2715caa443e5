"""Sampling defaults from a checkpoint's generation_config.json."""

from __future__ import annotations

from pathlib import Path

from tapserve.api.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams
from tapserve.model.config import read_json


def model_sampling_defaults(folder: str | Path) -> dict[str, float | int]:
    """The sampling defaults in folder's generation_config.json (none when it has none):
    what a request that leaves such a field out gets, as vLLM's --generation-config auto.
    A value that is not a number of the field's type, or out of the field's range, is a
    ValueError: it would otherwise fail every request."""
    path = Path(folder) / "generation_config.json"
    raw = read_json(path) if path.is_file() else {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults: dict[str, float | int] = {}
    for name, kind in MODEL_DEFAULT_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not float(value).is_integer())
        ):
            raise ValueError(f"{path}: {name} must be a number ({kind.__name__}), got {value!r}")
        defaults[name] = kind(value)
    if not -(2**63) <= defaults.get("top_k", 0) < 2**63:
        raise ValueError(f"{path}: top_k must fit in 64 bits, got {defaults['top_k']}")
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
