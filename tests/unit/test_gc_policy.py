"""api/gc_policy.py in a fresh process: what start-up made is frozen out of collections, and
the young generation is collected after YOUNG_THRESHOLD new objects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, json
from tapserve.api.gc_policy import YOUNG_THRESHOLD, settle_after_startup
before = gc.get_freeze_count()
settle_after_startup()
print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()[0], YOUNG_THRESHOLD]))
"""


def test_settle_after_startup_freezes_and_raises_the_threshold() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import tests" + SCRIPT],  # (tests binds tapserve to the checkout)
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    before, frozen, threshold, wanted = json.loads(out)
    assert before == 0 and frozen > 1000  # (the interpreter's and tapserve's objects)
    assert threshold == wanted == 100_000
