"""A smaller run of bench/load_test.py (the full one: 2,000 requests at 256 concurrent,
recorded in docs/reliability.md)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_load_nothing_lost():
    from tapserve.bench.load_test import run

    summary = run(requests=300, concurrency=64)
    assert summary["ok"], summary
    assert summary["failed"] == 0 and summary["kv_blocks_used_at_end"] == 0
