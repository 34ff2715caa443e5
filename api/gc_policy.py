"""The garbage collector's settings for a serving process (the API process, every rank).

What exists once start-up is over (modules, the model's and tokenizer's objects) lives until
the process ends: `gc.freeze()` moves it out of every later collection. Collections of the
young generation then wait for 100,000 new container objects instead of 700: a request's
tokens and outputs make many short-lived objects, and each collection walks them all.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 100_000


def settle_after_startup() -> None:
    """Freeze what start-up made and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
