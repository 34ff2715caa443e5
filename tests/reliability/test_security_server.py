"""Security properties of a live single-node server and of the code: API key on every route
but /health (routes from the app's own OpenAPI schema), ZeroMQ only on ipc:// in a 0700 dir,
only 127.0.0.1 listening, msgpack only (no pickle), the custom module only from the command
line, default bind 127.0.0.1, prompts and outputs logged only with --log-requests.
(A 2-rank torchrun group's sockets: test_security_torchrun.py.)"""

from __future__ import annotations

import builtins
import pickle
import re
import stat
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import LiveServer  # noqa: E402
from tests.helpers.procs import (  # noqa: E402
    api_pid,
    cmdline,
    descendants,
    flag_value,
    listening_tcp,
    unix_socket_paths,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = "security-key-5678"
SECRET_PROMPT = "xylophone quokka marmalade zeppelin"


@pytest.fixture(scope="module")
def server():
    s = LiveServer(api_key=KEY)
    yield s
    assert s.stop() == 0, s.log_tail()


def app_openapi() -> dict:
    """The OpenAPI schema of the app the API process serves (built in-process: the server
    does not publish /openapi.json)."""
    from tapserve.api.config import ApiConfig
    from tapserve.api.server import create_app
    from tapserve.model.demo import ensure_demo_checkpoint

    gate = create_app(ApiConfig(ipc_dir="/nonexistent", tokenizer=str(ensure_demo_checkpoint())))
    return gate.app.openapi()


def routes() -> list[tuple[str, str]]:
    return [
        (method.upper(), path) for path, ops in app_openapi()["paths"].items() for method in ops
    ]


# ---- API key --------------------------------------------------------------------------------
def test_api_key_on_every_route_but_health(server):
    found = routes()
    paths = {p for _, p in found}
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/generate",
        "/custom_output",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    } <= paths, paths
    for method, path in found:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=10)
            if path == "/health":
                assert r.status_code == 200, (method, path)
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers.get("www-authenticate") == "Bearer"
        ok = httpx.request(
            method,
            server.url + path,
            json={},
            timeout=10,
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert ok.status_code != 401, (method, path)
    # paths outside the schema are behind the key too (no information about what exists)
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    assert (
        httpx.get(
            server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}
        ).status_code
        == 404
    )
    assert (
        httpx.get(server.url + "/docs", headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 404
    )


# ---- sockets --------------------------------------------------------------------------------
def test_zmq_sockets_only_ipc_in_private_dir(server):
    rank0 = server.proc.pid
    api = api_pid(rank0)
    argv = cmdline(api)
    ipc_dir = Path(flag_value(argv, "--ipc-dir"))
    mode = ipc_dir.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == Path("/proc/self").stat().st_uid
    for pid in (rank0, api):  # rank 0 binds; the API process connects (no path of its own)
        paths = [p for p in unix_socket_paths(pid) if not p.startswith("@")]
        assert all(Path(p).parent == ipc_dir for p in paths), paths
    assert {Path(p).name for p in unix_socket_paths(rank0)} >= {"to_engine", "from_engine"}
    for name in ("to_engine", "from_engine"):
        assert stat.S_ISSOCK((ipc_dir / name).stat().st_mode)
    key_file = ipc_dir / "api_key"  # given in $TAPSERVE_API_KEY, the key never shows in ps
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert not any(KEY in a for pid in (rank0, api) for a in cmdline(pid))
    # no ZeroMQ endpoint on TCP: the only listening TCP socket is the HTTP port, on loopback
    assert listening_tcp([rank0, *descendants(rank0)]) == [(api, "127.0.0.1", server.port)]


def test_only_loopback_listens_and_default_bind(server):
    from tapserve import launch_flags
    from tapserve.api.config import ApiConfig

    assert launch_flags.parse_args([]).host == "127.0.0.1"
    assert ApiConfig(ipc_dir="x", tokenizer="y").host == "127.0.0.1"
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    listening = listening_tcp(pids)
    assert listening and all(addr == "127.0.0.1" for _, addr, _ in listening), listening
    # world size 1: no torch.distributed store or gloo sockets at all
    assert [port for _, _, port in listening] == [server.port]


# ---- no pickle across processes --------------------------------------------------------------
CROSS_PROCESS = (
    "api/wire.py",
    "ranks/plan.py",
    "ranks/group.py",
    "api/engine_client.py",
    "coordinator/loop.py",
    "ranks/worker.py",
)
PICKLE_RE = re.compile(
    r"\bpickle\b|cPickle|dill|cloudpickle|send_pyobj|recv_pyobj|"
    r"_object_list|broadcast_object|torch\.(save|load)\b|allow_pickle\s*=\s*True"
)


def test_no_pickle_in_cross_process_code():
    for rel in CROSS_PROCESS:
        text = (ROOT / rel).read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        code = re.sub(r'""".*?"""', "", code, flags=re.S)
        assert not PICKLE_RE.search(code), f"{rel}: {PICKLE_RE.search(code).group(0)}"


def test_wire_and_plan_codecs_never_pickle(monkeypatch):
    """Round-trip every message type and a StepPlan with pickle disabled; a plan whose
    arrays claim dtype object is refused, not unpickled."""
    import msgpack

    from tapserve.api import wire
    from tapserve.ranks.plan import StepKind, StepPlan, decode_plan, encode_plan

    def banned(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, banned)
    real_import = builtins.__import__

    def guarded_import(name, *a, **k):
        if name in ("pickle", "_pickle", "dill", "cloudpickle"):
            raise AssertionError(f"import {name}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guarded_import)

    value = {"dtype": "float32", "shape": [1, 2], "data": np.ones(2, np.float32).tobytes()}
    messages = [
        wire.AddRequest("r1", [1, 2, 3], {"max_new_tokens": 3}, {"position": 1}),
        wire.AbortRequest("r1"),
        wire.DrainRequest(15),
        wire.Outputs(
            [
                wire.RequestOutput(
                    "r1",
                    sequences=[
                        wire.SequenceOutput(index=0, new_token_ids=[5], finish_reason="length")
                    ],
                    finished=True,
                    custom_output=value,
                )
            ]
        ),
        wire.Shutdown("bye"),
    ]
    for msg in messages:
        assert wire.decode(wire.encode(msg)) == msg
    plan = StepPlan(kind=StepKind.HEARTBEAT)
    assert decode_plan(encode_plan(plan)).kind is StepKind.HEARTBEAT
    body = msgpack.unpackb(encode_plan(plan), raw=False)
    evil = pickle.__dict__.get("PROTO", b"\x80") + b"evil"
    body["arrays"][0] = ["|O", [1]]
    body["data"] = evil + body["data"]
    with pytest.raises(ValueError, match="not a native numeric dtype"):
        decode_plan(msgpack.packb(body, use_bin_type=True))
    with pytest.raises(Exception) as e:  # pickle bytes on the wire are not a message
        wire.decode(b"\x80\x04\x95" + b"\x00" * 16)
    assert "pickle" not in str(e.value)


# ---- custom module only from the command line -----------------------------------------------
def test_requests_cannot_name_a_custom_module(server):
    h = {"Authorization": f"Bearer {KEY}"}
    bodies = {
        "/v1/completions": {"model": "tapserve-demo", "prompt": "x", "max_tokens": 1},
        "/v1/chat/completions": {
            "model": "tapserve-demo",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "x"}],
        },
        "/generate": {"prompt": "x", "generate_config": {"max_new_tokens": 1}},
        "/custom_output": {"prompts": ["x"]},
    }
    for path, body in bodies.items():
        assert httpx.post(server.url + path, json=body, headers=h, timeout=30).status_code == 200, (
            path
        )
        for field in ("custom_module", "customModule", "handler", "module"):
            r = httpx.post(
                server.url + path, json={**body, field: "os:system"}, headers=h, timeout=30
            )
            assert r.status_code == 400, (path, field, r.text)
            assert field in r.text
    r = httpx.post(
        server.url + "/generate",
        headers=h,
        timeout=30,
        json={
            "prompt": "x",
            "generate_config": {"max_new_tokens": 1, "custom_module": "os:system"},
        },
    )
    assert r.status_code == 400
    from tapserve.api import wire

    assert not [f for f in wire.AddRequest.__dataclass_fields__ if "module" in f]


# ---- logging --------------------------------------------------------------------------------
def _generate_and_read_log(server: LiveServer) -> tuple[str, str]:
    r = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers,
        timeout=60,
        json={
            "model": "tapserve-demo",
            "prompt": SECRET_PROMPT,
            "max_tokens": 12,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200
    return r.json()["choices"][0]["text"], server.log_tail(10**7)


def test_prompts_and_outputs_not_logged_by_default(server):
    text, log = _generate_and_read_log(server)
    assert len(text.strip()) >= 8
    assert SECRET_PROMPT not in log and "quokka" not in log
    assert text.strip() not in log
    assert "/v1/completions" not in log  # no access log either


@pytest.mark.slow
def test_log_requests_logs_request_metadata():
    """With --log-requests the request is logged (access log, request ids, token counts)."""
    own = LiveServer("--log-requests", api_key=KEY)
    try:
        _, log = _generate_and_read_log(own)
        assert "/v1/completions" in log and "prompt_tokens=" in log
    finally:
        assert own.stop() == 0
