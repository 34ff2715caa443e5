"""A benchmark deployment head: a linear layer (hidden -> 1, float32) on the last prompt token
of every request (the base class's default selector; {"position": -1} opts a request out),
with weights made on first use (no checkpoint tensors needed)."""

from __future__ import annotations

import torch

from tapserve.model.custom_output import CustomOutputHandler


class LastTokenLinearHead(CustomOutputHandler):
    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            g = torch.Generator(device=hidden.device).manual_seed(0)
            self.weight = (
                torch.randn(
                    hidden.shape[1], 1, generator=g, device=hidden.device, dtype=hidden.dtype
                )
                * hidden.shape[1] ** -0.5
            )
        return (hidden @ self.weight).float()[:, 0]
