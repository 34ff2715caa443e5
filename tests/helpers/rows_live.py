"""Helpers for tests/api/test_api_rows_live.py: a head that lets a test pace rank 0 step by
step across processes, so a live stream comes in many chunks (a tiny CPU model otherwise
finishes before the API process reads its first output, and the whole answer arrives as one
chunk); and readers of live answers' rows, positions and token ids.

`GatedProbe` is `StopProbe` with a gate: a request whose custom_output_params hold
{"gate": DIR} arms it; from then on, forward call k (counted from the arming) waits until the
file DIR/k exists (`Gate.release` writes them) or DIR/open does (`Gate.open`, which disarms
it). A forward that waits longer than `GATE_PATIENCE_S` goes on, so a test that stops
releasing cannot hang the server.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from tests.helpers.custom import HEAD_B, HEAD_W, Reference, StopProbe, linear_head

GATE_PATIENCE_S = 5.0


class GatedProbe(StopProbe):
    def __init__(self) -> None:
        super().__init__()
        self.gate: Path | None = None
        self.gated_calls = 0

    def select_token_position(self, input_ids: list[int], params: dict | None):
        if (params or {}).get("gate"):
            self.gate, self.gated_calls = Path(params["gate"]), 0
        return super().select_token_position(input_ids, params)

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gated_calls += 1
            permit = self.gate / str(self.gated_calls)
            deadline = time.monotonic() + GATE_PATIENCE_S
            while not permit.exists() and time.monotonic() < deadline:
                if (self.gate / "open").exists():
                    self.gate = None
                    break
                time.sleep(0.002)
        return super().forward(selected_hidden_states)


class Gate:
    """The test's side: a directory of permits for one gated request."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.released = 0

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.released += 1
            (self.folder / str(self.released)).touch()

    def open(self) -> None:
        (self.folder / "open").touch()


# ---- reading live answers ----------------------------------------------------------------
def gated_stream(gate: Gate, create, cop: dict, **kwargs) -> list:
    """`create(**kwargs, stream=True)` with custom_output_params `cop` armed for GatedProbe:
    rank 0 runs one step per chunk read (and one to start). Every chunk, read to the end."""
    body = {
        **kwargs.pop("extra_body", {}),
        "custom_output_params": {**cop, "gate": str(gate.folder)},
    }
    gate.release()
    chunks = []
    try:
        for chunk in create(**kwargs, stream=True, extra_body=body):
            chunks.append(chunk)
            gate.release()
    finally:
        gate.open()
    return chunks


def expected_rows(ref: Reference, ids: list[int], positions: list[int]) -> np.ndarray:
    hidden = ref.final_hidden(ids)[positions]
    return linear_head(hidden, ref.tensors[HEAD_W], ref.tensors[HEAD_B]).numpy()


def assert_rows(ref: Reference, ids: list[int], positions: list[int], rows) -> None:
    """rows (JSON lists) are the head on transformers' hidden states of ids at positions."""
    got = np.array(rows, np.float32)
    assert got.shape == (len(positions), 3), (got.shape, positions)
    np.testing.assert_allclose(got, expected_rows(ref, ids, positions), rtol=1e-4, atol=1e-4)


def extra_of(obj) -> dict:
    """An openai object's `extra_outputs` (read through the client's model_extra)."""
    return (obj.model_extra or {}).get("extra_outputs") or {}


def ids_of(names: dict, logprobs) -> list[int]:
    """Token ids of a completions choice's (or chunk's) logprobs entries."""
    return [names["legacy"][t] for t in (logprobs.tokens if logprobs else [])]


def chat_ids_of(names: dict, logprobs) -> list[int]:
    return [names["bytes"][bytes(e.bytes)] for e in (logprobs.content or [] if logprobs else [])]


def stream_rows(chunks, prompt_positions: list[int], n_prompt: int, token_ids) -> dict:
    """Checks the streaming rule on every chunk: its positions are exactly its tokens' (the
    choice's first chunk carries the prompt rows first; a content_filter chunk adds the
    flagged token's), and its top-level extra_outputs is its choice's delta. Returns choice
    index -> {"pos", "rows", "ids", "text", "finish", "chunks"}."""
    seen: dict[int, dict] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        (choice,) = chunk.choices
        mine = seen.setdefault(
            choice.index,
            {"pos": [], "rows": [], "ids": [], "text": "", "finish": None, "chunks": 0},
        )
        extra = extra_of(choice)
        assert extra_of(chunk) == extra, chunk  # the top level is this choice's delta
        new_ids = token_ids(choice.logprobs)
        start = n_prompt + len(mine["ids"])
        want = [] if mine["chunks"] else list(prompt_positions)
        want += range(start, start + len(new_ids))
        if choice.finish_reason == "content_filter":
            want.append(start + len(new_ids))
        assert extra.get("custom_output_positions", []) == want, (chunk, mine)
        assert len(extra.get("custom_output", [])) == len(want)
        mine["pos"] += want
        mine["rows"] += extra.get("custom_output", [])
        mine["ids"] += new_ids
        mine["text"] += choice.text if hasattr(choice, "text") else choice.delta.content or ""
        mine["finish"] = choice.finish_reason or mine["finish"]
        mine["chunks"] += 1
    return seen


def stop_string_at(decode, tokens: list[int]) -> tuple[int, str]:
    """(j, stop): a string first completed by token j (2 <= j), as decoded text shows it."""
    for j in range(2, len(tokens)):
        before, full = decode(tokens[:j]), decode(tokens[: j + 1])
        if len(full) <= len(before) or not full.startswith(before):
            continue
        stop = full[max(len(before) - 1, 0) :]
        if full.find(stop) == len(full) - len(stop):
            return j, stop
    raise AssertionError(f"no stop string to pick in {decode(tokens)!r}")
