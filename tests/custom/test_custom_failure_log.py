"""Rank 0's log of handler failures (coordinator/handler_failures.py, CustomOutputStats): a
606 is logged with its traceback, at most once per kind per interval, the ones held back
counted in the next; a selector's 605 at debug level; the counters behind /metrics."""

from __future__ import annotations

import logging

import pytest

from tapserve.api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS
from tapserve.coordinator.custom_outputs import (
    CustomOutputStats,
    RequestError,
    select_position,
)
from tapserve.coordinator.handler_failures import FailureLog

LOGGER = "tapserve.coordinator.custom_output"


class TypoSelector:
    def select_token_position(self, input_ids, params):
        if params.get("position") == "bad":
            raise ValueError("position must be an int")
        return params["position"]

    def forward(self, rows):
        return rows


def refusal(params: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        select_position(TypoSelector(), [1, 2, 3], params, 4)
    return info.value


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_traceback_per_kind_per_interval(caplog) -> None:
    clock = Clock()
    failures = FailureLog(interval=10.0, clock=clock)
    caplog.set_level(logging.ERROR, LOGGER)
    error = refusal({"pos": 3}).selector_error
    assert isinstance(error, KeyError)
    assert failures.failed("selector", "first", error)
    assert failures.failed("forward", "a forward failure", RuntimeError("x"))  # its own window
    clock.now += 9.9
    assert not failures.failed("selector", "held back", error)
    assert not failures.failed("selector", "held back", error)
    clock.now += 0.1
    assert failures.failed("selector", "second", error)
    records = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert records == [
        ("first", True),
        ("a forward failure", True),
        ("second (2 more selector failures since the last traceback, not logged)", True),
    ]
    assert "KeyError: 'position'" in caplog.text
    assert 'return params["position"]' in caplog.text  # the selector's own line


def test_selector_failures_are_counted_by_code_and_logged(caplog) -> None:
    stats = CustomOutputStats()
    caplog.set_level(logging.DEBUG, LOGGER)
    typo, bad = refusal({"pos": 3}), refusal({"position": "bad"})
    assert (typo.code, bad.code) == (EXECUTION_EXCEPTION, INVALID_PARAMS)
    stats.selector_failed("r1", typo)
    stats.selector_failed("r2", bad)
    stats.selector_failed("r3", bad)
    assert (stats.selector_errors, stats.selector_invalid, stats.errors) == (1, 2, 0)
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [
        (logging.ERROR, "request r1"),
        (logging.DEBUG, "request r2"),
        (logging.DEBUG, "request r3"),
    ]
    # out-of-range positions are the engine's check: no selector error attached
    assert refusal({"position": 7}).selector_error is None
