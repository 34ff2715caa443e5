"""Listening TCP sockets of a 2-rank torchrun group (`--standalone`, gloo, CPU): what
torch.distributed's rendezvous store and gloo bind. Single-node launches are meant to keep
them on loopback; see docs/reliability.md for what torch actually does."""
from __future__ import annotations

import os
import signal

import pytest

from tests.checkpoints import make_tiny_checkpoint
from tests.proc_helpers import descendants, listening_tcp
from tests.test_tp_lifecycle import TorchrunServer

LOOPBACK = ("127.0.0.1", "::1")


def group_listeners(tmp_path):
    """(HTTP port, torchrun agent pid, [(pid, address, port)]) of a live 2-rank group."""
    server = TorchrunServer(make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True), tmp_path)
    try:
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        return server.port, server.proc.pid, listening_tcp(pids)
    finally:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)


@pytest.fixture(scope="module")
def listeners(tmp_path_factory):
    return group_listeners(tmp_path_factory.mktemp("torchrun-sockets"))


@pytest.mark.slow
def test_ranks_listen_only_on_loopback(listeners):
    """The ranks (rank 0 with its API process, rank 1): gloo pairs and the HTTP port."""
    port, agent, listening = listeners
    assert port in [p for _, _, p in listening]
    ranks = [s for s in listening if s[0] != agent]
    exposed = [s for s in ranks if s[1] not in LOOPBACK]
    assert ranks and not exposed, f"rank sockets bound beyond loopback: {exposed} (all: {listening})"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="torchrun --standalone's c10d rendezvous TCPStore (in the "
                   "torchrun agent process) listens on [::] (all interfaces, dual-stack): torch's "
                   "behaviour, documented in docs/reliability.md")
def test_torchrun_agent_store_listens_only_on_loopback(listeners):
    _, agent, listening = listeners
    exposed = [s for s in listening if s[0] == agent and s[1] not in LOOPBACK]
    assert not exposed, f"torchrun agent sockets beyond loopback: {exposed}"
