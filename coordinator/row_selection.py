"""Multi-row custom-output selections (a selector's list answer, DESIGN.md "Custom outputs over
many tokens") and the rows rank 0 holds until an output sends them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tapserve.api.wire import INVALID_PARAMS
from tapserve.model.custom_output import CustomOutputHandler

LAST_GENERATED = CustomOutputHandler.LAST_GENERATED
ALL_GENERATED = CustomOutputHandler.ALL_GENERATED


class SelectionError(ValueError):
    """A list answer breaks the rules: 605 naming custom_output_params."""

    code = INVALID_PARAMS


@dataclass(frozen=True)
class RowSelection:
    """Which tokens of a request get rows: prompt positions (ascending) and, per sequence,
    its last generated token (LAST_GENERATED), every one (ALL_GENERATED) or none."""

    prompt: tuple[int, ...]
    generated: int | None = None

    @property
    def all_generated(self) -> bool:
        return self.generated == ALL_GENERATED

    def max_rows(self, max_new_tokens: int) -> int:
        """The most rows one sequence can get."""
        extra = {LAST_GENERATED: 1, ALL_GENERATED: max_new_tokens}.get(self.generated, 0)
        return len(self.prompt) + extra


def parse_selection(answer: list, prompt_len: int, max_new_tokens: int) -> RowSelection | None:
    """A selector's list answer, checked; None for [] (no custom output). Raises
    SelectionError naming what is wrong."""
    bad = [v for v in answer if not isinstance(v, (int, np.integer)) or isinstance(v, bool)]
    if bad:
        raise SelectionError(f"the selector's list holds {bad[0]!r}, not an int position")
    values = [int(v) for v in answer]
    if len(set(values)) != len(values):
        raise SelectionError(f"the selector's list repeats a position: {values[:20]}")
    generated = [v for v in values if v in (LAST_GENERATED, ALL_GENERATED)]
    if len(generated) > 1:
        raise SelectionError("the selector's list holds both -2 (LAST_GENERATED) and -3")
    outside = [v for v in values if v not in generated and not 0 <= v < prompt_len]
    if outside:
        raise SelectionError(
            f"selected position {outside[0]} is outside the prompt [0, {prompt_len}) "
            f"(a list may add one of -2, LAST_GENERATED, or -3, ALL_GENERATED)"
        )
    if max_new_tokens == 0 and (not values or generated):
        what = "no position" if not values else f"{generated[0]} (a generated token)"
        raise SelectionError(f"a scoring-only request (0 tokens to generate) selects {what}")
    if not values:
        return None
    prompt = tuple(sorted(v for v in values if v >= 0))
    return RowSelection(prompt, generated[0] if generated else None)


@dataclass
class PendingRows:
    """Rows computed and not yet sent, with each row's position in prompt + generated ids;
    `take` empties it into one wire value."""

    positions: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)  # each [width] or a 0-d value
    dtype: str = ""

    def add(self, position: int, row: np.ndarray, dtype: str) -> None:
        self.positions.append(position)
        self.rows.append(row)
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.positions)

    def drop_from(self, position: int) -> None:
        """Forget the rows at position and after (their tokens were cut)."""
        keep = sum(1 for p in self.positions if p < position)
        del self.positions[keep:], self.rows[keep:]

    def copy(self) -> PendingRows:
        return PendingRows(list(self.positions), list(self.rows), self.dtype)

    def take(self) -> tuple[dict | None, list[int] | None]:
        """The rows as {dtype, shape [k] or [k, width], data} and their positions, emptied;
        (None, None) when there are none."""
        if not self.positions:
            return None, None
        array = np.stack(self.rows)
        value = {
            "dtype": self.dtype,
            "shape": list(array.shape),
            "data": array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(),
        }
        positions, self.positions, self.rows = self.positions, [], []
        return value, positions
