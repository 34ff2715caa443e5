"""SIGTERM on the shared live server (tests/helpers/api.py, `--shutdown-timeout 2`): in-flight
requests drain (bounded by the timeout), new ones get 503, an unfinished stream ends with an
error event, and launch.py exits 0. The pool starts a fresh server for any later test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers import wait_for  # noqa: E402
from tests.helpers.procs import exited  # noqa: E402

pytest_plugins = ["tests.helpers.api"]

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_sigterm_drains_in_flight_and_answers_503(server, http):
    # 8 choices of 2,000 tokens: more than the 2 s drain can finish on an idle fast machine
    # (one choice of 1,500 tokens sometimes finished, and the stream ended on [DONE])
    body = {"prompt": PROMPT, "max_tokens": 2000, "n": 8, "ignore_eos": True, "stream": True}
    short = {"prompt": PROMPT, "max_tokens": 1}

    def refused() -> bool:  # (once the 2 s drain is over, the server is gone)
        return http.post("/v1/completions", json=short).status_code == 503

    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_for(refused, 2, interval=0.02), server.log_tail()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
    assert server.proc.wait(30) == 0, server.log_tail()


def test_a_second_signal_ends_the_drain_at_once():
    """As uvicorn and vLLM: the first SIGINT drains (here for up to 120 s), a second one stops
    now; the stream still gets its one final answer, an error event. (Under a launcher, which
    forwards signals, only a second signal a second or more after the first counts.)"""
    from tests.helpers.api import LiveServer

    server = LiveServer("--shutdown-timeout", "120")
    try:
        import httpx

        with httpx.Client(base_url=server.url, timeout=60) as http:
            limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
            body = {
                "prompt": PROMPT,
                "max_tokens": limit - 32,
                "ignore_eos": True,
                "stream": True,
            }  # as long as the context allows: still running then
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                server.proc.send_signal(signal.SIGINT)
                # no launcher here: no gap needed, but the first must have been handled (two
                # signals pending at once are one to Python)
                assert wait_for(lambda: "draining for up to" in server.log_tail(), 60)
                server.proc.send_signal(signal.SIGINT)
                start = time.monotonic()
                rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
        assert server.proc.wait(30) == 0, server.log_tail()
        assert time.monotonic() - start < 20, "the drain ran on after the second signal"
        assert "again: stopping now" in server.log_tail()
    finally:
        server.stop()


@contextlib.contextmanager
def _open_stream(*server_args: str):
    """A fresh server with one stream open that no drain can finish (its first event read):
    yields the server, an HTTP client, the API process's pid and the stream's lines."""
    import httpx

    from tests.helpers.api import LiveServer
    from tests.helpers.procs import api_pid

    server = LiveServer(*server_args)
    body = {"prompt": PROMPT, "max_tokens": 2000, "n": 8, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(lines)
            yield server, http, api_pid(server.proc.pid), lines
    finally:
        server.stop()


def test_sigterm_to_the_api_process_drains_as_one_to_the_launcher():
    """systemd's default KillMode signals every process of a unit, the API process too. Its
    SIGTERM goes to rank 0 as a drain request: the API keeps answering (503 to new requests,
    past uvicorn's own 5 s), the stream runs until --shutdown-timeout and ends with the error
    event, and launch.py exits 0 (it used to be uvicorn's shutdown: new connections refused,
    the stream cut after 5 s, and rank 0 exiting 1 on the API process's exit)."""
    with _open_stream("--shutdown-timeout", "8") as (server, http, api, lines):
        os.kill(api, signal.SIGTERM)
        start = time.monotonic()
        time.sleep(5.5)  # past uvicorn's 5 s, 2.5 s before the drain ends
        short = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        rest = [line[6:] for line in lines if line.startswith("data: ")]
        ended = time.monotonic() - start
        assert short.status_code == 503, short.text
        assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
        assert 7 < ended < 20, ended  # the drain's 8 s, not uvicorn's 5
        assert server.proc.wait(30) == 0, server.log_tail()
        assert "the API process got signal 15" in server.log_tail()


def test_sigterm_to_every_process_at_once_is_one_signal():
    """The launcher and the API process signalled together (systemd, again): one drain, not a
    signal and its repeat; a later SIGTERM to the API process ends the drain at once."""
    with _open_stream("--shutdown-timeout", "120") as (server, http, api, lines):
        server.proc.send_signal(signal.SIGTERM)
        os.kill(api, signal.SIGTERM)
        start, events_late = time.monotonic(), 0
        for line in lines:
            if not line.startswith("data: "):
                continue
            if time.monotonic() - start > 2:
                events_late += 1
                if events_late == 1:  # still streaming after 2 s: a drain
                    os.kill(api, signal.SIGTERM)
            last = line
        stopped = time.monotonic() - start
        assert events_late > 1, server.log_tail()
        assert json.loads(last[6:])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
        assert stopped < 30, stopped
        assert server.proc.wait(30) == 0, server.log_tail()
        assert server.log_tail(20000).count("again: stopping now") == 1, server.log_tail()


def test_api_signalled_first_then_the_launcher_is_one_signal():
    """The same two signals in the other order (the API process's first, launch.py's 0.2 s
    later, no launcher above rank 0): one drain, not a signal and its repeat."""
    with _open_stream("--shutdown-timeout", "4") as (server, http, api, lines):
        os.kill(api, signal.SIGTERM)
        time.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
        drained = time.monotonic() - start
        assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
        assert server.proc.wait(30) == 0, server.log_tail()
        assert drained > 3, (drained, server.log_tail())  # the drain's 4 s, not stopped now
        assert "again: stopping now" not in server.log_tail(20000)


def test_signals_together_while_rank0_is_busy_are_one_signal():
    """The launcher and the API process signalled together while rank 0 is in a long step
    (held here with SIGSTOP for 1.5 s just after its own handler ran): the API's drain
    request, read after the step, came with the first signal and is not its repeat (it used
    to be timed when read: "again: stopping now", the requests in flight aborted)."""
    with _open_stream("--shutdown-timeout", "4") as (server, http, api, lines):
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(api, signal.SIGTERM)
            time.sleep(1.5)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
        drained = time.monotonic() - start
        assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
        assert server.proc.wait(30) == 0, server.log_tail()
        assert drained > 3.5, (drained, server.log_tail())  # the drain's 4 s
        assert "again: stopping now" not in server.log_tail(20000)


def test_a_wedged_rank0_cannot_hold_the_api_process():
    """Rank 0 stopped (SIGSTOP) never answers the drain request: a repeated SIGTERM, the
    engine silent for 3 s, stops the API process itself (it used to serve on for ever), and
    the open stream gets its final answer, the 503 error event, at once. Rank 0, going on,
    finds the API process stopped during the drain (or its repeated signal) and exits 0."""
    with _open_stream() as (server, http, api, lines):
        rank0 = server.proc.pid
        os.kill(rank0, signal.SIGSTOP)
        try:
            os.kill(api, signal.SIGTERM)
            time.sleep(4)  # the engine silent for 3 s since this signal, with 1 s to spare
            assert not exited(api), "the first signal went to rank 0: the API serves on"
            os.kill(api, signal.SIGTERM)
            start = time.monotonic()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
            # at once: no engine answers it (10 s leaves room for a loaded machine)
            assert time.monotonic() - start < 10, "the stream was not answered at once"
            assert json.loads(rest[-1])["error"]["code"] == "503_SERVICE_UNAVAILABLE"
            assert wait_for(lambda: exited(api), 15), server.log_tail()
            assert "the engine has been silent" in server.log_tail()
        finally:
            os.kill(rank0, signal.SIGCONT)
        assert server.proc.wait(30) == 0, server.log_tail()
        # rank 0 finds the API process gone during the drain or, when it reads the API's
        # repeated drain request first (where SIGSTOP held it decides), stops at once on it
        tail = server.log_tail()
        assert "stopped during the drain" in tail or "again: stopping now" in tail, tail


@contextlib.contextmanager
def _api_starting():
    """launch.py whose API process has just been spawned (it has not connected yet): yields
    the server and the API process's pid."""
    from tests.helpers.api import LiveServer
    from tests.helpers.procs import api_pid

    server = LiveServer(wait_ready=False)
    found: list[int] = []

    def spawned() -> bool:
        with contextlib.suppress(RuntimeError, OSError):
            found.append(api_pid(server.proc.pid))
        return bool(found) or server.proc.poll() is not None

    try:
        assert wait_for(spawned, 180, interval=0.01) and found, server.log_tail()
        yield server, found[0]
    finally:
        server.stop()


def test_a_signal_while_the_api_process_starts_stops_cleanly():
    """SIGTERM to the API process before it takes signals (its imports): the launcher
    stops with 0, a stop that was asked for (it was 1, an API failure)."""
    with _api_starting() as (server, api):
        os.kill(api, signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log_tail()
        assert "stopped by signal 15" in server.log_tail()


def test_rank0_stopping_before_the_api_process_connects_does_not_wait_for_it():
    """Rank 0 stops while its API process has not connected (held here with SIGSTOP): the
    final Shutdown cannot reach it, so rank 0 stops it after its 2 s flush instead of
    waiting 10 s for an exit that never comes (and killing it then)."""
    with _api_starting() as (server, api):
        os.kill(api, signal.SIGSTOP)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log_tail()
        assert time.monotonic() - start < 9, server.log_tail()  # 2 s, not 10
        assert "has not connected; stopping it" in server.log_tail()
