"""The engine on rank 0: requests in, one step at a time, outputs out.

Each step: schedule -> build the plan -> hand it to every rank (broadcast) -> run rank 0's
forward -> custom outputs, sampling, forks and beams -> outputs. `Engine.generate` in
coordinator/offline.py drives it for offline use; coordinator/loop.py drives it for serving.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Callable

import numpy as np
import torch

from api.detokenizer import Decoder
from api.wire import EXECUTION_EXCEPTION, INVALID_PARAMS, Outputs, RequestOutput
from coordinator.beam_search import BeamSearch
from coordinator.blocks import BlockManager
from coordinator.custom_outputs import (LAST_GENERATED, CustomOutputStats, RequestError,
                                        encode_row, run_handler, select_position)
from coordinator.output_dispatch import OutputDispatcher
from coordinator.outputs import SteadyColumns, put_news_in_columns, request_output
from coordinator.planner import PlanRows, Planner
from coordinator.run_ahead import AheadStep, TokenCopies, ahead_draw
from coordinator.sampler import SampleRow, Sampler
from coordinator.sampling_params import SamplingParams
from coordinator.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from coordinator.sequence import Request, Sequence, SequenceFactory, SeqStatus
from coordinator.validation import validate_prompt
from coordinator.stop_strings import kept_output_tokens, truncate_output, watches_stop_strings
from model.custom_output import CustomOutputError
from ranks.plan import StepKind, StepPlan
from ranks.runner import ModelRunner, StepOutput

log = logging.getLogger("tapserve.coordinator")


@dataclass
class EngineOptions:
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    custom_output_reuse: str = "omit"  # or "recompute"
    seed: int = 0
    output_workers: int = 0  # custom-output dispatch threads (0 = serial)
    # plain decode steps run ahead of their sampling (coordinator/run_ahead.py); None: on
    # CUDA at TP 1, where it pays (the CPU computes synchronously anyway)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.custom_output_reuse not in ("omit", "recompute"):
            raise ValueError("custom_output_reuse must be omit or recompute")


class Engine:
    def __init__(self, runner: ModelRunner, options: EngineOptions, handler: object | None = None,
                 send_plan: Callable[[StepPlan], None] = lambda plan: None,
                 text_decoder: Decoder | None = None):
        """text_decoder: the serving tokenizer, for stop strings of LAST_GENERATED requests
        (coordinator/stop_strings.py); without it only the API process sees stop strings."""
        capacity = runner.num_blocks * runner.cfg.block_size
        if options.max_model_len > capacity:  # one sequence must always fit the KV cache
            log.warning("max_model_len %d exceeds the KV cache (%d tokens): capped to %d",
                        options.max_model_len, capacity, capacity)
            options = replace(options, max_model_len=capacity)
        self.runner, self.options, self.handler = runner, options, handler
        self.text_decoder = text_decoder
        self.send_plan = send_plan
        self.blocks = BlockManager(runner.num_blocks, runner.cfg.block_size,
                                   options.enable_prefix_caching)
        self.scheduler = Scheduler(options.scheduler, self.blocks)
        self.planner = Planner(runner.cfg.block_size,
                               -(-options.max_model_len // runner.cfg.block_size))
        self.sampler = Sampler(options.seed, runner.device)
        self.beams = BeamSearch()
        self.seqs = SequenceFactory()
        self.requests: dict[str, Request] = {}
        self.custom_stats = CustomOutputStats()
        self.dispatcher = OutputDispatcher(options.output_workers)
        self._custom_pending: list[tuple[Sequence, object]] = []  # (sequence, Future of its value)
        self._arrivals = count()
        self._ready: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._stop_cuts: list[tuple[Sequence, int]] = []  # (sequence, output tokens to keep)
        self.columns = SteadyColumns()
        self.run_ahead = self._wants_run_ahead(options.async_scheduling, runner)
        self._token_copies = TokenCopies(options.scheduler.max_num_seqs, runner.device)
        self._ahead: AheadStep | None = None  # the decode step in flight, its host work to do
        self._finishes = 0  # sequences finished so far (AheadStep.finishes)
        self.num_ahead_steps = 0  # steps launched ahead of their predecessor's sampling

    @staticmethod
    def _wants_run_ahead(asked: bool | None, runner: ModelRunner) -> bool:
        tp = runner.tp.size
        if asked and tp > 1:  # the other ranks would need the sampled ids on their GPUs
            raise ValueError(f"async scheduling runs at TP 1 only (TP is {tp})")
        return runner.device.type == "cuda" and tp == 1 if asked is None else asked

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    custom_output_params: dict | None = None) -> None:
        """Validate and queue a request; raises RequestError (605/606) and queues nothing."""
        if request_id in self.requests:
            raise RequestError(INVALID_PARAMS, f"duplicate request id {request_id!r}")
        validate_prompt(prompt_token_ids, params, self.options, self.blocks)
        pos = select_position(self.handler, prompt_token_ids, custom_output_params,
                              params.max_new_tokens)
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals),
                          custom_position=pos, **self._decode_checks(params, len(prompt_token_ids)))
        if pos >= 0 and (self.options.custom_output_reuse == "recompute" or params.max_new_tokens == 0):
            request.reuse_cap_tokens = pos  # reuse stops below the selected token
        if params.num_beams == 1 and watches_stop_strings(request, self.text_decoder):
            request.watch_stop_strings = True
            request.max_total_tokens = 0  # every new token goes through _check_stop
        request.single = (params.n == 1 and params.num_beams == 1
                          and not request.watch_stop_strings)
        request.token_columns = (request.single and not params.logprobs
                                 and params.max_new_tokens > 0)
        request.runs_ahead = (request.token_columns and pos != LAST_GENERATED
                              and params.batch_draw in ("greedy", "temperature"))
        self.seqs.prompt_sequence(request)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _decode_checks(self, params: SamplingParams, prompt_len: int) -> dict:
        eos = [] if params.ignore_eos else self.options.eos_token_ids
        return dict(stop_token_set=frozenset(eos) | frozenset(params.stop_token_ids),
                    max_total_tokens=min(prompt_len + params.max_new_tokens,
                                         self.options.max_model_len))


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
        for seq, kept in self._stop_cuts:  # cut by a stop string in the last step
            if seq.scoring_reason is not None and not seq.is_finished:
                truncate_output(seq, kept)
        self._stop_cuts = []
        if self._ahead is not None and self._step_ahead(outputs):
            return outputs
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        plan, rows = self.planner.build(batch)
        plan.graph_bucket = self.runner.graph_bucket_for(plan)
        self.send_plan(plan)
        result = self.runner.execute(plan)
        draw = ahead_draw(batch) if self.run_ahead and plan.kind is StepKind.DECODE \
            and len(rows.logit_seqs) == len(batch.seqs) and not rows.custom_seqs else None
        if draw is not None:
            temperatures = ([s.request.params.temperature for s in batch.seqs]
                            if draw == "temperature" else None)
            self._launch_ahead(batch, result.logits, draw, temperatures)
            return outputs
        advanced = self._postprocess(batch, plan, rows, result)
        self._collect_outputs(batch, outputs, advanced)
        return outputs

    # ---- steps ahead of their predecessor's sampling (coordinator/run_ahead.py) -----------
    def _step_ahead(self, outputs: Outputs) -> bool:
        """Launch the next decode step of the step in flight, if the scheduler's arrays can
        schedule it, then finish the step in flight. False: the pipeline is drained and the
        caller schedules the general way."""
        ahead, self._ahead = self._ahead, None
        scheduled = self.scheduler.schedule_ahead()
        if scheduled is not None:
            batch, keep = scheduled
            plan, _ = self.planner.build(batch)
            plan.graph_bucket = self.runner.graph_bucket_for(plan)
            ids, temperatures = ahead.tokens, ahead.temperatures
            if keep is not None:  # rows finished since: their successors are dropped
                ids = ids[torch.from_numpy(keep).to(ids.device, non_blocking=True)]
                temperatures = temperatures and [temperatures[i] for i in keep.tolist()]
            result = self.runner.execute(plan, input_ids=ids)  # TP 1: no plan to send
            self._launch_ahead(batch, result.logits, ahead.draw, temperatures)
        self._finish_ahead(ahead, outputs)
        return scheduled is not None

    def _launch_ahead(self, batch: ScheduledBatch, logits: torch.Tensor, draw: str,
                      temperatures: list[float] | None) -> None:
        tokens = (self.sampler.greedy_tensor(logits) if draw == "greedy"
                  else self.sampler.temperature_tensor(logits, temperatures))
        self._ahead = AheadStep(batch, tokens, self._token_copies.start(tokens), draw,
                                temperatures, self._finishes)
        self.scheduler.note_advanced(batch, None)
        self.num_ahead_steps += 1

    def _finish_ahead(self, ahead: AheadStep, outputs: Outputs) -> None:
        """The host work of a step that ran ahead: its rows whose sequences still run (one
        that finished or was aborted since has had its final output) take their tokens."""
        tokens, batch = ahead.pending.wait(), ahead.batch
        seqs, context_lens, size = batch.seqs, batch.context_lens, self.blocks.block_size
        every_row = ahead.finishes == self._finishes
        rows = range(len(seqs)) if every_row else \
            [i for i, s in enumerate(seqs) if not s.is_finished]
        for i in rows:
            seq, computed = seqs[i], context_lens[i]
            seq.num_computed_tokens = computed
            if computed % size == 0:
                self.blocks.register_computed(seq)  # its step filled a block
        items = [(i, seqs[i]) for i in rows]
        plain = self._append_plain(items, tokens if every_row else [tokens[i] for i in rows])
        if every_row:
            self._collect_outputs(batch, outputs, tokens if plain else None)
            return
        self.columns.reset()
        for request in put_news_in_columns([s for _, s in items], outputs):
            outputs.outputs.append(self._output(request))

    def _postprocess(self, batch: ScheduledBatch, plan: StepPlan, rows: PlanRows,
                     result: StepOutput) -> list[int] | None:
        """Returns each row's token when every row gained exactly its sampled token."""
        seqs = batch.seqs
        for seq, context_len in zip(seqs, batch.context_lens):
            seq.num_computed_tokens = context_len
        size, after = self.blocks.block_size, plan.context_lens  # per row, as batch.context_lens
        before = after - np.diff(plan.query_start_loc)
        for i in np.flatnonzero(after // size != before // size).tolist():
            self.blocks.register_computed(seqs[i])  # a block filled in this step
        live = list(enumerate(rows.logit_seqs))
        if rows.custom_seqs:
            self._run_custom(result.hidden[torch.from_numpy(plan.custom_rows).to(result.hidden.device)],
                             rows.custom_seqs)
            live = [(i, s) for i, s in live if s.request.error_code is None]  # the handler failed
        advanced = self._sample(result.logits, live) if live else None
        self._collect_custom()
        if advanced is not None and not rows.custom_seqs and len(live) == len(seqs) \
                and plan.kind is StepKind.DECODE:
            self.scheduler.note_advanced(batch, advanced)  # every row gained its token alone
            return advanced
        return None

    def _collect_outputs(self, batch: ScheduledBatch, outputs: Outputs,
                         advanced: list[int] | None) -> None:
        """One output per request the step touched: the usual decode news in the columns
        (coordinator/outputs.py), a full RequestOutput for the rest."""
        for request in self.columns.put(batch, advanced, outputs):
            if request.params.max_new_tokens == 0:
                self._finish_scoring_only(request)
            outputs.outputs.append(self._output(request))

    def _run_custom(self, hidden_rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """One handler call and one device-to-host copy for the step's rows; each request's
        row is queued (copied) on the output dispatcher, collected by _collect_custom."""
        try:
            host = run_handler(self.handler, hidden_rows, self.custom_stats)
        except CustomOutputError as e:
            for seq in seqs:
                self._fail(seq.request, EXECUTION_EXCEPTION, f"custom output processor failed: {e}")
            return
        for i, seq in enumerate(seqs):
            rid = seq.request.request_id
            future = self.dispatcher.submit(rid, encode_row, host.row(i), host.dtype)
            self._custom_pending.append((seq, future))

    def _collect_custom(self) -> None:
        """Wait for this step's dispatched values (in queue order) before outputs are built."""
        pending, self._custom_pending = self._custom_pending, []
        for seq, future in pending:
            try:
                value = future.result()
            except Exception as e:
                self._fail(seq.request, EXECUTION_EXCEPTION, f"custom output processor failed: "
                                                             f"{type(e).__name__}: {e}")
                continue
            if seq.scoring_reason is None:
                seq.request.custom_output = value
            elif not seq.is_finished:  # LAST_GENERATED: scored, now it really finishes
                seq.custom_output = value
                if seq.hypothesis is not None:  # a fork scoring a finished beam
                    seq.hypothesis.custom_output = value
                self._finish_seq(seq, seq.scoring_reason, emit=seq.hypothesis is None)

    def close(self) -> None:
        """Stop the output dispatcher's threads (the engine is not used afterwards)."""
        self.dispatcher.close()

    def _finish_scoring_only(self, request: Request) -> None:
        seq = request.sequences[0]
        if request.params.max_new_tokens == 0 and not seq.is_finished \
                and seq.num_computed_tokens == seq.num_tokens:
            self._finish_seq(seq, "length")

    # ---- sampling, forks, beams ---------------------------------------------------------
    def _sample(self, logits: torch.Tensor, live: list[tuple[int, Sequence]]) -> list[int] | None:
        """Sample every live row; returns the tokens when one draw served the whole batch
        and no row needed a stop check (each sequence just gained its token)."""
        draws = {s.request.batch_draw for _, s in live}
        if "" not in draws:  # the usual decode step: one draw for the whole batch
            return self._draw_batch(logits, live, draws)
        if all([s.request.params.num_beams == 1 for _, s in live]):
            self._sample_rows(logits, live)  # no beams
            return None
        beam_groups: dict[Request, list[tuple[int, Sequence]]] = {}
        plain = []
        for i, seq in live:
            (beam_groups.setdefault(seq.request, []) if seq.request.params.num_beams > 1
             else plain).append((i, seq))
        if plain:
            self._sample_rows(logits, plain)
        for request, group in beam_groups.items():
            idx = torch.tensor([i for i, _ in group], device=logits.device)
            self._apply_beam_step(request, [s for _, s in group], logits[idx])
        return None

    def _draw_batch(self, logits: torch.Tensor, items: list[tuple[int, Sequence]],
                    draws: set[str]) -> list[int] | None:
        """Rows that all have a batch_draw ("greedy", "temperature" or "plain"): one argmax
        or one draw for the whole batch. Returns the tokens if no row needed a stop check."""
        if len(items) != logits.shape[0]:
            logits = logits[torch.tensor([i for i, _ in items], device=logits.device)]
        if draws == {"greedy"}:
            tokens = self.sampler.greedy(logits)
        elif draws == {"temperature"}:
            tokens = self.sampler.sample_temperature(
                logits, [s.request.params.temperature for _, s in items])
        else:
            tokens = self.sampler.sample_plain(logits, [s.request.params for _, s in items])
        return tokens if self._append_plain(items, tokens) else None

    def _sample_rows(self, logits: torch.Tensor, items: list[tuple[int, Sequence]]) -> None:
        """A SampleRow per row; forks an unforked request into its n samples."""
        rows = [SampleRow(s.request.params, s.token_ids, s.num_prompt_tokens,
                          self.options.eos_token_ids, seed_key=s.index,
                          num_samples=1 if s.request.forked else s.request.params.n)
                for _, s in items]
        idx = torch.tensor([i for i, _ in items], device=logits.device)
        result = self.sampler(logits[idx], rows)
        for k, (_, seq) in enumerate(items):
            targets = [seq]
            if not seq.request.forked:
                targets += self._fork(seq, seq.request.params.n - 1)
                seq.request.forked = True
                seq.request.batch_draw = seq.request.params.batch_draw
            for j, target in enumerate(targets):
                top = result.top_logprobs[k][j] if result.top_logprobs else None
                self._append(target, result.token_ids[k][j], result.logprobs[k][j], top)

    def _append_plain(self, items: list[tuple[int, Sequence]], tokens: list[int]) -> bool:
        """_append for plain-sampling sequences (no logprobs to keep), the stop check inlined.
        True when no row needed the stop check."""
        plain = True
        for (_, seq), token in zip(items, tokens):
            token_ids = seq.token_ids
            token_ids.append(token)
            request = seq.request
            if token in request.stop_token_set or len(token_ids) >= request.max_total_tokens:
                self._check_stop(seq, token)
                plain = False
        return plain

    def _fork(self, parent: Sequence, count_: int, first_index: int | None = None) -> list[Sequence]:
        children = []
        request = parent.request
        for j in range(count_):
            index = (first_index if first_index is not None else 1) + j
            child = self.seqs.fork(parent, index)
            self.blocks.fork(parent, child)
            request.sequences.append(child)
            if child.status is SeqStatus.RUNNING:
                self.scheduler.running.append(child)
            children.append(child)
        return children

    def _apply_beam_step(self, request: Request, beams: list[Sequence], logits: torch.Tensor) -> None:
        request.forked = True
        before = {id(h) for h in request.beam_state.finished} if request.beam_state else set()
        running, done = self.beams.step(request, beams, logits, self.options.eos_token_ids,
                                        self.options.max_model_len)
        if request.custom_position == LAST_GENERATED:
            self._score_hypotheses(request, beams, before)
        if done:
            for seq in beams:
                self._finish_seq(seq, "length")
            return
        used: set[int] = set()
        assignments = []
        for parent_pos, token, score in running:
            parent = beams[parent_pos]
            target = parent if parent_pos not in used else self._fork(parent, 1, first_index=0)[0]
            used.add(parent_pos)
            assignments.append((target, token, score))
        for pos, parent in enumerate(beams):
            if pos not in used:
                self._finish_seq(parent, "pruned", emit=False)
        for i, (target, token, score) in enumerate(assignments):
            target.index = i
            self._append(target, token, None, None, score=score)

    def _score_hypotheses(self, request: Request, beams: list[Sequence], before: set[int]) -> None:
        """LAST_GENERATED with beams: each newly finished hypothesis gets a fork of its parent
        beam (sharing its KV) holding the hypothesis' last token, scored in the next step."""
        for h in request.beam_state.finished:
            if id(h) in before:
                continue
            fork = self._fork(beams[h.parent], 1, first_index=len(request.sequences))[0]
            fork.token_ids.append(h.token_ids[-1])
            fork.scoring_reason, fork.hypothesis = h.finish_reason, h

    def _append(self, seq: Sequence, token: int, logprob: float | None, top, score=None) -> None:
        seq.token_ids.append(token)
        if score is not None:
            seq.cumulative_logprob = score
        elif logprob is not None:
            seq.cumulative_logprob += logprob
        params = seq.request.params
        if params.logprobs and logprob is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top or [])
        if params.num_beams == 1:
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        watch = seq.request.watch_stop_strings
        if watch and self._cut_by_stop_string(seq):
            return
        reason = self._stop_reason(seq, token)
        if reason and watch and self._cut_by_stop_string(seq, final=True):
            return  # a stop string in the characters held until the end
        if reason:
            self._finish_seq(seq, reason)

    def _cut_by_stop_string(self, seq: Sequence, final: bool = False) -> bool:
        """A stop string matched: finish "stop"; the last kept token is scored in the next
        step (none kept: no value). The tokens after it are dropped only once this step's
        output carried them, so the API process sees the same tokens and cuts its text at
        the same place."""
        kept = kept_output_tokens(seq, self.text_decoder, final)
        if kept is None:
            return False
        if kept:
            self._stop_cuts.append((seq, kept))
        self._finish_seq(seq, "stop", score=kept > 0)
        return True

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.request.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if (not p.ignore_eos and token in self.options.eos_token_ids) or token in p.stop_token_ids:
                return "stop"
        if num_output >= p.max_new_tokens or num_tokens >= self.options.max_model_len:
            return "length"
        return None

    # ---- finishing -----------------------------------------------------------------------
    def _finish_seq(self, seq: Sequence, reason: str, emit: bool = True, score: bool = True) -> None:
        if seq.is_finished:
            return
        if reason in ("stop", "length") and score and self._scores_last_token(seq):
            seq.scoring_reason = reason  # held back: the next step computes its last token
            return
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._finishes += 1
        self.scheduler.remove(seq)
        if not emit:
            seq.request.sequences.remove(seq)

    @staticmethod
    def _scores_last_token(seq: Sequence) -> bool:
        """LAST_GENERATED: a finishing sequence (not a beam: beams score their hypotheses)
        stays running one more step, its last token computed for the handler, no logits."""
        request = seq.request
        return (request.custom_position == LAST_GENERATED and request.params.num_beams == 1
                and seq.scoring_reason is None and seq.num_output_tokens > 0
                and request.error_code is None)

    def _finish_request(self, request: Request, reason: str) -> None:
        self.scheduler.drop_waiting(request)
        for seq in request.live_sequences:
            self._finish_seq(seq, reason)

    def _fail(self, request: Request, code: int, message: str) -> None:
        request.error_code, request.error_message = code, message
        self._finish_request(request, "error")

    def _output(self, request: Request) -> RequestOutput:
        output = request_output(request, self.beams)
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        owned = sum(len(s.block_table) for r in self.requests.values() for s in r.live_sequences)
        assert owned >= sum(1 for b in self.blocks.blocks if b.ref_count > 0)
