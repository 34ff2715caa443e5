"""A custom-output handler for the TP tests: a fixed linear head that records, in the file
named by $TAPSERVE_TEST_HANDLER_LOG, the rank that built it and each forward call."""

from __future__ import annotations

import os

import torch


class RecordingHead:
    def __init__(self) -> None:
        self.log = os.environ["TAPSERVE_TEST_HANDLER_LOG"]
        self._write(f"init rank={os.environ.get('RANK', '0')}")
        self.weight: torch.Tensor | None = None

    def _write(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int | list:
        if not params:
            return len(input_ids) - 1
        position = params["position"]
        return list(position) if isinstance(position, list) else int(position)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            g = torch.Generator().manual_seed(0)
            self.weight = torch.randn(3, hidden.shape[1], generator=g).to(hidden.device)
        self._write(f"forward rank={os.environ.get('RANK', '0')} rows={hidden.shape[0]}")
        return hidden.float() @ self.weight.float().T
