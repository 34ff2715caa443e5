"""The handler in each engine step on rank 0: one call for the step's rows, then each row to
its place. A one-row request's value goes through the output dispatcher; multi-row requests'
rows to RowSteps. A step that runs ahead queues its every-generated-token rows right after
its forward and takes them when its host work is done."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from tapserve.api.wire import EXECUTION_EXCEPTION
from tapserve.coordinator.custom_outputs import CustomOutputStats, encode_row
from tapserve.coordinator.engine_tokens import TokenSteps
from tapserve.coordinator.handler_rows import RowCopies, launch_handler, run_handler
from tapserve.coordinator.output_dispatch import OutputDispatcher
from tapserve.coordinator.planner import PlanRows
from tapserve.coordinator.row_steps import RowSteps
from tapserve.coordinator.run_ahead import AheadRows
from tapserve.coordinator.sequence import Request, Sequence
from tapserve.model.custom_output import CustomOutputError
from tapserve.ranks.plan import StepPlan


class HandlerSteps:
    """Runs the handler on a step's rows and hands each row to its request or sequence."""

    def __init__(
        self,
        handler: object | None,
        tokens: TokenSteps,
        stats: CustomOutputStats,
        fail: Callable[[Request, int, str], None],
        dispatcher: OutputDispatcher,
        busy: Callable[[], AbstractContextManager],
        device: torch.device,
    ):
        """fail(request, code, message): the engine's; busy: the keepalive's context while
        the handler runs (heartbeat plans to the other ranks)."""
        self.handler, self.tokens, self.stats, self.fail = handler, tokens, stats, fail
        self.dispatcher, self.busy = dispatcher, busy
        self.rows = RowSteps(tokens, stats, fail)
        self._copies = RowCopies(device)
        self._pending: list[tuple[Sequence, object]] = []  # (sequence, Future of its value)

    def run(self, hidden: torch.Tensor, rows: PlanRows, plan: StepPlan) -> None:
        """One handler call and one device-to-host copy for the step's rows (before its
        sampling). One-row values are queued on the dispatcher, collected by collect()."""
        seqs, positions, index = rows.custom_seqs, rows.custom_positions, plan.custom_rows
        if rows.generated_seqs:  # a plain decode plan's ALL_GENERATED rows
            seqs = seqs + rows.generated_seqs
            positions = positions + plan.positions[rows.generated].tolist()
            index = np.concatenate([index, rows.generated])
        stop_rows = RowSteps.stop_rows(seqs, positions)
        stop_params = [seqs[i].request.custom_output_params for i in stop_rows]
        try:
            with self.busy():
                host = run_handler(
                    self.handler,
                    hidden[torch.from_numpy(index).to(hidden.device)],
                    self.stats,
                    stop_rows,
                    stop_params,
                )
        except CustomOutputError as e:
            for seq in seqs:
                self.fail(seq.request, EXECUTION_EXCEPTION, f"custom output processor failed: {e}")
            return
        multi = []
        for i, seq in enumerate(seqs):
            if seq.request.selection is not None:
                multi.append(i)
                continue
            rid = seq.request.request_id
            future = self.dispatcher.submit(rid, encode_row, host.row(i), host.dtype)
            self._pending.append((seq, future))
        if multi:
            self.rows.place(host, seqs, positions, multi, stop_rows)

    def collect(self) -> None:
        """Wait for this step's dispatched one-row values (in queue order) before outputs
        are built."""
        pending, self._pending = self._pending, []
        for seq, future in pending:
            try:
                value = future.result()
            except Exception as e:
                self.fail(
                    seq.request,
                    EXECUTION_EXCEPTION,
                    f"custom output processor failed: {type(e).__name__}: {e}",
                )
                continue
            if seq.scoring_reason is None:
                seq.request.custom_output = value
            elif not seq.is_finished:  # LAST_GENERATED: scored, now it really finishes
                seq.custom_output = value
                if seq.hypothesis is not None:  # a fork scoring a finished beam
                    seq.hypothesis.custom_output = value
                self.tokens.finish_seq(seq, seq.scoring_reason, emit=seq.hypothesis is None)

    def launch_generated(
        self, hidden: torch.Tensor, rows: PlanRows, plan: StepPlan, follows: int = -1
    ) -> AheadRows | None:
        """Queue the handler on a decode step that runs ahead: its ALL_GENERATED rows, before
        a later step can overwrite the hidden states; their copy to the host starts.
        follows: the step's ScheduledBatch.follows."""
        if not rows.generated_seqs:
            return None
        seqs = rows.generated_seqs
        every = len(seqs) == hidden.shape[0]  # (sorted distinct row indices: all of them)
        positions = (plan.positions if every else plan.positions[rows.generated]).tolist()
        picked = hidden if every else hidden[torch.from_numpy(rows.generated).to(hidden.device)]
        stop_rows = stop_params = None
        if callable(getattr(self.handler, "should_stop", None)):
            stop_rows = list(range(len(seqs)))
            stop_params = [s.request.custom_output_params for s in seqs]
        try:
            with self.busy():
                device = launch_handler(self.handler, picked, self.stats, stop_rows, stop_params)
        except CustomOutputError as e:
            return AheadRows(seqs, positions, None, str(e), follows)
        return AheadRows(seqs, positions, self._copies.start(device), None, follows)
