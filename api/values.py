"""Custom-output values: wire form ({dtype, shape, data bytes}) -> HTTP JSON, without torch.

Floats widen exactly and non-finite ones become "NaN" / "Infinity" / "-Infinity" (DESIGN.md);
`custom_output_encoding: "base64"` sends the raw little-endian bytes base64-encoded.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}


def to_array(value: dict) -> np.ndarray:
    """Wire value -> numpy array of its shape (bfloat16 widened to float32, exactly)."""
    dtype, shape, data = value["dtype"], list(value["shape"]), value["data"]
    if dtype == "bfloat16":
        high = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return high.view(np.float32).reshape(shape)
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unknown custom output dtype {dtype!r}")
    return np.frombuffer(data, dtype=np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<")).reshape(
        shape
    )


def json_number(x: float | int) -> float | int | str:
    """A JSON-safe number: non-finite floats become "NaN" / "Infinity" / "-Infinity"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


def _nested(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_nested(v) for v in obj]
    return json_number(obj)


def encode_value(value: dict | None, encoding: str = "json") -> Any:
    """Wire value -> the JSON value or base64 object sent to clients; None stays None."""
    if value is None:
        return None
    if encoding == "base64":
        return {
            "dtype": value["dtype"],
            "shape": list(value["shape"]),
            "data": base64.b64encode(bytes(value["data"])).decode("ascii"),
        }
    array = to_array(value)
    if array.dtype.kind == "f":
        return _nested(array.astype(np.float64).tolist())
    return array.tolist()


def finite_logprob(x: float | None) -> float | None:
    """Logprobs of -inf are sent as -9999.0 (DESIGN.md "Errors"); NaN likewise."""
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0
