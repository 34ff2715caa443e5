"""Handler failures the operator sees, on a live server (`python launch.py`, CPU, demo model)
with a head whose selector reads `params["position"]`: a client's typo (`{"pos": 3}`) is a
KeyError, so a 606 / HTTP 500 whose traceback lands in the server's log (rate-limited per
kind) and `tapserve_custom_output_selector_failures_total{code="606"}` moves by exactly the
failures made; a selector ValueError is a 605 / HTTP 400 counted under code="605" (logged at
debug level only); a failing forward() moves `tapserve_custom_output_errors_total` and logs
its own traceback."""

from __future__ import annotations

import re
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tapserve.coordinator.handler_failures import LOG_INTERVAL_SECONDS  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.helpers.api import LiveServer  # noqa: E402

STRICT_HEAD = '''
from tapserve.model.demo import DemoHead


class StrictHead(DemoHead):
    """The demo head with a strict selector: params["position"], a KeyError on a typo."""

    def select_token_position(self, input_ids, params):
        if params is None:
            return len(input_ids) - 1
        if params.get("explode") == "forward":
            self.explode = True
            return len(input_ids) - 1
        position = params["position"]  # KeyError on {"pos": 3}: a handler bug, 606
        if not isinstance(position, int):
            raise ValueError(f"position must be an int, got {position!r}")
        return position

    def forward(self, hidden):
        if getattr(self, "explode", False):
            self.explode = False
            raise RuntimeError("forward exploded on purpose")
        return super().forward(hidden)
'''


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    module = tmp_path_factory.mktemp("strict-head") / "strict_head.py"
    module.write_text(STRICT_HEAD)
    server = LiveServer("--custom-module", f"{module}:StrictHead", "--log-level", "debug")
    yield server
    assert server.stop() == 0


def selector_failures(server: LiveServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(
        r'^tapserve_custom_output_selector_failures_total\{code="(\d+)"\} (\S+)$', text, re.M
    )
    return {code: float(value) for code, value in found}


def forward_failures(server: LiveServer) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^tapserve_custom_output_errors_total (\S+)$", text, re.M).group(1))


def complete(server: LiveServer, params: dict) -> httpx.Response:
    body = {"model": "tapserve-demo", "prompt": "Hi there", "max_tokens": 2}
    return httpx.post(
        server.url + "/v1/completions",
        json={**body, "custom_output_params": params},
        timeout=60,
    )


def server_log(server: LiveServer) -> str:
    with open(server.log.name, errors="replace") as f:
        return f.read()


def test_a_selector_typo_is_a_logged_and_counted_606(strict_server):
    before = selector_failures(strict_server)
    start = time.monotonic()
    r = complete(strict_server, {"pos": 3})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "606_EXECUTION_EXCEPTION"
    assert "KeyError" in r.json()["error"]["message"]
    # its traceback, with the handler's own line, in the server's log
    assert wait_for(lambda: "KeyError: 'position'" in server_log(strict_server), 30)
    log = server_log(strict_server)
    assert "606 custom output selection failed: KeyError" in log
    assert "Traceback (most recent call last)" in log
    assert 'position = params["position"]' in log
    # two more within the rate limit's window: counted, no second traceback yet
    for _ in range(2):
        assert complete(strict_server, {"pos": 3}).status_code == 500
    within_window = time.monotonic() - start < LOG_INTERVAL_SECONDS
    expected = before.get("606", 0) + 3
    assert wait_for(lambda: selector_failures(strict_server).get("606") == expected, 30)
    assert selector_failures(strict_server).get("605") == before.get("605", 0)
    if within_window:  # (else the third may have its own traceback)
        assert server_log(strict_server).count("custom output selection failed: KeyError") == 1
    # and the server serves on
    ok = complete(strict_server, {"position": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["extra_outputs"]["custom_output"]


def test_a_selector_value_error_is_a_605_counted_apart(strict_server):
    before = selector_failures(strict_server)
    for _ in range(2):
        r = complete(strict_server, {"position": "3"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "605_INVALID_PARAMS"
        assert r.json()["error"]["param"] == "custom_output_params"
    expected = {"605": before.get("605", 0) + 2, "606": before.get("606", 0)}
    assert wait_for(lambda: selector_failures(strict_server) == expected, 30)
    assert wait_for(lambda: "position must be an int" in server_log(strict_server), 30)
    # a position outside the prompt is the engine's check, not a selector failure
    assert complete(strict_server, {"position": 99}).status_code == 400
    assert not wait_for(lambda: selector_failures(strict_server) != expected, 2.5)


def test_a_forward_failure_is_logged_and_counted_as_a_handler_failure(strict_server):
    before, selectors = forward_failures(strict_server), selector_failures(strict_server)
    r = complete(strict_server, {"explode": "forward"})
    assert r.status_code == 500 and "forward exploded on purpose" in r.text
    assert wait_for(lambda: forward_failures(strict_server) == before + 1, 30)
    assert selector_failures(strict_server) == selectors
    assert wait_for(
        lambda: "RuntimeError: forward exploded on purpose" in server_log(strict_server), 30
    )
    assert "custom output processor failed on 1 rows" in server_log(strict_server)
