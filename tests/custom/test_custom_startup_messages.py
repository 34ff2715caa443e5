"""Start-up errors that say how to fix them (HandlerLoadError from build_handler): weights not
found name the concrete <module_stem>.safetensors paths tried, the tensor names each searched
file holds and the closest match; a missing class lists the classes the module defines; a
wrong row count shows the shape and the expected [rows] / [rows, width]. Also which
*.safetensors files of the checkpoint count: with model.safetensors.index.json only the
files it lists, without one every *.safetensors file in the folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tapserve.coordinator.custom_outputs import build_handler
from tapserve.model.custom_output import CustomOutputError, HandlerLoadError, check_output

HIDDEN = 8
HEAD = """
import torch


class ScoreHead:
    def select_token_position(self, input_ids, params):
        return len(input_ids) - 1

    def weight_names(self):
        return [{names}]

    def load_weights(self, tensors):
        self.weight = tensors[{first}]

    def forward(self, hidden):
        return (hidden.float() @ self.weight.T){rows}
"""


def write_head(folder: Path, names: list[str], rows: str = "") -> Path:
    module = folder / "score_head.py"
    source = HEAD.format(names=", ".join(map(repr, names)), first=repr(names[0]), rows=rows)
    module.write_text(source)
    return module


def checkpoint(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def build(spec: str, model_dir: Path | None) -> object:
    return build_handler(spec, model_dir, torch.device("cpu"), torch.float32, HIDDEN)[0]


def test_weights_not_found_lists_paths_tensors_and_the_closest_name(tmp_path) -> None:
    ckpt = checkpoint(
        tmp_path / "ckpt",
        {"score_head.weight": torch.ones(2, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)},
    )
    module = write_head(tmp_path, ["scor_head.weight"])
    with pytest.raises(HandlerLoadError) as info:
        build(str(module), ckpt)
    message = str(info.value)
    assert message.startswith("custom handler weights not found: ['scor_head.weight']")
    assert (
        f"searched {ckpt / 'model.safetensors'} (2 tensors): "
        "['model.norm.weight', 'score_head.weight']" in message
    )
    beside = tmp_path / "score_head.safetensors"
    assert f"searched {beside} (<module_stem>.safetensors): no such file" in message
    assert "closest to 'scor_head.weight': 'score_head.weight'" in message
    # the file beside the module, once there, is searched and listed too
    save_file({"bias": torch.zeros(2)}, str(beside))
    with pytest.raises(HandlerLoadError) as info:
        build(str(module), ckpt)
    assert f"searched {beside} (1 tensors): ['bias']" in str(info.value)
    assert "no such file" not in str(info.value)


def test_nothing_close_and_long_lists_are_cut(tmp_path) -> None:
    tensors = {f"layer.{i:03d}.weight": torch.zeros(1) for i in range(40)}
    ckpt = checkpoint(tmp_path / "ckpt", tensors)
    with pytest.raises(HandlerLoadError) as info:
        build(str(write_head(tmp_path, ["zzz"])), ckpt)
    message = str(info.value)
    assert "(40 tensors): ['layer.000.weight'," in message and " and 10 more" in message
    assert "'layer.030.weight'" not in message
    assert "nothing close to 'zzz'" in message


def test_only_the_index_listed_files_count(tmp_path) -> None:
    """With model.safetensors.index.json, an unlisted *.safetensors file in the checkpoint is
    not searched; without an index, every *.safetensors file in the folder is."""
    ckpt = checkpoint(tmp_path / "ckpt", {"model.norm.weight": torch.ones(HIDDEN)})
    save_file({"score_head.weight": torch.ones(2, HIDDEN)}, str(ckpt / "extra.safetensors"))
    module = write_head(tmp_path, ["score_head.weight"])
    handler = build(str(module), ckpt)  # no index: extra.safetensors counts
    assert torch.equal(handler.weight, torch.ones(2, HIDDEN))
    index = {"weight_map": {"model.norm.weight": "model.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HandlerLoadError) as info:
        build(str(module), ckpt)
    assert "extra.safetensors" not in str(info.value)
    index["weight_map"]["score_head.weight"] = "extra.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(build(str(module), ckpt).weight, torch.ones(2, HIDDEN))


def test_class_not_found_lists_the_module_classes(tmp_path) -> None:
    module = write_head(tmp_path, ["w"])
    module.write_text(module.read_text() + "\n\nclass Helper:\n    pass\n")
    with pytest.raises(HandlerLoadError) as info:
        build(f"{module}:ScorHead", None)
    assert str(info.value) == (
        f"{module} has no class 'ScorHead'; the classes it defines: ['Helper', 'ScoreHead'] "
        "(did you mean 'ScoreHead'?)"
    )


def test_wrong_row_count_shows_shape_and_expected(tmp_path) -> None:
    save_file({"w": torch.ones(3, HIDDEN)}, str(tmp_path / "score_head.safetensors"))
    module = write_head(tmp_path, ["w"], rows=".repeat(2, 1)")
    expected = (
        "custom handler dry run failed: CustomOutputError: returned 2 rows for 1 selected "
        "tokens: shape [2, 3], expected [1] or [1, width]"
    )
    with pytest.raises(HandlerLoadError, match=re.escape(expected)):
        build(str(module), None)
    with pytest.raises(CustomOutputError, match=re.escape("shape [4], expected [3] or [3, width]")):
        check_output(torch.zeros(4), 3)
    with pytest.raises(CustomOutputError, match=re.escape("expected [2] or [2, width]")):
        check_output(torch.zeros(2, 3, 4), 2)
