"""A linear reward head whose weights live in the model checkpoint.

    python launch.py --model DIR --custom-module examples/reward_head.py

The checkpoint's safetensors must hold `reward_head.weight` ([1, hidden] or [hidden]) and
`reward_head.bias` ([1]); the model loader ignores them, and this handler fetches them by
name on rank 0. For every request it scores one prompt token: the last one by default, or
`custom_output_params["position"]` (a zero-based index into the templated prompt's token
ids; -1 asks for no score). The output is one float32 per request: shape [rows].
"""

from __future__ import annotations

import torch

from tapserve.model.custom_output import CustomOutputHandler

WEIGHT, BIAS = "reward_head.weight", "reward_head.bias"


class RewardHead(CustomOutputHandler):
    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [1, hidden] float32
        self.bias: torch.Tensor | None = None  # [1] float32

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        """As the base class (`position`, else the last prompt token); other keys -> 605."""
        unknown = set(params or {}) - {"position"}
        if unknown:
            raise ValueError(f"unknown custom_output_params: {sorted(unknown)}")
        return super().select_token_position(input_ids, params)

    def weight_names(self) -> list[str]:
        return [WEIGHT, BIAS]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        weight, bias = tensors[WEIGHT].float(), tensors[BIAS].float()
        self.weight = weight.reshape(1, -1)
        self.bias = bias.reshape(1)

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (model dtype) -> [rows] float32 rewards."""
        scores = torch.nn.functional.linear(selected_hidden_states.float(), self.weight, self.bias)
        return scores[:, 0]
