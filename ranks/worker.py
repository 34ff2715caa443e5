"""The loop of ranks other than 0: receive a plan, run it, repeat. Stateless apart from the KV
cache; a stop plan ends the loop, a dead peer raises out of the broadcast (exit non-zero)."""

from __future__ import annotations

import signal

from tapserve.ranks.group import PlanChannel
from tapserve.ranks.plan import StepKind
from tapserve.ranks.runner import ModelRunner


def ignore_termination_signals() -> None:
    """torchrun signals every rank at once; only rank 0 decides when to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_worker(runner: ModelRunner, channel: PlanChannel) -> None:
    while True:
        plan = channel.recv()
        if plan.kind is StepKind.STOP:
            return
        if plan.kind is not StepKind.HEARTBEAT:
            runner.execute(plan)
