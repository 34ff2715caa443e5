"""A value head for reinforcement learning: a value for every generated token.

    python launch.py --model DIR --custom-module examples/value_head.py

PPO needs V(s) for each state s that produced a generated token. The state that produced
generated token i is the hidden state one position before it: the last prompt token's for
token 0, generated token i-1's for token i. So the selector returns the last prompt position
plus `ALL_GENERATED` (-3), and each sequence answers 1 + completion_tokens rows with
`custom_output_positions` [len(prompt) - 1, len(prompt), ...]. **The client drops the last
row** (the state after the final token, which produced nothing): row i is then the value of
the state that produced generated token i, TRL's PPO convention (`full_value[:, context_length
- 1 : -1]`). Keep the last row instead to bootstrap a truncated episode.

The weights are TRL's value head, as `AutoModelForCausalLMWithValueHead` saves it beside the
policy: `v_head.summary.weight` ([1, hidden]) and `v_head.summary.bias` ([1]) in the model
checkpoint's safetensors. The output is one float32 per row: [rows]. No params are taken.
"""

from __future__ import annotations

import torch

from tapserve.model.custom_output import CustomOutputHandler

WEIGHT, BIAS = "v_head.summary.weight", "v_head.summary.bias"


class ValueHead(CustomOutputHandler):
    labels = "value"

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [1, hidden] float32
        self.bias: torch.Tensor | None = None  # [1] float32

    def select_token_position(self, input_ids: list[int], params: dict | None) -> list[int]:
        """The last prompt token (the state that produces generated token 0), then every
        generated token. Any params are a ValueError (605)."""
        if params:
            raise ValueError(f"the value head takes no custom_output_params, got {sorted(params)}")
        return [len(input_ids) - 1, self.ALL_GENERATED]

    def weight_names(self) -> list[str]:
        return [WEIGHT, BIAS]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight = tensors[WEIGHT].float().reshape(1, -1)
        self.bias = tensors[BIAS].float().reshape(1)

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (model dtype) -> [rows] float32 values."""
        values = torch.nn.functional.linear(selected_hidden_states.float(), self.weight, self.bias)
        return values[:, 0]
