"""Listening TCP sockets of a 2-rank group (gloo, CPU): started by `launch.py --nproc-per-node 2`
(FileStore rendezvous, gloo on loopback) nothing but the loopback HTTP port and gloo's loopback
pairs listen; under `torchrun --standalone` the ranks do the same, but torchrun's own
rendezvous store listens on all interfaces (docs/reliability.md)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.procs import descendants, listening_tcp
from tests.tp.test_tp_lifecycle import TorchrunServer

LOOPBACK = ("127.0.0.1", "::1")


def group_listeners(tmp_path, local: bool = False):
    """(HTTP port, launcher pid, [(pid, address, port)]) of a live 2-rank group."""
    server = TorchrunServer(
        make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=True), tmp_path, local=local
    )
    pids = [server.proc.pid]
    try:
        pids += descendants(server.proc.pid)
        return server.port, server.proc.pid, listening_tcp(pids)
    finally:
        for pid in reversed(pids):  # the ranks run in sessions of their own under torchrun
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.proc.wait(10)


def test_local_group_listens_only_on_loopback(tmp_path):
    """The single-node launcher: every listening socket of the launcher, both ranks and the
    API process is on loopback (there is no TCP store at all)."""
    port, launcher, listening = group_listeners(tmp_path, local=True)
    assert port in [p for _, _, p in listening]
    exposed = [s for s in listening if s[1] not in LOOPBACK]
    assert not exposed, f"sockets bound beyond loopback: {exposed} (all: {listening})"
    assert not [s for s in listening if s[0] == launcher], "the launcher itself listens"


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
    assert ranks and not exposed, (
        f"rank sockets bound beyond loopback: {exposed} (all: {listening})"
    )


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="torchrun --standalone's c10d rendezvous TCPStore (in the "
    "torchrun agent process) listens on [::] (all interfaces, dual-stack): torch's "
    "behaviour, documented in docs/reliability.md",
)
def test_torchrun_agent_store_listens_only_on_loopback(listeners):
    _, agent, listening = listeners
    exposed = [s for s in listening if s[0] == agent and s[1] not in LOOPBACK]
    assert not exposed, f"torchrun agent sockets beyond loopback: {exposed}"
