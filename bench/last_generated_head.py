"""A reward head for bench/best_of_n.py: a fixed linear layer (hidden -> 1) on each sequence's
last generated token (LAST_GENERATED), or on the last prompt token for the separate scoring
requests ({"mode": "last_prompt_token"}), or nothing ({"mode": "none"})."""
from __future__ import annotations

import torch

from model.custom_output import CustomOutputHandler


class LastGeneratedRewardHead(CustomOutputHandler):
    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        mode = (params or {}).get("mode", "last_generated")
        if mode == "none":
            return self.NO_OUTPUT
        return len(input_ids) - 1 if mode == "last_prompt_token" else self.LAST_GENERATED

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            g = torch.Generator(device=hidden.device).manual_seed(0)
            self.weight = torch.randn(hidden.shape[1], 1, generator=g, device=hidden.device,
                                      dtype=hidden.dtype) * hidden.shape[1] ** -0.5
        return (hidden @ self.weight).float()[:, 0]
