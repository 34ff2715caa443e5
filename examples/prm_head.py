"""A process-reward head: a score for every reasoning step, in the prompt's one prefill.

    python launch.py --model DIR --custom-module examples/prm_head.py

Each step of a solution ends with a separator token, whose id the request names:
`custom_output_params = {"step_separator": 198}`. The selector returns every prompt position
holding that id (a multi-row selection), and the head scores each one: the softmax probability
that the step ending there is good, from a linear `[hidden -> 2]` head (columns: bad, good),
as process-reward models such as Qwen2.5-Math-PRM read theirs. The answer holds one float32
per step ([k]) with `custom_output_positions`, the separators' positions; a prompt without the
separator has no custom output.

The checkpoint's safetensors must hold `prm_head.weight` ([2, hidden]) and `prm_head.bias`
([2]); the model loader ignores them, and this handler fetches them by name on rank 0.
Score a whole solution without generating: `max_tokens` 0, or the native `/custom_output`.
"""

from __future__ import annotations

import torch

from tapserve.model.custom_output import CustomOutputHandler

WEIGHT, BIAS = "prm_head.weight", "prm_head.bias"
GOOD = 1  # the column holding the "good step" logit


class PrmHead(CustomOutputHandler):
    labels = "good_step_probability"

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [2, hidden] float32
        self.bias: torch.Tensor | None = None  # [2] float32

    def select_token_position(self, input_ids: list[int], params: dict | None) -> list[int]:
        """Every position whose token is `params["step_separator"]`; [] when there is none.
        Missing, unknown or malformed params are a ValueError (605)."""
        params = params or {}
        unknown = set(params) - {"step_separator"}
        if unknown:
            raise ValueError(f"unknown custom_output_params: {sorted(unknown)}")
        separator = params.get("step_separator")
        if separator is None:
            raise ValueError("step_separator (the token id that ends each step) is required")
        if not isinstance(separator, int) or isinstance(separator, bool) or separator < 0:
            raise ValueError(f"step_separator must be a token id (an int >= 0), got {separator!r}")
        return [i for i, token in enumerate(input_ids) if token == separator]

    def weight_names(self) -> list[str]:
        return [WEIGHT, BIAS]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight, self.bias = tensors[WEIGHT].float(), tensors[BIAS].float()
        if self.weight.dim() != 2 or self.weight.shape[0] != 2 or self.bias.shape != (2,):
            raise ValueError(
                f"PRM weights of shapes {tuple(self.weight.shape)} and {tuple(self.bias.shape)} "
                "do not fit [2, hidden] + [2]"
            )

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (model dtype) -> [rows] float32: P(good) of each step."""
        logits = torch.nn.functional.linear(selected_hidden_states.float(), self.weight, self.bias)
        return torch.softmax(logits, dim=-1)[:, GOOD]
