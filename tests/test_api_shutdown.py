"""SIGTERM on the shared live server (tests/api_helpers.py, `--shutdown-timeout 2`): in-flight
requests drain (bounded by the timeout), new ones get 503, an unfinished stream ends with an
error event, and launch.py exits 0. The pool starts a fresh server for any later test."""
from __future__ import annotations

import json
import signal

import pytest

pytest.register_assert_rewrite("tests.api_helpers")
from tests.api_helpers import wait_for  # noqa: E402

pytest_plugins = ["tests.api_helpers"]

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_sigterm_drains_in_flight_and_answers_503(server, http):
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    short = {"prompt": PROMPT, "max_tokens": 1}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: http.post("/v1/completions", json=short).status_code == 503, 2)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
    assert server.proc.wait(30) == 0, server.log_tail()
