"""The loop of ranks other than 0: receive a plan, run it, repeat. Stateless apart from the KV
cache; a stop plan ends the loop, a dead peer raises out of the broadcast (exit non-zero)."""
from __future__ import annotations

import os
import signal
import sys
import traceback

from ranks.group import PlanChannel
from ranks.plan import StepKind
from ranks.runner import ModelRunner


def ignore_termination_signals() -> None:
    """torchrun signals every rank at once; only rank 0 decides when to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_worker(runner: ModelRunner, channel: PlanChannel) -> None:
    """Run plans until the stop plan. Any error ends the process at once, non-zero: the
    channel may hold a posted receive, and a normal exit would wait for it (gloo joins its
    worker threads), keeping this rank alive until rank 0 goes."""
    try:
        while True:
            plan = channel.recv()
            if plan.kind is StepKind.STOP:
                return
            if plan.kind is not StepKind.HEARTBEAT:
                runner.execute(plan)
    except BaseException:  # noqa: BLE001 - every way out but the stop plan
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
