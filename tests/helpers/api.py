"""Helpers and shared fixtures for tests/test_api_*.py (loaded with
`pytest_plugins = ["tests.helpers.api"]`, so all API test modules of a pytest process share
one live server).

The server is the real one: `python launch.py --port 0 ...` (CPU, embedded demo model) in a
subprocess, its port read from its log, ready when /health answers; it runs with an API key,
`--max-queued-requests 0` (so the 257th concurrent request gets 503 with the default 256
running sequences), `--shutdown-timeout 2`, and `CrashyHead`: the demo head (same values)
that fails on request.
A test that stops the server leaves the pool to start a fresh one for the next test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port free now. Another process may take it before a server binds it: a server that
    can, should start with `--port 0` and be found by `port_from_log`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python launch.py --port 0 --device DEVICE *args` in its own session; logs to a temp
    file. Ready (/health answers) when built, unless wait_ready is False."""

    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        startup_timeout: float = 180.0,
        device: str = "cpu",
        wait_ready: bool = True,
    ):
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="tapserve-api-test-", suffix=".log", delete=False
        )
        self._port: int | None = None
        self._startup_timeout = startup_timeout
        # --port 0: the API process binds a port of the kernel's choice and logs it (a port
        # picked here and bound seconds later could be taken meanwhile by a parallel test)
        argv = [sys.executable, "launch.py", "--port", "0", "--device", device, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("TAPSERVE_API_KEY", None)
        if api_key:  # as the docs advise: off every command line
            env["TAPSERVE_API_KEY"] = api_key
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        if wait_ready:
            self._wait_ready(startup_timeout)

    @property
    def port(self) -> int:
        """The port the API process listens on (waits for its log line the first time)."""
        if self._port is None:
            self._port = port_from_log(Path(self.log.name), self.proc, self._startup_timeout)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            url = self.url
        except RuntimeError:
            self.stop()
            raise
        state = wait_healthy(url, self.proc, max(deadline - time.monotonic(), 1.0))
        if state == "exited":
            raise RuntimeError(f"launch.py exited with {self.proc.returncode}:\n{self.log_tail()}")
        if state == "timeout":
            self.stop()
            raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL the process group if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.returncode == 0:  # a clean stop: nothing left to debug in its log
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def port_from_log(log: Path, proc: subprocess.Popen, timeout: float) -> int:
    """The port of the API process's "API listening on http://127.0.0.1:PORT" line in `log`
    (a server started with --port 0); RuntimeError if proc exits or the line never comes."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(
            r"API listening on http://127\.0\.0\.1:(\d+)", log.read_text("utf-8", "replace")
        )
        if found:
            return int(found[1])
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"launch.py exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"no 'API listening on' line after {timeout} s:\n{tail}")
        time.sleep(0.1)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, interval: float = 0.3) -> str:
    """Poll `url`/health until it answers 200: "healthy", "exited" (proc ended first) or
    "timeout"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return "healthy"
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return "timeout"


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (the raw strings)."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def sse_json(events: list[str]) -> list[dict]:
    return [json.loads(e) for e in events if e != "[DONE]"]


def metric(server: LiveServer, name: str) -> float:
    """One unlabelled sample of /metrics."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def requests_total(server: LiveServer, status: str, endpoint: str = '[^"]*') -> float:
    """tapserve_requests_total of one status, summed over endpoints (or of one endpoint)."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return sum(
        float(v)
        for v in re.findall(
            rf'tapserve_requests_total{{(?=[^}}]*endpoint="{endpoint}")[^}}]*status="{status}"'
            rf"[^}}]*}} (\S+)",
            text,
        )
    )


# ---- shared fixtures -------------------------------------------------------------------------
API_KEY = "test-key-1234"
CRASHY_HEAD = '''
from tapserve.model.demo import DemoHead


class CrashyHead(DemoHead):
    """DemoHead that fails on request: {"crash": "select"} raises in the selector (606 before
    the stream opens), {"crash": "forward"} makes the next forward call raise (606 after)."""

    def __init__(self):
        super().__init__()
        self.fail_next_forward = False

    def select_token_position(self, input_ids, params):
        crash = (params or {}).get("crash")
        if crash == "select":
            raise RuntimeError("selector exploded")
        if crash == "forward":
            self.fail_next_forward = True
            params = None
        return super().select_token_position(input_ids, params)

    def forward(self, hidden):
        if self.fail_next_forward:
            self.fail_next_forward = False
            raise RuntimeError("head exploded")
        return super().forward(hidden)
'''


class ServerPool:
    """One live server at a time; `get()` starts a new one if the last has exited."""

    def __init__(self, head_dir: Path):
        module = head_dir / "crashy_head.py"
        module.write_text(CRASHY_HEAD)
        self.args = (
            "--custom-module",
            f"{module}:CrashyHead",
            "--max-queued-requests",
            "0",
            "--shutdown-timeout",
            "2",
        )
        self.current: LiveServer | None = None

    def get(self) -> LiveServer:
        if self.current is None or self.current.proc.poll() is not None:
            self.current = LiveServer(*self.args, api_key=API_KEY)
        return self.current

    def close(self) -> int | None:
        return self.current.stop() if self.current is not None else None


@pytest.fixture(scope="session")
def api_pool(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("api-head"))
    yield pool
    running = pool.current is not None and pool.current.proc.poll() is None
    code = pool.close()
    assert not running or code == 0, f"launch.py exited with {code} on SIGTERM"


@pytest.fixture
def server(api_pool) -> LiveServer:
    return api_pool.get()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline():
    """The offline engine (coordinator.offline.LLM) with the demo head, for expected values;
    prompts are token ids, so its transformers tokenizer (seconds to load) is skipped."""
    from unittest import mock

    from tapserve.coordinator import offline as offline_module
    from tapserve.coordinator.config import EngineConfig

    with mock.patch.object(offline_module, "_load_tokenizer", lambda config: None, create=True):
        return offline_module.LLM(
            EngineConfig(custom_module="tapserve.model.demo:DemoHead", device="cpu")
        )
