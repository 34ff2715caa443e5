"""A moderation head that watches every generated token and stops the sequence when it fires.

    python launch.py --custom-module examples/moderation_head.py

The head gives class probabilities [rows, 2] (`safe`, `flagged`) for every generated token
(`ALL_GENERATED`). Its `should_stop` hook ends a sequence at the first token whose `flagged`
probability is above the request's threshold, `custom_output_params = {"threshold": 0.9}`
(default 0.5; a number in [0, 1], else a 605): the sequence finishes with finish_reason
"content_filter", the flagged token's row is its last row, and the token itself (its text,
id and logprob) is never sent.

Weights come from `moderation_head.safetensors` next to this file: `moderation_head.weight`
[2, hidden] and `moderation_head.bias` [2]. The committed file fits the embedded demo model
(hidden size 64) and is written, deterministically, by

    python examples/moderation_head.py --hidden-size 64

(random weights: a stand-in for a trained classifier, enough to see the mechanics).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

try:
    from tapserve.model.custom_output import CustomOutputHandler
except ImportError:  # run as a script to write the weights file: no handler is built then
    CustomOutputHandler = object

WEIGHT, BIAS = "moderation_head.weight", "moderation_head.bias"
LABELS = ("safe", "flagged")
FLAGGED = LABELS.index("flagged")
DEFAULT_THRESHOLD = 0.5
WEIGHTS_FILE = Path(__file__).with_suffix(".safetensors")


def threshold_of(params: dict | None) -> float:
    """The request's threshold; ValueError (605 at selection) when it is not in [0, 1]."""
    params = params or {}
    unknown = set(params) - {"threshold"}
    if unknown:
        raise ValueError(f"unknown custom_output_params: {sorted(unknown)}")
    threshold = params.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return float(threshold)


class ModerationHead(CustomOutputHandler):
    labels = list(LABELS)

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [2, hidden] float32
        self.bias: torch.Tensor | None = None  # [2] float32

    def select_token_position(self, input_ids: list[int], params: dict | None) -> list[int]:
        """Every generated token; the threshold is checked here, so a bad one is a 605."""
        threshold_of(params)
        return [self.ALL_GENERATED]

    def weight_names(self) -> list[str]:
        return [WEIGHT, BIAS]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight, self.bias = tensors[WEIGHT].float(), tensors[BIAS].float()
        if self.weight.dim() != 2 or self.weight.shape[0] != len(LABELS):
            raise ValueError(f"moderation weights {tuple(self.weight.shape)} are not [2, hidden]")

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (model dtype) -> [rows, 2] float32 probabilities (safe, flagged)."""
        logits = torch.nn.functional.linear(selected_hidden_states.float(), self.weight, self.bias)
        return torch.softmax(logits, dim=-1)

    def should_stop(self, outputs: torch.Tensor, params: list[dict | None]) -> torch.Tensor:
        """forward's rows of this step's generated tokens and each row's request params ->
        bool [rows]: True ends that sequence at that token ("content_filter")."""
        thresholds = torch.tensor([threshold_of(p) for p in params], device=outputs.device)
        return outputs[:, FLAGGED] > thresholds


def make_weights(hidden_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights for a hidden size (same bytes on every machine)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(LABELS), hidden_size, generator=gen, dtype=torch.float32)
    bias = torch.randn(len(LABELS), generator=gen, dtype=torch.float32) * 0.1
    return {WEIGHT: weight / hidden_size**0.5, BIAS: bias}


def write_weights(path: str | Path = WEIGHTS_FILE, hidden_size: int = 64, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    save_file(make_weights(hidden_size, seed), str(path), metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write moderation_head.safetensors")
    parser.add_argument("--hidden-size", type=int, default=64, help="the model's hidden size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(WEIGHTS_FILE))
    args = parser.parse_args()
    print(write_weights(args.out, args.hidden_size, args.seed))
