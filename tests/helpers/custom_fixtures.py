"""Module-scoped fixtures shared by the custom-output test modules (import them by name):
a tiny Qwen3 checkpoint with the probe head's weights, the transformers reference, engines
with and without the handler, and TF32 off for float32 comparisons on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.custom import Reference, make_head_checkpoint, make_llm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_head_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> Reference:
    return Reference(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt: Path):
    return make_llm(ckpt)


@pytest.fixture(scope="module")
def plain_llm(ckpt: Path):
    return make_llm(ckpt, custom_module=None)


@pytest.fixture(scope="module")
def no_tf32():
    """float32 matmuls in full precision on CUDA for the module's tests (restored after)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
