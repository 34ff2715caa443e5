"""Multi-row custom outputs (DESIGN.md "Custom outputs over many tokens") without torch: rows
that arrive as deltas on the wire, kept with their positions and joined on their raw bytes.

A wire value of k rows is `{"dtype", "shape": [k] or [k, width], "data": bytes}` with k
positions beside it; joining and selecting never converts a number, so base64 stays bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from tapserve.api.values import encode_value

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


@dataclass
class Rows:
    """Rows of one dtype and one row shape (`[]` or `[width]`), their bytes and positions."""

    dtype: str | None = None
    row_shape: tuple[int, ...] = ()
    data: bytearray = field(default_factory=bytearray)
    positions: list[int] = field(default_factory=list)

    @classmethod
    def from_wire(cls, value: dict | None, positions: list[int] | None) -> Rows:
        """Rows of a wire delta; ValueError for a value that does not match its positions."""
        if value is None and not positions:
            return cls()
        if value is None or positions is None:
            raise ValueError("custom output rows and positions must come together")
        dtype, shape, data = value["dtype"], [int(d) for d in value["shape"]], value["data"]
        if dtype not in ITEM_BYTES:
            raise ValueError(f"unknown custom output dtype {dtype!r}")
        if len(shape) not in (1, 2) or shape[0] != len(positions):
            raise ValueError(
                f"custom output rows of shape {shape} do not match {len(positions)} positions"
            )
        if len(data) != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"custom output rows of shape {shape} hold {len(data)} bytes")
        return cls(dtype, tuple(shape[1:]), bytearray(data), [int(p) for p in positions])

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def row_bytes(self) -> int:
        return ITEM_BYTES[self.dtype] * math.prod(self.row_shape) if self.dtype else 0

    def extend(self, other: Rows) -> None:
        """Append other's rows (in place); ValueError when dtype or row shape differ."""
        if not other.positions:
            return
        if self.dtype is None:
            self.dtype, self.row_shape = other.dtype, other.row_shape
        elif (self.dtype, self.row_shape) != (other.dtype, other.row_shape):
            raise ValueError(
                f"custom output rows of {other.dtype}{list(other.row_shape)} cannot follow "
                f"rows of {self.dtype}{list(self.row_shape)}"
            )
        self.data += other.data
        self.positions += other.positions

    def select(self, keep: Callable[[int], bool]) -> Rows:
        """The rows whose position `keep` accepts, in their order."""
        chosen = [i for i, p in enumerate(self.positions) if keep(p)]
        if len(chosen) == len(self.positions):
            return Rows(self.dtype, self.row_shape, bytearray(self.data), list(self.positions))
        return self._take(chosen)

    def since(self, start: int) -> Rows:
        """The rows from index `start` on (a copy)."""
        if start >= len(self.positions):
            return Rows()
        cut = start * self.row_bytes
        return Rows(self.dtype, self.row_shape, self.data[cut:], self.positions[start:])

    def sorted(self) -> Rows:
        """The rows in ascending position order (a copy)."""
        order = sorted(range(len(self.positions)), key=self.positions.__getitem__)
        return self._take(order)

    @property
    def ascending(self) -> bool:
        return all(a < b for a, b in zip(self.positions, self.positions[1:]))

    def _take(self, indices: list[int]) -> Rows:
        size = self.row_bytes
        block = np.frombuffer(bytes(self.data), np.uint8).reshape(len(self.positions), size)
        return Rows(
            self.dtype if indices else None,
            self.row_shape if indices else (),
            bytearray(block[indices].tobytes()),
            [self.positions[i] for i in indices],
        )

    def wire(self) -> dict | None:
        """The rows as one wire value (None when there are none)."""
        if not self.positions:
            return None
        return {
            "dtype": self.dtype,
            "shape": [len(self.positions), *self.row_shape],
            "data": bytes(self.data),
        }


def join(parts: Iterable[Rows | None]) -> Rows:
    """All parts' rows, in order, in one new Rows (None: no rows)."""
    out = Rows()
    for part in parts:
        if part is not None:
            out.extend(part)
    return out


def client_fields(rows: Rows | None, encoding: str) -> dict:
    """`custom_output` and `custom_output_positions` as sent to clients; {} without rows."""
    if not rows:
        return {}
    ordered = rows if rows.ascending else rows.sorted()
    return {
        "custom_output": encode_value(ordered.wire(), encoding),
        "custom_output_positions": list(ordered.positions),
    }
