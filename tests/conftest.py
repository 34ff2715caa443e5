"""Shared pytest setup: the repo root on sys.path, one torch thread per process, and the
no-leak check that runs after every test on every engine built through
`tests.engine_helpers.make_llm` (free KV blocks == total blocks, invariants hold)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def kv_blocks_released():
    """After each test: every tracked engine is idle and holds no KV block."""
    yield
    helpers = sys.modules.get("tests.engine_helpers")  # loaded only by the engine tests
    if helpers is not None:
        helpers.check_tracked_engines()
