"""The engine on rank 0: requests in, one step at a time, outputs out.

Each step: schedule -> build the plan -> hand it to every rank (broadcast) -> run rank 0's
forward -> custom outputs, sampling, forks and beams (TokenSteps) -> outputs. A plain decode
step may run ahead of its sampling (coordinator/run_ahead.py). `LLM.generate`
(coordinator/offline.py) and coordinator/loop.py drive it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from itertools import count

import numpy as np
import torch

from tapserve.api.detokenizer import Decoder
from tapserve.api.sampling_params import BatchDraw, SamplingParams
from tapserve.api.wire import INVALID_PARAMS, Outputs, RequestOutput
from tapserve.coordinator.beam_search import BeamSearch
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.config import EngineOptions
from tapserve.coordinator.custom_outputs import (
    CustomOutputStats,
    RequestError,
    select_position,
)
from tapserve.coordinator.engine_tokens import TokenSteps
from tapserve.coordinator.handler_steps import HandlerSteps
from tapserve.coordinator.keepalive import PlanKeepalive
from tapserve.coordinator.output_dispatch import OutputDispatcher
from tapserve.coordinator.outputs import SteadyColumns, put_news_in_columns, request_output
from tapserve.coordinator.planner import Planner, PlanRows
from tapserve.coordinator.row_selection import RowSelection
from tapserve.coordinator.run_ahead import (
    AheadRows,
    AheadStep,
    TokenCopies,
    ahead_draw,
    row_params,
)
from tapserve.coordinator.sampler import Sampler, to_device
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.scheduler import Scheduler
from tapserve.coordinator.sequence import Request, SequenceFactory
from tapserve.coordinator.stop_strings import truncate_output, watches_stop_strings
from tapserve.coordinator.validation import validate_prompt, validate_row_bytes, validate_rows
from tapserve.ranks.plan import StepKind, StepPlan, block_table_dtype
from tapserve.ranks.runner import ModelRunner, StepOutput

log = logging.getLogger("tapserve.coordinator")


class Engine:
    """Rank 0's engine: add_request, step until has_work() is False, abort_request."""

    def __init__(
        self,
        runner: ModelRunner,
        options: EngineOptions,
        handler: object | None = None,
        send_plan: Callable[[StepPlan], None] = lambda plan: None,
        text_decoder: Decoder | None = None,
        keepalive: PlanKeepalive | None = None,
    ):
        """text_decoder: the serving tokenizer, for stop strings of LAST_GENERATED requests
        (coordinator/stop_strings.py); without it only the API process sees stop strings.
        keepalive: with other ranks, heartbeat plans while the handler runs."""
        capacity = runner.num_blocks * runner.cfg.block_size
        if options.max_model_len > capacity:  # one sequence must always fit the KV cache
            message = "max_model_len %d exceeds the KV cache (%d tokens): capped to %d"
            log.warning(message, options.max_model_len, capacity, capacity)
            options = replace(options, max_model_len=capacity)
        self.runner, self.options, self.handler = runner, options, handler
        self.send_plan = send_plan
        self._handler_busy = keepalive.busy if keepalive is not None else nullcontext
        self.blocks = BlockManager(
            runner.num_blocks, runner.cfg.block_size, options.enable_prefix_caching
        )
        self.scheduler = Scheduler(options.scheduler, self.blocks)
        self.planner = Planner(
            runner.cfg.block_size,
            -(-options.max_model_len // runner.cfg.block_size),
            table_dtype=block_table_dtype(runner.num_blocks),
        )
        self.sampler = Sampler(options.seed, runner.device)
        self.beams = BeamSearch()
        self.seqs = SequenceFactory()
        self.tokens = TokenSteps(
            self.sampler, self.scheduler, self.blocks, self.seqs, self.beams, options, text_decoder
        )
        self.requests: dict[str, Request] = {}
        self.custom_stats = CustomOutputStats()
        self.dispatcher = OutputDispatcher(options.output_workers)
        self.handler_steps = HandlerSteps(
            handler,
            self.tokens,
            self.custom_stats,
            self._fail,
            self.dispatcher,
            self._handler_busy,
            runner.device,
        )
        self._arrivals = count()
        self._ready: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self.columns = SteadyColumns()
        self.run_ahead = self._wants_run_ahead(options.async_scheduling, runner)
        self.fast_draws = True  # False (tests): every request samples by the general path
        self._token_copies = TokenCopies(options.scheduler.max_num_seqs, runner.device)
        self._ahead: AheadStep | None = None  # the decode step in flight, its host work to do
        self.num_steps = 0  # steps that ran a forward
        self.num_ahead_steps = 0  # of them launched ahead of their predecessor's sampling

    @property
    def text_decoder(self) -> Decoder | None:
        return self.tokens.text_decoder

    @text_decoder.setter
    def text_decoder(self, decoder: Decoder | None) -> None:
        self.tokens.text_decoder = decoder

    @staticmethod
    def _wants_run_ahead(asked: bool | None, runner: ModelRunner) -> bool:
        return runner.device.type == "cuda" if asked is None else asked

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        custom_output_params: dict | None = None,
    ) -> None:
        """Validate and queue a request; raises RequestError (605/606) and queues nothing."""
        if request_id in self.requests:
            raise RequestError(INVALID_PARAMS, f"duplicate request id {request_id!r}")
        validate_prompt(prompt_token_ids, params, self.options, self.blocks)
        with self._handler_busy():
            selected = select_position(
                self.handler, prompt_token_ids, custom_output_params, params.max_new_tokens
            )
        selection = selected if isinstance(selected, RowSelection) else None
        pos = -1 if selection is not None else selected
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            next(self._arrivals),
            custom_position=pos,
            selection=selection,
            custom_output_params=custom_output_params,
            all_generated=selection is not None and selection.all_generated,
            fast_draw=params.batch_draw if self.fast_draws else BatchDraw.GENERAL,
            **self._decode_checks(params, len(prompt_token_ids)),
        )
        validate_rows(request.max_rows, params, self.options)
        if selection is not None:
            validate_row_bytes(selection, params, self.options)
        first_prompt_row = selection.prompt[0] if selection and selection.prompt else pos
        if first_prompt_row >= 0 and (
            self.options.custom_output_reuse == "recompute" or params.max_new_tokens == 0
        ):
            request.reuse_cap_tokens = first_prompt_row  # reuse stops below the selected token
        if params.num_beams == 1 and watches_stop_strings(request, self.text_decoder):
            request.watch_stop_strings = True
            request.max_total_tokens = 0  # every new token goes through _check_stop
        request.single = params.n == 1 and params.num_beams == 1 and not request.watch_stop_strings
        plain = request.single and not params.logprobs and params.max_new_tokens > 0
        request.token_columns = plain and not request.all_generated  # (rows travel with tokens)
        request.runs_ahead = (
            plain
            and (request.all_generated or not request.scores_generated)
            and request.fast_draw is not BatchDraw.GENERAL
        )
        self.seqs.prompt_sequence(request)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _decode_checks(self, params: SamplingParams, prompt_len: int) -> dict:
        eos = [] if params.ignore_eos else self.options.eos_token_ids
        return dict(
            stop_token_set=frozenset(eos) | frozenset(params.stop_token_ids),
            max_total_tokens=min(prompt_len + params.max_new_tokens, self.options.max_model_len),
        )

    def abort_request(self, request_id: str, error: tuple[int, str] | None = None) -> None:
        """Drop a request (client gone, stop string, shutdown); its final output says why."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if error is not None:
            self._fail(request, *error)
        else:
            self._finish_request(request, "abort")
        self._ready.append(self._output(request))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ready) or self._ahead is not None

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> Outputs:
        """One engine step; its outputs (and those produced since the last step, e.g. aborts)."""
        outputs, self._ready = Outputs(self._ready), []
        cuts, self.tokens.stop_cuts = self.tokens.stop_cuts, []
        for seq, kept in cuts:  # cut by a stop string in the last step
            if seq.scoring_reason is not None and not seq.is_finished:
                truncate_output(seq, kept)
        if self._ahead is not None:
            # one step's host work per call: a drained step's column news must not share an
            # Outputs with a later full output of the same request (columns are read last)
            self._step_ahead(outputs)
            return outputs
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        plan, rows = self.planner.build(batch)
        plan.graph_bucket = self.runner.graph_bucket_for(plan)
        self.send_plan(plan)
        result = self.runner.execute(plan)
        self.num_steps += 1
        draw = self._ahead_draw(batch, plan, rows)
        if draw is not None:
            generated = self.handler_steps.launch_generated(result.hidden, rows, plan)
            self._launch_ahead(batch, result.logits, draw, row_params(draw, batch.seqs), generated)
            return outputs
        advanced = self._postprocess(batch, plan, rows, result)
        self._collect_outputs(batch, outputs, advanced)
        return outputs

    # ---- steps ahead of their predecessor's sampling (coordinator/run_ahead.py) -----------
    def _ahead_draw(
        self, batch: ScheduledBatch, plan: StepPlan, rows: PlanRows
    ) -> BatchDraw | None:
        """The draw by which this step's tokens stay on the device while the next step is
        launched, or None (the step is finished synchronously)."""
        if (
            not self.run_ahead
            or plan.kind is not StepKind.DECODE
            or rows.custom_seqs
            or len(rows.logit_seqs) != len(batch.seqs)
        ):
            return None
        return ahead_draw(batch)

    def _step_ahead(self, outputs: Outputs) -> None:
        """Launch the next decode step of the step in flight, if the scheduler's arrays can
        schedule it (else the pipeline drains: the next call schedules the general way),
        then finish the step in flight."""
        ahead, self._ahead = self._ahead, None
        scheduled = self.scheduler.schedule_ahead()
        if scheduled is not None:
            batch, keep = scheduled
            plan, rows = self.planner.build(batch)
            plan.graph_bucket = self.runner.graph_bucket_for(plan)
            ids, params = ahead.tokens, ahead.row_params
            if keep is not None:  # rows finished since: their successors are dropped
                ids = ids[to_device(keep, ids.device)]
                params = params and [params[i] for i in keep.tolist()]
            self.send_plan(plan)  # plan.ids_from_rank0: the ids follow on the GPUs
            result = self.runner.execute(plan, input_ids=ids)
            self.num_steps += 1
            generated = self.handler_steps.launch_generated(
                result.hidden, rows, plan, batch.follows
            )
            self._launch_ahead(batch, result.logits, ahead.draw, params, generated)
        self._finish_ahead(ahead, outputs)

    def _launch_ahead(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        draw: BatchDraw,
        params: list | None,
        generated: AheadRows | None = None,
    ) -> None:
        """Sample on the device as TokenSteps.sample would, and keep the step in flight."""
        if draw is BatchDraw.GREEDY:
            tokens = self.sampler.greedy_tensor(logits)
        elif draw is BatchDraw.TEMPERATURE:
            tokens = self.sampler.temperature_tensor(logits, params)
        else:
            tokens = self.sampler.plain_tensor(logits, params)
        self._ahead = AheadStep(
            batch,
            tokens,
            self._token_copies.start(tokens),
            draw,
            params,
            self.tokens.num_finished,
            generated,
        )
        self.scheduler.note_advanced(batch, None)
        self.num_ahead_steps += 1

    def _finish_ahead(self, ahead: AheadStep, outputs: Outputs) -> None:
        """The host work of a step that ran ahead: its rows whose sequences still run (one
        that finished or was aborted since has had its final output) take their tokens."""
        tokens, batch = ahead.pending.wait(), ahead.batch
        ended, sent = [], 0  # requests the rows ended (their newest token is dropped), and
        if ahead.generated is not None:  # how many rows left in the row columns
            ended, sent = self.handler_steps.rows.place_ahead(ahead.generated, outputs)
        seqs, context_lens, size = batch.seqs, batch.context_lens, self.blocks.block_size
        none_finished = ahead.num_finished_at_launch == self.tokens.num_finished
        rows = (
            range(len(seqs))
            if none_finished
            else [i for i, s in enumerate(seqs) if not s.is_finished]
        )
        for i in rows:
            seq, computed = seqs[i], context_lens[i]
            seq.num_computed_tokens = computed
            if computed % size == 0:
                self.blocks.register_computed(seq)  # its step filled a block
        items = [(i, seqs[i]) for i in rows]
        plain = self.tokens.append_plain(
            items, tokens if none_finished else [tokens[i] for i in rows]
        )
        if none_finished and plain and sent == len(seqs):  # every row sent with its row
            self.columns.reset()  # (each holds its newest token for its row: no other news)
            self.handler_steps.rows.note_steady(batch.serial, tokens)
            return
        if none_finished:
            self._collect_outputs(batch, outputs, tokens if plain else None)
            return
        self.columns.reset()
        for request in put_news_in_columns([s for _, s in items], outputs)[0] + ended:
            outputs.outputs.append(self._output(request))

    def _postprocess(
        self, batch: ScheduledBatch, plan: StepPlan, rows: PlanRows, result: StepOutput
    ) -> list[int] | None:
        """Returns each row's token when every row gained exactly its sampled token."""
        seqs = batch.seqs
        for seq, context_len in zip(seqs, batch.context_lens):
            seq.num_computed_tokens = context_len
        size, after = self.blocks.block_size, plan.context_lens  # per row, as batch.context_lens
        before = after - np.diff(plan.query_start_loc)
        for i in np.flatnonzero(after // size != before // size).tolist():
            self.blocks.register_computed(seqs[i])  # a block filled in this step
        live = list(enumerate(rows.logit_seqs))
        if rows.custom_seqs or rows.generated_seqs:
            self.handler_steps.run(result.hidden, rows, plan)
            # the handler failed, or its should_stop ended the sequence
            live = [(i, s) for i, s in live if s.request.error_code is None and not s.is_finished]
        advanced = self.tokens.sample(result.logits, live) if live else None
        self.handler_steps.collect()
        if (
            advanced is not None
            and not rows.custom_seqs
            and len(live) == len(seqs)
            and plan.kind is StepKind.DECODE
        ):
            self.scheduler.note_advanced(batch, advanced)  # every row gained its token alone
            return advanced
        return None

    def _collect_outputs(
        self, batch: ScheduledBatch, outputs: Outputs, advanced: list[int] | None
    ) -> None:
        """One output per request the step touched: the usual decode news in the columns
        (coordinator/outputs.py), a full RequestOutput for the rest."""
        for request in self.columns.put(batch, advanced, outputs):
            if request.params.max_new_tokens == 0:
                self.tokens.finish_scoring_only(request)
            outputs.outputs.append(self._output(request))

    def close(self) -> None:
        """Stop the output dispatcher's threads (the engine is not used afterwards)."""
        self.dispatcher.close()

    # ---- finishing -----------------------------------------------------------------------
    def _finish_request(self, request: Request, reason: str) -> None:
        self.scheduler.drop_waiting(request)
        for seq in request.live_sequences:
            self.tokens.finish_seq(seq, reason)

    def _fail(self, request: Request, code: int, message: str) -> None:
        request.error_code, request.error_message = code, message
        self._finish_request(request, "error")

    def _output(self, request: Request) -> RequestOutput:
        output = request_output(request, self.beams)
        if request.selection is not None:
            self.handler_steps.rows.count_sent(output)
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        owned = sum(len(s.block_table) for r in self.requests.values() for s in r.live_sequences)
        assert owned >= sum(1 for b in self.blocks.blocks if b.ref_count > 0)
