"""Run CPU checks of Triton kernels under the Triton interpreter. TRITON_INTERPRET=1 must be
set before triton is first imported, so the checks run once per test module in one
subprocess (one torch + triton import) and report {check name: error text or ""}."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Triton 3.6's interpreter (the GPU machine's) cannot take a loaded value, or a kernel
# argument, as a `range` bound ("only 0-dimensional arrays can be converted to Python
# scalars"); 3.9's can. There the compiled kernels are checked instead, in the GPU tests.
OLD_INTERPRETER = importlib.util.find_spec("triton") is not None and tuple(
    int(x) for x in importlib.metadata.version("triton").split(".")[:2]
) < (3, 9)
MARKER = "INTERPRETER_CHECKS "


def report(checks: dict[str, Callable[[], None]]) -> None:
    """Subprocess side: run every check, print one marked JSON line."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = ""
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()[-4000:]
    print(MARKER + json.dumps(results))


def run_checks(module: str) -> dict[str, str]:
    """Parent side: run `module.CPU_CHECKS` in an interpreter subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    code = f"from tests.helpers.interpreter import report; from {module} import CPU_CHECKS; report(CPU_CHECKS)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    pytest.fail(f"interpreter subprocess failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
