"""A handler's `labels`: one name for a [rows] output, one per column of a [rows, width]
output, checked against the dry run at start-up (build_handler, and the offline LLM that
builds it); the demo head names its two columns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tapserve.coordinator.custom_outputs import build_handler
from tapserve.model.custom_output import HandlerLoadError
from tapserve.model.demo import DemoHead

HIDDEN = 8
HEAD = """
import torch


class LabelledHead:
    labels = {labels!r}

    def select_token_position(self, input_ids, params):
        return len(input_ids) - 1

    def forward(self, hidden):
        return torch.zeros({shape}, dtype=torch.float32)
"""


def build(tmp_path: Path, labels: object, shape: str) -> object:
    module = tmp_path / "labelled_head.py"
    module.write_text(HEAD.format(labels=labels, shape=shape))
    return build_handler(str(module), None, torch.device("cpu"), torch.float32, HIDDEN)[0]


@pytest.mark.parametrize(
    "labels, shape",
    [
        (["yes", "no", "maybe"], "hidden.shape[0], 3"),
        (("yes", "no"), "hidden.shape[0], 2"),
        ("reward", "hidden.shape[0]"),
        (None, "hidden.shape[0], 4"),
    ],
)
def test_labels_that_fit_the_output(tmp_path, labels, shape) -> None:
    assert build(tmp_path, labels, shape).labels == labels


@pytest.mark.parametrize(
    "labels, shape, message",
    [
        (
            ["yes", "no"],
            "hidden.shape[0], 3",
            "custom handler LabelledHead.labels names 2 columns, but its output (the dry "
            "run's) is [rows, 3]: ['yes', 'no']",
        ),
        (
            "reward",
            "hidden.shape[0], 2",
            "custom handler LabelledHead.labels must be a list of 2 distinct nonempty names "
            "for its [rows, 2] output, got 'reward'",
        ),
        (
            ["a", "a"],
            "hidden.shape[0], 2",
            "custom handler LabelledHead.labels must be a list of 2 distinct nonempty names "
            "for its [rows, 2] output, got ['a', 'a']",
        ),
        (
            ["reward"],
            "hidden.shape[0]",
            "custom handler LabelledHead.labels must be one nonempty name (a str) for its "
            "[rows] output, got ['reward']",
        ),
        (
            ["a", 3],
            "hidden.shape[0], 2",
            "custom handler LabelledHead.labels must be a list of 2 distinct nonempty names "
            "for its [rows, 2] output, got ['a', 3]",
        ),
    ],
)
def test_labels_that_do_not_fit_stop_the_start(tmp_path, labels, shape, message) -> None:
    with pytest.raises(HandlerLoadError) as info:
        build(tmp_path, labels, shape)
    assert str(info.value) == message


def test_demo_head_names_its_columns() -> None:
    assert DemoHead.labels == ("LABEL_0", "LABEL_1")


def test_offline_llm_checks_labels_at_start(tmp_path, monkeypatch) -> None:
    """The offline LLM builds its handler as the server does: a mismatch stops it."""
    from tapserve.coordinator import offline as offline_module
    from tapserve.coordinator.config import EngineConfig

    module = tmp_path / "wrong_labels.py"
    module.write_text(
        "from tapserve.model.demo import DemoHead\n\n\n"
        "class WrongLabels(DemoHead):\n    labels = ('only_one',)\n"
    )
    monkeypatch.setattr(offline_module, "_load_tokenizer", lambda config: None, raising=False)
    with pytest.raises(HandlerLoadError, match=r"names 1 columns, but its output .* \[rows, 2\]"):
        offline_module.LLM(EngineConfig(custom_module=f"{module}:WrongLabels", device="cpu"))
