"""Benchmark deployment heads: a linear layer (hidden -> 1, float32; PairLinearHead: hidden ->
2) on the last prompt token of every request, or on the tokens `{"position": [...]}` lists
(the base class's default selector; {"position": -1} opts a request out), with weights made
on first use (no checkpoint tensors needed)."""

from __future__ import annotations

import torch

from tapserve.model.custom_output import CustomOutputHandler


class LastTokenLinearHead(CustomOutputHandler):
    width = 1

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            g = torch.Generator(device=hidden.device).manual_seed(0)
            self.weight = (
                torch.randn(
                    hidden.shape[1],
                    self.width,
                    generator=g,
                    device=hidden.device,
                    dtype=hidden.dtype,
                )
                * hidden.shape[1] ** -0.5
            )
        out = (hidden @ self.weight).float()
        return out[:, 0] if self.width == 1 else out


class PairLinearHead(LastTokenLinearHead):
    """hidden -> 2, float32: [rows, 2]."""

    width = 2
