"""A multi-class classifier head whose weights live beside this module.

    python launch.py --model DIR --custom-module examples/classifier_head.py

Weights come from `classifier_head.safetensors` next to this file (the engine looks there
after the model's own safetensors): `classifier_head.weight` [classes, hidden] and
`classifier_head.bias` [classes]. The committed file fits the embedded demo model (hidden
size 64, 4 classes) and is written, deterministically, by

    python examples/classifier_head.py --hidden-size 64 --num-classes 4

For every request it classifies one prompt token (the last by default, or
`custom_output_params["position"]`) and returns softmax probabilities: [rows, classes]
float32, so each response carries `[[p0, p1, p2, p3]]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

try:
    from tapserve.model.custom_output import CustomOutputHandler
except ImportError:  # run as a script to write the weights file: no handler is built then
    CustomOutputHandler = object

WEIGHT, BIAS = "classifier_head.weight", "classifier_head.bias"
LABELS = ("negative", "neutral", "positive", "off-topic")  # class order of the committed file
WEIGHTS_FILE = Path(__file__).with_suffix(".safetensors")


class ClassifierHead(CustomOutputHandler):
    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [classes, hidden] float32
        self.bias: torch.Tensor | None = None  # [classes] float32

    def weight_names(self) -> list[str]:
        return [WEIGHT, BIAS]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight, self.bias = tensors[WEIGHT].float(), tensors[BIAS].float()
        if self.weight.dim() != 2 or self.bias.shape != self.weight.shape[:1]:
            raise ValueError(
                f"classifier weights of shapes {tuple(self.weight.shape)} and "
                f"{tuple(self.bias.shape)} do not fit [classes, hidden] + [classes]"
            )

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (model dtype) -> [rows, classes] float32 probabilities."""
        logits = torch.nn.functional.linear(selected_hidden_states.float(), self.weight, self.bias)
        return torch.softmax(logits, dim=-1)


def make_weights(
    hidden_size: int, num_classes: int = len(LABELS), seed: int = 0
) -> dict[str, torch.Tensor]:
    """Deterministic weights for a hidden size (same bytes on every machine)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_classes, hidden_size, generator=gen, dtype=torch.float32)
    bias = torch.randn(num_classes, generator=gen, dtype=torch.float32) * 0.1
    return {WEIGHT: weight / hidden_size**0.5, BIAS: bias}


def write_weights(
    path: str | Path = WEIGHTS_FILE,
    hidden_size: int = 64,
    num_classes: int = len(LABELS),
    seed: int = 0,
) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    save_file(make_weights(hidden_size, num_classes, seed), str(path), metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write classifier_head.safetensors")
    parser.add_argument("--hidden-size", type=int, default=64, help="the model's hidden size")
    parser.add_argument("--num-classes", type=int, default=len(LABELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(WEIGHTS_FILE))
    args = parser.parse_args()
    print(write_weights(args.out, args.hidden_size, args.num_classes, args.seed))
