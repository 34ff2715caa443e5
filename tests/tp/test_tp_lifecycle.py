"""Life cycle of a 2-rank group on CPU (gloo), serving for real, started by torchrun and by
`launch.py --nproc-per-node 2`: heartbeats keep an idle pair healthy, a dead rank takes the
group down within 30 s (streams in flight end with an error event), SIGTERM ends every rank
(under torchrun too, streams in flight finish while new requests get 503)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tapserve.ranks.local_group import STORE_ENV
from tests.helpers import wait_for
from tests.helpers.api import port_from_log, wait_healthy
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.procs import descendants, exited

ROOT = Path(__file__).resolve().parents[2]


class TorchrunServer:
    """A 2-rank CPU group serving HTTP: under torchrun, or (local=True) started by
    `launch.py --nproc-per-node 2` (ranks/local_group.py)."""

    def __init__(self, model: Path, tmp: Path, local: bool = False, shutdown_timeout: int = 2):
        self.local = local
        self.log = open(tmp / "torchrun.log", "w+")
        launcher = (
            ["launch.py", "--nproc-per-node", "2"]
            if local
            else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py"]
        )
        cmd = [
            sys.executable,
            *launcher,
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            "0",  # the API process logs the port it got (none can be taken meanwhile)
            "--shutdown-timeout",
            str(shutdown_timeout),
            "--custom-module",
            "none",
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        try:
            self.port = port_from_log(Path(self.log.name), self.proc, 180)
        except RuntimeError:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.url = f"http://127.0.0.1:{self.port}"
        state = wait_healthy(self.url, self.proc, 180, interval=0.5)
        assert state != "exited", self.tail()
        assert state == "healthy", "torchrun group not healthy:\n" + self.tail()

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def rank_pid(self, rank: int) -> int:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().split()
            except OSError:
                continue
            if int(stat[3]) == self.proc.pid and f"RANK={rank}".encode() in env:
                return int(pid)
        raise AssertionError(f"rank {rank} not found")

    def complete(self) -> tuple[int, dict]:
        r = httpx.post(
            self.url + "/v1/completions",
            timeout=60,
            json={"model": "ckpt", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
        )
        return r.status_code, r.json()

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return rc, time.monotonic() - start


@pytest.fixture(params=["torchrun", "local"])
def server(tmp_path, request):
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True),
        tmp_path,
        local=request.param == "local",
    )
    yield server
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)


def test_idle_pair_stays_healthy_then_dead_rank_ends_group(server):
    status, body = server.complete()
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    time.sleep(4.5)  # several heartbeat periods with no work
    status, _ = server.complete()
    assert status == 200 and server.proc.poll() is None
    os.kill(server.rank_pid(1), signal.SIGKILL)
    rc, waited = server.wait_exit(30)
    assert rc != 0 and waited < 30, server.tail()


def test_sigterm_ends_every_rank_when_idle(server):
    ranks = [server.rank_pid(0), server.rank_pid(1)]
    server.proc.send_signal(signal.SIGTERM)
    _, waited = server.wait_exit(25)  # (a rank waiting on its peer would take 30 s)
    assert waited < 25, server.tail()
    assert wait_for(lambda: all(exited(pid) for pid in ranks), 30), server.tail()


def test_killed_launcher_takes_the_group_down(server):
    """SIGKILL of torchrun's agent (or of the local launcher): rank 0 sees its parent change,
    stops the group and the API process, so no orphan keeps serving (or holding the port)."""
    group = descendants(server.proc.pid)
    assert len(group) >= 3, group  # two ranks and the API process
    store = next(
        (
            line.split(b"=", 1)[1].decode()
            for line in Path(f"/proc/{server.rank_pid(0)}/environ").read_bytes().split(b"\0")
            if line.startswith(STORE_ENV.encode() + b"=")
        ),
        None,
    )
    assert (store is not None) == server.local
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in group):
        time.sleep(0.2)
    alive = [p for p in group if Path(f"/proc/{p}").exists()]
    for pid in alive:  # do not leak them into the rest of the run
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"still running after the launcher died: {alive}"
    # the local launcher's 0700 group directory: rank 0 removes it in the launcher's stead
    assert store is None or not Path(store).parent.exists(), store


def test_local_group_killed_rank0_leaves_no_ipc_directory(tmp_path):
    """Under `launch.py --nproc-per-node`, rank 0's 0700 ipc directory lives in the launcher's
    group directory, which the launcher removes even when rank 0 is SIGKILLed."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True), tmp_path, local=True
    )
    try:
        rank0 = server.rank_pid(0)
        env = Path(f"/proc/{rank0}/environ").read_bytes().split(b"\0")
        store = next(e for e in env if e.startswith(b"TAPSERVE_STORE_FILE=")).split(b"=", 1)[1]
        group_dir = Path(store.decode()).parent
        assert [p.name for p in group_dir.iterdir() if p.name.startswith("tapserve-")]
        group = descendants(server.proc.pid)  # both ranks and the API process
        os.kill(rank0, signal.SIGKILL)
        rc, waited = server.wait_exit(30)
        assert rc != 0 and waited < 30, server.tail()
        assert not group_dir.exists()
        assert wait_for(lambda: all(exited(p) for p in group), 60, interval=0.2), [
            p for p in group if not exited(p)
        ]  # orphans left
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)


class Stream:
    """One streaming greedy completion read on a thread: `started` once its first chunk came;
    `result()` is (its SSE payloads, the transport error that cut it or None)."""

    def __init__(self, url: str, first_id: int, max_tokens: int):
        import threading

        self.started = threading.Event()
        self.events: list[str] = []
        self.error: Exception | None = None
        body = {
            "model": "ckpt",
            "prompt": [1, 2, first_id],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        self.started.set()

    def result(self, timeout: float) -> tuple[list[str], Exception | None]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream still open"
        return self.events, self.error


def _streams_in_flight(server: TorchrunServer, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(server.url, 3 + i, max_tokens) for i in range(count)]
    for s in streams:
        assert s.started.wait(60), server.tail()
    return streams


def test_torchrun_sigterm_drains_streams_and_answers_503(tmp_path):
    """torchrun stops its workers with killpg: the API process, started by rank 0 in a session
    of its own, must not take that SIGTERM itself. Rank 0 drains: new requests get 503 (not
    a refused connection), the streams in flight end with their length and [DONE]."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True),
        tmp_path,
        shutdown_timeout=30,
    )
    try:
        streams = _streams_in_flight(server, 6, 600)
        server.proc.send_signal(signal.SIGTERM)
        answers, deadline = [], time.monotonic() + 6
        # the API keeps listening while the ranks drain (past uvicorn's own 5 s drain when
        # the streams last that long; on a fast machine they may all end sooner)
        while time.monotonic() < deadline and any(s.thread.is_alive() for s in streams):
            try:
                answers.append(
                    httpx.post(
                        server.url + "/v1/completions",
                        timeout=30,
                        json={"model": "ckpt", "prompt": [1, 2, 3], "max_tokens": 1},
                    ).status_code
                )
            except httpx.TransportError:  # refused: only once the streams had their ends
                for s in streams:
                    s.result(10)
                break
            time.sleep(0.25)
        assert answers and answers[-1] == 503 and set(answers) <= {200, 503}, (
            answers,
            server.tail(),
        )
        for s in streams:
            events, error = s.result(60)
            assert error is None and events[-1] == "[DONE]", (error, events[-2:], server.tail())
            finish = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-1])]
            assert finish[-1] == "length"
        _, waited = server.wait_exit(30)
        assert waited < 30, server.tail()
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)


def test_dead_rank_ends_streams_with_an_error_event(tmp_path):
    """Rank 1 dies mid-stream: rank 0 stops, and every stream still open ends with the error
    envelope as its last event (docs/api.md), not a connection cut mid-body."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True), tmp_path
    )
    try:
        streams = _streams_in_flight(server, 4, 800)
        os.kill(server.rank_pid(1), signal.SIGKILL)
        for s in streams:
            events, error = s.result(60)
            assert error is None, (error, server.tail())
            last = json.loads(events[-1])  # the engine is down: 503's envelope
            assert last.get("error", {}).get("code") == "503_SERVICE_UNAVAILABLE", last
        rc, waited = server.wait_exit(30)
        assert rc != 0 and waited < 30, server.tail()
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)


def test_hung_rank_ends_group_within_a_peer_timeout(tmp_path):
    """Rank 1 hangs (SIGSTOP) mid-stream. Found by an outside tester: new requests were
    admitted and hung while /health already said the engine was not responding (admission
    waited for the 300 s engine timeout), and rank 0 took two peer timeouts (~60 s) to exit,
    its stop plan waiting a second 30 s on the hung peer. Now a new request gets 503 once
    /health fails (10 s), the stream ends with the 503 envelope, and rank 0 exits within one
    peer timeout plus the stop plan's 5 s bound."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True), tmp_path
    )
    rank0, rank1 = server.rank_pid(0), server.rank_pid(1)
    try:
        (stream,) = _streams_in_flight(server, 1, 1000)  # of the 1024 the model takes
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()

        def unhealthy() -> bool:  # once the engine has been silent for 10 s
            return httpx.get(server.url + "/health", timeout=10).status_code == 503

        assert wait_for(unhealthy, 25, interval=0.2), server.tail()
        start = time.monotonic()
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=30,
            json={"model": "ckpt", "prompt": [1, 2, 3], "max_tokens": 1},
        )
        # (not held for the engine timeout, 300 s)
        assert r.status_code == 503 and time.monotonic() - start < 10, (r.text, server.tail())
        events, error = stream.result(60)
        assert error is None and '"503_SERVICE_UNAVAILABLE"' in events[-1], (error, events[-1:])
        while not exited(rank0) and time.monotonic() - stopped < 60:
            time.sleep(0.2)
        assert time.monotonic() - stopped < 45, server.tail()
    finally:  # torchrun starts each rank in a session of its own: kill them by pid
        for pid in (rank0, rank1, server.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)  # (rank 1 stopped as it is)
            except ProcessLookupError:
                pass
        server.proc.wait(10)


@pytest.mark.parametrize("local", [True, False], ids=["local", "torchrun"])
def test_one_ctrl_c_to_the_whole_group_drains(tmp_path, local):
    """A terminal's Ctrl-C reaches the launcher's process group: under `launch.py
    --nproc-per-node` rank 0 may get it from the terminal and again forwarded by the launcher
    (Python often merges the two). That is one Ctrl-C, not two: the drain goes on (a second
    signal would end it at once), so a stream in flight finishes whole."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True),
        tmp_path,
        local=local,
        shutdown_timeout=60,
    )
    try:
        body = {
            "model": "ckpt",
            "prompt": [1, 2, 3],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.killpg(server.proc.pid, signal.SIGINT)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", server.tail()
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 300, server.tail()
        assert "again: stopping now" not in server.tail()
        server.wait_exit(60)
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
