"""Shared pytest setup: one torch thread per process, and the
no-leak check that runs after every test on every engine built through
`tests.helpers.engine.make_llm` (free KV blocks == total blocks, invariants hold)."""

from __future__ import annotations

import sys

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def kv_blocks_released():
    """After each test: every tracked engine is idle and holds no KV block."""
    yield
    helpers = sys.modules.get("tests.helpers.engine")  # loaded only by the engine tests
    if helpers is not None:
        helpers.check_tracked_engines()
