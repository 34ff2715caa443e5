"""Single-node tensor parallelism without torchrun: `python launch.py --nproc-per-node N ...`.

The N ranks rendezvous through a FileStore in a private 0700 directory, gloo and NCCL pinned
to loopback, so the group listens on no TCP port (docs/reliability.md). As torchrun, the parent
forwards SIGINT/SIGTERM to every rank and, once a rank fails, stops the rest.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STORE_ENV = "TAPSERVE_STORE_FILE"  # set in the ranks: the FileStore path of their group
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def is_local_rank() -> bool:
    """True inside a rank process started by run_local_group."""
    return STORE_ENV in os.environ


def run_local_group(nproc: int, argv: list[str], grace_s: float = 30.0) -> int:
    """Run `python <argv>` as nproc ranks; return the first non-zero exit code, else 0."""
    group_dir = tempfile.mkdtemp(prefix="tapserve-group-")  # mode 0700
    env = {
        **os.environ,
        **LOOPBACK_ENV,
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        STORE_ENV: os.path.join(group_dir, "store"),
    }
    if nproc > 1:  # as torchrun: N ranks of all-core thread pools oversubscribe a CPU host
        env.setdefault("OMP_NUM_THREADS", "1")
    ranks = [
        subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(nproc)
    ]

    def forward(signum, _frame) -> None:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait(ranks, grace_s)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(group_dir, ignore_errors=True)


def _wait(ranks: list[subprocess.Popen], grace_s: float) -> int:
    """Wait for every rank, killing the rest grace_s after the first failure; that rank's exit
    status (128 + N for signal N)."""
    failed_at, first = None, 0  # the first failure's status (not that of a rank we stopped)
    while [p.poll() for p in ranks].count(None):  # polls every rank (any() would stop early)
        codes = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if codes and failed_at is None:
            failed_at, first = time.monotonic(), codes[0]
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    code = first or next((p.returncode for p in ranks if p.returncode != 0), 0)
    return 128 - code if code < 0 else code  # a rank killed by signal N: the shell's 128 + N
